"""The wire's JSON text (io_loop/jsontext.py): each library under it held to the same strict JSON and
the same values, so a free-threaded build (the standard library's json) reads and writes what a GIL
build (msgspec) does."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

from forkless.io_loop import jsontext


def shown(v) -> str:
    """A test id that is the same in every pytest-xdist worker (a memoryview's repr holds its address)."""
    return f"{type(v).__name__}:{(v if isinstance(v, str) else bytes(v))!r:.30}"


LIBRARIES = ["json"] + (["msgspec"] if importlib.util.find_spec("msgspec") else [])


@pytest.fixture(params=LIBRARIES)
def lib(request):
    return jsontext.library(request.param)


def test_the_module_runs_on_msgspec_where_it_is_installed_else_on_the_standard_library():
    assert jsontext.LIBRARY == LIBRARIES[-1]


NOT_JSON = [
    "NaN", "[1, Infinity]", "-Infinity", "[1,]", "01", "[1] x", "", '"\x01"', "{'a': 1}",
    "\ufeff[1]", b"\xef\xbb\xbf[1]",  # a byte order mark
    b"\xff", b'"\xed\xa0\x80"', "[1]".encode("utf-16"), "[1]".encode("utf-32"),  # bytes that are not UTF-8
    '"\\ud800"', '["a\\uDBFF"]', '{"s": "\\udc00x"}',  # an escaped lone surrogate: no UTF-8 can carry it
    "[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000,  # nesting: refused, no crash
]


@pytest.mark.parametrize("text", NOT_JSON, ids=shown)
def test_what_is_not_strict_json_is_refused_with_a_decode_error(lib, text):
    with pytest.raises(lib["DECODE_ERRORS"]):
        lib["loads"](text)


GOOD = ['{"seq": 1, "stream": "a", "x": [1, -2.5, 1e-300, 1e18, 3]}', '{"a": 1, "a": 2}', ' [1] ',
        '"\\ud83d\\ude00 \\u00e9 \u65e5"', '[true, false, null, -0.0, 0, 18446744073709551615, -9223372036854775808]',
        b'{"stream": "\xc3\xa9"}', bytearray(b"[1.5]"), memoryview(b"[2.5]")]


@pytest.mark.parametrize("text", GOOD, ids=shown)
def test_good_json_reads_as_the_standard_library_reads_it(lib, text):
    want = json.loads(bytes(text) if not isinstance(text, str) else text)
    got = lib["loads"](text)
    assert got == want and json.dumps(got) == json.dumps(want)  # -0.0 and 0 told apart too


def test_text_is_compact_utf8_and_what_json_cannot_hold_is_a_type_error(lib):
    assert lib["dumps"]({"a": [1, 2.5, True, None, "é\u2028\x01\"\\"]}) == \
        '{"a":[1,2.5,true,null,"é\u2028\\u0001\\"\\\\"]}'.encode()
    with pytest.raises(TypeError):
        lib["dumps"]({"seq": object()})


def test_every_float_is_written_with_digits_that_read_back_to_the_same_double(lib):
    rng = np.random.default_rng(11)
    doubles = np.concatenate([rng.standard_normal(2000) * 10.0 ** rng.integers(-300, 300, 2000),
                              rng.standard_normal(2000).astype(np.float32).astype(np.float64),
                              [0.0, -0.0, 1e16, 1e17, 1e20, 1e-7, 1e-5, 0.1, 5e-324, 1.7976931348623157e308]])
    text = lib["dumps_numbers"](doubles)
    assert np.array(json.loads(text)).tobytes() == doubles.tobytes()  # every bit, as another reader reads it
    assert np.array(lib["loads"](text)).tobytes() == doubles.tobytes()


def test_a_non_finite_float_is_found_in_the_text_and_a_finite_one_never_is(lib):
    finite = np.array([[1e20, -1e-7], [3.4e38, 5e-324]])
    assert not jsontext.non_finite_in(lib["dumps_numbers"](finite))
    assert not jsontext.non_finite_in(lib["dumps_numbers"](np.array([True, False])))
    for bad in (math.nan, math.inf, -math.inf):
        assert jsontext.non_finite_in(lib["dumps_numbers"](np.array([[1.0, bad]])))
