"""An aiohttp application served on the running loop, on TCP ``host:port`` or a unix-domain socket: how the metrics
endpoint and the demo feed start and stop their servers, written once.

Rules:
- ``serve_app(app, ...)`` starts one site: on ``unix_socket`` when given (bound by ``listen_unix``: a live server's
  socket is never taken over), else on ``host:port`` (port 0: a free one). Whatever fails on the way is raised once
  the runner is cleaned up and the socket file removed: nothing is left listening.
- Or on ``sockets`` already listening, bound earlier by their owner: a site for each, on a duplicate of its
  descriptor, so closing the site leaves them listening for another loop to serve (the metrics server's hand-over
  from the start to the IO thread); their owner closes them.
- ``listen_tcp`` binds as asyncio's ``create_server`` would, without a loop: a socket for each address of the host,
  one port for them all; where the host refuses every address, ``NoSocket`` (``EPERM``) naming the host, with the
  caller's ``hint``.
- ``Served.close()`` closes the listener and the open connections, then removes the socket file (only if still
  ours); idempotent.
- No access log: a scrape or a demo connection is not worth a line.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

from aiohttp import web

from forkless.io_loop.net.unixsocket import BACKLOG, ListeningUnixSocket, listen_unix

__all__ = ["NoSocket", "Served", "listen_tcp", "serve_app"]


class NoSocket(OSError):
    """asyncio made no listening socket for a TCP address (a host that refuses TCP sockets)."""


class Served:
    """A running site of ``serve_app``: where it listens, and ``close()``."""

    def __init__(self, runner: web.AppRunner, listener: ListeningUnixSocket | None, port: int) -> None:
        self._runner: web.AppRunner | None = runner
        self._listener = listener
        self.port = port  # the TCP port bound (the real one for port 0); 0 on a unix-domain socket

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


def _no_socket(host: str, hint: str) -> NoSocket:
    return NoSocket(errno.EPERM, f"no socket could be made to listen on {host}" + (f" ({hint})" if hint else ""))


def listen_tcp(host: str, port: int, *, hint: str = "") -> list[socket.socket]:
    """Non-blocking sockets listening on ``host:port`` now, before any loop serves them (see the module
    rules; port 0: the free one the first was given). ``NoSocket`` when no socket could be made for
    any address (``hint`` ends its text); a bind's ``OSError`` (a taken port) as it is."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(  # each address once, in order
                socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family the host refuses: asyncio skips such an address too
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if len(sockets) > 1:  # one port for every address of the host
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise _no_socket(host, hint)
    return sockets


async def serve_app(app: web.Application, *, host: str = "", port: int = 0, unix_socket: str = "",
                    sockets: Sequence[socket.socket] = (), shutdown_timeout_s: float, hint: str = "") -> Served:
    """Serve ``app`` on ``sockets`` (listening already; left open at the close), else on ``unix_socket``,
    else on ``host:port`` (see the module rules); ``hint`` ends ``NoSocket``'s text (what else the caller
    could do)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    listener: ListeningUnixSocket | None = None
    try:
        if sockets:
            for sock in sockets:  # a duplicate: closing the site closes it, not the owner's socket
                await web.SockSite(runner, sock.dup()).start()
            address = sockets[0].getsockname()
            return Served(runner, None, address[1] if isinstance(address, tuple) else 0)
        if unix_socket:
            listener = listen_unix(unix_socket)
            await web.SockSite(runner, listener.sock).start()
        else:
            # sockets of our own, not TCPSite's: where the host refuses every one, asyncio made a server of
            # none (3.11) or raises its own "could not bind on any address" (3.13 on), and listen_tcp says
            # which host and what else to do (hint) on both
            tcp = listen_tcp(host, port, hint=hint)
            try:
                for sock in tcp:
                    await web.SockSite(runner, sock).start()
            except BaseException:
                for sock in tcp:  # those no site took yet (closing one twice does nothing)
                    sock.close()
                raise
    except BaseException:
        await runner.cleanup()
        if listener is not None:
            listener.close()
        raise
    return Served(runner, listener, 0 if listener is not None else runner.addresses[0][1])
