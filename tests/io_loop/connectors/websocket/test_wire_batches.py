"""The WebSocket feed's wire in batches (issue 53): the frames one socket read brings are decoded
in one pass and cross as one chunk of one array; a batch of replies leaves in one socket write.

A real aiohttp server on 127.0.0.1 runs in the test's own loop, beside the feed's ``WebSocketSource``
under a ``SourceRunner`` (inbound and outbox plain asyncio queues). The server writes its frames
as raw bytes in ONE transport write, so the client's socket read holds them all; the client's
writes are counted by a spy around the real transport (it passes every write through).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from forkless.controller.codec import JsonCodec
from forkless.controller.config import Config
from forkless.controller.ioside import feed_sources
from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import DECODED, INBOUND, READ, Chunk, Outgoing
from forkless.io_loop.net import aiohttp_compat
from forkless.io_loop.source import SourceRunner
from tests.harness import UNIT_S
from tests.io_loop.net.test_aiohttp_compat import WriteSpy
from tests.servers import make_messages

pytestmark = pytest.mark.timeout(60 * UNIT_S)

F = 4
LIMIT_S = 20 * UNIT_S  # bounds each test if something hangs; nothing waits this long when it works


def server_frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """One unmasked frame as a server writes it (RFC 6455): FIN, the opcode, the length, the payload."""
    n = len(payload)
    if n < 126:
        header = struct.pack("!BB", 0x80 | opcode, n)
    elif n < 65536:
        header = struct.pack("!BBH", 0x80 | opcode, 126, n)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 127, n)
    return header + payload


def one_write(ws: web.WebSocketResponse, texts: list[str | bytes], close: bool = False) -> None:
    """``texts`` as text frames (and a close frame after them) in one write on the server's transport."""
    raw = b"".join(server_frame(t if isinstance(t, bytes) else t.encode()) for t in texts)
    if close:
        raw += server_frame(struct.pack("!H", 1000), opcode=0x8)
    ws._writer.transport.write(raw)


class Feed:
    """The server side of one test: ``script(ws)`` runs on each connection; text frames it
    receives are recorded in ``received``."""

    def __init__(self, script: Callable[[web.WebSocketResponse], Awaitable[None]]) -> None:
        self.script = script
        self.received: list[str] = []
        self.changed = asyncio.Event()

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        script = asyncio.create_task(self.script(ws))
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT:
                self.received.append(msg.data)
                self.changed.set()
        script.cancel()
        return ws

    async def wait_received(self, n: int) -> list[str]:
        while len(self.received) < n:
            self.changed.clear()
            await self.changed.wait()
        return self.received


@contextlib.asynccontextmanager
async def feed_and_runner(script: Callable[[web.WebSocketResponse], Awaitable[None]], feed_class: type[Feed] = Feed,
                          ) -> AsyncIterator[tuple[Feed, SourceRunner, asyncio.Queue]]:
    """A server running ``script``, and the WebSocket feed's source connected to it under a runner."""
    feed = feed_class(script)
    app = web.Application()
    app.router.add_get("/feed", feed.handle)
    site_runner = web.AppRunner(app, shutdown_timeout=0.5)  # a handler that never reads is cancelled, not waited on
    await site_runner.setup()
    task = None
    try:
        site = web.TCPSite(site_runner, "127.0.0.1", 0)
        await site.start()
        url = f"ws://127.0.0.1:{site_runner.addresses[0][1]}/feed"
        settings = Config(ws_url=url, features=F, max_batch=16, heartbeat_s=0.0, connect_timeout_s=2.0,
                          reconnect_min_s=0.05, reconnect_max_s=0.2, status_s=0.0).io_settings()
        (source,) = feed_sources(settings)
        inbound: asyncio.Queue = asyncio.Queue()
        runner = SourceRunner(source, settings.limits, JsonCodec(F), IOStats(), settings.feed_specs[0],
                              features=settings.features, max_batch=settings.max_batch, timeouts=settings.timeouts,
                              inbound=inbound, outbox=asyncio.Queue(), index=0)
        task = asyncio.create_task(runner.run())
        yield feed, runner, inbound
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await site_runner.cleanup()


def run(test: Callable[[], Awaitable[Any]]) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(LIMIT_S):
            return await test()

    return asyncio.run(bounded())


async def chunks_holding(inbound: asyncio.Queue, n: int) -> list[Chunk]:
    """The chunks put on inbound until they hold ``n`` messages."""
    chunks: list[Chunk] = []
    while sum(len(c) for c in chunks) < n:
        chunks.append(await inbound.get())
    return chunks


# ---- reading: one pass a read ----------------------------------------------------------------


