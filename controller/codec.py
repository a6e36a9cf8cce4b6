"""The wire codec: frames in, decoded messages and errors out; results in, frames out.

Rules:
- Pure: no sockets, no threads, no clock. ``decode`` never raises on bad input; every
  bad frame or bad element becomes one ``(reason, seq)`` error, and the good elements of the
  same frame are still returned.
- A decoded message is ``(seq, stream, x)`` with ``x`` a float32 vector of length
  ``features``. The batch of a frame comes back column-wise (``Decoded``) so the main
  thread can stack it without per-message work.
- Anything that speaks another protocol can replace ``JsonCodec`` by implementing
  ``Codec``: ``decode``, ``encode_results`` and ``encode_error``.
- Network data is only ever parsed as JSON; nothing is evaluated or unpickled.

Default protocol (text or binary frames, UTF-8 JSON)::

    in : {"seq": 1, "stream": "a", "x": [F numbers]}   or   [ {…}, {…} ]
    out: {"seq": 1, "stream": "a", "z": [F floats], "score": 0.3, "anomaly": false}
    err: {"error": "<short reason>", "seq": 1 | null}
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

MAX_STREAM_CHARS = 256


@dataclass
class Decoded:
    """What one frame held: good messages column-wise, and one error per bad part."""

    seq: list[Any] = field(default_factory=list)
    stream: list[str] = field(default_factory=list)
    x: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    errors: list[tuple[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seq)


class Codec(Protocol):
    """What the controller needs from a protocol. Implementations must be pure and thread-safe
    for one caller per method: ``decode`` runs in the IO thread, ``encode_*`` in the main thread."""

    def decode(self, frame: str | bytes) -> Decoded: ...

    def encode_results(
        self, seq: Sequence[Any], stream: Sequence[str], outputs: Mapping[str, np.ndarray]
    ) -> list[str]: ...

    def encode_error(self, reason: str, seq: Any) -> str: ...


class JsonCodec:
    """The default JSON protocol (see the module docstring)."""

    def __init__(self, features: int, *, max_frame_items: int = 10_000,
                 max_stream_chars: int = MAX_STREAM_CHARS) -> None:
        self.features = features
        self.max_frame_items = max_frame_items
        self.max_stream_chars = max_stream_chars

    # ---- decoding (IO thread) ---------------------------------------------------------------

    def decode(self, frame: str | bytes) -> Decoded:
        """Parse one frame. Never raises: bad parts come back in ``Decoded.errors``."""
        out = Decoded(x=np.zeros((0, self.features), np.float32))
        if isinstance(frame, (bytes, bytearray, memoryview)):
            try:
                frame = bytes(frame).decode("utf-8")
            except UnicodeDecodeError:
                out.errors.append(("not UTF-8", None))
                return out
        try:
            doc = json.loads(frame)
        except (ValueError, RecursionError):
            out.errors.append(("not JSON", None))
            return out

        if isinstance(doc, list):
            if len(doc) > self.max_frame_items:
                out.errors.append((f"batch frame too large: {len(doc)} > {self.max_frame_items} items", None))
                return out
            items = doc
        else:
            items = [doc]

        rows: list[list[Any]] = []
        for item in items:
            reason, seq = self._check(item)
            if reason is None:
                out.seq.append(seq)
                out.stream.append(item["stream"])
                rows.append(item["x"])
            else:
                out.errors.append((reason, seq))
        if rows:
            self._stack(rows, out)
        return out

    def _check(self, item: Any) -> tuple[str | None, Any]:
        """Return ``(None, seq)`` for a well-formed message, else ``(reason, seq or None)``."""
        if not isinstance(item, dict):
            return "not an object", None
        if "seq" not in item:
            return "missing field: seq", None
        seq = item["seq"]
        if type(seq) is not int:  # bool is an int subclass and is refused too
            return "seq must be an integer", None
        if "stream" not in item:
            return "missing field: stream", seq
        stream = item["stream"]
        if type(stream) is not str or not stream:
            return "stream must be a non-empty string", seq
        if len(stream) > self.max_stream_chars:
            return f"stream name longer than {self.max_stream_chars} characters", seq
        if "x" not in item:
            return "missing field: x", seq
        x = item["x"]
        if type(x) is not list:
            return "x must be an array of numbers", seq
        if len(x) != self.features:
            return f"x must have {self.features} numbers, got {len(x)}", seq
        for v in x:
            if type(v) is not float and type(v) is not int:
                return "x must hold numbers only", seq
        return None, seq

    def _stack(self, rows: list[list[Any]], out: Decoded) -> None:
        """Stack good rows into float32; drop (with an error) any row that is not finite there."""
        try:
            x = np.array(rows, dtype=np.float64)
        except OverflowError:  # an integer beyond float64: find the rows one by one
            x = np.empty((len(rows), self.features), np.float64)
            for i, row in enumerate(rows):
                try:
                    x[i] = row
                except OverflowError:
                    x[i] = np.inf
        with np.errstate(over="ignore", invalid="ignore"):
            x32 = x.astype(np.float32)
        finite = np.isfinite(x32).all(axis=1)
        if not finite.all():
            keep = np.flatnonzero(finite).tolist()
            for i in np.flatnonzero(~finite).tolist():
                out.errors.append(("x must be finite (within float32 range)", out.seq[i]))
            out.seq = [out.seq[i] for i in keep]
            out.stream = [out.stream[i] for i in keep]
            x32 = x32[finite]
        out.x = x32

    # ---- encoding (main thread) -------------------------------------------------------------

    def encode_results(
        self, seq: Sequence[Any], stream: Sequence[str], outputs: Mapping[str, np.ndarray]
    ) -> list[str]:
        """One frame per message: ``seq``, ``stream`` and every output field for that row."""
        columns = {name: np.asarray(value).tolist() for name, value in outputs.items()}
        names = list(columns)
        frames = []
        dumps = json.dumps
        for i, (s, k) in enumerate(zip(seq, stream)):
            obj = {"seq": s, "stream": k}
            for name in names:
                obj[name] = columns[name][i]
            try:
                frames.append(dumps(obj, allow_nan=False, separators=(",", ":")))
            except ValueError:
                frames.append(self.encode_error("processing produced a non-finite result", s))
        return frames

    def encode_error(self, reason: str, seq: Any) -> str:
        return json.dumps({"error": reason, "seq": seq}, separators=(",", ":"))

