"""Several devices (FORKLESS_DEVICES): the placement of slots and the routing of a batch with
literal inputs, then the real controller on 4 forced CPU devices (``JAX_NUM_CPU_DEVICES=4``,
in a subprocess, so this process keeps its one device) against the same runs on one device
bit for bit, and against the numpy reference."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest

from forkless.controller.device import placement as placement_module
from forkless.controller.device.placement import CanonicalRows, OutputField, Placement, unpack_outputs
from tests import device_runs
from tests.harness import ROOT, UNIT_S, app_env, run_app
from tests.reference import EWMAReference
from tests.servers import assert_results_match_reference, make_messages, parse_replies, send_frames

FOUR = {"JAX_NUM_CPU_DEVICES": "4"}


# ---- placement and routing: pure, literal ---------------------------------------------------------


def test_slots_are_strided_over_the_devices_and_each_shard_ends_with_its_spare_row():
    place = Placement(devices=4, max_streams=10)
    assert (place.rows_per_device, place.spare_row, place.table_rows) == (4, 3, 16)
    assert place.device_of(np.arange(10)).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    # device d holds global rows d*4 .. d*4+3; slot s is its local row s // 4
    assert place.global_rows(np.arange(10)).tolist() == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6]


def test_on_one_device_the_placement_is_todays_table():
    place = Placement(devices=1, max_streams=10)
    assert (place.rows_per_device, place.spare_row) == (11, 10)
    assert place.global_rows(np.arange(10)).tolist() == list(range(10))


def test_a_batch_is_grouped_by_device_in_arrival_order_and_padded_to_the_busiest_devices_bucket():
    place = Placement(devices=4, max_streams=10)
    slots = np.array([5, 0, 4, 1, 8], np.int32)  # devices 1, 0, 0, 1, 0
    route = place.route(slots, (1, 4, 16))
    assert route.bucket == 4  # device 0 has 3 messages
    assert route.counts.tolist() == [3, 2, 0, 0]
    assert route.positions.tolist() == [4, 0, 1, 5, 2]
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    packed = place.pack(x, slots, route)  # one array of uint32 words: x's bits, the key, valid
    assert packed.shape == (16, 4) and packed.dtype == np.uint32
    assert packed[:, 2].tolist() == [0, 1, 2, 3, 1, 0, 3, 3] + [3] * 8  # local rows; padding: spare 3
    assert packed[:, 3].tolist() == [1, 1, 1, 0, 1, 1, 0, 0] + [0] * 8
    assert packed[route.positions, :2].view(np.float32).tolist() == x.tolist()  # the outputs come back the same way
    assert not packed[[3, 6, 7], :2].any()


def test_packed_results_are_read_back_per_output_in_arrival_order():
    # rows of 9 bytes: a float32 pair, then a bool
    rows = np.zeros((4, 9), np.uint8)
    rows[:, :8] = np.array([[1, 2], [3, 4], [5, 6], [7, 8]], np.float32).view(np.uint8)
    rows[:, 8] = [0, 1, 1, 0]
    layout = (OutputField("z", np.dtype(np.float32), (2,), 0, 8), OutputField("", np.dtype(bool), (), 8, 1))
    z, bad = unpack_outputs(rows, layout, np.array([2, 0, 1]))
    assert z.tolist() == [[5, 6], [1, 2], [3, 4]] and z.dtype == np.float32
    assert bad.tolist() == [True, False, True]


def test_a_batch_all_on_one_device_takes_the_bucket_of_its_size():
    route = Placement(devices=4, max_streams=16).route(np.array([0, 4, 8, 0, 4], np.int32), (1, 4, 16))
    assert (route.bucket, route.counts.tolist(), route.positions.tolist()) == (16, [5, 0, 0, 0], [0, 1, 2, 3, 4])


def test_slots_to_reset_are_laid_out_per_device_padded_with_the_spare_row():
    idx = Placement(devices=2, max_streams=5).reset_index([3, 0, 1], per_device=3)
    # R = 4, spare 3: device 0 resets slot 0 (row 0); device 1 slots 3, 1 (rows 1, 0)
    assert idx.tolist() == [0, 3, 3, 1, 0, 3]
    assert Placement(devices=2, max_streams=5).reset_index([], per_device=2).tolist() == [3, 3, 3, 3]


def test_canonical_rows_go_to_the_sharded_table_and_come_back_in_slot_order(monkeypatch):
    place = Placement(devices=4, max_streams=10)
    canonical = np.arange(22, dtype=np.float32).reshape(11, 2)  # row 10: the spare
    table = place.to_sharded(canonical)
    assert table.shape == (16, 2)
    assert table[place.global_rows(np.arange(10))].tolist() == canonical[:10].tolist()
    spare_and_unused = [3, 7, 10, 11, 14, 15]  # every device's spare row; slots 10, 11 do not exist
    assert table[spare_and_unused].tolist() == [[20.0, 21.0]] * 6
    shards = np.split(table, 4)
    assert np.array_equal(np.asarray(CanonicalRows(shards, place)), canonical)
    # 4 devices x 8-byte rows: one local row a piece
    monkeypatch.setattr(placement_module, "CANONICAL_CHUNK_BYTES", 4 * 8)
    rows = CanonicalRows(shards, place)
    pieces = list(rows.pieces())
    assert [len(p) for p in pieces] == [4, 4, 2, 1]
    assert np.array_equal(np.concatenate(pieces), canonical) and rows.nbytes == canonical.nbytes


# ---- the controller on 4 forced devices against one device ----------------------------------------


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run this file makes on 4 forced devices, from one subprocess (``python -m
    tests.device_runs``: one start, one JAX, the compiles its runs share made once): the
    scenarios one step at a time and with FORKLESS_STEPS_IN_FLIGHT=3 (every batch queued at
    once), and both ways of a checkpoint between device counts: the first half of the
    checkpoint feed written on 4 devices (restored here, on one), and the second half restored
    on 4 from a first half written here. The test process itself keeps its one device."""
    work = tmp_path_factory.mktemp("four")
    written_here = device_runs.checkpoint_run(str(work / "from-one"), first=True)
    out = work / "out.json"
    done = subprocess.run([sys.executable, "-m", "tests.device_runs", str(work / "from-four"), str(work / "from-one"),
                           str(out)], cwd=ROOT, env=app_env(FOUR), capture_output=True, text=True,
                          timeout=300 * UNIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    four = json.loads(out.read_text())
    restored_here = device_runs.checkpoint_run(str(work / "from-four"), first=False)
    # the same JSON round trip as the subprocess's
    return {**four, **json.loads(json.dumps({"written_on_one": written_here, "restored_on_one": restored_here}))}


@pytest.fixture(scope="module")
def on_four(four_devices: dict[str, Any]) -> dict[str, Any]:
    return four_devices["scenarios"]


@pytest.fixture(scope="module")
def on_four_in_flight(four_devices: dict[str, Any]) -> dict[str, Any]:
    """The same runs on 4 devices with FORKLESS_STEPS_IN_FLIGHT=3, every batch queued at once."""
    return four_devices["in_flight"]


@pytest.fixture(scope="module")
def on_one() -> dict[str, Any]:
    assert len(jax.local_devices()) == 1, "the test process itself keeps one device"
    return json.loads(json.dumps(device_runs.scenarios()))  # the same JSON round trip as the subprocess's


RUNS = ("spread", "skewed", "eviction", "non_finite", "replicated")


def test_the_four_forced_devices_all_run_messages(on_four):
    assert on_four["jax_devices"] == 4
    run = on_four["spread"]
    assert run["devices"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert all(n > 0 for n in run["device_messages"]) and sum(run["device_messages"]) == 91


@pytest.mark.parametrize("name", RUNS)
def test_results_on_four_devices_with_three_steps_in_flight_equal_one_devices_bit_for_bit(on_four_in_flight,
                                                                                         on_one, name):
    run = on_four_in_flight[name]
    assert (run["devices"], run["results"]) == (["cpu:0", "cpu:1", "cpu:2", "cpu:3"], on_one[name]["results"])
    assert (run["errors"], run["resets"]) == (on_one[name]["errors"], on_one[name]["resets"])
    assert run["compilations_after_warmup"] == 0


@pytest.mark.parametrize("name", RUNS)
def test_results_on_four_devices_equal_one_devices_bit_for_bit(on_four, on_one, name):
    assert on_one[name]["devices"] == ["cpu:0"]
    assert on_four[name]["results"] == on_one[name]["results"]
    assert on_four[name]["errors"] == on_one[name]["errors"]


@pytest.mark.parametrize("name", ("spread", "skewed"))
def test_results_on_four_devices_equal_the_numpy_reference(on_four, name):
    run = on_four[name]
    ref = EWMAReference(warmup=3)
    batches = device_runs.BATCHES[name]
    seqs = [seq for b in batches for seq in b[0]]
    streams = [stream for b in batches for stream in b[1]]
    xs = np.concatenate([b[2] for b in batches])
    assert seqs == list(range(len(seqs))) and sorted(map(int, run["results"])) == seqs
    for seq, stream, x in zip(seqs, streams, xs):
        got = run["results"][str(seq)]
        z, score, anomaly = ref(stream, x)
        assert got["stream"] == stream
        np.testing.assert_allclose(got["z"], z, rtol=1e-5, atol=1e-5, err_msg=f"{name} seq {seq}")
        np.testing.assert_allclose(got["score"], score, rtol=1e-5, atol=1e-5)
        assert got["anomaly"] == anomaly


def test_a_skewed_batch_runs_on_its_one_device_padded_to_its_size(on_four):
    run = on_four["skewed"]
    assert run["device_messages"] == [36, 4, 4, 4]
    # 4 steps: 2 a device (Bd 4), 16 on device 0 (Bd 16) twice, 2 a device (Bd 4): 4 x (4 + 16 + 16 + 4) rows
    assert run["device_rows"] == 160


def test_recycled_slots_on_four_devices_start_as_new_streams(on_four):
    run = on_four["eviction"]
    ref = EWMAReference(warmup=2)
    recent: list[str] = []
    xs = np.concatenate([b[2] for b in device_runs.batches_of(device_runs.EVICTION_ORDER, [3] * 22, seed=3)])
    for i, name in enumerate(device_runs.EVICTION_ORDER):
        if name not in recent and len(recent) == 6:
            ref.n.pop(recent.pop(0), None)  # evicted: the reference forgets it
        if name in recent:
            recent.remove(name)
        recent.append(name)
        z, _, anomaly = ref(name, xs[i])
        got = run["results"][str(i)]
        assert got["stream"] == name
        np.testing.assert_allclose(got["z"], z, rtol=1e-5, atol=1e-5, err_msg=f"seq {i}")
        assert got["anomaly"] == anomaly
    assert run["streams_evicted"] == 66 - 6


def test_a_non_finite_stream_on_four_devices_is_reset_and_starts_again(on_four):
    run = on_four["non_finite"]
    got = [run["results"].get(str(i), {}).get("prod", run["errors"].get(str(i))) for i in range(8)]
    assert got == [2.0, 3.0, 7.0, float(np.float32(2e30)),
                   "processing produced a non-finite result (the stream starts again)", 5.0, 6.0, 7.0]
    assert run["resets"] == {"stream reset: non-finite": 1}


def test_the_state_is_sharded_by_stream_and_a_shared_leaf_is_replicated(on_four):
    # max_streams 10 over 4 devices: 4 rows each (3 slots and the spare), 16 in all
    assert on_four["spread"]["shardings"] == {
        ".count": {"spec": "P('d',)", "devices": 4, "shape": [16]},
        ".mean": {"spec": "P('d',)", "devices": 4, "shape": [16, 3]},
        ".var": {"spec": "P('d',)", "devices": 4, "shape": [16, 3]}}
    assert on_four["replicated"]["shardings"] == {
        "['count']": {"spec": "P('d',)", "devices": 4, "shape": [12]},
        "['weights']": {"spec": "P()", "devices": 4, "shape": [3]}}


@pytest.mark.parametrize("name", RUNS)
def test_nothing_compiles_after_warm_up_on_four_devices(on_four, name):
    assert on_four[name]["compilations_after_warmup"] == 0


def test_a_processor_that_cannot_be_sharded_is_refused_at_start_naming_one_device(on_four, on_one):
    changed, mixed = on_four["refused_changed_replicated_leaf"], on_four["refused_not_per_stream"]
    assert "state leaf ['weights']" in changed and "must return it unchanged" in changed
    assert "per_stream=False" in mixed
    assert "FORKLESS_DEVICES=1" in changed and "FORKLESS_DEVICES=1" in mixed
    # on one device both run
    assert on_one["refused_changed_replicated_leaf"] == on_one["refused_not_per_stream"] == ""


# ---- checkpoints move between device counts ------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_on_one(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both halves of the checkpoint feed on one device (here)."""
    directory = str(tmp_path_factory.mktemp("one") / "ckpt")
    return json.loads(json.dumps([device_runs.checkpoint_run(directory, first) for first in (True, False)]))


@pytest.mark.parametrize("way", ["4-then-1", "1-then-4"])
def test_a_checkpoint_taken_on_some_devices_restores_on_others(four_devices, checkpoint_on_one, way):
    if way == "4-then-1":
        written, restored = four_devices["checkpoint_first"], four_devices["restored_on_one"]
    else:
        written, restored = four_devices["written_on_one"], four_devices["checkpoint_second"]
    assert restored["restored"] and len(restored["devices"]) == (4 if way == "1-then-4" else 1)
    assert len(written["devices"]) == (4 if way == "4-then-1" else 1)
    # exactly what one device gives, and the reference over the whole feed (state carried over)
    assert written["results"] == checkpoint_on_one[0]["results"]
    assert restored["results"] == checkpoint_on_one[1]["results"]
    ref = EWMAReference(warmup=3)
    xs = np.concatenate([b[2] for b in device_runs.CHECKPOINT_BATCHES])
    results = {**written["results"], **restored["results"]}
    assert len(results) == len(device_runs.CHECKPOINT_NAMES)
    for i, name in enumerate(device_runs.CHECKPOINT_NAMES):
        z, _, _ = ref(name, xs[i])
        np.testing.assert_allclose(results[str(i)]["z"], z, rtol=1e-5, atol=1e-5, err_msg=f"seq {i}")


# ---- the program on 4 forced devices -------------------------------------------------------------


def test_the_demo_runs_over_four_devices_and_its_start_up_line_names_them():
    result = run_app(env={**FOUR, "FORKLESS_DURATION": "1", "FORKLESS_STATUS_S": "0.5"})
    assert result.returncode == 0, result.stderr
    assert "on 4 device(s): cpu:0, cpu:1, cpu:2, cpu:3, the stream table sharded over them" in result.stderr
    assert re.search(r"\| 4 devices fill \d+% \|", result.stdout), result.stdout


def test_more_devices_than_the_process_has_exits_2_naming_the_variable():
    result = run_app(env={**FOUR, "FORKLESS_DEVICES": "8"})
    assert result.returncode == 2
    assert "FORKLESS_DEVICES='8' is invalid: expected all, or at most 4" in result.stderr


def test_the_state_on_four_devices_survives_a_reconnect(feed_server, app):
    messages = make_messages(80, streams=6)
    first, second = ([json.dumps(m) for m in part] for part in (messages[:40], messages[40:]))
    server = feed_server(send_frames(first, second, gap_s=0.002))
    proc = app(env={**FOUR, "PYTHONUNBUFFERED": "1", "FORKLESS_WS_URL": server.url, "FORKLESS_FEATURES": "4",
                    "FORKLESS_MAX_BATCH": "16", "FORKLESS_MAX_STREAMS": "64", "FORKLESS_STATUS_S": "0",
                    "FORKLESS_RECONNECT_MIN_S": "0.05", "FORKLESS_RECONNECT_MAX_S": "0.2"})
    server.wait_for(lambda: server.received_count >= 40, 60 * UNIT_S, "the first connection's replies")
    server.drop()
    server.wait_for(lambda: server.received_count >= 80, 30 * UNIT_S, "the second connection's replies")
    proc.signal(signal.SIGTERM)
    result = proc.finish(20 * UNIT_S)
    assert result.returncode == 0, result.stderr
    assert "on 4 device(s)" in result.stderr
    assert len(server.connections) == 2
    results, errors = parse_replies(server.received)
    assert errors == []
    assert_results_match_reference(messages, results)
