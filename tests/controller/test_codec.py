"""The JSON codec, with literal frames: no sockets, no threads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from forkless.controller.codec import JsonCodec
from forkless.io_loop.jsontext import LIBRARY, dumps

F = 3
codec = JsonCodec(F, max_frame_items=4)


def msg(seq=1, stream="a", x=(1.0, 2.0, 3.0), **extra):
    return {"seq": seq, "stream": stream, "x": list(x), **extra}


def test_a_good_message_decodes_to_one_row_of_float32():
    d = codec.decode(json.dumps(msg(7, "s1", (1, 2.5, -3))))
    assert d.seq == [7] and d.stream == ["s1"] and d.errors == []
    assert d.x.dtype == np.float32 and d.x.tolist() == [[1.0, 2.5, -3.0]]


def test_binary_frames_are_read_as_utf8_json():
    d = codec.decode(json.dumps(msg(2)).encode())
    assert d.seq == [2]


def test_unknown_extra_fields_are_ignored():
    d = codec.decode(json.dumps(msg(3, ts=123, meta={"k": 1})))
    assert d.seq == [3] and d.errors == []


def test_an_array_frame_keeps_order_and_answers_bad_elements_one_by_one():
    frame = json.dumps([msg(1), {"seq": 2, "stream": "b"}, msg(3, "c"), 5])
    d = codec.decode(frame)
    assert d.seq == [1, 3] and d.stream == ["a", "c"]
    assert d.errors == [("missing field: x", 2), ("not an object", None)]


@pytest.mark.parametrize(
    ("frame", "reason", "seq"),
    [
        ("{not json", "not JSON", None),
        (b"\xff\xfe", "not UTF-8", None),
        ("42", "not an object", None),
        ('"text"', "not an object", None),
        (json.dumps({"stream": "a", "x": [1, 2, 3]}), "missing field: seq", None),
        (json.dumps(msg(seq="1")), "seq must be an integer", None),
        (json.dumps(msg(seq=1.5)), "seq must be an integer", None),
        (json.dumps(msg(seq=True)), "seq must be an integer", None),
        (json.dumps({"seq": 4, "x": [1, 2, 3]}), "missing field: stream", 4),
        (json.dumps(msg(4, stream="")), "stream must be a non-empty string", 4),
        (json.dumps(msg(4, stream=5)), "stream must be a non-empty string", 4),
        (json.dumps(msg(4, stream="s" * 300)), "stream name longer than 256 characters", 4),
        (json.dumps({"seq": 4, "stream": "a"}), "missing field: x", 4),
        (json.dumps(msg(4, x=[1, 2])), "x must have 3 numbers, got 2", 4),
        (json.dumps({"seq": 4, "stream": "a", "x": "1,2,3"}), "x must be an array of numbers", 4),
        (json.dumps(msg(4, x=[1, "2", 3])), "x must hold numbers only", 4),
        (json.dumps(msg(4, x=[1, True, 3])), "x must hold numbers only", 4),
        (json.dumps(msg(4, x=[1, None, 3])), "x must hold numbers only", 4),
        ('{"seq": 4, "stream": "a", "x": [1, NaN, 3]}', "not JSON", None),  # NaN is not JSON
        ('{"seq": 4, "stream": "a", "x": [1, Infinity, 3]}', "not JSON", None),
        # overflows a double: msgspec refuses it as JSON, the standard library reads an infinity (io_loop/jsontext.py)
        ('{"seq": 4, "stream": "a", "x": [1, 1e999, 3]}', *(("not JSON", None) if LIBRARY == "msgspec" else
                                                            ("x must be finite and within ±1e18", 4))),
        (json.dumps(msg(2**64)), "seq must be an integer", None),  # a seq is at most 64 bits, whatever reads it
        (json.dumps(msg(-(2**63) - 1)), "seq must be an integer", None),
        (json.dumps(msg(4, x=[1, 1e39, 3])), "x must be finite and within ±1e18", 4),
        (json.dumps(msg(4, x=[1, -(10**50), 3])), "x must be finite and within ±1e18", 4),
        (json.dumps([msg(i) for i in range(5)]), "batch frame too large: 5 > 4 items", None),
        ("[" * 100_000 + "]" * 100_000, "not JSON", None),  # hostile nesting: refused, no crash
        ('{"a":' * 100_000 + "1" + "}" * 100_000, "not JSON", None),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_each_kind_of_bad_input_gets_one_error_with_the_seq_when_readable(frame, reason, seq):
    d = codec.decode(frame)
    assert d.seq == []
    assert d.errors == [(reason, seq)]


def test_a_non_finite_row_is_dropped_but_its_neighbours_are_kept():
    frame = '[{"seq": 1, "stream": "a", "x": [1, 2, 3]}, {"seq": 2, "stream": "a", "x": [1, 4e38, 3]},' \
            ' {"seq": 3, "stream": "b", "x": [4, 5, 6]}]'
    d = codec.decode(frame)
    assert d.seq == [1, 3] and d.stream == ["a", "b"] and d.x.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert d.errors == [("x must be finite and within ±1e18", 2)]


def test_results_encode_one_frame_per_message_with_every_output_field():
    out = {"z": np.array([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0]], np.float32),
           "score": np.array([2.0, 0.0], np.float32), "anomaly": np.array([True, False])}
    frames = codec.encode_results([10, 11], ["a", "b"], out)
    assert [json.loads(f) for f in frames] == [
        {"seq": 10, "stream": "a", "z": [0.5, -1.0, 2.0], "score": 2.0, "anomaly": True},
        {"seq": 11, "stream": "b", "z": [0.0, 0.0, 0.0], "score": 0.0, "anomaly": False},
    ]


def test_a_non_finite_result_becomes_an_error_reply_not_invalid_json():
    out = {"score": np.array([np.inf, 1.0])}
    frames = codec.encode_results([1, 2], ["a", "a"], out)
    assert json.loads(frames[0]) == {"error": "processing produced a non-finite result", "seq": 1}
    assert json.loads(frames[1]) == {"seq": 2, "stream": "a", "score": 1.0}


def test_error_frames_have_reason_and_seq():
    assert json.loads(codec.encode_error("not JSON", None)) == {"error": "not JSON", "seq": None}


def one_dict_a_message(seq, stream, outputs):
    """The reference: one dict a message, written by one ``dumps`` each (the codec's frames
    before it wrote a batch a column at a time), a non-finite row an error reply."""
    columns = {name: np.asarray(value) for name, value in outputs.items()}
    frames = []
    for i in range(len(seq)):
        if not all(np.isfinite(v[i]).all() for v in columns.values() if v.dtype.kind == "f"):
            frames.append(dumps({"error": "processing produced a non-finite result", "seq": seq[i]}))
            continue
        frames.append(dumps({"seq": seq[i], "stream": stream[i],
                                    **{name: v[i].tolist() for name, v in columns.items()}}))
    return frames


def default_outputs(n, rng, dtype=np.float32):
    return {"z": rng.standard_normal((n, 8)).astype(dtype), "score": rng.random(n).astype(dtype),
            "anomaly": rng.random(n) < 0.5}


@pytest.mark.parametrize("n", [1, 2, 16, 64, 256])
def test_a_batch_of_results_is_byte_for_byte_one_dumps_a_message(n):
    rng = np.random.default_rng(n)
    seq, stream = list(range(10**12, 10**12 + n)), [f"sensor-{i % 16}" for i in range(n)]
    for dtype in (np.float32, np.float64, np.float16):
        outputs = default_outputs(n, rng, dtype)
        assert JsonCodec(8).encode_results(seq, stream, outputs) == one_dict_a_message(seq, stream, outputs)


def test_every_float32_bit_pattern_class_is_written_as_tolist_writes_it():
    bits = np.random.default_rng(7).integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = np.concatenate([values[np.isfinite(values)], np.array(
        [0.0, -0.0, 1e16, 1e17, 1e20, 1e-7, 1e-5, 0.1, 3.4e38, 1e-45, 100.0], np.float32)])
    seq = list(range(len(values)))
    outputs = {"score": values, "z": values.reshape(-1, 1)}
    assert JsonCodec(1).encode_results(seq, ["a"] * len(seq), outputs) == \
        one_dict_a_message(seq, ["a"] * len(seq), outputs)


@pytest.mark.parametrize("case", ["ints", "bools_2d", "non_contiguous", "big_endian", "zero_width", "non_finite",
                                  "stream_commas", "seq_text", "seq_null", "unicode", "percent_name", "name_seq",
                                  "three_dims", "object"])
def test_unusual_outputs_and_names_are_written_as_one_dumps_a_message_writes_them(case):
    rng = np.random.default_rng(3)
    n = 5
    seq, stream = list(range(n)), ["a", "b", "c", "d", "e"]
    outputs = default_outputs(n, rng)
    if case == "ints":
        outputs = {"count": rng.integers(-2**63, 2**63 - 1, n), "small": rng.integers(0, 200, (n, 3)).astype(np.uint8),
                   "wide": rng.integers(0, 2**64 - 1, n, dtype=np.uint64)}
    elif case == "bools_2d":
        outputs = {"flags": rng.random((n, 4)) < 0.5}
    elif case == "non_contiguous":
        outputs = {"z": np.asfortranarray(rng.standard_normal((n, 3))), "score": rng.random(2 * n)[::2]}
    elif case == "big_endian":
        outputs = {"score": rng.random(n).astype(">f8"), "count": np.arange(n).astype(">i4")}
    elif case == "zero_width":
        outputs = {"empty": np.zeros((n, 0), np.float32), "score": np.ones(n, np.float32)}
    elif case == "non_finite":
        outputs["score"][[0, 3]] = [np.nan, -np.inf]
        outputs["z"][4, 2] = np.inf
    elif case == "stream_commas":
        stream = ["a,b", 'q"u,o"te', "c", "back\\slash,", "e"]
    elif case == "seq_text":
        seq = ["1,2", "x", 3, 4.5, [1, 2]]
    elif case == "seq_null":
        seq = [None, True, -1, 10**18, "s"]
    elif case == "unicode":
        stream = ["ä", "日本", "\u2028", "\x01", "e"]
    elif case == "percent_name":
        outputs = {"p%b%%": np.arange(n, dtype=np.float32), "q%s": np.arange(n)}
        stream = ["%b", "%s", "%%", "%", "e"]
    elif case == "name_seq":
        outputs = {"seq": np.arange(n, dtype=np.float32), "score": np.ones(n)}
    elif case == "three_dims":
        outputs = {"cube": rng.standard_normal((n, 2, 2))}
    elif case == "object":
        outputs = {"label": np.array(["x", "y,z", "w", "v", "u"], object), "score": np.ones(n)}
    got = JsonCodec(8).encode_results(seq, stream, outputs)
    want = [dumps({"seq": s, "stream": t, **{k: np.asarray(v).tolist()[i] for k, v in outputs.items()}})
            for i, (s, t) in enumerate(zip(seq, stream))]
    if case == "non_finite":
        for i in (0, 3, 4):
            want[i] = dumps({"error": "processing produced a non-finite result", "seq": seq[i]})
    assert got == want


# ---- decode_frames: a socket read's frames in one pass -------------------------------------------


def one_at_a_time(c: JsonCodec, frames: list) -> tuple[list, list, np.ndarray]:
    parts = [c.decode(f) for f in frames]
    return ([s for p in parts for s in p.seq], [s for p in parts for s in p.stream],
            np.concatenate([p.x for p in parts if len(p)]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_frames_of_good_frames_is_the_frames_decoded_one_at_a_time(dtype):
    rng = np.random.default_rng(5)
    c = JsonCodec(F, max_frame_items=4, dtype=dtype)
    values = [0, -0.0, 1e18, -1e18, 2**53 + 1, 2**59 + 2**36 + 1, 37000.10, 1700000000123, 1e-300, 3]
    frames: list = [json.dumps(msg(i, f"s{i % 3}", (values[i % 10], rng.standard_normal(), i))) for i in range(6)]
    frames.append(json.dumps([msg(6, "a"), msg(7, "b", (1, 2, 3))]).encode())  # an array frame, as bytes
    frames.append(dumps(msg(8, "ü" * 256)))  # the longest stream name allowed
    decoded = c.decode_frames(frames)
    seq, stream, x = one_at_a_time(c, frames)
    assert decoded.seq == seq == list(range(9)) and decoded.stream == stream and not decoded.errors
    assert decoded.x.dtype == dtype and decoded.x.tobytes() == x.tobytes()  # every bit as one at a time


BAD_AMONG_GOOD = ["not json", b"\xff\xfe", "[1, 2]", "[]", "17", '"text"', json.dumps([msg(9)] * 5),
                  json.dumps(msg(9, x=(1, 2))), json.dumps(msg(9, x=(1, True, 3))), json.dumps(msg(9, x=(1, None, 3))),
                  json.dumps(msg(9, x=(1, "2", 3))), '{"seq": 9, "stream": "a", "x": [1, 1e19, 3]}',
                  json.dumps(msg(True)), json.dumps(msg(9.0)), json.dumps(msg(9, "")), json.dumps(msg(9, "a" * 257)),
                  json.dumps(msg(9, 7)), json.dumps({"seq": 9, "stream": "a"}), json.dumps({"stream": "a", "x": [1]}),
                  json.dumps(msg(9) | {"x": "1,2,3"}), json.dumps([msg(9), [1]]), json.dumps(msg(2**64))]


@pytest.mark.parametrize("bad", BAD_AMONG_GOOD)
def test_decode_frames_leaves_a_read_with_any_bad_part_to_be_decoded_one_frame_at_a_time(bad):
    frames = [json.dumps(msg(i)) for i in range(3)] + [bad] + [json.dumps(msg(4))]
    assert codec.decode_frames(frames) is None
    one = codec.decode(bad)  # what the frame-at-a-time decode then makes of it: errors, or nothing at all
    assert one.errors or (len(one) == 0 and bad == "[]")


def test_decode_frames_leaves_fewer_than_four_frames_to_decode_alone():
    assert codec.decode_frames([json.dumps(msg(i)) for i in range(3)]) is None
    assert len(codec.decode_frames([json.dumps(msg(i)) for i in range(4)])) == 4


def test_the_guarded_codec_reads_frames_in_one_pass_only_with_the_built_in_codec():
    from forkless.controller.codec import guarded_codec

    class UsersCodec(JsonCodec):
        pass

    frames = [json.dumps(msg(i)) for i in range(5)]
    assert len(guarded_codec(None, F, max_frame_items=4, dtype=np.float32).decode_frames(frames)) == 5
    assert guarded_codec(UsersCodec(F), F, max_frame_items=4, dtype=np.float32).decode_frames(frames) is None
