"""Checkpoints: the file format round-trips bit-exact, damaged files are skipped, files that do
not fit the run are refused by name, and the background writer never stalls or raises.

Real files in ``tmp_path`` throughout; the only stand-in is a ``write`` function that waits on
an event the test controls, to hold a checkpoint in flight.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest

import forkless
from forkless.controller.checkpoints.checkpoint import checkpoint_path, list_checkpoints, load_newest, write_checkpoint
from forkless.controller.checkpoints.checkpointer import Checkpointer
from forkless.controller.checkpoints.ckptformat import TEMP_PREFIX
from forkless.controller.checkpoints.snapshot import Snapshot, restore_state, take_snapshot
from forkless.controller.config import Config
from forkless.controller.device.compiled import example_batch
from forkless.controller.errors import CheckpointMismatch
from forkless.controller.metrics import metric_families
from forkless.controller.processor import EWMAState, default_processor
from forkless.controller.stats import StatsSnapshot, status_line
from forkless.io_loop.counters import SECONDS_BOUNDS, Histogram
from forkless.io_loop.errors import ConfigError

WAIT_S = 10.0 * float(os.environ.get("FORKLESS_TEST_TIME_SCALE", "1"))

CONFIG = Config(features=3, max_streams=10)
PROCESSOR = default_processor(CONFIG)
SETTINGS = {"features": 3, "max_streams": 10, "processor": "ewma/1"}
LIKE = jax.eval_shape(lambda: PROCESSOR.init(CONFIG))
NAMES = ["alpha", "", "ünï côdé", "lone \ud800 surrogate", "tab\there"]


def ewma_state(seed: int = 0) -> EWMAState:
    """The default processor's init state on the device, filled with values no zeros would hide
    (NaN, -0.0, infinities among them: the round trip must be bit-exact)."""
    rng = np.random.default_rng(seed)
    init = PROCESSOR.init(CONFIG)
    mean = rng.standard_normal(init.mean.shape).astype(np.float32)
    mean[0, :3] = [np.nan, -0.0, np.inf]
    return jax.device_put(EWMAState(
        count=rng.integers(0, 1 << 30, init.count.shape).astype(np.int32),
        mean=mean,
        var=rng.random(init.var.shape).astype(np.float32),
    ))


def snapshot(processed: int = 0, *, names: list[str] | None = None, settings: dict | None = None,
             state: EWMAState | None = None) -> Snapshot:
    names = NAMES if names is None else names
    streams = (list(names), np.arange(len(names), dtype=np.int32), np.linspace(1e9, 2e9, len(names)))
    return take_snapshot(ewma_state(processed) if state is None else state, streams,
                         {"processed": processed, "anomalies": processed // 2},
                         SETTINGS if settings is None else settings, wall_time=1_700_000_000.25 + processed)


def write_several(directory: Path, count: int) -> list[Path]:
    paths = [checkpoint_path(directory, i) for i in range(count)]
    for i, path in enumerate(paths):
        write_checkpoint(path, snapshot(i))
    return paths


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


class HeldWrite:
    """A ``write`` for the Checkpointer that waits until ``release`` before writing for real."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, path: Path, snap: Snapshot) -> int:
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never released the write"
        return write_checkpoint(path, snap)


# ---- the format -------------------------------------------------------------------------------------


def test_a_state_stream_table_and_counts_round_trip_bit_exact(tmp_path: Path) -> None:
    state = ewma_state(7)
    snap = snapshot(7, state=state)
    size = write_checkpoint(checkpoint_path(tmp_path, 0), snap)

    restored = load_newest(tmp_path, SETTINGS, LIKE)

    assert restored is not None and restored.path == checkpoint_path(tmp_path, 0)
    assert restored.nbytes == size == os.path.getsize(restored.path)
    assert isinstance(restored.state, EWMAState)
    for name, saved, got in zip(EWMAState._fields, jax.device_get(state), restored.state):
        assert got.dtype == saved.dtype and got.shape == saved.shape, name
        assert got.tobytes() == saved.tobytes(), name
    assert restored.names == NAMES
    assert restored.slots.dtype == np.int32 and restored.slots.tolist() == list(range(len(NAMES)))
    assert restored.last_seen.dtype == np.float64 and restored.last_seen.tobytes() == snap.last_seen.tobytes()
    assert restored.counts == {"processed": 7, "anomalies": 3} and restored.processed == 7
    assert restored.settings == SETTINGS and restored.wall_time == 1_700_000_007.25
    assert restored.versions["jax"] == jax.__version__ and restored.versions["numpy"] == np.__version__
    assert restored.versions["forkless"] == forkless.__version__
    # what restore gives back can go straight onto the device and into the step
    on_device = jax.device_put(restored.state)
    jax.jit(PROCESSOR.step).lower(on_device, example_batch(CONFIG.features, 4, CONFIG.max_streams)).compile()


