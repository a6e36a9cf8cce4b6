"""The wire codec: frames in, decoded messages and errors out; results in, frames out.

Rules:
- Pure: no sockets, no threads, no clock. ``decode`` never raises on bad input: each bad frame or element is one
  ``(reason, seq)`` error, and the frame's good elements are still returned.
- A decoded message is ``(seq, stream, x)``, ``x`` of length ``features`` built in the processor's input dtype
  from the parsed numbers (a float64 input never passes through float32), column-wise per frame (``Decoded``).
- Another protocol replaces ``JsonCodec`` by implementing ``Codec`` (docs/embedding/contract.md); ``encode_error``
  may return None: no error frame, counted as a declined reply. ``GuardedCodec`` keeps a codec's exceptions off
  the IO thread and the loop.
- Network data is only ever parsed as JSON; nothing is evaluated or unpickled.

Default protocol (text or binary frames, UTF-8 JSON)::

    in : {"seq": 1, "stream": "a", "x": [F numbers]}   or   [ {…}, {…} ]
    out: {"seq": 1, "stream": "a", "z": [F floats], "score": 0.3, "anomaly": false}
    err: {"error": "<short reason>", "seq": 1 | null}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any, Protocol

import numpy as np

from forkless.io_loop.decoding import NOT_NUMBERS_REASON, X_MAX, X_RANGE_REASON, FrameDecoder
from forkless.io_loop.jsontext import DECODE_ERRORS, dumps, dumps_numbers, loads, non_finite_in

__all__ = ["Codec", "Decoded", "GuardedCodec", "JsonCodec", "fallback_error_frame", "guarded_codec"]

MAX_STREAM_CHARS = 256
# a seq is an integer JSON libraries write as a 64-bit one (orjson, the codec's first library, read
# larger ones as floats): beyond this range it is refused as not an integer, whichever library reads it
SEQ_MIN, SEQ_MAX = -(2**63), 2**64 - 1
# one frame's error replies are bounded, so output stays O(input): after this many, one
# summary reply stands for the rest of that frame's bad elements
MAX_ERROR_REPLIES = 16
FOLDED_REASON = f"bad element beyond {MAX_ERROR_REPLIES} error replies in one frame"
NON_FINITE_RESULT = "processing produced a non-finite result"
# decode_frames takes this many frames or more; fewer are decoded one at a time, as fast or faster
# (bench/docs/per-message-cost.md)
ONE_PASS_MIN_FRAMES = 4
# The accepted input range (|x| <= X_MAX, X_RANGE_REASON) is io_loop/decoding.py's: emit_rows refuses the same.


@dataclass
class Decoded:
    """What one frame held: good messages column-wise, and one error per bad part."""

    seq: list[Any] = field(default_factory=list)
    stream: list[str] = field(default_factory=list)
    x: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    errors: list[tuple[str, Any]] = field(default_factory=list)
    # bad elements beyond MAX_ERROR_REPLIES: not answered one by one; the last entry of
    # ``errors`` is then one summary reply for all of them (counted under FOLDED_REASON)
    folded: int = 0

    def cast(self, dtype: Any) -> None:
        """``x`` made ``dtype`` (a custom codec's, for the processor's input dtype)."""
        self.x = self.x.astype(dtype)

    def __len__(self) -> int:
        return len(self.seq)

    def error_counts(self) -> list[tuple[str, int]]:
        """(reason, how many bad elements) for the counters: every bad element counted once."""
        if not self.folded:
            return [(reason, 1) for reason, _ in self.errors]
        return [(reason, 1) for reason, _ in self.errors[:-1]] + [(FOLDED_REASON, self.folded)]


def _json_items(values: Sequence[Any]) -> list[bytes]:
    """``values`` as one JSON array by one ``dumps``, cut at its commas: each value's text
    when no value's text holds a comma (more pieces than values otherwise)."""
    return dumps(values if type(values) is list else list(values))[1:-1].split(b",")


