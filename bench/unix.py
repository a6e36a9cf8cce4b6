"""The benchmark over unix-domain sockets: one address form for its servers and clients, and a
guard that refuses every TCP or UDP socket, as the lent TPU host does.

Rules:

- An address is a URL. ``ws://HOST:PORT/PATH`` is TCP; ``ws+unix://ENCODED/PATH`` is the unix
  socket whose path is ``ENCODED`` percent-decoded (``unix_url``), the form of
  requests-unixsocket's ``http+unix://``. The WebSocket handshake then asks for
  ``ws://localhost/PATH`` (``handshake_url``): the path and ``Host`` of the URL, the connection
  the socket's.
- The load generator and the ping probe print ``LISTENING <address>`` in this form; every
  client of the benchmark (``bench.io_ceiling``, ``bench.spawn_client``, ``bench.inline_client``,
  the feed of ``bench.run``'s start-up figure) opens its ``aiohttp.ClientSession`` with
  ``client_session(address)`` (a ``UnixConnector`` for a unix address, one session a socket);
  forkless itself is handed ``FORKLESS_WS_URL=handshake_url(address)`` and
  ``FORKLESS_WS_UNIX_SOCKET=socket_path(address)`` (``forkless_env``; a feed of
  ``FORKLESS_FEEDS`` takes ``"unix_socket"``), exactly as a user of the product would.
- ``FORKLESS_BENCH_UNIX=1`` (``bench.run --unix``) selects unix sockets for everything. Every
  Python process the run starts then loads ``bench/no_inet/sitecustomize.py`` (``refuse_inet``):
  an audit hook that raises ``PermissionError`` at the creation of any AF_INET or AF_INET6
  socket, so a TCP or UDP socket opened by mistake fails the run on any machine, as it would on
  the TPU host, instead of passing unnoticed where loopback works.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

UNIX_SCHEME = "ws+unix"
UNIX_ENV = "FORKLESS_BENCH_UNIX"  # "1": every socket of the run a unix one (bench.run --unix)
SOCKET_DIR_ENV = "FORKLESS_BENCH_SOCKET_DIR"  # where a unix run's sockets are made (bench.run: one folder a run)
NO_INET_DIR = Path(__file__).resolve().parent / "no_inet"  # holds the sitecustomize.py that calls refuse_inet
INET_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def enabled() -> bool:
    """Whether this run is over unix sockets (``FORKLESS_BENCH_UNIX=1``)."""
    return os.environ.get(UNIX_ENV, "") == "1"


def unix_url(path: str | Path, ws_path: str = "/") -> str:
    """The address of a WebSocket served on the unix socket ``path`` at ``ws_path``."""
    return f"{UNIX_SCHEME}://{quote(str(path), safe='')}{ws_path}"


def socket_path(url: str) -> str | None:
    """The unix socket of ``url``, None for a TCP address."""
    parts = urlsplit(url)
    return unquote(parts.netloc) if parts.scheme == UNIX_SCHEME else None


def handshake_url(url: str) -> str:
    """The URL the handshake asks for: ``url`` itself over TCP, ``ws://localhost/PATH`` over a unix socket."""
    parts = urlsplit(url)
    if parts.scheme != UNIX_SCHEME:
        return url
    return f"ws://localhost{parts.path or '/'}" + (f"?{parts.query}" if parts.query else "")


def client_session(url: str, **kwargs: Any) -> Any:
    """An ``aiohttp.ClientSession`` that reaches ``url``: through its unix socket (``UnixConnector``)
    for a unix address, the default connector otherwise. Connect with ``handshake_url(url)``."""
    import aiohttp

    path = socket_path(url)
    if path is not None:
        kwargs["connector"] = aiohttp.UnixConnector(path=path)
    return aiohttp.ClientSession(**kwargs)


async def start_site(runner: Any, host: str, unix_socket: str | None, ws_path: str = "/") -> str:
    """Serve ``runner`` (an aiohttp ``AppRunner``, set up) on the unix socket ``unix_socket`` when
    given, else on ``host`` at a free TCP port; the address to print."""
    from aiohttp import web

    if unix_socket:
        await web.UnixSite(runner, unix_socket).start()
        return unix_url(unix_socket, ws_path)
    await web.TCPSite(runner, host, 0).start()
    port = runner.addresses[0][1]
    return f"ws://{f'[{host}]' if ':' in host else host}:{port}{ws_path}"


def new_socket_path(tag: str) -> str:
    """A fresh socket path for ``tag`` in the run's socket folder (``SOCKET_DIR_ENV``, made by
    ``bench.run --unix``; a new private folder if unset). Unix socket paths are limited to ~107
    bytes, so the folder lives under the system's temporary folder, not under a deep work folder."""
    folder = os.environ.get(SOCKET_DIR_ENV) or tempfile.mkdtemp(prefix="fkb-")
    path = Path(folder) / f"{tag[:60]}.sock"
    n = 1
    while path.exists():
        n += 1
        path = Path(folder) / f"{tag[:60]}-{n}.sock"
    return str(path)


def forkless_env(url: str) -> dict[str, str]:
    """The product's own variables for one feed at ``url``: ``FORKLESS_WS_URL``, and
    ``FORKLESS_WS_UNIX_SOCKET`` for a unix address."""
    path = socket_path(url)
    env = {"FORKLESS_WS_URL": handshake_url(url)}
    if path is not None:
        env["FORKLESS_WS_UNIX_SOCKET"] = path
    return env


def forkless_feed(url: str, name: str) -> dict[str, str]:
    """One feed of ``FORKLESS_FEEDS`` at ``url`` (``"unix_socket"`` for a unix address)."""
    path = socket_path(url)
    return {"url": handshake_url(url), "name": name, **({"unix_socket": path} if path is not None else {})}


def product_takes_unix_socket() -> bool:
    """Whether this checkout's forkless has ``FORKLESS_WS_UNIX_SOCKET`` (the forkless designs can
    only run over a unix socket when it does)."""
    from forkless.controller.config import VARIABLES

    return any(v.name == "WS_UNIX_SOCKET" for v in VARIABLES)


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``bench/no_inet`` first on ``PYTHONPATH``: a Python process started with it
    refuses inet sockets (``refuse_inet``)."""
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(NO_INET_DIR)]
    return {**env, "PYTHONPATH": os.pathsep.join([str(NO_INET_DIR), *parts])}


def refuse_inet() -> None:
    """From now on, creating an AF_INET or AF_INET6 socket in this process raises ``PermissionError``
    (an audit hook: it cannot be removed, which is the point)."""

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "socket.__new__" and len(args) >= 2 and args[1] in INET_FAMILIES:
            raise PermissionError(f"{UNIX_ENV}=1: this benchmark run opens no TCP or UDP socket (the TPU host "
                                  f"refuses them), and {sys.argv[0] or 'python'} asked for one "
                                  f"(family {socket.AddressFamily(args[1]).name})")

    sys.addaudithook(hook)
