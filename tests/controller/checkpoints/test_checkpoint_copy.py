"""Checkpoints copied between steps: what is written is exactly the state and the stream table
at the moment the checkpoint began (T0), although steps, slot resets and recycled streams ran
while it was being copied; the step stays in place (the state is not copied whole); at most
one checkpoint is in flight; a copy that cannot be completed is counted, not written.

The copy is made to take many ticks (a few rows per chunk, no time budget), so every batch
below lands while part of the table is copied and part is not.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forkless.controller.checkpoints.checkpoint as checkpoint
import forkless.controller.checkpoints.snapshot as snapshot
from forkless import Runtime
from forkless.controller.config import Config
from forkless.controller.declared import Description
from forkless.controller.loop import Controller
from forkless.controller.processor import Processor, default_processor
from forkless.controller.rowcopy import RowCopy
from forkless.controller.slots import StreamSlots
from forkless.io_loop.crossing import Chunk
from tests.fake_io import FakeIO, drain

WAIT_S = 10.0 * float(os.environ.get("FORKLESS_TEST_TIME_SCALE", "1"))
F = 2
STREAMS = 40


# ---- RowCopy and the stream table, alone -------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_a_row_copy_is_the_columns_at_t0_whatever_is_written_while_it_runs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((50, 3)).astype(np.float32)
    b = rng.integers(0, 100, 50)
    at_t0 = [a.copy(), b.copy()]
    copy = RowCopy([a, b], 50)
    while not copy.advance([a, b], int(rng.integers(1, 8))):
        rows = rng.integers(0, 52, int(rng.integers(0, 10)))  # repeats, and rows past the end
        copy.before_write([a, b], rows)
        rows = rows[rows < 50]
        a[rows] += 1.0
        b[rows] -= 7
    assert copy.kept_rows > 0  # some writes reached rows before the copy did
    got = copy.result()
    assert got[0].tobytes() == at_t0[0].tobytes() and got[1].tolist() == at_t0[1].tolist()
    assert not np.array_equal(a, at_t0[0])  # and the columns did change meanwhile


def test_result_before_the_copy_is_done_is_refused() -> None:
    copy = RowCopy([np.zeros(4)], 4)
    copy.advance([np.zeros(4)], 2)
    with pytest.raises(RuntimeError, match="2 of 4 rows"):
        copy.result()


@pytest.mark.parametrize("idle_s", [None, 0.5])
def test_a_table_copy_is_the_table_at_t0_while_streams_come_recycle_and_repeat(idle_s: float | None) -> None:
    table = StreamSlots(30, idle_s=idle_s)
    table.lookup([f"s{i}" for i in range(25)], now=0.0)
    table.lookup(["s3", "s1", "s3"], now=1.0)
    names0, slots0, seen0 = table.export()
    copy = table.begin_copy()
    now = 2.0
    rng = np.random.default_rng(3)
    recycled = 0
    while not copy.advance(3):
        now += 1.0
        batch = [f"s{i}" for i in rng.integers(0, 25, 3)] + [f"new{now:.0f}-{k}" for k in range(2)]
        recycled += len(table.lookup(batch, now=now)[2])
    if idle_s is not None:
        assert recycled > 0  # slots changed hands while the copy ran
    names, slots, last_seen = copy.result()
    assert names[:] == names0.tolist() and list(names) == names0.tolist()
    assert slots.tolist() == slots0.tolist() and last_seen.tolist() == seen0.tolist()
    assert table.export()[0].tolist() != names0.tolist()  # the table itself moved on


def test_a_table_copy_keeps_a_recycled_slot_s_name_until_released_and_then_reads_the_live_one() -> None:
    table = StreamSlots(3, idle_s=0.5)
    table.lookup(["a", "b", "c"], now=0.0)
    copy = table.begin_copy()
    assert copy.advance(10)
    names = copy.result()[0]
    assert table.lookup(["d"], now=1.0)[2] == [0]  # a's slot recycled while the copy is held
    assert names[:] == ["a", "b", "c"]
    copy.release()
    assert table.lookup(["e"], now=2.0)[2] == [1]  # b's slot recycled after the release
    assert names[:] == ["a", "e", "c"]  # a released copy is no longer told: it reads the live name


def test_restore_then_copy_gives_back_what_was_restored() -> None:
    table = StreamSlots(5, idle_s=1.0)
    table.restore(["c", "a", "b"], [2, 0, 1], [3.0, 1.0, 2.0])
    copy = table.begin_copy()
    assert copy.advance(10)
    names, slots, last_seen = copy.result()
    assert (names[:], slots.tolist(), last_seen.tolist()) == (["c", "a", "b"], [2, 0, 1], [3.0, 1.0, 2.0])


# ---- the controller: a checkpoint copied between steps ----------------------------------------------


def config(tmp_path: Path, **changes: Any) -> Config:
    base = dict(features=F, max_batch=4, max_streams=STREAMS, max_wait_ms=0.0, status_s=0.0, stream_idle_s=0.0,
                checkpoint_dir=str(tmp_path), checkpoint_s=3600.0, checkpoint_restore="never")
    return Config(**{**base, **changes})


PROCESSOR = default_processor(config(Path("unused")))


def feed(fake: FakeIO, ctl: Controller, streams: list[str], seq: int, rng: np.random.Generator) -> int:
    """One chunk of messages for ``streams``, processed (the tick after it advances the copy)."""
    x = rng.standard_normal((len(streams), F)).astype(np.float32)
    fake.inbound.put_nowait(Chunk(list(range(seq, seq + len(streams))), streams, x, time.monotonic_ns()))
    ctl.process_pending()
    drain(fake.outbound)
    return seq + len(streams)


def small_chunks(monkeypatch: pytest.MonkeyPatch, ctl: Controller) -> None:
    """A few rows per chunk and one chunk per tick: the copy spans many steps."""
    monkeypatch.setattr(snapshot, "COPY_CHUNK_BYTES", 48)
    ctl.checkpointer.copy_budget_s = 0.0


def wait_written(ctl: Controller, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while ctl.checkpointer.written + ctl.checkpointer.failures < count or ctl.checkpointer.busy:
        assert time.monotonic() < deadline, "timed out waiting for the checkpoint to be written"
        time.sleep(0.01)


@pytest.mark.parametrize("incremental", [True, False], ids=["copied-between-steps", "whole-at-once"])
def test_the_written_checkpoint_is_the_state_and_table_at_t0_though_steps_ran_during_the_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, incremental: bool) -> None:
    fake = FakeIO()
    rng = np.random.default_rng(11)
    with Controller(config(tmp_path), processor=PROCESSOR, runtime=Runtime(io_factory=fake)) as ctl:
        ctl.incremental_checkpoints = incremental
        small_chunks(monkeypatch, ctl)
        seq = 0
        for start in range(0, STREAMS, 4):  # every slot in use
            seq = feed(fake, ctl, [f"s{i}" for i in range(start, start + 4)], seq, rng)
        seq = feed(fake, ctl, ["s7", "s30", "s7", "s2"], seq, rng)
        ctl.checkpointer.schedule(0.0)
        seq = feed(fake, ctl, ["s5", "s6"], seq, rng)  # its tick begins the checkpoint: T0 is after this batch
        pending = ctl.checkpointer.pending
        assert pending is not None and pending.incremental is incremental
        state_t0 = [np.array(leaf) for leaf in jax.device_get(ctl.state)]  # copies; the views are dropped
        names_t0, slots_t0, seen_t0 = ctl.slots.export()
        counts_t0 = (ctl.main_stats.processed, ctl.main_stats.counters["anomalies"])
        pointer = ctl.state.mean.unsafe_buffer_pointer()
        steps = 0
        while ctl.checkpointer.pending is not None:
            # rows already copied and rows not yet, repeated streams, and new streams that take
            # the slot of an idle one (its row reset on the device, its name replaced)
            streams = [f"s{i}" for i in rng.integers(0, STREAMS, 2)] + [f"new{steps}", "s39"]
            seq = feed(fake, ctl, streams, seq, rng)
            steps += 1
            if incremental:  # the step stayed in place: the table was never copied whole
                assert ctl.state.mean.unsafe_buffer_pointer() == pointer
        assert steps >= 5 and ctl.slots.evicted >= steps
        wait_written(ctl, 1)
        assert ctl.checkpointer.failures == 0 and ctl.checkpointer.skipped == 0
        restored = checkpoint.load_newest(tmp_path, {"features": F}, like=ctl.state)
        assert restored.processed == counts_t0[0] and restored.counts["anomalies"] == counts_t0[1]
        assert ctl.main_stats.processed > counts_t0[0]
        for saved, at_t0 in zip(jax.tree.leaves(restored.state), state_t0):
            assert saved.tobytes() == at_t0.tobytes()
        assert not np.array_equal(np.asarray(ctl.state.mean), state_t0[1])  # the live state moved on
        assert restored.names == names_t0.tolist() and restored.slots.tolist() == slots_t0.tolist()
        assert restored.last_seen.tolist() == (seen_t0 + pending.seen_shift).tolist()
        ctl.checkpointer.schedule(float("inf"))


def test_a_checkpoint_due_while_one_is_being_copied_is_skipped_and_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeIO()
    rng = np.random.default_rng(5)
    with Controller(config(tmp_path), processor=PROCESSOR, runtime=Runtime(io_factory=fake)) as ctl:
        small_chunks(monkeypatch, ctl)
        writer = ctl.checkpointer
        seq = feed(fake, ctl, ["a", "b"], 0, rng)
        writer.schedule(0.0)
        seq = feed(fake, ctl, ["a"], seq, rng)
        first = writer.pending
        assert first is not None and writer.busy
        writer.schedule(0.0)  # due again while copying
        seq = feed(fake, ctl, ["b"], seq, rng)
        assert writer.skipped == 1 and writer.pending is first
        assert writer.submit(snapshot.take_snapshot(ctl.state, ([], [], []), {}, {}, 0.0)) is False
        assert writer.skipped == 2
        while writer.pending is not None:
            seq = feed(fake, ctl, ["a"], seq, rng)
        wait_written(ctl, 1)
        assert (writer.written, writer.skipped, writer.failures) == (1, 2, 0)
        assert ctl.stats().checkpoint_skipped == 2
        writer.schedule(float("inf"))


def test_the_orderly_stop_drops_a_copy_in_progress_and_writes_the_final_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeIO()
    rng = np.random.default_rng(6)
    ctl = Controller(config(tmp_path), processor=PROCESSOR, runtime=Runtime(io_factory=fake))
    ctl.start()
    small_chunks(monkeypatch, ctl)
    seq = feed(fake, ctl, ["a", "b", "c"], 0, rng)
    ctl.checkpointer.schedule(0.0)
    feed(fake, ctl, ["a"], seq, rng)
    assert ctl.checkpointer.pending is not None
    ctl.stop()
    final = [np.array(leaf) for leaf in jax.device_get(ctl.state)]
    assert (ctl.checkpointer.written, ctl.checkpointer.skipped) == (1, 1)
    restored = checkpoint.load_newest(tmp_path, {"features": F}, like=ctl.state)
    assert restored.processed == 4 and restored.names == ["b", "c", "a"]
    for saved, now in zip(jax.tree.leaves(restored.state), final):
        assert saved.tobytes() == now.tobytes()


POISON = 12345.0


def _refuse_poison(x: np.ndarray) -> np.ndarray:
    if (x == POISON).any():
        raise ValueError("poisoned batch")
    return np.zeros((), np.float32)


def _step_totals(state: jax.Array, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    zero = jax.pure_callback(_refuse_poison, jax.ShapeDtypeStruct((), jnp.float32), batch.x)
    totals = state.at[batch.key].add(jnp.where(batch.valid, batch.x[:, 0], 0.0))
    return totals, {"total": totals[batch.key] + zero}


TOTALS = Processor(lambda cfg: jnp.zeros((cfg.max_streams + 1,), jnp.float32), _step_totals,
                   description=Description(name="totals"))


def test_a_copy_whose_state_was_lost_by_a_failed_step_is_counted_as_failed_and_not_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeIO()
    with Controller(config(tmp_path), processor=TOTALS, runtime=Runtime(io_factory=fake)) as ctl:
        small_chunks(monkeypatch, ctl)
        writer = ctl.checkpointer
        x = np.ones((2, F), np.float32)
        fake.inbound.put_nowait(Chunk([0, 1], ["a", "b"], x, time.monotonic_ns()))
        ctl.process_pending()
        writer.schedule(0.0)
        ctl.process_pending()
        assert writer.pending is not None
        fake.inbound.put_nowait(Chunk([2], ["a"], np.full((1, F), POISON, np.float32), time.monotonic_ns()))
        ctl.process_pending()  # the step fails, the state starts again; the copy cannot be completed
        assert writer.pending is None and writer.abandoned == 1
        assert ctl.stats().checkpoint_failures == 1 and ctl.stats().resets == {"state lost with a failed step": 1}
        assert checkpoint.list_checkpoints(tmp_path) == []
        writer.schedule(0.0)  # the next one is taken and written as usual
        while writer.pending is not None or writer.written == 0:
            ctl.process_pending()
            if writer.pending is None:
                wait_written(ctl, 1)
        assert writer.written == 1 and len(checkpoint.list_checkpoints(tmp_path)) == 1
        writer.schedule(float("inf"))


# ---- the writer thread leaves the GIL to the main thread between chunks of work ------------------


def test_the_writer_pauses_between_chunks_of_names_and_the_file_is_the_same(tmp_path: Path) -> None:
    names = [f"stream-{i}" for i in range(5000)]
    snap = snapshot.Snapshot({"mean": np.arange(6, dtype=np.float32)}, names, np.arange(5000, dtype=np.int32),
                               np.zeros(5000), {"processed": 1}, {}, 0.0)
    pauses = []
    checkpoint.write_checkpoint(tmp_path / "paused.fkc", snap, pause=lambda: pauses.append(1))
    checkpoint.write_checkpoint(tmp_path / "plain.fkc", snap)
    assert len(pauses) == 3  # 5000 names in chunks of 2048
    paused, plain = (tmp_path / "paused.fkc").read_bytes(), (tmp_path / "plain.fkc").read_bytes()
    assert paused == plain


def test_ordered_names_read_the_live_list_with_recycled_slots_put_back() -> None:
    from forkless.controller.slots import OrderedNames

    live = ["a", "b", "c", "d"]
    replaced: dict[int, str] = {}
    names = OrderedNames(live, replaced, np.array([2, 0, 3, 1]))
    replaced[0] = "a"  # recorded before the slot changes hands
    live[0] = "new"
    assert names[:] == ["c", "a", "d", "b"] and names[1] == "a" and len(names) == 4 and names[1:3] == ["a", "d"]


# ---- a checkpoint cloned on the device (an accelerator's, several devices') ------------------------


def test_a_snapshot_cloned_on_the_device_is_the_state_at_t0_and_the_steps_stay_in_place(tmp_path: Path) -> None:
    """The main thread copies the state on its device and starts the host copy; the writer
    thread finishes it after donated steps ran: it holds T0's values, and the steps updated
    the state in place (nothing on the host held the live buffers). On one CPU device, as
    the engine does on an accelerator or several devices (issue 48: a 68 MB state's
    device_get held a TPU host's main thread 19.6 ms)."""
    import threading

    from forkless.controller.device.layouts import device_copy
    from forkless.controller.engine import compile_step

    cfg = config(tmp_path)
    engine = compile_step(PROCESSOR, cfg)
    rng = np.random.default_rng(5)
    for _ in range(4):
        engine.step(rng.standard_normal((4, F)).astype(np.float32), rng.integers(0, STREAMS, 4).astype(np.int32))
    state = engine.state
    clone = device_copy(state, jax.tree.map(lambda leaf: leaf.sharding, state))
    state_t0 = [np.array(leaf) for leaf in jax.device_get(state)]
    pending = snapshot.PendingSnapshot(state, StreamSlots(STREAMS).begin_copy(), {"processed": 1}, {}, 0.0,
                                       rows=STREAMS + 1, get_state=lambda: engine.state, incremental=False,
                                       clone=clone)
    del state
    pointer = engine.state.mean.unsafe_buffer_pointer()
    for _ in range(6):  # donated steps over every row, before the writer thread takes the copy
        engine.step(rng.standard_normal((4, F)).astype(np.float32), rng.integers(0, STREAMS, 4).astype(np.int32))
        assert engine.state.mean.unsafe_buffer_pointer() == pointer  # in place: no view held the buffer
    pending.complete()
    finished: list[Any] = []
    writer = threading.Thread(target=lambda: finished.append(pending.finish()))  # as the checkpointer's thread
    writer.start()
    writer.join(WAIT_S)
    [snap] = finished
    for saved, at_t0 in zip(jax.tree.leaves(snap.state), state_t0):
        assert np.asarray(saved).tobytes() == at_t0.tobytes()
    assert not np.array_equal(np.asarray(engine.state.mean), state_t0[1])  # the live state moved on
