"""Exactly-once state across kill -9 for a user's own replayable source (io_loop/source.py's
positions): tests/source_program.py, a program written against the public API only, is killed
while it runs and started again; the state it ends with must hold every message exactly once."""

from __future__ import annotations

import json
import re
import signal
from collections import Counter

import pytest

from tests.harness import KILLED_EXIT_S, UNIT_S, AppProcess, wait_until

pytestmark = pytest.mark.timeout(180 * UNIT_S)

FRAMES = 500
PER_FRAME = 3  # with FORKLESS_MAX_BATCH=2, a checkpoint may fall inside a frame: the replayed frame is cut
STREAMS = 5


@pytest.mark.parametrize("in_flight", ["1", "3"])
def test_a_replayable_user_source_keeps_every_message_exactly_once_across_kill_9(tmp_path, in_flight):
    # in_flight 3: FORKLESS_STEPS_IN_FLIGHT=3 and a step with work enough to be dispatched
    # asynchronously (tests/source_program.py): the kill lands while steps are in flight
    lines, expected = [], Counter()
    for f in range(FRAMES):
        frame = []
        for k in range(PER_FRAME):
            seq = f * PER_FRAME + k
            stream = f"s{seq % STREAMS}"
            expected[stream] += 1
            frame.append({"seq": seq, "stream": stream, "x": [1.0]})
        lines.append(json.dumps(frame))
    source = tmp_path / "input.jsonl"
    source.write_text("\n".join(lines) + "\n")
    final, checkpoints, gate = tmp_path / "final.json", tmp_path / "ckpt", tmp_path / "gate"
    # the first run holds before the middle line until the gate is opened, which it never is: the
    # kill lands while frames flow on a fast machine, in the hold at the latest on a slow one,
    # never after the end (the run was finished before the kill on one core, 2026-12-04)
    argv = ("-m", "tests.source_program", str(source), str(final), str(checkpoints), "0.004", str(FRAMES // 2),
            str(gate))

    env = {"FORKLESS_STEPS_IN_FLIGHT": in_flight, "SOURCE_PROGRAM_WORK": "1" if in_flight != "1" else "0"}
    with AppProcess(program=argv, env=env) as first:
        first.wait_for_line(r"resumed at None", timeout_s=60 * UNIT_S)
        wait_until(lambda: checkpoints.exists() and len(list(checkpoints.iterdir())) >= 2,
                   timeout_s=60 * UNIT_S, what="two checkpoints written", poll_s=0.05)
        first.signal(signal.SIGKILL)
        assert first.finish(KILLED_EXIT_S).returncode == -signal.SIGKILL
    assert not final.exists()

    gate.touch()
    with AppProcess(program=argv, env=env) as second:
        result = second.finish(120 * UNIT_S)
    assert result.returncode == 0, result.stderr
    resumed = int(re.search(r"resumed at (\d+)", result.stdout).group(1))
    assert 0 < resumed < FRAMES - 1, result.stdout  # it went on from a checkpoint, not from the start
    assert "restored from" in result.stdout and "restored from None" not in result.stdout
    assert json.loads(final.read_text()) == dict(expected)  # each message in the state exactly once
    most = int(re.search(r"most steps in flight (\d+)", result.stdout).group(1))
    assert most == 1 if in_flight == "1" else most >= 2, result.stdout


def test_every_checkpoint_damaged_refuses_to_start_a_replayable_user_source_fresh(tmp_path):
    source = tmp_path / "input.jsonl"
    source.write_text("".join(json.dumps([{"seq": i, "stream": "s", "x": [1.0]}]) + "\n" for i in range(20)))
    final, checkpoints = tmp_path / "final.json", tmp_path / "ckpt"
    argv = ("-m", "tests.source_program", str(source), str(final), str(checkpoints), "0")
    with AppProcess(program=argv) as first:
        assert first.finish(120 * UNIT_S).returncode == 0
    assert json.loads(final.read_text()) == {"s": 20} and list(checkpoints.iterdir())
    for path in checkpoints.iterdir():  # every checkpoint damaged: a flipped byte in each
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with AppProcess(program=argv) as second:
        result = second.finish(120 * UNIT_S)
    assert result.returncode != 0
    assert "PositionLost" in result.stderr and "the position of source 'lines' is unknown" in result.stderr
