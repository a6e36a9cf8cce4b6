"""What a source hands over, checked before any of it is taken (io_loop/source.py's
``SourceContext`` calls these): misuse gets a clear error naming the argument, bad values are
refused as the codec refuses them.

Rules:
- Positions (``Positions``, one per source): a source's emits all carry a position or none
  does (its first emit decides: a checkpoint can only say where the state is if every message
  of a replayable source has one); each position is an ``int`` or a ``str``, all of one type,
  and greater than the one before (``str`` ones compared as text): a position names one frame,
  so a repeated one would be applied twice after a restart. A refused emit takes nothing and
  uses no position (``ValueError`` / ``TypeError``).
- ``emit``'s ``first`` is an ``int`` of 0 or more (``check_first``).
- ``emit_rows``' rows (``checked_rows``): a wrong shape raises ``ValueError``; a row whose ``x``
  holds anything but real numbers within ±``X_MAX`` (io_loop/decoding.py, the codec's range) is
  refused with its reason, as ``emit`` refuses a bad element, checked before the cast to the
  processor's dtype (1e39 is inf in float32); the good rows are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from forkless.io_loop.decoding import NOT_NUMBERS_REASON, X_MAX, X_RANGE_REASON

__all__ = ["COMPLEX_REASON", "Positions", "Rows", "check_first", "check_position", "checked_rows", "drop_first",
           "row_reason"]


@dataclass
class Rows:
    """Messages a source decoded itself, in the shape the hand-over takes (``DecodedFrame``):
    the good rows, and one ``(reason, seq)`` per refused row."""

    seq: list[Any]
    stream: list[str]
    x: Any
    errors: list[tuple[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seq)

    def error_counts(self) -> list[tuple[str, int]]:
        return [(reason, 1) for reason, _ in self.errors]


COMPLEX_REASON = "x must hold real numbers (a complex value's imaginary part would be lost)"


def row_reason(row: Any) -> str | None:
    """Why one row of ``x`` (not of an int or float array) is refused; None: it is good."""
    for value in row:
        if isinstance(value, (complex, np.complexfloating)):
            if value.imag:
                return COMPLEX_REASON
            value = value.real  # nothing is lost
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            return NOT_NUMBERS_REASON
        if not -X_MAX <= value <= X_MAX:  # also false for NaN
            return X_RANGE_REASON
    return None


def checked_rows(seq: list[Any], stream: list[str], x: Any, features: int, dtype: Any) -> Rows:
    """``emit_rows``' input as ``Rows``: a wrong shape raises ``ValueError``; a row whose ``x``
    holds anything but real numbers within ±``X_MAX`` is refused as ``emit`` refuses it (its
    reason and seq in ``errors``), the other rows kept, made the processor's input dtype."""
    n = len(seq)
    try:
        raw = np.asarray(x)
    except ValueError:  # rows of different lengths
        raw = None
    if raw is None or raw.shape != (n, features) or len(stream) != n:
        raise ValueError(f"emit_rows takes seq and stream of one length n and x of shape (n, {features}); got "
                         f"{n}, {len(stream)} and {'rows of different lengths' if raw is None else raw.shape}")
    if raw.dtype.kind in "iuf":  # checked before the cast: 1e39 is inf in float32
        good = ((raw >= -X_MAX) & (raw <= X_MAX)).all(axis=1)  # NaN compares false
        if good.all():
            return Rows(list(seq), [str(s) for s in stream], raw.astype(dtype, copy=False))
        reasons = [None if ok else X_RANGE_REASON for ok in cast(np.ndarray, good).tolist()]  # (n,): raw is 2-D
    else:  # an object array (None, a huge int), complex, bool, text
        reasons = [row_reason(row) for row in raw]
    kept = [i for i, reason in enumerate(reasons) if reason is None]
    if not kept:
        x_kept = np.zeros((0, features), dtype)
    elif raw.dtype.kind in "cO":  # numbers only in the rows kept; a complex one has no imaginary part
        x_kept = np.array([[value.real for value in raw[i]] for i in kept], dtype)
    else:
        x_kept = raw[kept].astype(dtype)
    return Rows([seq[i] for i in kept], [str(stream[i]) for i in kept], x_kept,
                 [(reason, seq[i]) for i, reason in enumerate(reasons) if reason is not None])


def check_position(position: Any) -> None:
    if position is not None and type(position) not in (int, str):
        raise TypeError(f"a position is an int or a str (it is written into the checkpoint), not "
                        f"{type(position).__name__}")


def drop_first(decoded: Any, drop: int) -> None:
    """Cut a decoded frame's first ``drop`` good messages (the state holds them)."""
    decoded.seq = decoded.seq[drop:]
    decoded.stream = decoded.stream[drop:]
    decoded.x = decoded.x[drop:]


def check_first(first: Any) -> None:
    if type(first) is not int:  # bool, float, str: no count of messages
        raise TypeError(f"emit's first is an int (good messages of the frame the state holds), not "
                        f"{type(first).__name__}: {first!r}")
    if first < 0:
        raise ValueError(f"emit's first counts good messages the state holds: 0 or more, not {first}")


class Positions:
    """One source's positions so far (see the module rules); IO loop only, like the source."""

    __slots__ = ("last", "name", "positioned")

    def __init__(self, name: str) -> None:
        self.name = name
        self.positioned: bool | None = None  # whether the source's emits carry positions (its first decides)
        self.last: int | str | None = None  # the last position emitted: the next must be greater

    def place(self, position: Any) -> None:
        """The position rules for one emit (the module rules), before anything of it is taken: a
        source's emits all carry a position or none does (its first decides), each greater than
        the last, all of one type. ``TypeError`` / ``ValueError`` naming what is wrong."""
        positioned = position is not None
        if positioned:
            check_position(position)
        if self.positioned is not None and positioned != self.positioned:
            raise ValueError(f"source {self.name!r}: position={position!r}, but its earlier emits had "
                             f"{'positions' if self.positioned else 'none'}: every emit of a source carries a "
                             f"position (the checkpoint records where the state is by them) or none does")
        if not positioned:
            self.positioned = False
            return
        last = self.last
        if last is not None:
            if type(position) is not type(last):
                raise TypeError(f"source {self.name!r}: position {position!r} is a {type(position).__name__}, its "
                                f"earlier ones were {type(last).__name__}s: a source's positions are all int or all "
                                "str")
            if not position > last:  # type: ignore[operator]  # of one type (checked above): mypy pairs no unions
                raise ValueError(f"source {self.name!r}: position {position!r} does not increase on the last one "
                                 f"({last!r}): each frame needs its own position, greater than the one before (a "
                                 f"repeated one would be applied twice after a restart; str positions compare as "
                                 f"text: zero-pad numbers in them, or use an int)")
        self.positioned, self.last = True, position  # only once every rule holds: a refused emit decides nothing
