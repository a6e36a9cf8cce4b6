"""Everything forkless does with aiohttp's private attributes, in one place.

Rules:
- Two patches and three shortcuts on one ``ClientWebSocketResponse``, each measured or needed:
  1. ``cork(ws)``: ``CorkedTransport`` under ``ws._writer`` so a batch's frames leave in one ``write``
     (bench/README.md); the fallback of 5.
  2. ``clear_abnormal_close(ws)`` clears ``ws._close_code`` after our own cancelled ``receive()``, so ``close()``
     waits for the server's close frame.
  3. ``drop(ws)`` aborts the transport: an aborted stop ends the connection at once.
  4. ``data_ready(ws)`` peeks at ``ws._reader._buffer``: the reader takes every data frame one read brought and
     decodes them in one pass.
  5. ``text_frames(ws)`` writes a batch of text frames itself, framed and masked as RFC 6455 and aiohttp's
     ``send_frame`` do, in one ``transport.write``, waiting on flow control as ``send_frame`` does
     (bench/docs/per-message-cost.md). Not on a connection that compresses: aiohttp's writer, corked, there.
- ``aiohttp_missing(ws)`` names what this aiohttp no longer has; a test runs it against a real connection, so an
  upgrade that moves these fails the suite instead of silently turning them off.
- ``UnixConnector`` wraps a wss:// URL's unix-domain socket in TLS, verified against the URL's host (aiohttp's own
  would send it in the clear), through its private ``_create_connection`` and ``_factory``; where they are missing
  it refuses a wss:// URL rather than send it in the clear (``unix_tls_missing()``, run by a test).
- Imports aiohttp only (no numpy, no JAX): the benchmark's spawn child uses it too.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from aiohttp.client_exceptions import UnixClientConnectorError

try:  # the frame writer's own pieces: text_frames() says None where they are gone
    from aiohttp._websocket.helpers import PACK_LEN1, PACK_LEN2, PACK_LEN3, PACK_RANDBITS, websocket_mask
except ImportError:  # pragma: no cover - an aiohttp that moved them
    PACK_LEN1 = PACK_LEN2 = PACK_LEN3 = PACK_RANDBITS = websocket_mask = None  # type: ignore[assignment]  # see text_frames

__all__ = ["CorkedTransport", "TextFrames", "UnixConnector", "aiohttp_missing", "clear_abnormal_close", "cork",
           "data_ready", "drop", "text_frames", "unix_tls_missing"]

_DATA = (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY)


class CorkedTransport:
    """Stands in for one connection's socket transport inside aiohttp's frame writer, so the
    frames of one batch leave in a single ``write`` instead of one each. Writes pass straight
    through unless corked (pongs and close frames included)."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._held: list[bytes] = []
        self.corked = False

    def write(self, data: bytes) -> None:
        if self.corked:
            self._held.append(data)
        else:
            self._transport.write(data)

    def cork(self) -> None:
        """Hold the writes from now until ``uncork``."""
        self.corked = True

    def uncork(self) -> None:
        self.corked = False
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class TextFrames:
    """Writes a batch of text frames to one connection in one ``transport.write`` (see the module
    rules): ``write(frames)`` frames them all (a ``str`` is sent as its UTF-8, ``bytes`` as they
    are), then ``await drained()`` waits while the transport's buffer is over its high-water mark."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self._protocol = writer.protocol
        self._masked = bool(writer.use_mask)
        self._random_bits = writer.get_random_bits

    def write(self, frames: Sequence[str | bytes]) -> None:
        """Every frame of ``frames`` handed to the transport in one write, or none of them:
        ``ClientConnectionResetError`` when the connection is closing, as ``send_frame`` raises."""
        writer = self._writer
        transport = writer.transport
        if writer._closing or transport.is_closing():
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        masked, random_bits, mask = self._masked, self._random_bits, websocket_mask
        parts: list[bytes | bytearray] = []
        append = parts.append
        length_bit = 0x80 if masked else 0
        data: bytes | bytearray
        for frame in frames:
            data = frame if isinstance(frame, bytes) else frame.encode("utf-8")  # a send's frame subclasses them
            n = len(data)
            if n < 126:
                append(PACK_LEN1(0x81, length_bit | n))
            elif n < 65536:
                append(PACK_LEN2(0x81, length_bit | 126, n))
            else:
                append(PACK_LEN3(0x81, length_bit | 127, n))
            if masked:
                key = PACK_RANDBITS(random_bits())
                data = bytearray(data)
                mask(key, data)
                append(key)
            append(data)
        transport.write(b"".join(parts))

    async def drained(self) -> None:
        """Wait while the transport holds more than its high-water mark (the peer reads slowly),
        as ``send_frame`` waits."""
        protocol = self._protocol
        if protocol._paused:
            await protocol._drain_helper()


def text_frames(ws: aiohttp.ClientWebSocketResponse | aiohttp.web.WebSocketResponse) -> TextFrames | None:
    """The batch writer of ``ws`` (a client's or, prepared, a server's connection); None on a
    connection that compresses or where this aiohttp's layout differs (write with ``send_frame``)."""
    writer = getattr(ws, "_writer", None)
    if websocket_mask is None or writer is None or getattr(writer, "compress", True) or \
            not all(hasattr(writer, name) for name in _TEXT_FRAMES_NEEDS) or \
            not callable(getattr(writer.protocol, "_drain_helper", None)):
        return None
    return TextFrames(writer)


