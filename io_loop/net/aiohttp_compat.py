"""Everything forkless does with aiohttp's private attributes, in one place.

Rules:
- Two patches and one shortcut, each measured or needed, on one ``ClientWebSocketResponse``:
  1. ``cork(ws)`` puts ``CorkedTransport`` in place of ``ws._writer.transport`` so the frames
     of one outgoing batch leave in one ``write`` (one syscall): +20-25% maximum throughput,
     measured A/B (see bench/README.md).
  2. ``clear_abnormal_close(ws)`` clears ``ws._close_code`` after our own cancelled
     ``receive()`` so that ``close()`` waits for the server's close frame (see the client).
  3. ``drop(ws)`` aborts the transport under ``ws._writer``: an aborted stop ends the
     connection at once instead of waiting to write a close frame nobody reads.
- ``aiohttp_missing(ws)`` names what this aiohttp no longer has; a test runs it against a real
  connection, so an aiohttp upgrade that moves these attributes fails the suite instead of
  silently turning the corked write off.
- ``UnixConnector``: aiohttp's own connects a wss:// URL's request through a unix-domain socket
  in the clear (aiohttp 3.14 has no TLS there); ours wraps the socket in TLS, verified against
  the URL's host, through its private ``_create_connection`` and ``_factory``. Where this
  aiohttp lacks them it refuses a wss:// URL (``ClientConnectorSSLError``) rather than send it in
  the clear; ``unix_tls_missing()`` names what is missing, run by a test.
- Imports aiohttp only (no numpy, no JAX): the benchmark's spawn child uses it too.
"""

from __future__ import annotations

import ssl
from typing import Any

import aiohttp
from aiohttp.client_exceptions import UnixClientConnectorError

__all__ = ["CorkedTransport", "UnixConnector", "aiohttp_missing", "clear_abnormal_close", "cork", "drop",
           "unix_tls_missing"]


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


def cork(ws: aiohttp.ClientWebSocketResponse) -> CorkedTransport | None:
    """Install the corked transport in aiohttp's writer; None (plain writes) if its layout changed."""
    writer = getattr(ws, "_writer", None)
    if writer is None or not hasattr(writer, "transport"):
        return None
    corked = CorkedTransport(writer.transport)
    writer.transport = corked
    return corked


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
