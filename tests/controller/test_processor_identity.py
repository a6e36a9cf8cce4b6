"""A checkpoint is restored only into the processor that wrote it, by its declared name and
version, and never brings back stale weights: shared (not per-stream) leaves come from the
processor's ``init`` at every start unless it says ``restore_shared=True``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkless import OnResults, Runtime
from forkless.controller.config import Config
from forkless.controller.declared import Description
from forkless.controller.device.compiled import compilations
from forkless.controller.errors import CheckpointMismatch, ProcessorContractError
from forkless.controller.loop import Controller
from forkless.controller.processor import Processor, default_processor
from tests.controller.test_loop import chunk, process_all
from tests.fake_io import FakeIO, drain

F = 2
ROOT = Path(__file__).resolve().parents[2]


def config(directory: Path) -> Config:
    return Config(features=F, max_batch=4, max_streams=8, max_wait_ms=0.0, status_s=0.0,
                  checkpoint_dir=str(directory))


class Weighted(NamedTuple):
    weight: jax.Array  # float32 [F]: shared by every stream (a model's weights)
    total: jax.Array  # float32 [S + 1, F]: per stream


def weighted_sum(weight: float, *, name: str = "weighted", version: str = "1",
                 restore_shared: bool = False) -> Processor:
    """Per stream, the running total of x; out = total * weight (the weights loaded at start)."""

    def init(cfg):
        return Weighted(jnp.full((cfg.features,), weight, jnp.float32),
                        jnp.zeros((cfg.max_streams + 1, cfg.features), jnp.float32))

    def step(state, batch):
        spare = state.total.shape[0] - 1
        key = jnp.where(batch.valid, batch.key, spare)
        total = state.total[key] + batch.x  # one message per stream per batch in these tests
        return Weighted(state.weight, state.total.at[key].set(total)), {"out": total * state.weight}

    return Processor(init, step, description=Description(name=name, version=version, restore_shared=restore_shared))


def run(directory: Path, processor: Processor | None, messages: list[float]) -> list[float]:
    """One run of stream "a" over ``messages`` (one a batch); its first output per message; the
    stop writes a checkpoint."""
    outs: list[float] = []
    fake = FakeIO()

    def on_results(seq, stream, outputs):
        outs.extend(float(v) for v in outputs["out"][:, 0])

    with Controller(config(directory), processor=processor, sinks=[OnResults(on_results)],
                    runtime=Runtime(io_factory=fake)) as ctl:
        for i, x in enumerate(messages):
            fake.inbound.put_nowait(chunk([i], ["a"], [[x, 0.0]]))
            process_all(ctl)
    drain(fake.outbound)
    return outs


def test_a_new_weights_file_is_used_after_a_restore_while_the_per_stream_state_continues(tmp_path):
    assert run(tmp_path, weighted_sum(1.0), [1.0, 2.0]) == [1.0, 3.0]
    # retrained weights: the per-stream total continues (3 + 4), the output uses the new weight
    assert run(tmp_path, weighted_sum(10.0), [4.0]) == [70.0]


def test_restore_shared_brings_back_the_shared_leaves_learned_online(tmp_path):
    assert run(tmp_path, weighted_sum(1.0, restore_shared=True), [1.0, 2.0]) == [1.0, 3.0]
    assert run(tmp_path, weighted_sum(10.0, restore_shared=True), [4.0]) == [7.0]  # the checkpoint's weight


def test_the_start_log_says_which_leaves_came_from_where(tmp_path, caplog):
    run(tmp_path, weighted_sum(1.0), [1.0])
    with caplog.at_level("INFO", logger="forkless.controller"):
        run(tmp_path, weighted_sum(2.0), [1.0])
    assert "shared leaves .weight taken from the processor's init (restore_shared=False)" in caplog.text


def test_a_processor_built_elsewhere_with_the_same_name_and_version_restores(tmp_path):
    run(tmp_path, weighted_sum(1.0), [1.0])

    def built_somewhere_else():  # another module and qualname for its step: only the declared name counts
        made = weighted_sum(1.0)
        return Processor(made.init, lambda state, batch: made.step(state, batch),
                         description=Description(name="weighted", version="1"))

    assert run(tmp_path, built_somewhere_else(), [1.0]) == [2.0]


def test_the_default_processor_obtained_either_way_restores_the_others_checkpoint(tmp_path):
    cfg = config(tmp_path)
    with Controller(cfg, runtime=Runtime(io_factory=FakeIO())) as ctl:  # as `python app.py` builds it
        pass
    with Controller(cfg, processor=default_processor(cfg), runtime=Runtime(io_factory=FakeIO())) as ctl:
        restored = ctl.restored_from
    assert restored is not None


@pytest.mark.parametrize("other, setting", [
    (dict(name="another"), "processor"),
    (dict(version="2"), "processor_version"),
], ids=["name", "version"])
def test_a_checkpoint_of_another_processor_is_refused_before_the_compile_naming_what_differs(tmp_path, other,
                                                                                              setting):
    run(tmp_path, weighted_sum(1.0), [1.0])
    ctl = Controller(config(tmp_path), processor=weighted_sum(1.0, **other), runtime=Runtime(io_factory=FakeIO()))
    before = compilations()
    with pytest.raises(CheckpointMismatch) as raised:
        ctl.start()
    assert raised.value.setting == setting
    assert compilations() == before  # refused before anything was compiled
    assert ctl.engine is None


def test_a_processor_without_a_name_cannot_be_used_with_checkpoints(tmp_path):
    named = weighted_sum(1.0)
    with pytest.raises(ProcessorContractError, match=r"checkpoints \(FORKLESS_CHECKPOINT_DIR\) need a processor "
                                                     r"that declares its identity"):
        Controller(config(tmp_path), processor=Processor(named.init, named.step),
                   runtime=Runtime(io_factory=FakeIO()))
    Controller(Config(features=F), processor=Processor(named.init, named.step),
               runtime=Runtime(io_factory=FakeIO()))  # no checkpoints


def test_the_program_exits_2_with_one_line_for_an_unnamed_processor_with_checkpoints(tmp_path):
    code = ("import sys, app, tests.controller.test_processor_identity as t; "
            "from forkless.controller.processor import Processor; "
            "p = t.weighted_sum(1.0); sys.exit(app.main([], processor=Processor(p.init, p.step)))")
    env = {"JAX_PLATFORMS": "cpu", "FORKLESS_FEATURES": str(F), "FORKLESS_DURATION": "5", "PATH": "/usr/bin:/bin",
           "FORKLESS_CHECKPOINT_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert "forkless: processor error: checkpoints (FORKLESS_CHECKPOINT_DIR) need a processor" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_checkpoint_written_before_processors_had_names_restores_into_the_default(tmp_path):
    from forkless.controller.checkpoints.checkpoint import checkpoint_path, load_newest, write_checkpoint
    from forkless.controller.checkpoints.snapshot import take_snapshot

    cfg = config(tmp_path)
    proc = default_processor(cfg)
    state = jax.device_get(proc.init(cfg))
    legacy = {"features": F, "max_streams": cfg.max_streams, "processor": "ewma/1"}
    write_checkpoint(checkpoint_path(tmp_path, 1),
                     take_snapshot(state, (["a"], np.array([0], np.int32), np.array([0.0])), {}, legacy, 0.0))
    expect = {"features": F, "max_streams": cfg.max_streams, "processor": "ewma", "processor_version": "1"}
    assert load_newest(tmp_path, expect, like=state) is not None
