"""The one check of a number a call takes: a number of seconds (a deadline's ``max_age_s``, a
backoff's ``min_s``, a stop's ``timeout``) or a count (``tries``): ``whole``.

Rules:
- A number is a number: any ``numbers.Real`` (``int``, ``float``, ``fractions.Fraction``, numpy's
  ``float32``, ``float64``, ``int32``, ``int64``, …) is taken, and returned as a ``float`` (a count,
  any ``numbers.Integral``, as an ``int``). A ``bool`` is no number here (``True`` is a flag that
  slipped into the wrong place), nor is text.
- Whatever is no number is a ``TypeError`` naming what was given and its type; a number out of its
  range (NaN, an infinity, zero or less where more is needed) a ``ValueError``; both name the
  argument (``what``) and what would be right.
- Every call of the IO side that takes seconds or a count checks it here, where the value is given
  (``Controller.send(max_age_s=)``, a portal's ``from_main.put(max_age_s=)``, ``Backoff``,
  ``RestartPolicy``, ``Relogin``, ``IOPortal``): a bad value is refused at once, never later.
- Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["seconds", "seconds_or_none", "whole"]


def seconds(value: Any, what: str, *, zero: bool = False) -> float:
    """``value`` as a finite number of seconds > 0 (>= 0 with ``zero``), a ``float``. ``TypeError`` for
    what is no number, ``ValueError`` for one out of range, each naming ``what``."""
    return _seconds(value, what, zero, "")


def seconds_or_none(value: Any, what: str, none: str, *, zero: bool = False) -> float | None:
    """``seconds``, or None where ``value`` is None: ``none`` says what None means ("no deadline")."""
    return None if value is None else _seconds(value, what, zero, none)


def _seconds(value: Any, what: str, zero: bool, none: str) -> float:
    also = f" (or None: {none})" if none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} is a number of seconds{also}, not a {type(value).__name__}: {value!r}")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond a double (10**400): out of range, as an infinity is
        as_float = math.inf
    if not (math.isfinite(as_float) and (as_float >= 0 if zero else as_float > 0)):
        raise ValueError(f"{what} is a finite number of seconds {'>= 0' if zero else '> 0'}{also}, not {value!r}")
    return as_float


def whole(value: Any, what: str, *, means_zero: str = "") -> int:
    """``value`` as an ``int`` >= 0 (any ``numbers.Integral`` but a ``bool``); ``means_zero`` says
    what 0 means ("never give up"). ``TypeError`` for what is no whole number, ``ValueError`` for
    one below 0, each naming ``what``."""
    zero = f" (0: {means_zero})" if means_zero else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} is an int >= 0{zero}, not a {type(value).__name__}: {value!r}")
    as_int = int(value)
    if as_int < 0:
        raise ValueError(f"{what} is an int >= 0{zero}, not {value!r}")
    return as_int
