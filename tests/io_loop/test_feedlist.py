"""FORKLESS_FEEDS (io_loop/feedlist.py), each entry read by its connector room's schema
(io_loop/connectors/websocket/entry.py, .../jetstream/entry.py): each field's fault reported by its own text, never
by msgspec's message (which quotes values), patterns anchored at the very end, the fields the documents list, and an
entry's first fault the one reported."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from forkless.controller.config import variable
from forkless.io_loop.connectors.jetstream import entry as jetstream_entry
from forkless.io_loop.connectors.websocket import entry as websocket_entry
from forkless.io_loop.errors import ValueProblem
from forkless.io_loop.feedlist import feed_list

ROOT = Path(__file__).resolve().parents[2]
FEED_KEYS, JETSTREAM_KEYS = websocket_entry.WEBSOCKET_FIELDS, jetstream_entry.JETSTREAM_FIELDS
# the fields both rooms' entries have are refused in the same words
REFUSALS = {**websocket_entry.WEBSOCKET_REFUSALS, **jetstream_entry.JETSTREAM_REFUSALS}
WS = {"url": "ws://127.0.0.1:9/feed", "name": "a"}
JS = {"nats": "nats://127.0.0.1:4222", "stream": "TICKS", "results": "scores", "name": "a"}
SECRET = "SECRET-VALUE"


def _refusal(entry: dict[str, Any]) -> str:
    with pytest.raises(ValueProblem) as err:
        feed_list(json.dumps([entry]))
    return str(err.value)


# every field the schema checks, given a wrong type and (where it has one) a value out of its bounds:
# the string values carry SECRET, which msgspec's own message would quote ("Invalid enum value '…'")
FAULTS = [
    (WS, "url", 1), (WS, "url", None), (WS, "unix_socket", 5), (WS, "headers", [SECRET]),
    (WS, "headers", {"X-Key": 1}), (WS, "name", SECRET + " x"), (WS, "name", 7), (WS, "required", 1),
    (WS, "required", SECRET), (WS, "replies", SECRET), (WS, "overflow", SECRET), (WS, "overflow", None),
    (WS, "buffer", True), (WS, "buffer", 1.0), (WS, "buffer", -1), (WS, "buffer", 10_000_001), (WS, "buffer", SECRET),
    (JS, "nats", 1), (JS, "stream", SECRET + ".x"), (JS, "stream", "x" * 256), (JS, "stream", None),
    (JS, "subject", 1), (JS, "results", 1), (JS, "start", SECRET), (JS, "required", "true"),
    (JS, "replies", SECRET), (JS, "token", [SECRET]), (JS, "creds", 1), (JS, "partition_count", 0),
    (JS, "partition_count", 65537), (JS, "partition_count", True), (JS, "partition_count", SECRET),
]


@pytest.mark.parametrize(("base", "field", "value"), FAULTS,
                         ids=[f"{'js' if b is JS else 'ws'}-{f}-{v!r}"[:40] for b, f, v in FAULTS])
def test_each_fault_is_reported_by_its_fields_text_never_by_the_value(base, field, value):
    text = _refusal({**base, field: value})
    where = "feed 0" if field == "name" else "feed 0 ('a')"
    assert text == f"{where}: {REFUSALS[field]}", text
    assert SECRET not in text and "Expected" not in text and "$" not in text


@pytest.mark.parametrize(("base", "field"), [(WS, "url"), (JS, "stream")])
def test_a_missing_required_field_is_reported_by_its_text(base, field):
    assert _refusal({k: v for k, v in base.items() if k != field}) == f"feed 0 ('a'): {REFUSALS[field]}"


@pytest.mark.parametrize(("base", "field", "value"), [(WS, "name", "a\n"), (JS, "stream", "TICKS\n")])
def test_a_pattern_holds_to_the_very_end_of_the_value(base, field, value):
    # msgspec searches a pattern; anchored with "$" it would let a trailing newline through
    text = _refusal({**base, field: value})
    assert text.endswith(REFUSALS[field]), text


def test_every_unknown_field_is_named_sorted_with_the_fields_there_are():
    assert _refusal({**WS, "zz": 1, "token": SECRET, "aa": 2}) == (
        "feed 0 ('a'): unknown field(s) 'aa', 'token', 'zz'; the fields are " + ", ".join(FEED_KEYS))
    assert _refusal({**JS, "headers": {}, "url": "ws://h/x"}) == (
        "feed 0 ('a'): unknown field(s) 'headers', 'url' for a JetStream feed; its fields are "
        + ", ".join(JETSTREAM_KEYS))


def test_an_entry_with_several_faults_is_refused_for_its_first_in_the_entrys_order():
    assert _refusal({**WS, "buffer": -1, "overflow": "x"}).endswith(REFUSALS["buffer"])
    assert _refusal({**WS, "overflow": "x", "buffer": -1}).endswith(REFUSALS["overflow"])
    # the schema's faults come before the checks after it (the URL's syntax)
    assert _refusal({**WS, "url": "http://h/x", "buffer": -1}).endswith(REFUSALS["buffer"])


def test_the_schemas_fields_are_the_documented_ones():
    listed = re.findall(r'"(\w+)"', variable("FEEDS").allowed)
    assert list(FEED_KEYS) == listed[:len(FEED_KEYS)], "FORKLESS_FEEDS's allowed text lists the WebSocket fields"
    docs = (ROOT / "docs" / "feeds.md").read_text() + (ROOT / "docs" / "jetstream.md").read_text()
    undocumented = [key for key in {*FEED_KEYS, *JETSTREAM_KEYS} if f"`{key}`" not in docs and f'"{key}"' not in docs]
    assert not undocumented, f"fields no document names: {undocumented}"
    # each field but subscribe (any JSON value) has its refusal text, the same in both rooms where both have it
    assert set(REFUSALS) == {*FEED_KEYS, *JETSTREAM_KEYS} - {"subscribe"}
    ws, js = websocket_entry.WEBSOCKET_REFUSALS, jetstream_entry.JETSTREAM_REFUSALS
    assert set(ws) & set(js) == {"name", "required", "replies"}
    assert all(ws[key] == js[key] for key in set(ws) & set(js))