def test_the_frames_of_one_read_cross_as_one_chunk_of_one_array():
    messages = make_messages(12, features=F)

    async def send(ws: web.WebSocketResponse) -> None:
        one_write(ws, [json.dumps(m) for m in messages])
        await asyncio.sleep(3600)

    async def test() -> tuple[list[Chunk], int]:
        async with feed_and_runner(send) as (_, runner, inbound):
            return await chunks_holding(inbound, len(messages)), runner.stats.frames_in

    chunks, frames_in = run(test)
    assert len(chunks) == 1 and frames_in == 12
    (chunk,) = chunks
    assert type(chunk.x) is np.ndarray  # one array made in one pass, not a list of the frames' own
    stamps = chunk.trace.ns  # the first chunk is sampled: read (the read's first frame), decoded, put inbound
    assert stamps[READ] == chunk.received_ns and stamps[READ] <= stamps[DECODED] <= stamps[INBOUND]
    assert chunk.seq == [m["seq"] for m in messages] and chunk.stream == [m["stream"] for m in messages]
    np.testing.assert_array_equal(chunk.x, np.array([m["x"] for m in messages], np.float32))


def test_a_read_of_more_messages_than_a_batch_crosses_in_chunks_of_at_most_max_batch_in_order():
    messages = make_messages(40, features=F)  # max_batch is 16

    async def send(ws: web.WebSocketResponse) -> None:
        one_write(ws, [json.dumps(m) for m in messages])
        await asyncio.sleep(3600)

    async def test() -> list[Chunk]:
        async with feed_and_runner(send) as (_, _runner, inbound):
            return await chunks_holding(inbound, len(messages))

    chunks = run(test)
    assert [len(c) for c in chunks] == [16, 16, 8]
    assert [s for c in chunks for s in c.seq] == [m["seq"] for m in messages]
    np.testing.assert_array_equal(np.concatenate([np.concatenate(c.x_parts()) for c in chunks]),
                                  np.array([m["x"] for m in messages], np.float32))


BAD_FRAMES = [
    ("not json at all", [("not JSON", None)]),
    (json.dumps({"seq": 1000, "stream": "a", "x": [1, 2]}), [("x must have 4 numbers, got 2", 1000)]),
    (json.dumps({"seq": 1001, "stream": "a", "x": [1, True, 3, 4]}), [("x must hold numbers only", 1001)]),
    ('{"seq": 1002, "stream": "a", "x": [1, 1e39, 3, 4]}', [("x must be finite and within ±1e18", 1002)]),
    (json.dumps({"seq": "7", "stream": "a", "x": [1, 2, 3, 4]}), [("seq must be an integer", None)]),
    (json.dumps({"seq": 1003, "stream": "", "x": [1, 2, 3, 4]}), [("stream must be a non-empty string", 1003)]),
    (json.dumps([{"seq": 1004, "stream": "a", "x": [1, 2, 3, 4]}, {"seq": 1005, "x": [1, 2, 3, 4]}]),
     [("missing field: stream", 1005)]),  # a good element and a bad one in one frame
]


@pytest.mark.parametrize("bad,errors", BAD_FRAMES, ids=[e[0][0] for _, e in BAD_FRAMES])
def test_a_bad_frame_among_good_ones_of_one_read_gets_its_own_error_reply_and_spoils_no_neighbour(bad, errors):
    good = make_messages(10, features=F)
    texts = [json.dumps(m) for m in good[:5]] + [bad] + [json.dumps(m) for m in good[5:]]
    good_in_bad = [{"seq": 1004, "stream": "a", "x": [1, 2, 3, 4]}] if bad.startswith("[") else []
    taken = good[:5] + good_in_bad + good[5:]

    async def send(ws: web.WebSocketResponse) -> None:
        one_write(ws, texts)
        await asyncio.sleep(3600)

    async def test() -> tuple[list[Chunk], list[str], IOStats]:
        async with feed_and_runner(send) as (feed, runner, inbound):
            chunks = await chunks_holding(inbound, len(taken))
            return chunks, list(await feed.wait_received(len(errors))), runner.stats

    chunks, replies, stats = run(test)
    assert [s for c in chunks for s in c.seq] == [m["seq"] for m in taken]  # every good message, in order
    np.testing.assert_array_equal(np.concatenate([np.concatenate(c.x_parts()) for c in chunks]),
                                  np.array([m["x"] for m in taken], np.float32))
    assert [json.loads(f) for f in replies] == [{"error": reason, "seq": seq} for reason, seq in errors]
    assert stats.frames_in == 11 and stats.messages_in == len(taken) and stats.errors_out == len(errors)
    assert dict(stats.errors) == {reason: 1 for reason, _ in errors}


