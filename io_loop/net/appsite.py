"""An aiohttp application served on the running loop, on TCP ``host:port`` or on a unix-domain
socket: how the metrics endpoint (io_loop/net/http.py) and the demo feed (io_loop/sources/demo_feed.py)
start and stop their servers, written once.

Rules:
- ``serve_app(app, ...)`` sets up aiohttp's runner and starts one site: on ``unix_socket`` when given
  (bound by ``listen_unix``, io_loop/net/unixsocket.py: a live server's socket is never taken over),
  else on ``host:port`` (port 0: a free one). Whatever fails on the way (an ``OSError``, a
  cancellation) is raised once the runner is cleaned up and the socket file removed: nothing is
  left listening.
- A TCP site for which asyncio made no socket (it skips an address whose socket is refused) is
  ``NoSocket``, an ``OSError`` (``EPERM``) naming the host, with the caller's ``hint``.
- ``Served.close()`` closes the listener and the open connections (aiohttp's cleanup, which
  waits up to the ``shutdown_timeout_s`` given for handlers still running), then removes the
  socket file (only if still ours); idempotent.
- No access log: a scrape or a demo connection is not worth a line.
"""

from __future__ import annotations

import errno

from aiohttp import web
from forkless.io_loop.net.unixsocket import ListeningUnixSocket, listen_unix

__all__ = ["NoSocket", "Served", "serve_app"]


class NoSocket(OSError):
    """asyncio made no listening socket for a TCP address (a host that refuses TCP sockets)."""


class Served:
    """A running site of ``serve_app``: where it listens, and ``close()``."""

    def __init__(self, runner: web.AppRunner, listener: ListeningUnixSocket | None) -> None:
        self._runner: web.AppRunner | None = runner
        self._listener = listener
        # the TCP port bound (the real one for port 0); 0 on a unix-domain socket
        self.port: int = 0 if listener is not None else runner.addresses[0][1]

    async def close(self) -> None:
        """Close the listener and the open connections, remove the socket file; idempotent."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        try:
            await runner.cleanup()
        finally:
            self._remove_socket()

    def _remove_socket(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()


async def serve_app(app: web.Application, *, host: str = "", port: int = 0, unix_socket: str = "",
                shutdown_timeout_s: float, hint: str = "") -> Served:
    """Serve ``app`` on ``unix_socket``, else on ``host:port`` (see the module rules); ``hint``
    ends ``NoSocket``'s text (what else the caller could do)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    listener: ListeningUnixSocket | None = None
    try:
        if unix_socket:
            listener = listen_unix(unix_socket)
            await web.SockSite(runner, listener.sock).start()
        else:
            await web.TCPSite(runner, host, port).start()
            if not runner.addresses:  # asyncio skips an address whose socket is refused
                raise NoSocket(errno.EPERM, f"no socket could be made to listen on {host}" + (f" ({hint})" if hint
                                                                                            else ""))
    except BaseException:
        await runner.cleanup()
        if listener is not None:
            listener.close()
        raise
    return Served(runner, listener)
