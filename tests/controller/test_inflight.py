"""Steps in flight (FORKLESS_STEPS_IN_FLIGHT, controller/inflight.py): what users see is what one
step at a time gives, bit for bit.

The processor here does a few small matrix products a step besides its per-stream total, so
that on the CPU a step is dispatched asynchronously (XLA runs a cheap one inline, in its
dispatch) and steps are really in flight; each test checks that they were (``most``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkless import OnResults, Runtime
from forkless.controller.checkpoints import checkpoint
from forkless.controller.config import Config
from forkless.controller.declared import Description
from forkless.controller.loop import Controller
from forkless.controller.processor import Processor
from tests.controller.test_loop import chunk, frames
from tests.fake_io import FakeIO, drain

# steps in flight handed between the threads, in order: run on free-threaded CPython too (.ci/run)
pytestmark = pytest.mark.threads

F = 2
N = 256  # the side of the step's matrix products
POISON = 12345.0  # x[0] that makes the step fail at run time (a host callback raises)
HUGE = 3e38  # twice in a stream: its float32 total overflows to inf (a non-finite output)


def _refuse_poison(x: np.ndarray) -> np.ndarray:
    if (x == POISON).any():
        raise ValueError("poisoned batch")
    return np.zeros((), np.float32)


def _init(config: Any) -> dict[str, jax.Array]:
    return {"total": jnp.zeros(config.max_streams + 1, jnp.float32), "w": jnp.eye(N, dtype=jnp.float32) * 0.5}


def _step(state: dict[str, jax.Array], batch: Any) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Per stream the running total of x[0], plus work that keeps the step off the inline path."""
    total = state["total"].at[batch.key].add(jnp.where(batch.valid, batch.x[:, 0], 0.0))
    m = state["w"]
    for _ in range(3):
        m = jnp.tanh(m @ m + 0.1)
    work = jnp.broadcast_to(jnp.minimum(m.sum(), 0.0) * 0.0, batch.key.shape)
    return {"total": total, "w": state["w"]}, {"total": total[batch.key] + work}


def _step_or_fail(state: dict[str, jax.Array], batch: Any) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """``_step``, failing at run time on POISON. A host callback makes XLA:CPU run the step
    inline, in its dispatch: its failure is raised there, and its steps are not in flight."""
    zero = jax.pure_callback(_refuse_poison, jax.ShapeDtypeStruct((), jnp.float32), batch.x)
    new_state, out = _step(state, batch)
    return new_state, {"total": out["total"] + zero}


TOTALS = Processor(_init, _step, description=Description(name="inflight-totals"))
FAILING = Processor(_init, _step_or_fail, description=Description(name="inflight-totals-failing"))


def _config(depth: int, **more: Any) -> Config:
    return Config(**{"features": F, "max_batch": 4, "max_streams": 6, "max_wait_ms": 0.0, "status_s": 0.0,
                     "steps_in_flight": depth, **more})


def _feed() -> list:
    """A long mixed feed: 8 streams (2 past max_streams: refused), a batch that fails at run
    time in the middle with ``FAILING`` (the state is lost: every stream starts again), a
    stream whose total overflows (non-finite: its state is reset), chunks of 1 to 6 messages."""
    rng = np.random.default_rng(46)
    chunks, seq = [], 0
    for i in range(40):
        n = int(rng.integers(1, 7))
        streams = [f"s{int(k)}" for k in rng.integers(0, 8, n)]
        xs = rng.normal(size=(n, F)).round(3)
        if i in (12, 13):
            streams[0], xs[0, 0] = "s1", HUGE  # s1 overflows at the second
        if i == 25:
            xs[-1, 0] = POISON
        chunks.append(chunk(list(range(seq, seq + n)), streams, xs.tolist()))
        seq += n
    return chunks


def _never_seen_done(ctl: Controller) -> None:
    """The controller's steps are never seen done before they are finished, however fast this
    machine runs them: each stays in flight until the depth is full, the stop or a settle (the
    tests' own test of steps really in flight, not left to the machine's speed)."""
    ctl.engine.ready = lambda pending: False


