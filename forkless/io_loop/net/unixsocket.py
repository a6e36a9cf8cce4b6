"""Listening on a unix-domain socket: the demo feed's (``FORKLESS_DEMO_UNIX_SOCKET``) and the
metrics endpoint's (``FORKLESS_METRICS_ADDR=unix:/path``).

Rules:
- ``listen_unix(path)`` binds a new listening socket at ``path``, the way a TCP listener binds a
  port: a live server already listening there is never taken over (``EADDRINUSE``, as a taken
  port), a stale socket file (its server gone: a connect is refused) is replaced, and anything
  that is not a socket is left alone (``EEXIST``). asyncio's ``create_unix_server`` would remove
  any socket file, a live server's too: so the socket is bound here and handed to aiohttp
  (``web.SockSite``).
- ``ListeningUnixSocket.remove()`` deletes the socket file at the stop, only if the file at
  ``path`` is still the one bound here (another process may have replaced it since).
- Pure sockets and files, no asyncio: ``--check`` (io_loop/probe.py) binds and removes the same
  way without a loop.
"""

from __future__ import annotations

import errno
import os
import socket
import stat

__all__ = ["ListeningUnixSocket", "listen_unix"]

BACKLOG = 128


class ListeningUnixSocket:
    """A socket listening at ``path`` (``sock``), and the file's identity, to remove only our own."""

    def __init__(self, path: str, sock: socket.socket) -> None:
        self.path = path
        self.sock = sock
        st = os.stat(path)
        self._identity = (st.st_dev, st.st_ino)

    def remove(self) -> None:
        """Delete the socket file if it is still ours (see the module rules); never raises."""
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
        except OSError:
            pass

    def close(self) -> None:
        """Close the socket (when no server took it over) and remove its file."""
        self.sock.close()
        self.remove()


def _make_room(path: str) -> None:
    """Nothing at ``path`` afterwards, or ``OSError``: a live server there (``EADDRINUSE``), or a
    file that is not a socket (``EEXIST``). A stale socket (connect refused) is removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket (not removed)")
    knock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    knock.setblocking(False)
    try:
        knock.connect(path)
    except ConnectionRefusedError:  # its server is gone: a stale file
        os.unlink(path)
        return
    except FileNotFoundError:
        return
    except BlockingIOError:  # a backlog full of connections: alive and busy
        pass
    finally:
        knock.close()
    raise OSError(errno.EADDRINUSE, f"another server is listening on {path}")


def listen_unix(path: str) -> ListeningUnixSocket:
    """A new non-blocking socket listening at ``path`` (see the module rules); ``OSError`` with the
    reason (``EADDRINUSE``, ``EEXIST``, ``EACCES``, ``ENOENT`` for a missing directory …)."""
    _make_room(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(BACKLOG)
        sock.setblocking(False)
        return ListeningUnixSocket(path, sock)
    except BaseException:
        sock.close()
        raise
