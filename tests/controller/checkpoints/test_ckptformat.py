"""The checkpoint format (controller/checkpoints/ckptformat.py) on its own: bytes made from named numpy
arrays and read back, damage refused, file names, the fit checks. No JAX, no files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from forkless.controller.checkpoints.ckptformat import (
    FORMAT,
    MIN_BYTES,
    CheckpointDamaged,
    check_fits,
    decode_names,
    encode,
    file_name,
    is_temporary,
    join,
    parse_checkpoint,
    sequence_of,
    temporary_name,
)
from forkless.controller.device.placement import CanonicalRows, Placement
from forkless.controller.errors import CheckpointMismatch

ROOT = Path(__file__).resolve().parents[3]
NAMES = ["alpha", "", "ünï côdé", "lone \ud800 surrogate", "tab\there"]


def checkpoint(names: list[str] = NAMES, **changes) -> tuple[bytes, dict]:
    leaves = [("state.mean", np.arange(12, dtype=np.float32).reshape(6, 2)), ("state.n", np.arange(6, dtype=np.int64))]
    fields = {"settings": {"features": 2, "max_streams": 5, "processor": "ewma", "processor_version": "1"},
              "versions": {"forkless": "test"}, "wall_time": 12.5, "counts": {"processed": 9, "anomalies": 1},
              "positions": {"feed": {"seq": 3}}, **changes}
    streams = (names, np.arange(len(names), dtype=np.int32), np.linspace(0.0, 1.0, len(names)))
    return join(encode(leaves, streams, **fields)), fields


def test_what_is_encoded_reads_back_exactly():
    data, fields = checkpoint()
    header, arrays = parse_checkpoint(data, "mem")
    assert header["format"] == FORMAT and header["streams"] == len(NAMES) and header["processed"] == 9
    assert {k: header[k] for k in fields} == fields
    np.testing.assert_array_equal(arrays["state.mean"], np.arange(12, dtype=np.float32).reshape(6, 2))
    assert arrays["state.n"].dtype == np.int64
    np.testing.assert_array_equal(arrays["streams.slots"], np.arange(len(NAMES), dtype=np.int32))
    assert decode_names(arrays["streams.names"], header["names_encoding"], header["streams"]) == NAMES
    assert header["names_encoding"] == "lines"
    assert all(entry["offset"] % 64 == 0 for entry in header["arrays"])


def test_every_array_keeps_its_shape_a_0_d_one_too():
    leaves = [("state['b']", np.float32(1.5)), ("state['w']", np.ones(3, np.float32)),
              ("state['one']", np.array([7], np.int64)), ("state['t']", np.arange(6.0).reshape(2, 3).T)]
    header, arrays = parse_checkpoint(join(encode(leaves, ([], np.zeros(0), np.zeros(0)), settings={}, versions={},
                                                  wall_time=0.0, counts={}, positions={})), "mem")
    for name, leaf in leaves:
        assert arrays[name].shape == np.shape(leaf) and arrays[name].dtype == np.asarray(leaf).dtype, name
        np.testing.assert_array_equal(arrays[name], leaf)
    assert arrays["state['b']"].ndim == 0 and {e["name"]: e["shape"] for e in header["arrays"]}["state['b']"] == []


def test_names_holding_a_newline_are_encoded_as_json_and_read_back():
    names = ["one\ntwo", "three", "lone \udc80"]
    header, arrays = parse_checkpoint(checkpoint(names)[0], "mem")
    assert header["names_encoding"] == "json"
    assert decode_names(arrays["streams.names"], "json", 3) == names
    with pytest.raises(ValueError, match="2 stream names, the header says 3"):
        decode_names(np.frombuffer(b"a\nb", np.uint8), "lines", 3)
    with pytest.raises(ValueError, match="unknown names encoding"):
        decode_names(arrays["streams.names"], "csv", 3)


def test_the_same_input_gives_the_same_bytes_and_pause_is_called_between_name_chunks():
    names = [f"s{i}" for i in range(5000)]
    pauses: list[int] = []
    a = join(encode([("state", np.zeros(3))], (names, np.arange(5000), np.zeros(5000)), settings={}, versions={},
                    wall_time=0.0, counts={}, positions={}, pause=lambda: pauses.append(1)))
    b = join(encode([("state", np.zeros(3))], (names, np.arange(5000), np.zeros(5000)), settings={}, versions={},
                    wall_time=0.0, counts={}, positions={}))
    assert a == b and len(pauses) == 3  # 2048 names a chunk


def test_a_lazy_leaf_is_written_in_canonical_order():
    placement = Placement(devices=2, max_streams=5)
    shards = [np.arange(placement.spare_row + 1, dtype=np.float32) + 100 * d for d in range(2)]
    rows = CanonicalRows(shards, placement)
    data = join(encode([("state.t", rows)], ([], np.zeros(0), np.zeros(0)), settings={}, versions={}, wall_time=0.0,
                       counts={}, positions={}))
    np.testing.assert_array_equal(parse_checkpoint(data, "mem")[1]["state.t"], np.asarray(rows))


@pytest.mark.parametrize("where", ["header", "array", "digest"])
def test_a_flipped_byte_is_refused(where):
    data = bytearray(checkpoint()[0])
    at = {"header": 40, "array": len(data) // 2, "digest": len(data) - 20}[where]
    data[at] ^= 0x01
    with pytest.raises(CheckpointDamaged, match="mem: checksum mismatch"):
        parse_checkpoint(bytes(data), "mem")


def test_truncated_bytes_and_other_bytes_are_refused():
    data = checkpoint()[0]
    with pytest.raises(CheckpointDamaged, match="no end marker"):
        parse_checkpoint(data[:-1], "mem")
    with pytest.raises(CheckpointDamaged, match="too short"):
        parse_checkpoint(data[:MIN_BYTES - 1], "mem")
    with pytest.raises(CheckpointDamaged, match="not a forkless checkpoint"):
        parse_checkpoint(b"X" + data[1:], "mem")


def test_file_names_sort_in_sequence_order_and_temporary_ones_are_told_apart():
    assert file_name(7) == "ckpt-000000007.fkc" and sequence_of(file_name(7)) == 7
    assert sequence_of(file_name(1234567890)) == 1234567890
    temp = temporary_name(file_name(3), 4242)
    assert temp == ".tmp-ckpt-000000003.fkc.4242" and is_temporary(temp)
    assert sequence_of(temp) is None and not is_temporary(file_name(3))
    assert sequence_of("ckpt-1.fkc") is None and sequence_of("ckpt-000000001.fkc.bak") is None


def test_check_fits_names_the_setting_and_reads_a_legacy_processor_id():
    header = parse_checkpoint(checkpoint()[0], "mem")[0]
    check_fits("mem", header, {"features": 2, "processor": "ewma", "processor_version": "1"})
    with pytest.raises(CheckpointMismatch, match="features: 2 in the checkpoint, 3 now"):
        check_fits("mem", header, {"features": 3})
    with pytest.raises(CheckpointMismatch, match="checkpoint format"):
        check_fits("mem", {**header, "format": 2}, {})
    with pytest.raises(CheckpointMismatch, match=r"absent: '\(not recorded\)' in the checkpoint"):
        check_fits("mem", header, {"absent": 1})
    legacy = {**header, "settings": {"processor": "ewma/1"}}
    check_fits("mem", legacy, {"processor": "ewma", "processor_version": "1"})
    with pytest.raises(CheckpointMismatch, match="processor"):
        check_fits("mem", legacy, {"processor": "other", "processor_version": "1"})
    check_fits("mem", {**header, "settings": {"shape": [1, 2]}}, {"shape": (1, 2)})  # as JSON reads it back


def test_importing_the_format_loads_no_jax():
    code = ("import sys, forkless.controller.checkpoints.ckptformat; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
