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

import fcntl
import struct
import termios
from collections import deque
from typing import Any

import aiohttp

__all__ = ["CorkedTransport", "clear_abnormal_close", "cork", "drop", "missing"]


class CorkedTransport:
    """Stands in for one connection's socket transport inside aiohttp's frame writer, so the
    frames of one batch leave in a single ``write`` instead of one each. Writes pass straight
    through unless corked (pongs and close frames included).

    It also remembers how many frames each of its recent writes held, so that frames still
    waiting in the transport's buffer when a connection is given up can be counted."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._held: list[bytes] = []
        self._writes: deque[tuple[int, int]] = deque(maxlen=4096)  # (bytes, frames), newest last
        self.corked = False

    def write(self, data: bytes) -> None:
        if self.corked:
            self._held.append(data)
        else:
            self._transport.write(data)

    def uncork(self, frames: int) -> None:
        self.corked = False
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            self._transport.write(data)
            self._writes.append((len(data), frames))

    def frames_unconfirmed(self) -> int:
        """Frames (from the newest writes) not known to have reached the peer: still in the
        transport's buffer, or in the kernel's send queue not yet acknowledged by the peer
        (``TIOCOUTQ``, where the socket is still open); an upper estimate when a write was
        partly through. Call it before the connection is closed."""
        try:
            waiting = self._transport.get_write_buffer_size()
        except Exception:  # a closed transport: nothing left to count
            return 0
        waiting += _kernel_send_queue_bytes(self._transport)
        frames = 0
        for size, count in reversed(self._writes):
            if waiting <= 0:
                break
            frames += count
            waiting -= size
        return frames

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _kernel_send_queue_bytes(transport: Any) -> int:
    """Bytes the kernel holds for this socket that the peer has not acknowledged (Linux
    ``TIOCOUTQ``); 0 where that cannot be read (closed socket, TLS layer, other systems)."""
    sock = transport.get_extra_info("socket")
    try:
        fd = sock.fileno() if sock is not None else -1
        if fd < 0:
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, AttributeError, ValueError):
        return 0


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
