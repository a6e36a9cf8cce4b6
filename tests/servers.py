"""A real, scriptable aiohttp WebSocket feed server for the fault tests.

Rules:
- ``FeedServer`` runs an aiohttp application in a background thread with its own event
  loop, on ``127.0.0.1`` and a free port (0), so the test's main thread can drive a
  ``Controller`` (or wait on a ``python app.py`` subprocess) against it.
- The scenario is a script: ``session(conn)``, an ``async def`` run in the server's loop for
  every accepted WebSocket connection (``conn`` is a ``ServerConn``). When it returns,
  the connection is closed (if it is not already). Scripts keep their own state in a
  closure; everything the server saw is also recorded here: ``attempts`` (the monotonic time
  of every HTTP request, accepted or not) and ``connections`` (every ``ServerConn``).
- Handshake faults: ``handshake_status`` is a function ``attempt_index -> status | None``;
  a status (401, 404, 503 …) answers the upgrade request with that HTTP status instead.
- Refusing connections: ``refuse_for(seconds)`` stops listening (the port then refuses
  TCP connections) and listens again on the same port after that long.
- Pings: ``autoping=False`` hands PING frames to the script (``ServerConn.recv`` skips them
  and counts them in ``pings``) and does not answer them unless ``answer_pings`` is set on
  the connection. ``ServerConn.stop_reading()`` pauses the TCP transport: nothing is read,
  so TCP pushes back on the client.
- Closing without losing replies: aiohttp's ``WebSocketResponse.close()`` discards every data
  frame that arrives after our close frame and before the client's. ``close_keep_reading``
  instead writes the close frame with the low-level frame writer (``ws._writer``, private
  aiohttp API) and keeps reading data frames until the client's close arrives, so results the
  client sent before it saw our close are still counted.
- TLS: pass ``ssl_context`` (see ``self_signed_certificate``); the URL is then ``wss://``.
- Thread safety: the recorded lists are only appended to in the server thread; the test
  thread reads them (``len``, iteration over a copy) while it runs, or after ``stop()``.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ["FeedServer", "ServerConn", "self_signed_certificate", "server_ssl_context"]

PATH = "/feed"
START_TIMEOUT_S = 10.0


class ServerConn:
    """One accepted WebSocket connection, as a script sees it."""

    def __init__(self, server: FeedServer, index: int, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.server = server
        self.index = index  # 0 for the first connection, 1 for the next …
        self.request = request
        self.ws = ws
        self.headers = dict(request.headers)
        self.received: list[str] = []  # every data frame from the client, in order
        self.pings = 0
        self.answer_pings = False
        self.opened_at = time.monotonic()
        self.closed_at: float | None = None
        self.client_close_code: int | None = None
        self.end_message: tuple[Any, Any, Any] | None = None  # what ended the reading, for diagnostics

    async def send(self, obj: Any) -> None:
        """Send one text frame: a str as is, anything else as JSON."""
        await self.ws.send_str(obj if isinstance(obj, str) else json.dumps(obj))

    async def send_bytes(self, data: bytes) -> None:
        await self.ws.send_bytes(data)

    async def recv(self, timeout: float | None = None) -> str | None:
        """The next data frame from the client (recorded in ``received``), or None when the
        connection is closing/closed or ``timeout`` passed. PINGs are counted (and answered
        only if ``answer_pings``); with the server's default ``autoping`` aiohttp answers them."""
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
                self.received.append(msg.data)
                return msg.data
            if msg.type is aiohttp.WSMsgType.BINARY:
                text = msg.data.decode("utf-8", "replace")
                self.received.append(text)
                return text
            self.end_message = (msg.type, msg.data, self.ws.exception())
            if msg.type is aiohttp.WSMsgType.CLOSE:
                self.client_close_code = msg.data
            elif self.client_close_code is None and self.ws.close_code is not None:
                self.client_close_code = self.ws.close_code
            return None

    async def read_until_closed(self, timeout: float = 10.0) -> None:
        """Read (and record) data frames until the client closes or ``timeout`` passes."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            if await self.recv(timeout=end - loop.time()) is None and (
                self.ws.closed or self.client_close_code is not None or self.ws._closing
            ):
                return

    async def send_close(self, code: int = aiohttp.WSCloseCode.GOING_AWAY) -> None:
        """Write a close frame but keep the connection readable (see the module rules); a
        task already reading with ``recv`` goes on receiving data frames until the client's close."""
        assert self.ws._writer is not None
        await self.ws._writer.close(code, b"test server closing")

    async def close_keep_reading(self, code: int = aiohttp.WSCloseCode.GOING_AWAY,
                                 timeout: float = 5.0) -> None:
        """Send a close frame, then keep reading data frames until the client's close
        arrives (see the module rules): nothing the client sent before it saw our close is lost."""
        await self.send_close(code)
        await self.read_until_closed(timeout)
        if not self.ws.closed:
            await self.ws.close()

    def stop_reading(self) -> None:
        """Stop reading the socket at the TCP level: the client's writes back up."""
        transport = self.request.transport
        if transport is not None:
            transport.pause_reading()

    def resume_reading_threadsafe(self) -> None:
        """Undo ``stop_reading``; callable from the test thread."""
        transport = self.request.transport
        if transport is not None and self.server.loop is not None:
            self.server.loop.call_soon_threadsafe(transport.resume_reading)


