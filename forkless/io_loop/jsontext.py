"""JSON text for the wire: one set of functions over the fastest JSON library this interpreter has.

Rules:
- ``loads``, ``dumps`` and ``dumps_numbers`` behave alike whichever library is under them: ``loads``
  takes str or UTF-8 bytes and raises ``DECODE_ERRORS`` on anything that is not strict JSON
  (``NaN``, ``Infinity``, a byte order mark, bytes that are not UTF-8, an escaped lone
  surrogate) or nests too deep; ``dumps`` writes compact UTF-8 bytes, raising ``TypeError`` on
  what JSON cannot hold. A float is written with the shortest digits that read back to the same
  double, so a reader gets the same values from either library.
- What differs is named here and nowhere else: the form of a float's exponent (``1e+20`` and
  ``1e-07`` from ``json``, ``1e20`` and ``1e-7`` from msgspec), and a number that overflows a
  double (``1e999``), which msgspec refuses as not JSON and ``json`` reads as an infinity (the
  codec then refuses it as out of range). docs/performance.md says which library runs where.
- Which library: msgspec where it is installed (every GIL build: requirements.txt), else the
  standard library's ``json`` (its C scanner and encoder), which is what a free-threaded 3.13
  has: msgspec builds for free-threaded CPython from 3.14 on only, and orjson re-enables the GIL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

__all__ = ["DECODE_ERRORS", "LIBRARY", "dumps", "dumps_numbers", "library", "loads", "non_finite_in"]

def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_json_decoder = json.JSONDecoder(parse_constant=_refuse_constant)
_json_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=True)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # an escaped \ud800-\udfff, in either case


def _json_loads(data: str | bytes) -> Any:
    """The standard library's scanner, held to strict JSON as msgspec is (see the module's rules)."""
    text = data if isinstance(data, str) else bytes(data).decode("utf-8")  # strict: no UTF-16, no BOM skipped
    if text[:1] == "\ufeff":
        raise ValueError("a byte order mark is not JSON")
    doc = _json_decoder.decode(text)
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        _json_encoder.encode(doc).encode("utf-8")  # a lone surrogate cannot be written as UTF-8: refused
    return doc


def _json_dumps(obj: Any) -> bytes:
    return _json_encoder.encode(obj).encode("utf-8")


def library(name: str) -> dict[str, Any]:
    """This module's functions over one library, ``"msgspec"`` or ``"json"`` (what the module binds at
    import; bench/json_library.py measures each); ImportError where msgspec is not installed."""
    load: Callable[[str | bytes], Any]  # either library's
    if name == "msgspec":
        import msgspec.json  # only when asked for: free-threaded 3.13 has none, and the json fallback runs

        errors: tuple[type[BaseException], ...] = (msgspec.DecodeError, RecursionError)
        load, dump = msgspec.json.Decoder().decode, msgspec.json.Encoder().encode
    elif name == "json":
        errors = (ValueError, RecursionError)  # JSONDecodeError and UnicodeError are ValueErrors
        load, dump = _json_loads, _json_dumps
    else:
        raise ValueError(f"no JSON library {name!r}: 'msgspec' or 'json'")

    def dumps_numbers(values: Any) -> bytes:
        """A numpy array of numbers (bool, int or float) as one JSON array, nested as the array
        is, each float as its float64 value (as ``tolist()`` makes it)."""
        return dump(values.tolist())

    return {"LIBRARY": name, "DECODE_ERRORS": errors, "loads": load, "dumps": dump, "dumps_numbers": dumps_numbers}


def non_finite_in(body: bytes) -> bool:
    """Whether ``dumps_numbers``' text of a float array may hold a NaN or an infinity (msgspec
    writes them as ``null``, ``json`` as ``NaN`` and ``Infinity``: no other JSON number holds
    an ``N`` or an ``I``)."""
    return b"null" in body or b"N" in body or b"I" in body


try:
    _bound = library("msgspec")
except ImportError:
    _bound = library("json")
LIBRARY: str = _bound["LIBRARY"]
DECODE_ERRORS: tuple[type[BaseException], ...] = _bound["DECODE_ERRORS"]
loads: Callable[[str | bytes], Any] = _bound["loads"]
dumps: Callable[[Any], bytes] = _bound["dumps"]
dumps_numbers: Callable[[Any], bytes] = _bound["dumps_numbers"]
