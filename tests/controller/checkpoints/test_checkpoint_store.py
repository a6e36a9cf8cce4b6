"""A checkpoint store of a new kind needs nothing of the controller but the ``CheckpointStore``
calls (controller/checkpoints/checkpointer.py): ``MemoryStore`` below keeps checkpoints as bytes in a dict,
is handed to ``Controller(checkpoint_store=...)``, and a second controller given it continues
every stream exactly as an uninterrupted run does. The directory store is the same protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from forkless import OnResults, Runtime
from forkless.controller.checkpoints.checkpoint import DirectoryStore, Restored, as_restored, list_checkpoints
from forkless.controller.checkpoints.checkpointer import Checkpointer, store_for
from forkless.controller.checkpoints.ckptformat import CheckpointDamaged, parse_checkpoint
from forkless.controller.checkpoints.snapshot import Snapshot, checkpoint_bytes
from forkless.controller.config import Config
from forkless.controller.errors import ProcessorContractError
from forkless.controller.loop import Controller
from forkless.controller.processor import Processor, default_processor
from forkless.io_loop.crossing import Chunk
from tests.fake_io import FakeIO, drain

F = 3
CONFIG = Config(features=F, max_batch=4, max_streams=16, max_wait_ms=0.0, status_s=0.0, stream_idle_s=0.0,
                checkpoint_s=3600.0)
PROCESSOR = default_processor(CONFIG)
STREAMS = ["a", "b", "c", "d", "e"]


class MemoryStore:
    """Checkpoints as bytes in a dict, the newest ``keep`` kept: a ``CheckpointStore`` and nothing else."""

    label = "memory"

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.objects: dict[int, bytes] = {}
        self.starts = 0

    def start(self) -> None:
        self.starts += 1

    def next_sequence(self) -> int:
        return max(self.objects, default=-1) + 1

    def write(self, sequence: int, snapshot: Snapshot, pause: Callable[[], None]) -> tuple[int, str]:
        data = checkpoint_bytes(snapshot, pause)
        self.objects[sequence] = data
        return len(data), f"memory:{sequence}"

    def prune(self) -> None:
        for sequence in sorted(self.objects)[:-self.keep]:
            del self.objects[sequence]

    def load(self, expect: Mapping[str, Any], like: Any, skipped: list[Any] | None = None) -> Restored | None:
        for sequence in sorted(self.objects, reverse=True):
            where, data = f"memory:{sequence}", self.objects[sequence]
            try:
                return as_restored(where, *parse_checkpoint(data, where), expect, like, len(data))
            except CheckpointDamaged:
                if skipped is not None:
                    skipped.append(where)
        return None


def messages(count: int, seed: int = 3) -> list[tuple[int, str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((count, F)).astype(np.float32)
    return [(i, STREAMS[i % len(STREAMS)], xs[i]) for i in range(count)]


def run(msgs: list[tuple[int, str, np.ndarray]], store: MemoryStore | None = None,
        config: Config = CONFIG) -> tuple[dict[int, dict[str, Any]], str | None]:
    """``msgs`` through a controller (a fake IO side, one chunk of at most 4 a batch), stopped in
    order: each message's outputs by seq, and the checkpoint it continued from."""
    fake, results = FakeIO(), {}

    def on_results(seq: list[Any], stream: list[str], outputs: dict[str, np.ndarray]) -> None:
        for i, s in enumerate(seq):
            results[s] = {name: np.asarray(v)[i].tolist() for name, v in outputs.items()}

    ctl = Controller(config, processor=PROCESSOR, sinks=[OnResults(on_results)],
                     runtime=Runtime(checkpoint_store=store, io_factory=fake))
    ctl.start()
    try:
        for at in range(0, len(msgs), 4):
            part = msgs[at:at + 4]
            fake.inbound.put_nowait(Chunk([m[0] for m in part], [m[1] for m in part],
                                          np.stack([m[2] for m in part]), time.monotonic_ns()))
            ctl.process_pending()
            drain(fake.outbound)
    finally:
        ctl.stop()
    return results, ctl.restored_from


def test_a_store_of_its_own_kind_carries_the_state_into_a_second_controller() -> None:
    msgs = messages(40)
    uninterrupted, _ = run(msgs)
    store = MemoryStore()
    first, fresh = run(msgs[:20], store)
    assert fresh is None and store.starts == 1 and list(store.objects) == [0]  # the stop's checkpoint
    second, restored_from = run(msgs[20:], store)
    assert restored_from == "memory:0" and list(store.objects) == [0, 1]
    assert {**first, **second} == uninterrupted
    assert run(msgs[20:])[0] != second  # without the restore its outputs differ: the state did continue


def test_the_checkpointer_numbers_on_from_a_store_and_keeps_its_newest() -> None:
    store = MemoryStore(keep=2)
    store.objects = {4: b"older", 5: b"old"}
    writer = Checkpointer(store)
    writer.start()
    try:
        for processed in (1, 2):
            assert writer.submit(Snapshot(state=[np.zeros(2)], names=[], slots=np.zeros(0, np.int32),
                                          last_seen=np.zeros(0), counts={"processed": processed}, settings={},
                                          wall_time=1.0))
            while writer.busy:
                time.sleep(0.005)
    finally:
        assert writer.stop(10.0)
    assert sorted(store.objects) == [6, 7] and writer.last_path == "memory:7"
    assert (writer.written, writer.failures) == (2, 0)


def test_every_checkpoint_of_a_store_damaged_starts_fresh_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    run(messages(8), store)
    store.objects = {seq: data[:-40] for seq, data in store.objects.items()}  # truncated
    with caplog.at_level(logging.WARNING, "forkless.controller"):
        _, restored_from = run(messages(4), store)
    assert restored_from is None
    assert "every checkpoint in memory is damaged (memory:0): starting with an empty state" in caplog.text


def test_the_run_s_store_is_chosen_in_one_place(tmp_path: Path) -> None:
    own, objects = MemoryStore(), MemoryStore()
    directory = Config(features=F, checkpoint_dir=str(tmp_path))
    off = CONFIG.checkpoints
    assert store_for(off, own, None) is own and store_for(off, None, objects) is objects
    assert store_for(off, None, None) is None
    chosen = store_for(directory.checkpoints, None, None)
    assert isinstance(chosen, DirectoryStore)
    assert (chosen.directory, chosen.keep) == (tmp_path, directory.checkpoint_keep)


def test_an_own_store_beside_a_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Runtime\(checkpoint_store=\.\.\.\) and FORKLESS_CHECKPOINT_DIR"):
        Controller(Config(features=F, checkpoint_dir=str(tmp_path)), processor=PROCESSOR,
                   runtime=Runtime(checkpoint_store=MemoryStore(), io_factory=FakeIO()))
    assert list_checkpoints(tmp_path) == []


def test_an_own_store_needs_a_processor_that_declares_its_name() -> None:
    anonymous = Processor(PROCESSOR.init, PROCESSOR.step)
    with pytest.raises(ProcessorContractError, match="declares its identity"):
        Controller(CONFIG, processor=anonymous, runtime=Runtime(checkpoint_store=MemoryStore(), io_factory=FakeIO()))