Script = Callable[[ServerConn], Awaitable[None]]


class FeedServer:
    """See the module docstring. Use as a context manager: ``with FeedServer(script) as server``."""

    def __init__(self, script: Script | None = None, *, handshake_status: Callable[[int], int | None] | None = None,
                 ssl_context: ssl.SSLContext | None = None, autoping: bool = True,
                 max_msg_size: int = 64 << 20) -> None:
        self.script = script or _read_forever
        self.handshake_status = handshake_status
        self.ssl_context = ssl_context
        self.autoping = autoping
        self.max_msg_size = max_msg_size
        self.attempts: list[float] = []  # monotonic time of every HTTP request to PATH
        self.connections: list[ServerConn] = []
        self.script_errors: list[BaseException] = []
        self.port = 0
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="test-feed-server", daemon=True)
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._handlers: set[asyncio.Task] = set()
        self._startup_error: BaseException | None = None

    # ---- test-thread API ----------------------------------------------------------------------

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the test feed server did not start")
        if self._startup_error is not None:
            raise self._startup_error
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        loop, stop = self.loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass
        self._thread.join(timeout)

    def __enter__(self) -> FeedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, coro: Awaitable[Any], timeout: float = 10.0) -> Any:
        """Run a coroutine in the server's loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def refuse_for_threadsafe(self, seconds: float) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.refuse_for(seconds)))

    # ---- server-loop API (for scripts) ----------------------------------------------------

    async def refuse_for(self, seconds: float) -> None:
        """Stop listening (connections are refused by the OS), listen again after ``seconds``."""
        if self._site is not None:
            await self._site.stop()
            self._site = None
        await asyncio.sleep(seconds)
        await self._listen()

    # ---- the server thread ------------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # reported to start() or kept for the test
            self._startup_error = exc
        finally:
            self._ready.set()
            loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_get(PATH, self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        await self._listen()
        scheme = "wss" if self.ssl_context is not None else "ws"
        self.url = f"{scheme}://127.0.0.1:{self.port}{PATH}"
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            for task in list(self._handlers):
                task.cancel()
            if self._handlers:
                await asyncio.wait(self._handlers, timeout=2.0)
            await self._runner.cleanup()

    async def _listen(self) -> None:
        assert self._runner is not None
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.ssl_context,
                           reuse_address=True)
        await site.start()
        self._site = site
        if not self.port:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        index = len(self.attempts)
        self.attempts.append(time.monotonic())
        status = self.handshake_status(index) if self.handshake_status is not None else None
        if status is not None:
            return web.Response(status=status, text=f"test server says {status}")
        ws = web.WebSocketResponse(autoping=self.autoping, max_msg_size=self.max_msg_size, timeout=2.0)
        await ws.prepare(request)
        conn = ServerConn(self, len(self.connections), request, ws)
        self.connections.append(conn)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self.script(conn)
        except (asyncio.CancelledError, ConnectionError, aiohttp.ClientError):
            pass
        except Exception as exc:  # a broken script must fail the test, not vanish
            self.script_errors.append(exc)
        finally:
            self._handlers.discard(task)
            conn.closed_at = time.monotonic()
            if not ws.closed:
                try:
                    await asyncio.wait_for(ws.close(), 2.0)
                except (Exception, asyncio.CancelledError):
                    pass
        return ws


async def _read_forever(conn: ServerConn) -> None:
    await conn.read_until_closed(timeout=3600)


def self_signed_certificate(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """Write a self-signed certificate for ``host`` (an IP SAN) and its key; return their paths."""
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
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path = directory / "cert.pem"
    key_path = directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def server_ssl_context(cert_path: Path, key_path: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_path, key_path)
    return ctx


# ---- feed data and checking (shared by the fault tests) -------------------------------------


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