_TEXT_FRAMES_NEEDS = ("transport", "protocol", "use_mask", "get_random_bits", "_closing", "compress")


def cork(ws: aiohttp.ClientWebSocketResponse) -> CorkedTransport | None:
    """Install the corked transport in aiohttp's writer; None (plain writes) if its layout changed."""
    writer = getattr(ws, "_writer", None)
    if writer is None or not hasattr(writer, "transport"):
        return None
    corked = CorkedTransport(writer.transport)
    writer.transport = corked
    return corked


def data_ready(ws: aiohttp.ClientWebSocketResponse) -> Callable[[], bool]:
    """A check, made once per connection, of whether aiohttp has already parsed ``ws``'s next
    message and it is a text or binary frame, so that ``receive()`` returns it without waiting
    (it read it from the socket with the frames before it). Where this aiohttp's layout
    differs the check always says False: the frames are then handed over one at a time."""
    buffer = getattr(getattr(ws, "_reader", None), "_buffer", None)
    if buffer is None:
        return _never
    data = _DATA

    def ready() -> bool:
        return bool(buffer) and buffer[0][0].type in data

    return ready


def _never() -> bool:
    return False


def clear_abnormal_close(ws: aiohttp.ClientWebSocketResponse) -> None:
    """Forget the "abnormal closure" aiohttp records when our own ``receive()`` is cancelled,
    so that ``close()`` reads until the server's close frame instead of dropping TCP at once."""
    if getattr(ws, "_close_code", None) == aiohttp.WSCloseCode.ABNORMAL_CLOSURE:
        ws._close_code = None


def drop(ws: aiohttp.ClientWebSocketResponse) -> None:
    """Close the TCP connection at once, without a closing handshake (an aborted stop must not
    wait on a peer that does not read)."""
    writer = getattr(ws, "_writer", None)
    transport = getattr(writer, "transport", None)
    if transport is not None:
        transport.abort()


def aiohttp_missing(ws: aiohttp.ClientWebSocketResponse) -> list[str]:
    """What the patches above need and this aiohttp's open ``ws`` lacks (empty: all there)."""
    gaps = []
    writer = getattr(ws, "_writer", None)
    if writer is None:
        gaps.append("ClientWebSocketResponse._writer")
    elif not hasattr(writer, "transport"):
        gaps.append("WebSocketWriter.transport")
    elif not callable(getattr(writer.transport, "write", None)):
        gaps.append("WebSocketWriter.transport.write")
    if not hasattr(ws, "_close_code"):
        gaps.append("ClientWebSocketResponse._close_code")
    buffer = getattr(getattr(ws, "_reader", None), "_buffer", None)
    if not hasattr(buffer, "__getitem__") or not hasattr(buffer, "__len__"):
        gaps.append("ClientWebSocketResponse._reader._buffer")
    if websocket_mask is None:
        gaps.append("aiohttp._websocket.helpers (PACK_LEN1/2/3, PACK_RANDBITS, websocket_mask)")
    if writer is not None:
        gaps += [f"WebSocketWriter.{name}" for name in _TEXT_FRAMES_NEEDS if not hasattr(writer, name)]
        if not callable(getattr(getattr(writer, "protocol", None), "_drain_helper", None)):
            gaps.append("WebSocketWriter.protocol._drain_helper")
        if not hasattr(getattr(writer, "protocol", None), "_paused"):
            gaps.append("WebSocketWriter.protocol._paused")
    return gaps


def unix_tls_missing(connector: aiohttp.UnixConnector | None = None) -> list[str]:
    """What ``UnixConnector``'s TLS needs and this aiohttp (or ``connector``) lacks (empty: all there)."""
    gaps = []
    if not callable(getattr(aiohttp.UnixConnector, "_create_connection", None)):
        gaps.append("UnixConnector._create_connection")
    if connector is not None and not callable(getattr(connector, "_factory", None)):
        gaps.append("BaseConnector._factory")
    return gaps


class UnixConnector(aiohttp.UnixConnector):
    """aiohttp's ``UnixConnector``, with TLS over the socket for a wss:// URL (see the module rules):
    the request's TLS context (``ws_connect(ssl=...)``), the server name the URL's host."""

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
        if not req.is_ssl():
            return await super()._create_connection(req, traces, timeout)
        gaps = unix_tls_missing(self)
        if gaps:
            raise aiohttp.ClientConnectorSSLError(req.connection_key, OSError(
                f"this aiohttp ({aiohttp.__version__}) lacks what TLS over a unix-domain socket needs: "
                f"{', '.join(gaps)}"))
        context = req.ssl if isinstance(req.ssl, ssl.SSLContext) else ssl.create_default_context()
        try:
            _, proto = await self._loop.create_unix_connection(
                self._factory, self.path, ssl=context, server_hostname=(req.server_hostname or req.host).rstrip("."))
        except ssl.SSLCertVerificationError as exc:
            raise aiohttp.ClientConnectorCertificateError(req.connection_key, exc) from exc
        except ssl.SSLError as exc:
            raise aiohttp.ClientConnectorSSLError(req.connection_key, exc) from exc
        except OSError as exc:
            raise UnixClientConnectorError(self.path, req.connection_key, exc) from exc
        return proto