def _run(depth: int, folder: Path, processor: Processor, handoff: str = "park") -> tuple[list, list, Any, Any, int]:
    """The feed through a controller with ``depth`` steps in flight: the replies, what
    ``on_results`` got, the counters, the stop's checkpoint and the most steps that were in flight."""
    fake = FakeIO()
    handed: list = []
    ctl = Controller(_config(depth, checkpoint_dir=str(folder), handoff=handoff), processor=processor,
                     sinks=[OnResults(lambda seq, stream, out: handed.append((list(seq), list(stream),
                                                                              out["total"].tolist())))],
                     runtime=Runtime(io_factory=fake))
    with ctl:
        if processor is TOTALS:
            _never_seen_done(ctl)
        for c in _feed():
            fake.inbound.put_nowait(c)
        while ctl.process_pending():
            pass
        replies = frames(drain(fake.outbound))
        stats = ctl.stats()
    most = ctl._intake.flight.most
    saved = checkpoint.load_newest(folder, {"features": F}, like=jax.device_get(ctl.state))
    return replies, handed, stats, saved, most


@pytest.mark.parametrize(("processor", "handoff"), [(TOTALS, "park"), (FAILING, "park"), (TOTALS, "spin")],
                         ids=["in-flight", "failing-inline", "in-flight-spinning"])