def _finite_rows(arrays: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """Which of the ``n`` rows hold only finite values in every float array."""
    ok = np.ones(n, bool)
    for arr in arrays.values():
        if arr.dtype.kind == "f":
            ok &= np.isfinite(arr.reshape(n, -1)).all(axis=1)
    return ok


# decode_frames' column-at-a-time checks
_SEQ, _STREAM, _X = itemgetter("seq"), itemgetter("stream"), itemgetter("x")
_INT, _STR, _LIST, _NUMBER = {int}, {str}, {list}, {int, float}


class Codec(FrameDecoder, Protocol):
    """What the controller needs from a protocol. Implementations must be pure and thread-safe
    for one caller per method: ``decode`` runs in the IO thread, ``encode_*`` in the main thread.
    A reply frame is ``str``, or ``bytes`` holding UTF-8 text; both are sent as text frames.
    The IO thread's half (``decode``, ``encode_error``) is ``io_loop.decoding.FrameDecoder``."""

    def decode(self, frame: str | bytes) -> Decoded: ...

    def encode_results(
        self, seq: Sequence[Any], stream: Sequence[str], outputs: Mapping[str, np.ndarray]
    ) -> Sequence[str | bytes | None]: ...  # one per message (None: no reply), or none

    def encode_error(self, reason: str, seq: Any) -> str | bytes | None: ...  # None: no frame


class JsonCodec:
    """The default JSON protocol (see the module docstring)."""

    def __init__(self, features: int, *, max_frame_items: int = 10_000,
                 max_stream_chars: int = MAX_STREAM_CHARS, dtype: Any = np.float32) -> None:
        self.features = features
        self.dtype = np.dtype(dtype)  # of x: the processor's input dtype (the Controller passes it)
        self.max_frame_items = max_frame_items
        self.max_stream_chars = max_stream_chars

    # ---- decoding (IO thread) ---------------------------------------------------------------

    def decode(self, frame: str | bytes) -> Decoded:
        """Parse one frame. Never raises: bad parts come back in ``Decoded.errors``."""
        try:
            doc = loads(frame)
        except DECODE_ERRORS:
            return Decoded(errors=[(self._parse_failure(frame), None)])

        if type(doc) is dict:  # the common case: one message per frame
            reason, seq = self._check(doc)
            if reason is None:
                return Decoded([seq], [doc["stream"]], np.array([doc["x"]], self.dtype))
            return Decoded(errors=[(reason, seq)])

        out = Decoded()
        if type(doc) is not list:
            out.errors.append(("not an object", None))
            return out
        if len(doc) > self.max_frame_items:
            out.errors.append((f"batch frame too large: {len(doc)} > {self.max_frame_items} items", None))
            return out
        rows: list[list[Any]] = []
        for item in doc:
            reason, seq = self._check(item)
            if reason is None:
                out.seq.append(seq)
                out.stream.append(item["stream"])
                rows.append(item["x"])
            else:
                out.errors.append((reason, seq))
        if rows:
            out.x = np.array(rows, self.dtype)
        if len(out.errors) > MAX_ERROR_REPLIES:
            folded = len(out.errors) - (MAX_ERROR_REPLIES - 1)
            first = out.errors[MAX_ERROR_REPLIES - 1][0]
            out.errors[MAX_ERROR_REPLIES - 1:] = [(f"{folded} more bad elements in this frame "
                                                   f"(the first: {first})", None)]
            out.folded = folded
        return out

    def decode_frames(self, frames: Sequence[str | bytes]) -> Decoded | None:
        """The good messages of several frames (one socket read's) as one ``Decoded``, in one pass:
        each frame parsed by ``loads`` (io_loop/jsontext.py), the fields checked a column at a time (C loops over the
        messages, not Python per message), the numbers made one array. Only for frames that are
        all good: None as soon as anything is not (a frame that does not parse, a bad element,
        a number out of range, a frame too large), and the caller then decodes the frames one
        at a time with ``decode``, so each bad part gets its own reason exactly as there and no
        good neighbour is lost."""
        if len(frames) < ONE_PASS_MIN_FRAMES:
            return None
        try:
            docs = list(map(loads, frames))
        except DECODE_ERRORS:
            return None
        if len(set(map(type, docs))) == 1 and type(docs[0]) is dict:  # one message a frame: the common case
            items = docs
        else:
            items = []
            for doc in docs:
                if type(doc) is dict:
                    items.append(doc)
                elif type(doc) is list and 0 < len(doc) <= self.max_frame_items:
                    items += doc
                else:
                    return None
        if not items:
            return None
        try:
            seq = list(map(_SEQ, items))
            stream = list(map(_STREAM, items))
            rows = list(map(_X, items))
        except (KeyError, TypeError):  # an element that is not an object, or lacks a field
            return None
        if set(map(type, seq)) != _INT or min(seq) < SEQ_MIN or max(seq) > SEQ_MAX \
                or set(map(type, stream)) != _STR or set(map(type, rows)) != _LIST \
                or set(map(len, rows)) != {self.features} or min(map(len, stream)) < 1 \
                or max(map(len, stream)) > self.max_stream_chars \
                or not set(map(type, chain.from_iterable(rows))) <= _NUMBER:
            return None
        x = np.array(rows, np.float64)  # as decode() builds it: the same double for every number
        if not np.abs(x).max(initial=0.0) <= X_MAX:
            return None
        return Decoded(seq, stream, x if self.dtype == np.float64 else x.astype(self.dtype))

    @staticmethod
    def _parse_failure(frame: str | bytes) -> str:
        if isinstance(frame, (bytes, bytearray, memoryview)):
            try:
                bytes(frame).decode("utf-8")
            except UnicodeDecodeError:
                return "not UTF-8"
        return "not JSON"

    def _check(self, item: Any) -> tuple[str | None, Any]:
        """Return ``(None, seq)`` for a well-formed message, else ``(reason, seq or None)``."""
        if type(item) is not dict:
            return "not an object", None
        if "seq" not in item:
            return "missing field: seq", None
        seq = item["seq"]
        if type(seq) is not int or not SEQ_MIN <= seq <= SEQ_MAX:  # bool is an int subclass: refused too
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
            kind = type(v)
            if kind is not float and kind is not int:
                return NOT_NUMBERS_REASON, seq
            if not -X_MAX <= v <= X_MAX:  # also false for NaN
                return X_RANGE_REASON, seq
        return None, seq

    # ---- encoding (main thread) -------------------------------------------------------------

    def encode_results(
        self, seq: Sequence[Any], stream: Sequence[str], outputs: Mapping[str, np.ndarray]
    ) -> list[str | bytes]:
        """One frame per message: ``seq``, ``stream`` and every output field for that row, in
        that order; a row with a non-finite float becomes an error reply.

        The batch is written a column at a time (``_encode_columns``: one ``dumps`` call a
        column, the frames joined in one C loop), byte for byte what one ``dumps`` of
        each message's dict writes; outputs that path cannot take (another dtype than bool,
        int or float, more than two dimensions, a name that is not a str or is ``seq`` or
        ``stream``) are written a message at a time (``_encode_each``)."""
        arrays = {name: np.asarray(value) for name, value in outputs.items()}
        written = self._encode_columns(seq, stream, arrays)
        if written is None:
            return self._encode_each(seq, stream, arrays)
        frames, maybe_non_finite = written
        if maybe_non_finite:
            for i in np.flatnonzero(~_finite_rows(arrays, len(seq))).tolist():
                frames[i] = self.encode_error(NON_FINITE_RESULT, seq[i])
        return frames

    @staticmethod
    def _encode_columns(seq: Sequence[Any], stream: Sequence[str],
                        arrays: Mapping[str, np.ndarray]) -> tuple[list[str | bytes], bool] | None:
        """The frames of ``encode_results`` written a column at a time, and whether a float column
        wrote a non-finite value (``non_finite_in``: its rows are then found with numpy); None when a
        column cannot be written so (see ``encode_results``). A column's JSON array is cut into
        its rows at the commas (rows of numbers at ``],[``): numbers, ``true`` and ``false``
        hold none, and a column of other values is cut so only when it yields exactly one
        piece a row (a piece a value: no value held a comma). Floats are written from float64,
        as ``tolist()`` makes them, so the text is the same."""
        n = len(seq)
        template = [b'{"seq":%b,"stream":%b']
        columns = [_json_items(seq), _json_items(stream)]
        maybe_non_finite = False
        for name, arr in arrays.items():
            kind = arr.dtype.kind
            if type(name) is not str or name in ("seq", "stream") or kind not in "biuf" or arr.ndim not in (1, 2) \
                    or len(arr) != n:
                return None
            body = dumps_numbers(arr)
            if kind == "f" and non_finite_in(body):
                maybe_non_finite = True
            key = dumps(name).replace(b"%", b"%%")
            if arr.ndim == 1:
                template.append(b"," + key + b":%b")
                columns.append(body[1:-1].split(b","))
            elif arr.shape[1] == 0:
                template.append(b"," + key + b":[]")
            else:
                template.append(b"," + key + b":[%b]")
                columns.append(body[2:-2].split(b"],["))
        if any(len(column) != n for column in columns):
            return None
        return list(map(b"".join([*template, b"}"]).__mod__, zip(*columns))), maybe_non_finite

    def _encode_each(self, seq: Sequence[Any], stream: Sequence[str],
                     arrays: Mapping[str, np.ndarray]) -> list[str | bytes]:
        """``encode_results`` a message at a time: one dict and one ``dumps`` each."""
        n = len(seq)
        ok = _finite_rows(arrays, n)
        columns = {name: arr.tolist() for name, arr in arrays.items()}
        names = list(columns)
        all_ok = bool(ok.all())
        frames: list[str | bytes] = []
        for i in range(n):
            if not all_ok and not ok[i]:
                frames.append(self.encode_error(NON_FINITE_RESULT, seq[i]))
                continue
            obj = {"seq": seq[i], "stream": stream[i]}
            for name in names:
                obj[name] = columns[name][i]
            frames.append(dumps(obj))
        return frames

    def encode_error(self, reason: str, seq: Any) -> bytes:
        return dumps({"error": reason, "seq": seq})


# ---- any codec made as safe as the built-in one ---------------------------------------------------

DECODE_FAILED = "decode failed"
ENCODE_FAILED = "encode failed"
MAX_LOGGED_FAILURES = 1000


def fallback_error_frame(reason: str, seq: Any) -> bytes:
    """The JSON error frame used when a codec's own ``encode_error`` fails."""
    try:
        return dumps({"error": reason, "seq": seq})
    except TypeError:  # a seq that is not JSON
        return dumps({"error": reason, "seq": None})


class GuardedCodec:
    """Wraps any ``Codec`` so that its exceptions never reach the IO thread or the loop (what each failure
    becomes: docs/embedding/contract.md, "codec").

    - ``decode`` raising or returning badly shaped columns is one ``("decode failed", None)`` error; ``x`` of
      another dtype is converted to ``dtype``, the processor's input dtype.
    - ``encode_error`` returning None declines the reply; raising, or returning anything but str, bytes or
      None, falls back to ``fallback_error_frame``.
    - ``encode_batch`` (the loop's) calls ``encode_results``: one entry per message (None: no reply) or none
      at all; raising or any other length answers the batch with ``"encode failed"`` (not even encoded with
      ``errors=False``).
    - Each distinct failure (method, exception type, first line) is logged once with its traceback; the
      counters count every one.
    """

    def __init__(self, codec: Codec, features: int, log: logging.Logger | None = None,
                 dtype: Any = np.float32) -> None:
        self.codec = codec
        self.features = features
        self.dtype = np.dtype(dtype)
        self.log = log if log is not None else logging.getLogger("forkless.codec")
        self._logged: set[tuple[str, str]] = set()  # (method, failure); written per method by one thread
        if type(codec) is JsonCodec and codec.dtype == self.dtype:
            # the built-in codec never raises and always returns well-formed columns (its
            # tests pin both): its decode runs unwrapped, saving a call and a check per frame,
            # and it reads a socket read's frames in one pass
            self.decode = codec.decode  # type: ignore[method-assign]  # this instance's: the built-in codec's own
            self.decode_frames = codec.decode_frames  # type: ignore[method-assign]  # as decode

    def decode(self, frame: str | bytes) -> Decoded:
        try:
            decoded = self.codec.decode(frame)
            problem = self._check_decoded(decoded)
        except Exception as exc:
            self._log_once("decode", exc)
            return Decoded(errors=[(DECODE_FAILED, None)])
        if problem:
            self._log_once("decode", ValueError(problem))
            return Decoded(errors=[(DECODE_FAILED, None)])
        return decoded

    def decode_frames(self, frames: Sequence[str | bytes]) -> Decoded | None:
        """Several frames in one pass: the built-in codec's (``JsonCodec.decode_frames``); for
        any other codec None, and the caller decodes the frames one at a time with ``decode``
        (a codec's contract is one frame at a time)."""
        return None

    def encode_error(self, reason: str, seq: Any) -> str | bytes | None:
        try:
            frame = self.codec.encode_error(reason, seq)
            if frame is None or isinstance(frame, (str, bytes)):
                return frame  # None: the codec declines this error reply (no frame)
            raise TypeError(f"encode_error returned {type(frame).__name__}, not str, bytes or None")
        except Exception as exc:
            self._log_once("encode_error", exc)
            return fallback_error_frame(reason, seq)

    def encode_batch(self, seq: Sequence[Any], stream: Sequence[str], outputs: Mapping[str, np.ndarray], *,
                     errors: bool = True) -> tuple[list[str | bytes | None], bool]:
        """``(one frame or None per message, True)``, or ``(error frames, False)`` if encoding failed
        (each None where ``encode_error`` declined, and all None with ``errors=False``)."""
        try:
            frames: list[str | bytes | None] = list(self.codec.encode_results(seq, stream, outputs))
            if not frames:
                return [None] * len(seq), True
            if len(frames) != len(seq):
                raise ValueError(f"encode_results returned {len(frames)} frames for {len(seq)} messages "
                                 "(one per message, None for no reply)")
            return frames, True
        except Exception as exc:
            self._log_once("encode_results", exc)
            if not errors:
                return [None] * len(seq), False
            return [self.encode_error(ENCODE_FAILED, s) for s in seq], False

    def encode_results(self, seq: Sequence[Any], stream: Sequence[str],
                       outputs: Mapping[str, np.ndarray]) -> list[str | bytes | None]:
        return self.encode_batch(seq, stream, outputs)[0]

    def _check_decoded(self, d: Any) -> str:
        if not isinstance(d, Decoded):
            return f"decode returned {type(d).__name__}, not Decoded"
        n = len(d.seq)
        if len(d.stream) != n:
            return f"decode returned {n} seq values but {len(d.stream)} streams"
        if n and (not isinstance(d.x, np.ndarray) or d.x.shape != (n, self.features)):
            return (f"decode returned x of shape {list(getattr(d.x, 'shape', []))}, "
                    f"expected [{n}, {self.features}] ({self.dtype})")
        if n and d.x.dtype != self.dtype:
            d.cast(self.dtype)
        return ""

    def _log_once(self, method: str, exc: BaseException) -> None:
        lines = str(exc).strip().splitlines()
        key = (method, f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200])
        if key in self._logged or len(self._logged) >= MAX_LOGGED_FAILURES:
            return
        self._logged.add(key)
        self.log.error("the codec's %s failed (%s); answered with an error, carrying on (logged once)",
                       method, key[1], exc_info=exc)


def guarded_codec(codec: Codec | None, features: int, *, max_frame_items: int, dtype: Any) -> GuardedCodec:
    """The codec a controller runs: ``codec`` (by default ``JsonCodec``) behind ``GuardedCodec``,
    so a custom codec's exceptions become error replies, never a dead thread, and its ``x`` is
    cast to ``dtype`` (the processor's input dtype) if it differs."""
    user = codec if codec is not None else JsonCodec(features, max_frame_items=max_frame_items, dtype=dtype)
    return GuardedCodec(user, features, dtype=dtype)
