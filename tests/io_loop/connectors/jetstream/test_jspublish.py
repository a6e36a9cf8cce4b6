"""``ReplyAcks`` (io_loop/connectors/jetstream/replies.py), the results stream's acknowledgements of the item a
JetStream feed is publishing, handed literal acknowledgements as the protocol parser gives them:
no server, no socket. The publisher against a real nats-server is in
tests/io_loop/connectors/jetstream/test_jetstream.py;
here: a frame counts as published only once acknowledged, and in order from the item's first
(what is not is published again after a reconnect), duplicates in either spelling, no stream for the subject,
the stream's error acknowledgements, and acknowledgements not understood."""

from __future__ import annotations

import pytest

pytest.importorskip("nats", reason="nats-py is not installed (pip install -r requirements-dev.txt)")

from forkless.io_loop.connectors.jetstream.replies import ReplyAcks
from forkless.io_loop.connectors.jetstream.transport import (
    NatsApiError,
    NatsError,
    NatsNoStreamResponse,
    NatsUnavailable,
)

INBOX = b"_INBOX.abc."


def _acks() -> tuple[ReplyAcks, list[int]]:
    woken: list[int] = []
    return ReplyAcks(len(INBOX), lambda: woken.append(1)), woken


def _ack(acks: ReplyAcks, n: int, data: bytes = b'{"stream":"SCORES", "seq":1}', headers=None) -> None:
    acks.on_ack(INBOX + b"%d" % n, b"", data, headers)


def test_frames_count_as_published_only_once_acknowledged_and_in_order_from_the_first():
    acks, woken = _acks()
    acks.begin(10, 3)  # frames 0-2 of the item were published with the reply subjects <inbox>10-12
    _ack(acks, 12)
    assert (acks.acked, acks.prefix(), acks.complete()) == (1, 0, False)  # frame 0 not acknowledged: all again
    _ack(acks, 10)
    assert (acks.prefix(), acks.complete(), woken) == (1, False, [])
    _ack(acks, 11)
    assert (acks.prefix(), acks.complete(), woken) == (3, True, [1])  # woken once, when all are


def test_an_earlier_items_acknowledgement_a_copy_or_a_foreign_subject_changes_nothing():
    acks, woken = _acks()
    acks.begin(10, 2)
    for n in (9, 12):  # an earlier item's (acknowledged after its timeout), beyond this one
        _ack(acks, n)
    acks.on_ack(b"_INBOX.abc.x", b"", b"{}", None)
    _ack(acks, 10)
    _ack(acks, 10)  # a copy
    assert (acks.acked, acks.prefix(), woken) == (1, 1, [])


@pytest.mark.parametrize("data", [b'{"stream":"SCORES", "seq":4, "duplicate": true}',  # nats-server 2.15
                                  b'{"stream":"SCORES","seq":4,"duplicate":true}'])
def test_a_duplicate_acknowledgement_counts_as_published_and_as_a_duplicate_in_either_spelling(data):
    acks, _ = _acks()
    acks.begin(0, 2)
    _ack(acks, 0, data)
    _ack(acks, 1, b'{"stream":"SCORES", "seq":5, "duplicate": false}')
    assert (acks.prefix(), acks.duplicates) == (2, 1)


def test_no_stream_for_the_subject_ends_the_wait_with_the_error():
    acks, woken = _acks()
    acks.begin(0, 3)
    _ack(acks, 0)
    _ack(acks, 1, b"", {"Status": "503"})
    assert isinstance(acks.error, NatsNoStreamResponse) and acks.complete() and woken == [1]
    _ack(acks, 2)  # after the error: not counted
    assert (acks.acked, acks.prefix()) == (1, 1)
    acks.begin(3, 1)  # the next item starts without it
    assert acks.error is None and not acks.complete()


@pytest.mark.parametrize(("data", "kind", "name", "code", "err_code", "description"), [
    (b'{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"},'
     b'"stream":"SCORES","seq":0}', NatsApiError, "BadRequestError", 400, 10054,
     "message size exceeds maximum allowed"),
    (b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"},"stream":"SCORES","seq":0}',
     NatsUnavailable, "ServiceUnavailableError", 503, 10077, "maximum messages exceeded"),  # nats-server 2.15's
    (b'{"error":{"code":409,"description":"something new"}}', NatsApiError, "APIError", 409, None, "something new"),
])
def test_an_error_acknowledgement_ends_the_wait_with_the_servers_error(data, kind, name, code, err_code,
                                                                         description):
    acks, woken = _acks()
    acks.begin(0, 2)
    _ack(acks, 0, data)
    error = acks.error
    assert type(error) is kind and error.api and str(error).startswith(f"{name}: ")
    assert (error.code, error.err_code, error.description) == (code, err_code, description)
    assert acks.complete() and woken == [1] and (acks.acked, acks.prefix()) == (0, 0)  # published again


@pytest.mark.parametrize("data", [b'{"error":', b'{"error": "refused"}', b'["error"]', b'{"error":{"code":[1]}}',
                                  b'\xff"error"'])
def test_an_acknowledgement_not_understood_ends_the_wait_as_an_error_and_never_counts_as_stored(data):
    acks, woken = _acks()
    acks.begin(0, 1)
    _ack(acks, 0, data)  # never raises (it would go to the connection's error_cb, and the wait to the timeout)
    assert isinstance(acks.error, NatsError) and acks.complete() and woken == [1]
    assert (acks.acked, acks.prefix()) == (0, 0)
