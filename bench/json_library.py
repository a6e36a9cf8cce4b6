"""The codec's own work under each JSON library this interpreter has: µs a message, medians of repeats.

    python -m bench.json_library [--repeats 7]

``JsonCodec`` (controller/codec.py) runs unchanged over msgspec, the standard library's ``json``
and, where it is installed, orjson (as the codec wrote it before msgspec: ``orjson.loads``,
``orjson.dumps``, and numpy arrays through ``OPT_SERIALIZE_NUMPY``), on the benchmark's own message
shapes (bench/loadgen.py: 8 features, ``standard_normal().round(5)``, streams ``s0``..``s99``;
replies as the default detector's: ``z`` [n, 8] and ``score`` float32, ``anomaly`` bool). Each
figure is the median over ``--repeats`` of the best of 3 timings of a pass (docs/performance.md
quotes them). Nothing here is asserted: speed is measured, not tested.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from forkless.controller import codec as codec_module
from forkless.io_loop import jsontext

FEATURES = 8


def _libraries() -> dict[str, dict[str, Any]]:
    """Each library's four functions, as the codec imports them from io_loop/jsontext.py."""
    libs: dict[str, dict[str, Any]] = {}
    for name in ("msgspec", "json"):
        try:
            libs[name] = jsontext.library(name) | {"non_finite_in": jsontext.non_finite_in}
        except ImportError:
            pass
    try:
        import orjson
    except ImportError:
        return libs

    def numbers(arr: np.ndarray) -> bytes:
        if arr.dtype.kind == "f":
            arr = np.ascontiguousarray(arr, np.float64)
        elif not arr.flags.c_contiguous or not arr.dtype.isnative:
            arr = np.ascontiguousarray(arr, arr.dtype.newbyteorder("="))
        return orjson.dumps(arr, option=orjson.OPT_SERIALIZE_NUMPY)

    libs["orjson"] = {"DECODE_ERRORS": (orjson.JSONDecodeError, RecursionError), "loads": orjson.loads,
                      "dumps": orjson.dumps, "dumps_numbers": numbers, "non_finite_in": lambda b: b"null" in b}
    return libs


def _frames(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((n, FEATURES)).round(5)
    return [b'{"seq":%d,"stream":"s%d","x":%s}' % (i, i % 100, json.dumps(x, separators=(",", ":")).encode())
            for i, x in enumerate(xs.tolist())]


def _outputs(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    score = rng.random(n).astype(np.float32)
    return {"z": rng.standard_normal((n, FEATURES)).astype(np.float32), "score": score, "anomaly": score > 0.9}


def _per_message_us(work: Callable[[], Any], messages: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return best / messages * 1e6


def _cases() -> dict[str, tuple[Callable[[codec_module.JsonCodec], Callable[[], Any]], int]]:
    frames = _frames(2048)
    batch_frames = [b"[" + b",".join(frames[i:i + 64]) + b"]" for i in range(0, 2048, 64)]
    reads = [frames[i:i + 16] for i in range(0, 2048, 16)]
    cases: dict[str, tuple[Callable[[codec_module.JsonCodec], Callable[[], Any]], int]] = {
        "decode, one message a frame": (lambda c: lambda: [c.decode(f) for f in frames], len(frames)),
        "decode, 64 messages a frame": (lambda c: lambda: [c.decode(f) for f in batch_frames], 2048),
        "decode_frames, a read of 16 frames": (lambda c: lambda: [c.decode_frames(r) for r in reads], 2048),
    }
    for n in (1, 4, 64, 256):
        seq, stream, outputs = list(range(10**6, 10**6 + n)), [f"s{i % 100}" for i in range(n)], _outputs(n)
        reps = max(1, 2048 // n)
        cases[f"encode_results, a batch of {n}"] = (
            lambda c, seq=seq, stream=stream, outputs=outputs, reps=reps:
            lambda: [c.encode_results(seq, stream, outputs) for _ in range(reps)], reps * n)
    return cases


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    libs, cases = _libraries(), _cases()
    for functions in libs.values():
        functions.pop("LIBRARY", None)
    saved = {n: getattr(codec_module, n) for n in next(iter(libs.values()))}
    results: dict[str, dict[str, float]] = {case: {} for case in cases}
    try:
        for _ in range(a.repeats):
            for lib, functions in libs.items():  # alternating, so a slower minute touches every library
                for name, fn in functions.items():
                    setattr(codec_module, name, fn)
                c = codec_module.JsonCodec(FEATURES)
                for case, (make, messages) in cases.items():
                    results[case].setdefault(lib, [])  # type: ignore[arg-type]
                    results[case][lib].append(_per_message_us(make(c), messages))  # type: ignore[attr-defined]
    finally:
        for name, fn in saved.items():
            setattr(codec_module, name, fn)
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    print(f"Python {sys.version.split()[0]}, GIL {'on' if gil else 'off'}: µs a message, median of {a.repeats}")
    print("| work | " + " | ".join(libs) + " |")
    print("|---" * (1 + len(libs)) + "|")
    for case, per_lib in results.items():
        print(f"| {case} | " + " | ".join(f"{statistics.median(per_lib[lib]):.2f}" for lib in libs) + " |")


if __name__ == "__main__":
    main()