def test_a_snapshot_stays_as_taken_while_later_steps_run_even_with_a_donated_state() -> None:
    # on the CPU, device_get returns views of the device buffers; a step that donates its state
    # must not write into them (JAX copies a donated buffer that a host view still holds)
    step = jax.jit(lambda s: jax.tree.map(lambda a: a + 1, s), donate_argnums=0)
    state = ewma_state(3)
    snap = snapshot(state=state)
    taken = jax.tree.map(np.copy, snap.state)
    for _ in range(3):
        state = step(state)
    jax.block_until_ready(state)
    for name, before, after in zip(EWMAState._fields, taken, snap.state):
        assert before.tobytes() == after.tobytes(), name


@pytest.mark.parametrize("names", [[], [""], ["one\nname with a newline", "b"], [f"s{i}" for i in range(70_000)]],
                         ids=["none", "one-empty", "newline", "more-than-a-chunk"])
def test_any_stream_names_round_trip(tmp_path: Path, names: list[str]) -> None:
    write_checkpoint(checkpoint_path(tmp_path, 0), snapshot(names=names))
    restored = load_newest(tmp_path, SETTINGS, LIKE)
    assert restored.names == names and len(restored.slots) == len(restored.last_seen) == len(names)


def test_a_directory_without_checkpoints_restores_nothing(tmp_path: Path) -> None:
    assert load_newest(tmp_path, SETTINGS, LIKE) is None
    assert load_newest(tmp_path / "missing", SETTINGS, LIKE) is None


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _drop_the_end_marker(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)


@pytest.mark.parametrize(("damage", "reason"), [(_truncate, "truncated"), (_flip_a_byte, "checksum"),
                                                (_drop_the_end_marker, "end marker")],
                         ids=["truncated", "corrupted-byte", "no-end-marker"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_for_the_previous_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage, reason: str) -> None:
    older, newest = write_several(tmp_path, 2)
    damage(newest)
    caplog.set_level(logging.WARNING, logger="forkless.checkpoint")

    restored = load_newest(tmp_path, SETTINGS, LIKE)

    assert restored.path == older and restored.processed == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "forkless.checkpoint"]
    assert len(warnings) == 1 and newest.name in warnings[0] and reason in warnings[0], warnings


def test_every_damaged_checkpoint_restores_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for path in write_several(tmp_path, 2):
        _flip_a_byte(path)
    assert load_newest(tmp_path, SETTINGS, LIKE) is None
    assert len([r for r in caplog.records if r.name == "forkless.checkpoint"]) == 2


