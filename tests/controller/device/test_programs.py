"""controller/device/programs.py: a program compiled once in a process is not traced or compiled again
by the next ``compile_step`` of the same processor and settings; anything that changes what it
computes is compiled anew, and every engine has a state of its own."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import jax
import numpy as np
import pytest

from forkless.controller.config import Config
from forkless.controller.device import programs
from forkless.controller.device.compiled import compilations
from forkless.controller.engine import compile_step
from forkless.controller.errors import ProcessorContractError
from forkless.controller.processor import Processor, default_processor, ewma_processor

# one message a step and one batch size (max_batch 1: one bucket), so that each program here
# compiles in ~0.5 CPU-s; the default detector's programs are the suite's persistent cache's
X = np.array([[1.0, 2.0]], np.float32)
KEY = np.array([3], np.int32)


@pytest.fixture(autouse=True)
def nothing_kept() -> Any:
    programs.forget()
    yield
    programs.forget()


def config(**overrides: Any) -> Config:
    return Config(**{"features": 2, "max_streams": 8, "max_batch": 1, **overrides})


def init_compilations(processor: Any, cfg: Config) -> int:
    """What ``processor.init`` itself compiles (the helper-built processors' table is one
    computation, run at every init): all a kept program's next ``compile_step`` may compile."""
    before = compilations()
    jax.block_until_ready(processor.init(cfg))
    return compilations() - before


def scores(engine: Any, rounds: int = 3) -> list[list[float]]:
    return [engine.step(X * (1 + r * r), KEY).outputs["score"].tolist() for r in range(rounds)]


def test_the_same_processor_and_settings_compile_once_and_each_engine_has_its_own_state() -> None:
    cfg = config()
    processor = default_processor(cfg)
    first = compile_step(processor, cfg)
    own = init_compilations(processor, cfg)
    before = compilations()
    second = compile_step(default_processor(cfg), cfg)  # the default detector: one per setting
    assert compilations() - before == own
    ran_first = scores(first)
    assert scores(second) == ran_first  # a fresh state, not the first engine's after its steps
    assert scores(first) != ran_first  # the first engine's state had moved on


def test_another_processor_of_the_same_shapes_is_compiled_and_computes_its_own_results() -> None:
    cfg = config()
    low = compile_step(ewma_processor(alpha=0.05), cfg)
    before = compilations()
    high = compile_step(ewma_processor(alpha=0.5), cfg)
    assert compilations() > before
    assert scores(low)[2] != scores(high)[2]


@pytest.mark.parametrize("change", [{"features": 3}, {"max_batch": 4}])
def test_other_shapes_or_batch_sizes_are_compiled_anew(change: dict[str, Any]) -> None:
    processor = ewma_processor()
    compile_step(processor, config())
    before = compilations()
    engine = compile_step(processor, config(**change))
    assert compilations() > before
    assert set(engine._compiled.steps) == set(config(**change).buckets)


class Scaled:
    """A model object whose step is a bound method: what it computes may change with it (a
    ``Processor`` of its bound methods is run)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.base = ewma_processor()

    def init(self, cfg: Any) -> Any:
        return self.base.init(cfg)

    def step(self, state: Any, batch: Any) -> Any:
        state, out = self.base.step(state, batch)
        return state, {**out, "score": out["score"] * self.factor}


def test_a_processor_of_bound_methods_is_traced_at_every_compile() -> None:
    cfg = config()
    model = Scaled(1.0)
    processor = Processor(model.init, model.step)
    once = scores(compile_step(processor, cfg))
    model.factor = 2.0
    twice = scores(compile_step(processor, cfg))
    np.testing.assert_allclose(np.asarray(twice), 2 * np.asarray(once), rtol=1e-6)


def test_a_processor_that_breaks_the_contract_is_refused_at_every_compile() -> None:
    base = ewma_processor()

    def step(state: Any, batch: Any) -> Any:  # writes every row of the table
        state, out = base.step(state, batch)
        return state._replace(mean=state.mean + 1.0), out

    bad = Processor(base.init, step)
    for _ in range(2):
        with pytest.raises(ProcessorContractError, match="rows other than its batch's"):
            compile_step(bad, config())


def test_the_processor_s_functions_are_not_kept_alive_by_it() -> None:
    weights = np.ones((1 << 16,), np.float32)  # what a model's step closes over
    base = ewma_processor()

    def step(state: Any, batch: Any) -> Any:
        assert weights is not None  # closed over, not traced: the default detector's program
        return base.step(state, batch)

    processor = Processor(base.init, step)
    compile_step(processor, config())
    assert len(programs._kept) == 1
    alive = weakref.ref(step)
    del processor, step
    gc.collect()
    assert alive() is None


def test_only_the_newest_programs_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(programs, "KEPT", 2)
    processors = [ewma_processor() for _ in range(3)]  # three programs, one persistent-cache entry
    for processor in processors:
        compile_step(processor, config())
    assert len(programs._kept) == 2
    own = init_compilations(processors[-1], config())
    before = compilations()
    compile_step(processors[-1], config())
    assert compilations() - before == own
    compile_step(processors[0], config())
    assert compilations() - before > 2 * own