def test_data_frames_then_a_close_in_one_read_are_handed_over_before_the_connection_ends():
    messages = make_messages(6, features=F)

    async def send(ws: web.WebSocketResponse) -> None:
        one_write(ws, [json.dumps(m) for m in messages], close=True)
        await asyncio.sleep(3600)

    async def test() -> tuple[list[Chunk], IOStats]:
        async with feed_and_runner(send) as (_, runner, inbound):
            chunks = await chunks_holding(inbound, len(messages))
            while runner.stats.reconnects == 0:  # the close ended the connection: it connects again
                await asyncio.sleep(0.01)
            return chunks, runner.stats

    chunks, stats = run(test)
    assert [s for c in chunks for s in c.seq] == [m["seq"] for m in messages]
    assert stats.frames_in >= 6 and "closed by the server (code 1000)" in stats.last_error


# ---- writing: one write a batch --------------------------------------------------------------


@pytest.mark.parametrize("framer", [True, False], ids=["framed-here", "aiohttp-corked"])
def test_a_batch_of_replies_leaves_in_one_socket_write_and_arrives_whole_and_in_order(framer, monkeypatch):
    # framed by aiohttp_compat.TextFrames, or (where it is not there: an aiohttp whose layout changed)
    # by aiohttp's send_frame a frame at a time under the cork
    frames: list[str | bytes] = [b'{"seq": 1}', "café ünïcode", b"x" * 125, b"y" * 126, "z" * 70_000,
                                 b'{"seq": 2}']
    spies: list[WriteSpy] = []
    real_cork = aiohttp_compat.cork

    def cork_with_a_spy(ws: aiohttp.ClientWebSocketResponse) -> Any:
        spies.append(spy := WriteSpy(ws._writer.transport))
        ws._writer.transport = spy
        return real_cork(ws)

    monkeypatch.setattr(aiohttp_compat, "cork", cork_with_a_spy)
    if not framer:
        monkeypatch.setattr(aiohttp_compat, "text_frames", lambda ws: None)

    async def idle(ws: web.WebSocketResponse) -> None:
        await asyncio.sleep(3600)

    async def test() -> tuple[list[str], list[bytes], int]:
        async with feed_and_runner(idle) as (feed, runner, _):
            while not spies:
                await asyncio.sleep(0.01)
            await runner.out.held.outbox.put(Outgoing(list(frames)))
            received = await feed.wait_received(len(frames))
            return list(received), list(spies[0].writes), runner.stats.results_out

    received, writes, results_out = run(test)
    assert received == [f.decode() if isinstance(f, bytes) else f for f in frames]
    assert len(writes) == 1  # the whole batch, one write
    assert results_out == len(frames)


def test_each_frame_of_a_batch_is_masked_with_its_own_key():
    texts = [f"frame {i}".encode() for i in range(8)]
    spies: list[WriteSpy] = []

    async def idle(ws: web.WebSocketResponse) -> None:
        await asyncio.sleep(3600)

    async def test() -> bytes:
        async with feed_and_runner(idle) as (feed, runner, _):
            while runner.stats.connects == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the writer took its framer; spy on the transport under it
            source = runner.source
            spies.append(spy := WriteSpy(source._cork._transport))
            source._cork._transport = spy
            await runner.out.held.outbox.put(Outgoing(list(texts)))
            await feed.wait_received(len(texts))
            return spies[0].writes[0]

    written = run(test)
    keys, at = [], 0
    for text in texts:
        assert written[at] == 0x81 and written[at + 1] == 0x80 | len(text)  # FIN text frame, masked, length
        key = written[at + 2:at + 6]
        payload = bytes(b ^ key[i % 4] for i, b in enumerate(written[at + 6:at + 6 + len(text)]))
        assert payload == text
        keys.append(key)
        at += 6 + len(text)
    assert at == len(written) and len(set(keys)) == len(keys)


def test_a_peer_that_does_not_read_makes_the_writer_wait_instead_of_buffering_without_bound():
    batch = [b"r" * 4096] * 50  # 200 KiB a batch; the kernel's socket buffers hold a few MiB
    batches = 200

    async def never_read(ws: web.WebSocketResponse) -> None:
        await asyncio.sleep(3600)

    class NotReading(Feed):
        async def handle(self, request: web.Request) -> web.WebSocketResponse:
            request.transport.pause_reading()  # the peer reads nothing: TCP pushes back on the client
            return await super().handle(request)

    async def test() -> tuple[int, bool]:
        async with feed_and_runner(never_read, feed_class=NotReading) as (_, runner, _):
            while runner.stats.connects == 0:
                await asyncio.sleep(0.01)
            outbox = runner.out.held.outbox
            for _ in range(batches):
                outbox.put_nowait(Outgoing(list(batch)))
            protocol = None
            while outbox.qsize() and not (protocol is not None and protocol.writing_paused):
                await asyncio.sleep(0.01)
                cork = runner.source._cork
                protocol = cork._transport.get_protocol() if cork is not None else None
            return outbox.qsize(), protocol is not None and protocol.writing_paused

    left, writing_paused = run(test)
    assert writing_paused and left > 0  # the writer waits for the transport to drain, taking no more
