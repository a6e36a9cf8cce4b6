"""io_loop/connectors/jetstream/nats_compat.py (the JetStream feed's raw subscriptions and one-buffer publications)
against a real nats-server (tests/natsserver.py).

These are the tests that fail when a nats-py upgrade moves the private parts the feed's fast path
uses: what a raw subscription's handler is given, that nats-py's own subscriptions still work
beside one, and that a buffer of HPUB commands arrives as the messages it holds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.harness import UNIT_S

pytest.importorskip("nats", reason="nats-py is not installed (pip install -r requirements-dev.txt)")

LIMIT_S = 10.0 * UNIT_S  # bounds each wait if something hangs; nothing waits this long when it works


async def _connected(url: str) -> Any:
    from forkless.io_loop.connectors.jetstream.nats_compat import RawClient

    nc = RawClient()
    await nc.connect(url, allow_reconnect=False, connect_timeout=2)
    return nc


def _run(url: str, body: Any) -> Any:
    async def main() -> Any:
        nc = await _connected(url)
        try:
            async with asyncio.timeout(LIMIT_S):
                return await body(nc)
        finally:
            await nc.close()

    return asyncio.run(main())


def test_this_nats_py_has_every_private_part_the_fast_path_uses(nats_server):
    from forkless.io_loop.connectors.jetstream.nats_compat import nats_missing

    async def body(nc: Any) -> list[str]:
        return nats_missing(nc)

    assert _run(nats_server.url, body) == []


def test_a_raw_subscription_gets_subject_reply_payload_and_parsed_headers_in_order_beside_a_plain_one(nats_server):
    async def body(nc: Any) -> tuple[list, list]:
        raw: list[tuple] = []
        done = asyncio.Event()

        def handler(subject: bytes, reply: bytes, data: bytes, headers: dict | None) -> None:
            raw.append((subject, reply, data, headers))
            if len(raw) == 3:
                done.set()

        plain: list[Any] = []
        plain_done = asyncio.Event()

        async def on_plain(msg: Any) -> None:
            plain.append((msg.subject, msg.data))
            plain_done.set()

        await nc.raw_subscribe("raw.>", handler)
        await nc.subscribe("plain", cb=on_plain)
        await nc.publish("raw.a", b"one", reply="back.1")
        await nc.publish("plain", b"nats-py's own")
        await nc.publish("raw.b", b"two", headers={"Nats-Msg-Id": "x:1:0"})
        await nc.publish("raw.c", b"")
        await done.wait()
        await plain_done.wait()
        return raw, plain

    raw, plain = _run(nats_server.url, body)
    assert raw == [(b"raw.a", b"back.1", b"one", None), (b"raw.b", b"", b"two", {"Nats-Msg-Id": "x:1:0"}),
                   (b"raw.c", b"", b"", None)]
    assert plain == [("plain", b"nats-py's own")]


def test_a_handler_that_raises_is_reported_to_error_cb_and_the_next_message_still_comes(nats_server):
    from forkless.io_loop.connectors.jetstream.nats_compat import RawClient

    async def main() -> tuple[list, list]:
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        nc = RawClient()
        await nc.connect(nats_server.url, allow_reconnect=False, connect_timeout=2, error_cb=on_error)
        got: list[bytes] = []
        came = asyncio.Event()

        def handler(_s: bytes, _r: bytes, data: bytes, _h: Any) -> None:
            if data == b"bad":
                raise ValueError("a handler's bug")
            got.append(data)
            came.set()

        try:
            async with asyncio.timeout(LIMIT_S):
                await nc.raw_subscribe("raw", handler)
                await nc.publish("raw", b"bad")
                await nc.publish("raw", b"good")
                await came.wait()
        finally:
            await nc.close()
        return got, errors

    got, errors = asyncio.run(main())
    assert got == [b"good"]
    assert [str(e) for e in errors] == ["a handler's bug"]


def test_a_message_arriving_after_unsubscribe_is_not_handed_to_the_handler(nats_server):
    async def body(nc: Any) -> list:
        got: list[bytes] = []
        came = asyncio.Event()
        sub = await nc.raw_subscribe("raw", lambda _s, _r, data, _h: (got.append(data), came.set()))
        await nc.publish("raw", b"before")
        await came.wait()  # (not nc.flush(): nats-py writes its PING ahead of what its flusher holds)
        await sub.unsubscribe()
        # what the server sent before it read the UNSUB, fed to nats-py's own parser
        await nc._ps.parse(b"MSG raw %d 5\r\nafter\r\n" % sub._id)
        return got

    assert _run(nats_server.url, body) == [b"before"]


def test_a_buffer_of_hpub_commands_arrives_as_its_messages_with_their_headers_and_replies(nats_server):
    from forkless.io_loop.connectors.jetstream.nats_compat import publish_commands
    from forkless.io_loop.connectors.jetstream.replies import reply_commands
    from forkless.io_loop.crossing import Origin

    async def body(nc: Any) -> list:
        got: list[tuple] = []
        done = asyncio.Event()

        def handler(subject: bytes, reply: bytes, data: bytes, headers: dict | None) -> None:
            got.append((subject, reply, data, headers))
            if len(got) == 3:
                done.set()

        await nc.raw_subscribe("scores", handler)
        await nc.flush()  # nothing queued: publish_commands writes to the transport itself
        frames = ['{"seq":1}', b'{"seq":2,"z":"\xc3\xa9"}', ""]
        await publish_commands(nc, reply_commands(b"scores", b"_INBOX.t.", 40, "TICKS", frames,
                                                  [Origin(7, 0, False), Origin(7, 1, True), Origin(9, 0, True)],
                                                  nc.max_payload))
        # handed over before it returned, without a turn of the loop for nats-py's flusher: a lease
        # fence checked just before cannot be passed by bytes still waiting in the process
        assert not nc._pending, "the replies wait in nats-py's buffer for its flusher task"
        await done.wait()
        return got

    assert _run(nats_server.url, body) == [
        (b"scores", b"_INBOX.t.40", b'{"seq":1}', {"Nats-Msg-Id": "TICKS:7:0"}),
        (b"scores", b"_INBOX.t.41", b'{"seq":2,"z":"\xc3\xa9"}', {"Nats-Msg-Id": "TICKS:7:1"}),
        (b"scores", b"_INBOX.t.42", b"", {"Nats-Msg-Id": "TICKS:9:0"})]


def test_commands_published_behind_queued_ones_keep_their_order_and_wake_the_flusher(nats_server):
    from forkless.io_loop.connectors.jetstream.nats_compat import publish_commands

    async def body(nc: Any) -> list:
        got: list[bytes] = []
        done = asyncio.Event()

        def handler(subject: bytes, reply: bytes, data: bytes, headers: dict | None) -> None:
            got.append(data)
            if len(got) == 2:
                done.set()

        await nc.raw_subscribe("order", handler)
        await nc.flush()
        await nc._send_command(b"PUB order 5\r\nfirst\r\n")  # queued for the flusher, not yet written
        await publish_commands(nc, b"PUB order 6\r\nsecond\r\n")
        assert nc._pending, "written ahead of what was queued before it"
        await asyncio.wait_for(done.wait(), 10)  # the flusher was woken: nothing waits for a later flush
        return got

    assert _run(nats_server.url, body) == [b"first", b"second"]


def test_a_reply_larger_than_the_servers_max_payload_is_refused_before_anything_is_written():
    from forkless.io_loop.connectors.jetstream.replies import reply_commands
    from forkless.io_loop.connectors.jetstream.transport import NatsError
    from forkless.io_loop.crossing import Origin

    with pytest.raises(NatsError, match="MaxPayloadError: a reply of 11 bytes, over the server's max_payload"):
        reply_commands(b"scores", b"i.", 0, "TICKS", ["ok", "x" * 11], [Origin(1, 0, False), Origin(1, 1, True)], 10)


def test_publishing_commands_on_a_closed_connection_raises_connection_closed(nats_server):
    import nats.errors

    from forkless.io_loop.connectors.jetstream.nats_compat import publish_commands

    async def main() -> None:
        nc = await _connected(nats_server.url)
        await nc.close()
        with pytest.raises(nats.errors.ConnectionClosedError):
            await publish_commands(nc, b"PUB x 0\r\n\r\n")

    asyncio.run(main())