def test_a_half_written_temporary_file_is_ignored_and_removed_when_the_writer_starts(tmp_path: Path) -> None:
    (complete,) = write_several(tmp_path, 1)
    # what kill -9 in the middle of writing checkpoint 1 leaves: half its bytes under a temporary name
    write_checkpoint(checkpoint_path(tmp_path, 1), snapshot(1))
    full = checkpoint_path(tmp_path, 1).read_bytes()
    checkpoint_path(tmp_path, 1).unlink()
    leftover = tmp_path / f"{TEMP_PREFIX}{checkpoint_path(tmp_path, 1).name}.4242"
    leftover.write_bytes(full[: len(full) // 2])

    assert load_newest(tmp_path, SETTINGS, LIKE).path == complete
    writer = Checkpointer(tmp_path)
    writer.start()
    try:
        assert not leftover.exists()
        assert writer.submit(snapshot(1))
    finally:
        assert writer.stop(WAIT_S)
    assert list_checkpoints(tmp_path) == [complete, checkpoint_path(tmp_path, 1)]
    assert load_newest(tmp_path, SETTINGS, LIKE).processed == 1


# ---- a checkpoint that does not fit this run ----------------------------------------------------


@pytest.mark.parametrize(("setting", "saved", "current"), [
    ("features", 3, 4), ("max_streams", 10, 1_000_000), ("processor", "ewma/1", "mine/2")])
def test_a_shape_defining_setting_that_differs_names_the_setting_and_both_values(
        tmp_path: Path, setting: str, saved, current) -> None:
    write_checkpoint(checkpoint_path(tmp_path, 0), snapshot(settings={**SETTINGS, setting: saved}))

    with pytest.raises(CheckpointMismatch) as err:
        load_newest(tmp_path, {**SETTINGS, setting: current}, LIKE)

    assert isinstance(err.value, ValueError)
    assert (err.value.setting, err.value.saved, err.value.current) == (setting, saved, current)
    message = str(err.value)
    assert setting in message and repr(saved) in message and repr(current) in message
    assert "ckpt-000000000.fkc" in message and "FORKLESS_CHECKPOINT_RESTORE=never" in message


def test_a_mismatch_is_raised_not_skipped_even_when_an_older_checkpoint_fits(tmp_path: Path) -> None:
    write_checkpoint(checkpoint_path(tmp_path, 0), snapshot(0))
    write_checkpoint(checkpoint_path(tmp_path, 1), snapshot(1, settings={**SETTINGS, "features": 5}))
    with pytest.raises(CheckpointMismatch, match="features"):
        load_newest(tmp_path, SETTINGS, LIKE)


def test_settings_recorded_but_not_expected_do_not_have_to_match(tmp_path: Path) -> None:
    write_checkpoint(checkpoint_path(tmp_path, 0), snapshot(settings={**SETTINGS, "alpha": 0.05}))
    restored = load_newest(tmp_path, SETTINGS, LIKE)
    assert restored.settings["alpha"] == 0.05


def test_a_state_leaf_of_another_shape_names_the_leaf_and_both_shapes(tmp_path: Path) -> None:
    write_checkpoint(checkpoint_path(tmp_path, 0), snapshot())
    other = Config(features=4, max_streams=10)
    like = jax.eval_shape(lambda: PROCESSOR.init(other))

    with pytest.raises(CheckpointMismatch) as err:
        load_newest(tmp_path, {"processor": "ewma/1"}, like)

    assert err.value.setting == "state leaf 'state.mean'"
    assert "float32[11, 3]" in str(err.value) and "float32[11, 4]" in str(err.value)


def test_a_0_d_leaf_saved_as_one_element_by_an_earlier_format_is_restored_0_d() -> None:
    # checkpoints written before the format kept 0-d leaves 0-d hold such a leaf as [1]: the same one value
    like = {"b": jax.ShapeDtypeStruct((), np.float32), "w": jax.ShapeDtypeStruct((1,), np.float32)}
    arrays = {"state['b']": np.array([2.5], np.float32), "state['w']": np.array([3.0], np.float32)}
    state = restore_state("mem", arrays, like)
    assert state["b"].shape == () and float(state["b"]) == 2.5 and state["w"].shape == (1,)
    with pytest.raises(CheckpointMismatch, match=r"state\['w'\].*'float32\[\]' in the checkpoint, 'float32\[1\]' now"):
        restore_state("mem", {**arrays, "state['w']": np.array(3.0, np.float32)}, like)  # never the other way


def test_a_state_leaf_of_another_dtype_names_the_leaf(tmp_path: Path) -> None:
    write_checkpoint(checkpoint_path(tmp_path, 0), snapshot())
    like = LIKE._replace(count=jax.ShapeDtypeStruct(LIKE.count.shape, np.int64))
    with pytest.raises(CheckpointMismatch, match=r"state leaf 'state.count'.*int32\[11\].*int64\[11\]"):
        load_newest(tmp_path, SETTINGS, like)


def test_a_state_of_another_structure_names_the_missing_leaf(tmp_path: Path) -> None:
    write_checkpoint(checkpoint_path(tmp_path, 0), snapshot())
    like = {"count": LIKE.count, "mean": LIKE.mean, "var": LIKE.var, "extra": LIKE.count}
    with pytest.raises(CheckpointMismatch) as err:
        load_newest(tmp_path, SETTINGS, like)
    assert err.value.setting == "the state's leaves"
    assert err.value.saved == ["state.count", "state.mean", "state.var"]
    assert "state['extra']" in err.value.current and "state['extra']" in str(err.value)


# ---- the writer thread --------------------------------------------------------------------------------


def test_checkpoint_priority_reaches_the_writer_and_defaults_to_idle(tmp_path: Path) -> None:
    from forkless import Runtime
    from forkless.controller.loop import Controller
    from tests.fake_io import FakeIO

    default = Controller(Config.from_env({"FORKLESS_CHECKPOINT_DIR": str(tmp_path)}),
                         runtime=Runtime(io_factory=FakeIO()))
    normal = Controller(Config.from_env({"FORKLESS_CHECKPOINT_DIR": str(tmp_path),
                                         "FORKLESS_CHECKPOINT_PRIORITY": "normal"}),
                        runtime=Runtime(io_factory=FakeIO()))
    assert default.checkpointer.background is True and normal.checkpointer.background is False


def test_the_writer_lets_go_of_a_written_checkpoint_before_the_next_one_arrives(tmp_path: Path) -> None:
    # its host copy is a state's size: held until the next checkpoint, it doubled the memory between them
    writer = Checkpointer(tmp_path)
    writer.start()
    snap = snapshot(1)
    held = weakref.ref(snap.state.mean)
    assert writer.submit(snap)
    del snap
    wait_until(lambda: not writer.busy, "the checkpoint")
    wait_until(lambda: held() is None, "the writer to drop the written snapshot")
    assert writer.stop(WAIT_S) and writer.written == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
def test_the_writer_thread_runs_at_idle_priority_and_the_main_thread_keeps_its_own(tmp_path: Path) -> None:
    # so hashing and writing never hold a core that a step or the IO loop wants
    policy = os.sched_getscheduler(0)
    writer = Checkpointer(tmp_path)
    writer.start()
    assert writer.submit(snapshot(1))
    wait_until(lambda: not writer.busy, "the checkpoint")  # its thread has run: its policy is set
    assert os.sched_getscheduler(writer._thread.native_id) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == policy != os.SCHED_IDLE
    assert writer.stop(WAIT_S) and writer.written == 1

    # the checkpoint of a stop is written at the caller's priority: an unprivileged thread
    # cannot leave SCHED_IDLE, and a stop must not wait behind other processes for a core
    seen: list[int] = []

    def recording(path: Path, snap: Snapshot) -> int:
        seen.append(os.sched_getscheduler(0))
        return write_checkpoint(path, snap)

    writer = Checkpointer(tmp_path, write=recording)
    writer.start()
    assert writer.submit(snapshot(3))
    wait_until(lambda: not writer.busy, "the periodic checkpoint")
    assert writer.stop(WAIT_S, final=snapshot(4)) and writer.written == 2
    assert seen == [os.SCHED_IDLE, policy]
    assert load_newest(tmp_path, SETTINGS, LIKE).processed == 4
    plain = Checkpointer(tmp_path, background=False)  # the control: the setting is what does it
    plain.start()
    assert plain.submit(snapshot(2))
    wait_until(lambda: not plain.busy, "the checkpoint")
    assert os.sched_getscheduler(plain._thread.native_id) == policy
    assert plain.stop(WAIT_S)


def test_the_writer_keeps_the_newest_n_and_a_restart_goes_on_numbering(tmp_path: Path) -> None:
    writer = Checkpointer(tmp_path, keep=2)
    writer.start()
    for i in range(4):
        assert writer.submit(snapshot(i))
        wait_until(lambda: not writer.busy, f"checkpoint {i}")
    assert writer.stop(WAIT_S)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000002.fkc", "ckpt-000000003.fkc"]
    assert (writer.written, writer.failures, writer.skipped) == (4, 0, 0)
    assert writer.last_bytes == os.path.getsize(checkpoint_path(tmp_path, 3))
    assert writer.last_success_at == 1_700_000_003.25 and writer.last_duration_s > 0

    again = Checkpointer(tmp_path, keep=2)
    again.start()
    assert again.stop(WAIT_S, final=snapshot(9))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000003.fkc", "ckpt-000000004.fkc"]
    assert load_newest(tmp_path, SETTINGS, LIKE).processed == 9


def test_at_most_one_checkpoint_is_in_flight_the_next_is_skipped(tmp_path: Path) -> None:
    held = HeldWrite()
    writer = Checkpointer(tmp_path, write=held)
    writer.start()
    try:
        assert writer.submit(snapshot(0))
        assert held.entered.wait(WAIT_S)
        assert writer.busy
        assert writer.submit(snapshot(1)) is False
        assert writer.skipped == 1 and writer.stats_fields()["checkpoint_skipped"] == 1
        held.release.set()
        wait_until(lambda: not writer.busy, "the held write")
        assert writer.submit(snapshot(2))
    finally:
        held.release.set()
        assert writer.stop(WAIT_S)
    assert [load_newest(tmp_path, SETTINGS, LIKE).processed, writer.written, writer.skipped] == [2, 2, 1]


def test_tick_takes_a_snapshot_every_interval_and_not_while_one_is_in_flight(tmp_path: Path) -> None:
    held = HeldWrite()
    writer = Checkpointer(tmp_path, interval_s=10.0, write=held)
    taken = []

    def take() -> Snapshot:
        taken.append(len(taken))
        return snapshot(len(taken))

    writer.start()
    try:
        assert writer.tick(100.0, take) is False  # the first call starts the schedule
        assert writer.tick(109.9, take) is False and taken == []
        assert writer.tick(110.0, take) is True and taken == [0]
        assert held.entered.wait(WAIT_S)
        assert writer.tick(120.0, take) is False and taken == [0]  # in flight: skipped, take() not paid
        assert writer.skipped == 1
        held.release.set()
        wait_until(lambda: not writer.busy, "the held write")
        assert writer.tick(125.0, take) is False
        assert writer.tick(130.0, take) is True and taken == [0, 1]
    finally:
        held.release.set()
        assert writer.stop(WAIT_S)


def test_stop_waits_for_the_write_in_flight_then_writes_the_final_checkpoint(tmp_path: Path) -> None:
    held = HeldWrite()
    writer = Checkpointer(tmp_path, write=held)
    writer.start()
    assert writer.submit(snapshot(0))
    assert held.entered.wait(WAIT_S)
    assert writer.stop(0.05, final=snapshot(1)) is False  # still held: stop gives up at its timeout
    assert list_checkpoints(tmp_path) == []
    threading.Timer(0.1, held.release.set).start()
    assert writer.stop(WAIT_S) is True
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000000.fkc", "ckpt-000000001.fkc"]
    assert load_newest(tmp_path, SETTINGS, LIKE).processed == 1 and writer.written == 2


def test_a_failed_write_is_counted_and_logged_once_never_raised(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "ckpt"
    writer = Checkpointer(directory)
    writer.start()
    caplog.set_level(logging.INFO, logger="forkless.checkpoint")
    try:
        shutil.rmtree(directory)  # the disk went away under a running process
        for i in range(3):
            assert writer.submit(snapshot(i)) is True
            wait_until(lambda: not writer.busy, f"failed checkpoint {i}")
        assert (writer.failures, writer.written) == (3, 0)
        assert writer.last_error.startswith("FileNotFoundError")
        assert writer.stats_fields()["checkpoint_failures"] == 3
        errors = [r for r in caplog.records if r.name == "forkless.checkpoint" and r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "FileNotFoundError" in errors[0].getMessage()

        directory.mkdir()
        assert writer.submit(snapshot(3))
        wait_until(lambda: not writer.busy, "the checkpoint after the directory came back")
    finally:
        assert writer.stop(WAIT_S)
    assert (writer.failures, writer.written) == (3, 1)
    assert any("written again" in r.getMessage() for r in caplog.records)
    assert os.listdir(directory) == ["ckpt-000000000.fkc"]  # no temporary file left behind


def test_a_write_that_raises_anything_is_a_failure_not_a_dead_thread(tmp_path: Path) -> None:
    def broken(path: Path, snap: Snapshot) -> int:
        raise ValueError("cannot encode this")

    writer = Checkpointer(tmp_path, write=broken)
    writer.start()
    assert writer.submit(snapshot(0))
    wait_until(lambda: not writer.busy, "the broken write")
    assert writer.submit(snapshot(1))  # the thread is alive and takes the next one
    assert writer.stop(WAIT_S)
    assert writer.failures == 2 and writer.last_error == "ValueError: cannot encode this"


# ---- configuration, statistics, metrics ---------------------------------------------------------------


def test_checkpoints_are_off_by_default_and_the_defaults_are_the_documented_ones() -> None:
    config = Config.from_env({})
    assert (config.checkpoint_dir, config.checkpoint_s, config.checkpoint_keep, config.checkpoint_restore) == (
        "", 60.0, 3, "auto")
    assert not config.checkpoints_on


def test_checkpoint_variables_are_parsed(tmp_path: Path) -> None:
    config = Config.from_env({"FORKLESS_CHECKPOINT_DIR": str(tmp_path / "new" / "dir"),
                              "FORKLESS_CHECKPOINT_S": "0.5", "FORKLESS_CHECKPOINT_KEEP": "1",
                              "FORKLESS_CHECKPOINT_RESTORE": "NEVER"})
    assert (config.checkpoint_dir, config.checkpoint_s, config.checkpoint_keep, config.checkpoint_restore) == (
        str(tmp_path / "new" / "dir"), 0.5, 1, "never")
    assert config.checkpoints_on


def test_a_checkpoint_dir_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"FORKLESS_CHECKPOINT_DIR=.*expected a writable directory path"):
        Config.from_env({"FORKLESS_CHECKPOINT_DIR": str(tmp_path / "file" / "ckpt")})


def _stats(**changes) -> StatsSnapshot:
    seconds = Histogram(SECONDS_BOUNDS).snapshot()
    return StatsSnapshot(
        at=0.0, messages_in=0, frames_in=0, messages_out=0, errors_out=0, processed=0, batches=0,
        errors={}, dropped={}, connects=0, reconnects=0, connect_failures=0, connected=False, connection_since=0.0,
        inbound_depth=0, outbound_depth=0, unsent=0, batch_size=Histogram((1,)).snapshot(), latency=seconds,
        loop_lag=seconds, step_seconds=seconds, compilations=0, compilations_after_warmup=None, devices=(),
        ready=False, **changes)


def test_the_writer_s_figures_become_stats_fields_and_metrics(tmp_path: Path) -> None:
    writer = Checkpointer(tmp_path)
    writer.start()
    assert writer.stop(WAIT_S, final=snapshot(5))
    snap = _stats(**writer.stats_fields())
    values = {fam.name: fam.samples[0].value for fam in metric_families(snap) if fam.name.startswith(
        "forkless_checkpoint")}
    assert values == {
        "forkless_checkpoint_last_success_timestamp_seconds": 1_700_000_005.25,
        "forkless_checkpoint_duration_seconds": writer.last_duration_s,
        "forkless_checkpoint_bytes": os.path.getsize(checkpoint_path(tmp_path, 0)),
        "forkless_checkpoint_failures": 0,
        "forkless_checkpoint_skipped": 0,
    }
    assert _stats().checkpoint_last_at == 0.0 and _stats().checkpoint_failures == 0  # off: all zero


def test_the_status_line_shows_checkpoints_only_when_they_are_on_and_problems_only_when_there_are_some() -> None:
    assert "ckpt" not in status_line(_stats(), None)
    assert " | ckpt none yet | " in status_line(_stats(checkpoints_on=True), None)
    line = status_line(_stats(checkpoints_on=True, checkpoint_age_s=12.4, checkpoint_duration_s=0.43), None)
    assert " | ckpt 12s ago 0.4s | " in line
    line = status_line(_stats(checkpoints_on=True, checkpoint_age_s=75.0, checkpoint_duration_s=0.4,
                              checkpoint_failures=2, checkpoint_skipped=1), None)
    assert " | ckpt 75s ago 0.4s FAILED 2 skipped 1 | " in line


def test_the_writer_s_fields_give_the_age_of_the_newest_checkpoint(tmp_path: Path) -> None:
    writer = Checkpointer(tmp_path)
    assert np.isnan(writer.stats_fields()["checkpoint_age_s"]) and writer.stats_fields()["checkpoints_on"]
    writer.start()
    assert writer.stop(WAIT_S, final=snapshot(5))  # its state "taken" at 1_700_000_005.25
    before = time.time()
    age = writer.stats_fields()["checkpoint_age_s"]
    assert before - 1_700_000_005.25 <= age <= time.time() - 1_700_000_005.25


def test_a_late_tick_takes_one_checkpoint_and_the_next_is_an_interval_later_not_at_once(tmp_path: Path) -> None:
    writer = Checkpointer(tmp_path, interval_s=10.0)
    taken = []
    writer.start()
    try:
        writer.tick(100.0, lambda: taken.append(1) or snapshot(len(taken)))
        assert writer.tick(135.0, lambda: taken.append(1) or snapshot(len(taken))) is True  # 25 s late
        wait_until(lambda: not writer.busy, "the write")
        assert writer.tick(135.1, lambda: taken.append(1) or snapshot(len(taken))) is False
        assert writer.tick(145.0, lambda: taken.append(1) or snapshot(len(taken))) is True
        assert len(taken) == 2 and writer.skipped == 0
    finally:
        assert writer.stop(WAIT_S)