def test_three_steps_in_flight_answer_a_long_mixed_feed_exactly_as_one_at_a_time(tmp_path: Path, processor: Processor,
                                                                                 handoff: str) -> None:
    one = _run(1, tmp_path / "one", processor)
    three = _run(3, tmp_path / "three", processor, handoff)
    replies, handed, stats, saved, most = three
    if processor is TOTALS:
        assert (one[4], most) == (1, 3)  # steps were really in flight
    assert replies == one[0]  # every reply, bit for bit, in the same order
    assert handed == one[1]
    errors = {"too many streams (FORKLESS_MAX_STREAMS=6)", "processing produced a non-finite result (the stream "
              "starts again)"} | ({"processing failed"} if processor is FAILING else set())
    assert {e["error"] for e in replies if "error" in e} == errors
    for name in ("processed", "errors", "resets", "batches"):
        assert getattr(stats, name) == getattr(one[2], name), name
    assert stats.compilations_after_warmup == 0
    assert stats.resets == {"stream reset: non-finite": 1} | (
        {"state lost with a failed step": 1} if processor is FAILING else {})
    for a, b in zip(jax.tree.leaves(saved.state), jax.tree.leaves(one[3].state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert (saved.processed, saved.names) == (one[3].processed, one[3].names)


@pytest.mark.parametrize("handoff", ["park", "spin"])
def test_the_stop_with_three_steps_in_flight_answers_every_one_of_them(handoff: str) -> None:
    fake = FakeIO()
    ctl = Controller(_config(3, handoff=handoff), processor=TOTALS, runtime=Runtime(io_factory=fake))
    ctl.start()
    _never_seen_done(ctl)
    sent = [chunk([i], [f"s{i % 4}"], [[1.0, 0.0]]) for i in range(12)]
    for c in sent:
        fake.inbound.put_nowait(c)
    ctl.stop()  # the stop's batches: up to three in flight, every one finished before it ends
    replies = frames(drain(fake.outbound))
    assert ctl._intake.flight.most == 3 and len(ctl._intake.flight) == 0
    assert [r["seq"] for r in replies] == list(range(12))
    assert [r["total"] for r in replies] == [1.0] * 4 + [2.0] * 4 + [3.0] * 4
    assert ctl.stats().processed == 12 and ctl.stats().dropped == {}


def test_a_step_that_fails_when_its_results_are_fetched_runs_the_steps_dispatched_after_it_again() -> None:
    from forkless.controller.engine import StepFailed, compile_step

    cfg = _config(3)
    x = np.ones((2, F), np.float32)
    one, flight = compile_step(TOTALS, cfg), compile_step(TOTALS, cfg)
    # one at a time: a step on slots 1, 2; its state lost; then slots 2, 3 and a reset of 3, then 3, 4
    one.finish(one.dispatch(x, np.array([1, 2], np.int32)))
    lost = one.take_state()
    one.restore(jax.tree.map(np.zeros_like, jax.device_get(_init(cfg))))  # a fresh state, as after a lost one
    del lost
    expected = [one.step(x, np.array([2, 3], np.int32))]
    one.reset([3])
    expected.append(one.step(x, np.array([3, 4], np.int32)))
    # in flight: the step before, then the failing one, then the two after it and the reset between
    flight.finish(flight.dispatch(x, np.array([1, 2], np.int32)))
    failing = flight.dispatch(x, np.array([1, 2], np.int32))
    after = [flight.dispatch(x, np.array([2, 3], np.int32))]
    flight.reset([3])
    after.append(flight.dispatch(x, np.array([3, 4], np.int32)))
    for leaf in jax.tree.leaves(failing.ran):  # its results cannot be fetched: it fails at run time
        leaf.delete()
    with pytest.raises(StepFailed) as failed:
        flight.finish(failing)
    assert failed.value.state_lost
    got = [flight.finish(p) for p in after]
    for a, b in zip(got, expected):
        assert a.outputs["total"].tolist() == b.outputs["total"].tolist()
    assert np.asarray(flight.state["total"]).tolist() == np.asarray(one.state["total"]).tolist()
    assert flight.unfinished == 0


def test_a_checkpoint_is_not_begun_with_steps_in_flight() -> None:
    from forkless.controller.engine import compile_step
    from forkless.controller.slots import StreamSlots

    engine = compile_step(TOTALS, _config(3))
    pending = engine.dispatch(np.ones((1, F), np.float32), np.array([1], np.int32))
    table = StreamSlots(6).begin_copy()
    with pytest.raises(RuntimeError, match="steps are in flight"):
        engine.begin_snapshot(table, {}, {}, 0.0, seen_shift=0.0, incremental=False)
    engine.finish(pending)
    assert engine.begin_snapshot(table, {}, {}, 0.0, seen_shift=0.0, incremental=False) is not None


def test_steps_left_in_flight_are_dropped_unanswered_with_what_a_stopping_instance_held() -> None:
    # what a partitioned instance whose lease is lost does with them (Controller._drop_unanswered)
    fake = FakeIO()
    ctl = Controller(_config(3), processor=TOTALS, runtime=Runtime(io_factory=fake))
    ctl.start()
    _never_seen_done(ctl)  # the steps stay in flight until the drain (only the depth, 3, finishes the oldest)
    fake.inbound.put_nowait(chunk([0], ["a"], [[1.0, 0.0]]))
    fake.inbound.put_nowait(chunk([1], ["b"], [[1.0, 0.0]]))
    fake.inbound.put_nowait(chunk([2, 3], ["a", "b"], [[1.0, 0.0], [1.0, 0.0]]))
    ctl._process(0.0, settle=False)  # run()'s turn: its steps stay in flight
    in_flight = ctl._intake.flight.messages
    assert in_flight >= 1
    assert ctl._intake.drain() == in_flight  # counted with the rest it held, never answered
    assert len(ctl._intake.flight) == 0 and ctl.engine.unfinished == 0
    answered = len(frames(drain(fake.outbound)))
    assert answered + in_flight == 4
    ctl.stop()


def _arriving_while_in_flight(ctl: Controller, fake: FakeIO, arriving: list, looks_before_done: int = 5) -> None:
    """``arriving`` is put on inbound the first time the loop looks at a step in flight, and the
    step is seen done only at the ``looks_before_done``-th look: messages come while a step runs,
    however fast this machine runs it."""
    looks = []

    def ready(pending: Any) -> bool:
        looks.append(pending)
        if len(looks) == 1:
            for c in arriving:
                fake.inbound.put_nowait(c)
        return len(looks) >= looks_before_done

    ctl.engine.ready = ready


@pytest.mark.parametrize("handoff", ["park", "spin"])
@pytest.mark.parametrize("arriving, most", [
    ([chunk([1], ["b"], [[1.0, 0.0]])], 1),  # a partial batch waits for the running step, then goes out
    ([chunk([1, 2, 3, 4], ["b", "c", "d", "e"], [[1.0, 0.0]] * 4)], 2),  # a full one is dispatched behind it
], ids=["partial-waits", "full-joins"])
def test_only_a_closed_batch_is_dispatched_behind_a_running_step(arriving: list, most: int, handoff: str) -> None:
    fake = FakeIO()
    ctl = Controller(_config(3, max_wait_ms=10_000.0, handoff=handoff), processor=TOTALS,
                     runtime=Runtime(io_factory=fake))
    with ctl:
        _arriving_while_in_flight(ctl, fake, arriving)
        fake.inbound.put_nowait(chunk([0], ["a"], [[1.0, 0.0]]))
        ctl._process(0.0, settle=False)  # run()'s turns: a's step stays in flight between them
        ctl._process(0.0, settle=False)
        while ctl.process_pending():
            pass
        replies = frames(drain(fake.outbound))
    assert ctl._intake.flight.most == most
    assert [r["seq"] for r in replies] == list(range(1 + len(arriving[0])))
