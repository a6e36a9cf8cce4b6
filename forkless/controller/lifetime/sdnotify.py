"""The service manager told of the start, the stop, and that the loops turn: systemd's notify protocol
(sd_notify(3)), in its few documented lines, for a unit of ``Type=notify`` with ``WatchdogSec=``.

Rules:
- Only where asked (``Runtime(notify_systemd=True)``) and where ``NOTIFY_SOCKET`` names the manager's socket;
  otherwise every call does nothing (``NoServiceManager``).
- ``STATUS=`` names the phase while starting; ``READY=1`` once the step is compiled and the IO side runs (not once
  the feed connects: that is ``/readyz``'s, and a start waiting for a feed that is down would hit the unit's start
  timeout); ``STOPPING=1`` when the orderly stop begins.
- The watchdog (``WATCHDOG_USEC`` set, ``WATCHDOG_PID`` this process where set): ``run()``'s loop sends
  ``WATCHDOG=1`` every half interval, only once the IO loop has turned since the last (``keep_alive``), so a hung
  main thread or IO loop stops the pings and systemd restarts the unit.
- Sends never block (``MSG_DONTWAIT``) and never stop the run: a failure is logged once, the next are tried.
- The variables stay in the environment: the process starts no other. Nothing here exits the process.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Mapping

__all__ = ["NoServiceManager", "ServiceManager", "notify_address", "service_manager", "watchdog_interval_s"]

log = logging.getLogger("forkless.controller")


def notify_address(value: str) -> str | bytes | None:
    """``NOTIFY_SOCKET``'s address to send to: a path as it is, ``@name`` as the abstract ``\\0name``;
    None for what is not a unix socket's (empty, or another scheme such as ``vsock:``)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def watchdog_interval_s(environ: Mapping[str, str], pid: int) -> float | None:
    """The watchdog's timeout in seconds from ``WATCHDOG_USEC``, None when it is off: unset, not a
    positive integer, or ``WATCHDOG_PID`` set to another process than ``pid``."""
    owner = environ.get("WATCHDOG_PID", "").strip()
    if owner and owner != str(pid):
        return None
    usec = environ.get("WATCHDOG_USEC", "").strip()
    if not usec.isdigit() or int(usec) <= 0:
        return None
    return int(usec) / 1e6


class NoServiceManager:
    """No ``NOTIFY_SOCKET`` (or not asked): every call does nothing."""

    def status(self, text: str) -> None:
        pass

    def ready(self, status: str) -> None:
        pass

    def stopping(self, status: str) -> None:
        pass

    def keep_alive(self, now: float, io_turns: int) -> bool:
        return False

    def watchdog_due(self, now: float) -> bool:
        return False

    def close(self) -> None:
        pass


class ServiceManager:
    """Notifications to the socket at ``address`` (``notify_address``); ``watchdog_s``: the watchdog's
    timeout (None: off). Main thread only."""

    def __init__(self, address: str | bytes, watchdog_s: float | None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s
        self._sock: socket.socket | None = None
        self._ready = False
        self._next_ping = math.inf  # monotonic seconds: the next WATCHDOG=1 due (once READY=1 is sent)
        self._io_turns = -1  # the IO loop's turns at the last ping
        self._failed = False  # a failure was logged: the next is not

    def send(self, *fields: str) -> bool:
        """One datagram of ``KEY=value`` lines; False if it could not be sent (logged once)."""
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto("\n".join(fields).encode(), socket.MSG_DONTWAIT, self.address)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("could not notify the service manager on NOTIFY_SOCKET (%s); the run goes on", exc)
            return False
        return True

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def ready(self, status: str) -> None:
        """``READY=1``, once; arms the pings (``keep_alive``) where the watchdog is on."""
        if self._ready:
            return
        self._ready = True
        self.send("READY=1", f"STATUS={status}")

    def stopping(self, status: str) -> None:
        """``STOPPING=1``: systemd stops the watchdog then, and the unit's ``TimeoutStopSec=`` bounds the stop."""
        self.send("STOPPING=1", f"STATUS={status}")

    def watchdog_due(self, now: float) -> bool:
        """True when a ping is due (every half timeout, once ready); ``keep_alive`` sends it."""
        if not self._ready or self.watchdog_s is None:
            return False
        if self._next_ping == math.inf:
            self._next_ping = now  # the first one at once
        return now >= self._next_ping

    def keep_alive(self, now: float, io_turns: int) -> bool:
        """``WATCHDOG=1`` if one is due and the IO loop has turned since the last (``io_turns``: its
        count of lag samples); else nothing, asked again at the next turn of the main loop."""
        if not self.watchdog_due(now) or io_turns == self._io_turns:
            return False
        self._io_turns = io_turns
        assert self.watchdog_s is not None
        self._next_ping = now + self.watchdog_s / 2
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def service_manager(environ: Mapping[str, str] | None = None,
                    pid: int | None = None) -> ServiceManager | NoServiceManager:
    """The service manager named by ``NOTIFY_SOCKET`` in ``environ`` (this process's by default), with the
    watchdog of ``WATCHDOG_USEC`` for ``pid``; ``NoServiceManager`` where none is named."""
    environ = os.environ if environ is None else environ
    address = notify_address(environ.get("NOTIFY_SOCKET", ""))
    if address is None:
        if environ.get("NOTIFY_SOCKET"):
            log.warning("NOTIFY_SOCKET=%s is not a unix socket's path or @name: the service manager is not notified",
                        environ["NOTIFY_SOCKET"])
        return NoServiceManager()
    return ServiceManager(address, watchdog_interval_s(environ, os.getpid() if pid is None else pid))
