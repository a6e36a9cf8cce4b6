"""Loopback feed servers for the tests, and the feed data and checks they share.

Rules:
- Two servers with one interface: ``FeedServer`` (aiohttp) and ``WebsocketsFeedServer``
  (the ``websockets`` library), so a bug that aiohttp's client and aiohttp's server share
  cannot hide. Each runs in its own thread and event loop (``LoopThread``) on ``127.0.0.1``
  and a free port, so the test's main thread can drive a ``Controller`` (or wait on a
  ``python app.py`` subprocess) against it. ``SERVERS`` maps a name to each, for
  ``pytest.mark.parametrize``; the ``feed_server`` fixture (tests/conftest.py) starts them
  and always stops them.
- The scenario is a script: ``script(conn)``, an ``async def`` run in the server's loop for
  every accepted connection (``conn`` is a ``FeedConn``). When it returns, the connection is
  closed (if it is not already). ``send_frames(...)`` is the common script: send these
  frames, record the replies until the client closes. Without a script the server only reads.
- Everything the server saw is recorded in the server thread and only appended to:
  ``attempts`` (every HTTP request: time, headers, the status it was refused with),
  ``connections`` (every ``FeedConn``, with the frames it ``received``), ``script_errors``.
  Each record wakes ``wait_for(predicate, timeout_s, what)``, so the test thread waits on
  what happened instead of sleeping or polling. Test-thread reads copy (``received``).
- Handshake faults: ``handshake_status`` is a function ``attempt_index -> status | None``; a
  status (401, 404, 503 …) answers the upgrade request with that HTTP status instead. It may
  be replaced while the server runs.
- Refusing connections: ``refuse_for(seconds)`` stops listening (the port then refuses TCP
  connections) and listens again on the same port after that long.
- Closing without losing replies: ``send_close`` writes our close frame and keeps the
  connection readable, so the replies the client sent before it saw our close are still
  recorded (aiohttp's own ``close()`` discards them: see ``AiohttpConn.send_close``).
- aiohttp only: ``autoping=False`` hands PING frames to the script (counted in ``pings``, and
  answered only if ``answer_pings`` is set on the connection); ``stop_reading()`` pauses the
  TCP transport, so TCP pushes back on the client (once the kernel's socket buffers are
  full), and ``writes_blocked()`` says when the push-back has come round to the server's
  own writes; ``compress=False`` declines the permessage-deflate the client offers, so
  replies take their full size and those buffers fill sooner.
- TLS: pass ``ssl_context`` (see ``self_signed_certificate``); the URL is then ``wss://``.
- A unix-domain socket: pass ``unix_socket`` (a path); the server listens there instead of on
  TCP (aiohttp's ``UnixSite``, websockets' ``unix_serve``) and ``url`` is ``ws://localhost/feed``
  (or ``wss://``), the handshake's path and Host for a client that connects through the socket.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import websockets
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from websockets.asyncio.server import Server, ServerConnection, serve, unix_serve
from websockets.http11 import Request, Response
from websockets.protocol import State

__all__ = [
    "SERVERS",
    "AiohttpConn",
    "Attempt",
    "FeedConn",
    "FeedServer",
    "LoopThread",
    "LoopbackServer",
    "Script",
    "WebsocketsConn",
    "WebsocketsFeedServer",
    "assert_results_match_reference",
    "make_messages",
    "parse_replies",
    "self_signed_certificate",
    "send_frames",
    "server_ssl_context",
]

PATH = "/feed"
START_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0  # how long our close waits for the client's close frame
READ_FOREVER_S = 3600.0
MAX_MSG_BYTES = 64 << 20


# ---- the loop thread ----------------------------------------------------------------------------


class LoopThread:
    """An asyncio event loop in a daemon thread; the test thread hands it coroutines."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        """Run ``coro`` in the loop and return its result (raise its exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop, join the thread, close the loop; callable more than once."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


# ---- what a script sees ------------------------------------------------------------------------


class Attempt(NamedTuple):
    """One HTTP request to the feed path, accepted or not."""

    at: float  # time.monotonic() when it arrived
    headers: CIMultiDictProxy[str]
    status: int | None  # the HTTP status it was refused with; None: upgraded to a WebSocket


class FeedConn:
    """One accepted WebSocket connection, as a script sees it (the part both servers share)."""

    def __init__(self, server: LoopbackServer, index: int, headers: CIMultiDictProxy[str]) -> None:
        self.server = server
        self.index = index  # 0 for the first connection, 1 for the next …
        self.headers = headers
        self.received: list[str] = []  # every data frame from the client, in order (binary as UTF-8)
        self.opened_at = time.monotonic()
        self.closed_at: float | None = None  # when the script ended and the connection was closed
        self.client_close_code: int | None = None  # the code in the client's close frame
        self.end_message: Any = None  # what ended the reading, for diagnostics

    # -- implemented by each server's connection

    async def send(self, obj: Any) -> None:
        """Send one text frame: a str as is, anything else as JSON."""
        raise NotImplementedError

    async def send_bytes(self, data: bytes) -> None:
        raise NotImplementedError

    async def recv(self, timeout: float | None = None) -> str | None:
        """The next data frame from the client (recorded in ``received``), or None when the
        connection is closing/closed or ``timeout`` passed."""
        raise NotImplementedError

    def closing(self) -> bool:
        """Whether a close frame was sent or received (nothing more will be read after it)."""
        raise NotImplementedError

    async def close(self, code: int = aiohttp.WSCloseCode.OK) -> None:
        """Close the connection with ``code``."""
        raise NotImplementedError

    async def send_close(self, code: int = aiohttp.WSCloseCode.GOING_AWAY) -> None:
        """Write a close frame but keep the connection readable: a task already reading with
        ``recv`` goes on receiving data frames until the client's close."""
        raise NotImplementedError

    # -- shared

    async def send_frame(self, frame: Any) -> None:
        """``send_bytes`` for bytes, ``send`` for anything else."""
        await (self.send_bytes(frame) if isinstance(frame, bytes) else self.send(frame))

    async def read_until_closed(self, timeout: float = 10.0) -> None:
        """Read (and record) data frames until the client closes or ``timeout`` passes."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            if await self.recv(timeout=end - loop.time()) is None and self.closing():
                return

    def reading(self, timeout: float = READ_FOREVER_S) -> asyncio.Task[None]:
        """Start ``read_until_closed`` in a task, so the script can send while replies are
        recorded; await the task before the script returns. Nothing else may ``recv`` meanwhile."""
        return asyncio.create_task(self.read_until_closed(timeout))

    async def close_keep_reading(self, code: int = aiohttp.WSCloseCode.GOING_AWAY, timeout: float = 5.0) -> None:
        """Send a close frame, then keep reading data frames until the client's close arrives:
        nothing the client sent before it saw our close is lost."""
        await self.send_close(code)
        await self.read_until_closed(timeout)
        await self.close(code)

    def _record(self, text: str) -> str:
        self.received.append(text)
        self.server._changed()
        return text


Script = Callable[[FeedConn], Awaitable[None]]


class AiohttpConn(FeedConn):
    """A connection to ``FeedServer``; ``ws`` is aiohttp's ``WebSocketResponse``."""

    def __init__(self, server: FeedServer, index: int, request: web.Request, ws: web.WebSocketResponse) -> None:
        super().__init__(server, index, request.headers)
        self.request = request
        self.ws = ws
        self.pings = 0
        self.answer_pings = False

    async def send(self, obj: Any) -> None:
        await self.ws.send_str(obj if isinstance(obj, str) else json.dumps(obj))

    async def send_bytes(self, data: bytes) -> None:
        await self.ws.send_bytes(data)

    async def recv(self, timeout: float | None = None) -> str | None:
        # PINGs are counted (and answered only if ``answer_pings``) when the server runs with
        # autoping=False; with the default autoping aiohttp answers them itself
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while True:
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                return None
            try:
                msg = await self.ws.receive(timeout=left)
            except TimeoutError:
                return None
            if msg.type is aiohttp.WSMsgType.PING:
                self.pings += 1
                if self.answer_pings:
                    await self.ws.pong(msg.data)
                continue
            if msg.type is aiohttp.WSMsgType.TEXT:
                return self._record(msg.data)
            if msg.type is aiohttp.WSMsgType.BINARY:
                return self._record(msg.data.decode("utf-8", "replace"))
            self.end_message = (msg.type, msg.data, self.ws.exception())
            if msg.type is aiohttp.WSMsgType.CLOSE:
                self.client_close_code = msg.data
            elif self.client_close_code is None and self.ws.close_code is not None:
                self.client_close_code = self.ws.close_code
            return None

    def closing(self) -> bool:
        return self.ws.closed or self.client_close_code is not None or self.ws._closing

    async def close(self, code: int = aiohttp.WSCloseCode.OK) -> None:
        if not self.ws.closed:
            await self.ws.close(code=code, message=b"test server closing")

    async def send_close(self, code: int = aiohttp.WSCloseCode.GOING_AWAY) -> None:
        # aiohttp's WebSocketResponse.close() discards every data frame that arrives after our
        # close frame and before the client's; writing the close frame with the low-level frame
        # writer (``ws._writer``, private aiohttp API) keeps them readable
        assert self.ws._writer is not None
        await self.ws._writer.close(code, b"test server closing")

    def stop_reading(self) -> None:
        """Stop reading the socket at the TCP level: the client's writes back up (once the
        kernel's socket buffers are full: megabytes, seconds at the client's pace)."""
        transport = self.request.transport
        if transport is not None:
            transport.pause_reading()

    def writes_blocked(self) -> bool:
        """Whether our writes are held back because the client does not read (the transport's
        buffer is above its high-water mark); readable from the test thread."""
        protocol = self.request.protocol
        return protocol is not None and protocol.writing_paused

    def resume_reading_threadsafe(self) -> None:
        """Undo ``stop_reading``; callable from the test thread."""
        transport = self.request.transport
        if transport is not None:
            self.server.loop_thread.call_soon(transport.resume_reading)


class WebsocketsConn(FeedConn):
    """A connection to ``WebsocketsFeedServer``; ``ws`` is the ``websockets`` ``ServerConnection``."""

    def __init__(self, server: WebsocketsFeedServer, index: int, ws: ServerConnection) -> None:
        assert ws.request is not None
        super().__init__(server, index, CIMultiDictProxy(CIMultiDict(ws.request.headers.raw_items())))
        self.ws = ws
        self._closer: asyncio.Task[None] | None = None

    async def send(self, obj: Any) -> None:
        await self.ws.send(obj if isinstance(obj, str) else json.dumps(obj))

    async def send_bytes(self, data: bytes) -> None:
        await self.ws.send(data)

    async def recv(self, timeout: float | None = None) -> str | None:
        try:
            async with asyncio.timeout(timeout):  # websockets' recv() is safe to cancel
                data = await self.ws.recv()
        except TimeoutError:
            return None
        except websockets.ConnectionClosed as exc:
            self.end_message = exc
            if exc.rcvd is not None:
                self.client_close_code = exc.rcvd.code
            return None
        return self._record(data if isinstance(data, str) else data.decode("utf-8", "replace"))

    def closing(self) -> bool:
        return self.ws.state in (State.CLOSING, State.CLOSED)

    async def close(self, code: int = aiohttp.WSCloseCode.OK) -> None:
        await self.ws.close(code, "test server closing")

    async def send_close(self, code: int = aiohttp.WSCloseCode.GOING_AWAY) -> None:
        # websockets delivers data frames that arrive while closing; its close() waits for the
        # client's close frame, so it runs aside while the script goes on reading
        if self._closer is None:
            self._closer = asyncio.create_task(self.close(code))
            await asyncio.sleep(0)  # let it write the close frame


# ---- the servers -----------------------------------------------------------------------------


class LoopbackServer:
    """What both servers share: the loop thread, the records, waiting on them (module rules)."""

    impl = ""

    def __init__(self, script: Script | None = None, *, handshake_status: Callable[[int], int | None] | None = None,
                 ssl_context: ssl.SSLContext | None = None, max_msg_size: int = MAX_MSG_BYTES,
                 unix_socket: str = "") -> None:
        self.script: Script = script or _read_forever
        self.unix_socket = unix_socket
        self.handshake_status = handshake_status
        self.ssl_context = ssl_context
        self.max_msg_size = max_msg_size
        self.attempts: list[Attempt] = []
        self.connections: list[FeedConn] = []
        self.script_errors: list[BaseException] = []
        self.port = 0
        self.url = ""
        self.loop_thread = LoopThread(f"test-feed-{self.impl}")
        self._cond = threading.Condition()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._started = False

    # ---- test-thread API ----------------------------------------------------------------------

    def start(self) -> str:
        """Listen on 127.0.0.1 and a free port; returns the ``ws://`` (or ``wss://``) URL."""
        self._started = True
        self.loop_thread.start()
        self.loop_thread.call(self._start(), START_TIMEOUT_S)
        scheme = "wss" if self.ssl_context is not None else "ws"
        host = "localhost" if self.unix_socket else f"127.0.0.1:{self.port}"
        self.url = f"{scheme}://{host}{PATH}"
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close every connection and stop listening; callable more than once."""
        if not self._started or self.loop_thread.loop.is_closed():
            return
        try:
            self.loop_thread.call(self._stop(), timeout_s)
        finally:
            self.loop_thread.stop(timeout_s)

    def __enter__(self) -> LoopbackServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 10.0) -> Any:
        """Run a coroutine in the server's loop and return its result."""
        return self.loop_thread.call(coro, timeout_s)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Wait until ``predicate()`` (over what the server recorded) holds; it is checked again
        whenever the server records something. Fails naming ``what`` after ``timeout_s``."""
        with self._cond:
            if not self._cond.wait_for(predicate, timeout_s):
                raise AssertionError(f"not within {timeout_s:.1f}s: {what} ({self.describe()})")

    def describe(self) -> str:
        """What the server saw so far, in one line, for failure messages."""
        return (f"{self.impl} server: {len(self.attempts)} requests, {len(self.connections)} connections, "
                f"{self.received_count} frames received, script errors {self.script_errors!r}")

    @property
    def received(self) -> list[str]:
        """Every frame received, connection by connection, each in arrival order (a copy)."""
        return [frame for conn in list(self.connections) for frame in list(conn.received)]

    @property
    def received_count(self) -> int:
        """How many frames were received, over every connection (cheap: for wait predicates)."""
        return sum(len(conn.received) for conn in list(self.connections))

    def replies(self) -> list[Any]:
        """``received``, each frame decoded as JSON."""
        return [json.loads(frame) for frame in self.received]

    def drop(self, code: int = aiohttp.WSCloseCode.SERVICE_RESTART) -> None:
        """Close every open connection from the server side (default 1012, service restart)."""
        self.call(self._drop(code))

    def refuse_for_threadsafe(self, seconds: float) -> None:
        self.loop_thread.call_soon(lambda: asyncio.ensure_future(self.refuse_for(seconds)))

    # ---- server-loop API (for scripts) ----------------------------------------------------

    async def refuse_for(self, seconds: float) -> None:
        """Stop listening (connections are refused by the OS), listen again after ``seconds``."""
        await self._stop_listening()
        await asyncio.sleep(seconds)
        await self._listen()

    # ---- for the implementations ---------------------------------------------------------------

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _attempt(self, headers: CIMultiDictProxy[str]) -> int | None:
        """Record an HTTP request; the status to refuse it with, if any."""
        status = self.handshake_status(len(self.attempts)) if self.handshake_status is not None else None
        self.attempts.append(Attempt(time.monotonic(), headers, status))
        self._changed()
        return status

    async def _run_script(self, conn: FeedConn) -> None:
        self.connections.append(conn)
        self._changed()
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self.script(conn)
        except (asyncio.CancelledError, ConnectionError, aiohttp.ClientError, websockets.ConnectionClosed):
            pass
        except Exception as exc:  # a broken script must fail the test, not vanish
            self.script_errors.append(exc)
        finally:
            self._handlers.discard(task)
            try:
                await asyncio.wait_for(conn.close(), CLOSE_TIMEOUT_S)
            except (Exception, asyncio.CancelledError):
                pass
            conn.closed_at = time.monotonic()
            self._changed()

    async def _drop(self, code: int) -> None:
        open_conns = [conn for conn in self.connections if conn.closed_at is None]
        await asyncio.gather(*(conn.close(code) for conn in open_conns), return_exceptions=True)

    async def _cancel_handlers(self) -> None:
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=CLOSE_TIMEOUT_S)

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    async def _listen(self) -> None:
        raise NotImplementedError

    async def _stop_listening(self) -> None:
        raise NotImplementedError


class FeedServer(LoopbackServer):
    """The feed on aiohttp's server. ``autoping=False``, ``compress=False``: see the module rules."""

    impl = "aiohttp"

    def __init__(self, script: Script | None = None, *, autoping: bool = True, compress: bool = True,
                 **options: Any) -> None:
        super().__init__(script, **options)
        self.autoping = autoping
        self.compress = compress
        self._runner: web.AppRunner | None = None
        self._site: web.BaseSite | None = None

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get(PATH, self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await self._listen()

    async def _stop(self) -> None:
        await self._cancel_handlers()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _listen(self) -> None:
        assert self._runner is not None
        site: web.BaseSite
        if self.unix_socket:
            site = web.UnixSite(self._runner, self.unix_socket, ssl_context=self.ssl_context)
        else:
            site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.ssl_context, reuse_address=True)
        await site.start()
        self._site = site
        if not self.port and not self.unix_socket:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop_listening(self) -> None:
        if self._site is not None:
            await self._site.stop()
            self._site = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        status = self._attempt(request.headers)
        if status is not None:
            return web.Response(status=status, text=f"test server says {status}")
        ws = web.WebSocketResponse(autoping=self.autoping, compress=self.compress, max_msg_size=self.max_msg_size,
                                   timeout=CLOSE_TIMEOUT_S)
        await ws.prepare(request)
        await self._run_script(AiohttpConn(self, len(self.connections), request, ws))
        return ws


class WebsocketsFeedServer(LoopbackServer):
    """The feed on the ``websockets`` library's asyncio server (it answers pings itself)."""

    impl = "websockets"

    def __init__(self, script: Script | None = None, **options: Any) -> None:
        super().__init__(script, **options)
        self._servers: list[Server] = []  # one more after each refuse_for

    async def _start(self) -> None:
        await self._listen()

    async def _stop(self) -> None:
        await self._cancel_handlers()
        for server in self._servers:
            server.close()
        await asyncio.wait([asyncio.ensure_future(s.wait_closed()) for s in self._servers], timeout=CLOSE_TIMEOUT_S)

    async def _listen(self) -> None:
        options: dict[str, Any] = dict(ssl=self.ssl_context, process_request=self._process_request,
                                       max_size=self.max_msg_size, ping_interval=None, close_timeout=CLOSE_TIMEOUT_S)
        if self.unix_socket:
            server = await unix_serve(self._handle, self.unix_socket, **options)
        else:
            server = await serve(self._handle, "127.0.0.1", self.port, **options)
        self._servers.append(server)
        if not self.port and not self.unix_socket:
            self.port = server.sockets[0].getsockname()[1]

    async def _stop_listening(self) -> None:
        if self._servers:
            self._servers[-1].server.close()  # the listening socket only: open connections go on

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path != PATH:
            return connection.respond(404, "no feed here\n")
        status = self._attempt(CIMultiDictProxy(CIMultiDict(request.headers.raw_items())))
        if status is not None:
            return connection.respond(status, f"test server says {status}\n")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        await self._run_script(WebsocketsConn(self, len(self.connections), ws))


SERVERS: dict[str, type[LoopbackServer]] = {"aiohttp": FeedServer, "websockets": WebsocketsFeedServer}


# ---- scripts ------------------------------------------------------------------------------------


async def _read_forever(conn: FeedConn) -> None:
    await conn.read_until_closed(timeout=READ_FOREVER_S)


def send_frames(*per_connection: Sequence[Any], gap_s: float = 0.0) -> Script:
    """A script: connection ``i`` sends the frames in ``per_connection[i]`` (str or bytes as
    they are, anything else as JSON), ``gap_s`` apart, while recording replies until the client
    closes; later connections only record."""

    async def script(conn: FeedConn) -> None:
        reader = conn.reading()
        frames = per_connection[conn.index] if conn.index < len(per_connection) else ()
        for frame in frames:
            await conn.send_frame(frame)
            if gap_s:
                await asyncio.sleep(gap_s)
        await reader

    return script


# ---- TLS ------------------------------------------------------------------------------------------


def self_signed_certificate(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """Write a self-signed certificate for ``host`` (an IP SAN, or a DNS SAN for a name such as
    ``localhost``) and its key; return their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "forkless test feed")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([_san(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path = directory / "cert.pem"
    key_path = directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _san(host: str) -> Any:
    """The subject alternative name for ``host``: an IP address, else a DNS name."""
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def server_ssl_context(cert_path: Path, key_path: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_path, key_path)
    return ctx


# ---- feed data and checking -------------------------------------------------------------------


def make_messages(n: int, *, streams: int = 4, features: int = 4, seed: int = 0, start: int = 0) -> list[dict]:
    """``n`` well-formed messages, seq ``start``…, streams taking turns, reproducible from ``seed``."""
    import random

    rng = random.Random(seed)
    base = [[rng.uniform(-5, 5) for _ in range(features)] for _ in range(streams)]
    out = []
    for i in range(n):
        k = i % streams
        x = [round(b + rng.gauss(0.0, 1.0), 6) for b in base[k]]
        out.append({"seq": start + i, "stream": f"s{k}", "x": x})
    return out


def parse_replies(frames: list[str]) -> tuple[dict[int, list[dict]], list[dict]]:
    """Results by seq (a list, so duplicates show) and the error replies, from reply frames."""
    results: dict[int, list[dict]] = {}
    errors: list[dict] = []
    for frame in frames:
        obj = json.loads(frame)
        if "error" in obj:
            errors.append(obj)
        else:
            results.setdefault(obj["seq"], []).append(obj)
    return results, errors


def assert_results_match_reference(messages: list[dict], results: dict[int, list[dict]], *,
                                   alpha: float = 0.05, threshold: float = 4.0, warmup: int = 20) -> None:
    """Every message has exactly one result, equal to the one-at-a-time reference run over
    ``messages`` in order (float32 vs float64: small tolerances; the anomaly flag is only
    compared where the score is not within rounding of the threshold)."""
    import numpy as np

    from tests.reference import EWMAReference

    ref = EWMAReference(alpha=alpha, threshold=threshold, warmup=warmup)
    assert sorted(results) == sorted(m["seq"] for m in messages), "results for exactly these messages"
    for m in messages:
        got = results[m["seq"]]
        assert len(got) == 1, f"seq {m['seq']} answered {len(got)} times"
        r = got[0]
        z, score, anomaly = ref(m["stream"], m["x"])
        assert r["stream"] == m["stream"]
        np.testing.assert_allclose(r["z"], z, rtol=2e-3, atol=2e-3, err_msg=f"seq {m['seq']}")
        assert abs(r["score"] - score) <= 2e-3 * max(1.0, abs(score)), f"seq {m['seq']}"
        if abs(score - threshold) > 1e-2:
            assert r["anomaly"] == anomaly, f"seq {m['seq']}"
