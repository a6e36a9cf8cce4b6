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
- ``missing(ws)`` names what this aiohttp no longer has; a test runs it against a real
  connection, so an aiohttp upgrade that moves these attributes fails the suite instead of
  silently turning the corked write off.
- Imports aiohttp only (no numpy, no JAX): the benchmark's spawn child uses it too.
"""

from __future__ import annotations

from typing import Any

import aiohttp

__all__ = ["CorkedTransport", "clear_abnormal_close", "cork", "drop", "missing"]


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


def missing(ws: aiohttp.ClientWebSocketResponse) -> list[str]:
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
