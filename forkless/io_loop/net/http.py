"""MetricsServer: ``/metrics``, ``/healthz``, ``/readyz`` and ``/startedz`` over HTTP, on the IO thread's loop.

Rules:
- An aiohttp site on the IO thread's running loop, no thread or process of its own: an answer from ``/healthz`` is
  itself the proof that the IO loop is alive; a blocked loop shows as a scrape timeout.
- From the first second: ``bind()`` listens at once, from any thread, so a controller binds before it compiles;
  ``stop(keep_sockets=True)`` ends the serving on one loop and leaves the sockets listening (a scrape meanwhile waits
  in the backlog) for ``start()`` on the next; ``close()`` releases the address.
- Binds exactly ``FORKLESS_METRICS_ADDR`` (port 0: a free one; the real URL returned). Off by default; a non-loopback
  address is used only because the operator wrote it, and logged as such. ``unix:/path`` serves on that socket
  (a live server's never taken over), no TCP socket opened.
- ``/metrics`` is whatever the ``render`` callable returns, once per scrape: this module knows no metric and imports
  no Prometheus library. The health endpoints read a few fields of ``snapshot()``, the controller's.
- ``/healthz`` is 200 whenever it answers, during the start too (a liveness probe must not kill a program that
  compiles). ``/readyz`` is 200 only while the step is compiled and every required feed connected (one, if none is
  required), else 503 with the reasons. ``/startedz`` is 503 while the start runs, then 200 whatever the feed
  does: a startup probe bounds the start, never a feed's outage. The health endpoints answer JSON.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from forkless.io_loop.errors import MetricsServerError
from forkless.io_loop.net.appsite import NoSocket, Served, listen_tcp, serve_app
from forkless.io_loop.net.netaddr import is_loopback, parse_host_port, unix_address, unix_label
from forkless.io_loop.net.unixsocket import ListeningUnixSocket, listen_unix

__all__ = ["MetricsServer"]

log = logging.getLogger("forkless.http")


Render = Callable[[], tuple[bytes, str]]
"""``render() -> (body, content type)``: what ``/metrics`` answers, made at each scrape."""


def no_metrics() -> tuple[bytes, str]:
    """What ``/metrics`` answers when the server is handed no ``render``: an empty exposition."""
    return b"", "text/plain; version=0.0.4; charset=utf-8"


class MetricsServer:
    """Serves the three endpoints from three callables: ``snapshot()`` (one whole-process
    snapshot, or None before the controller has one), ``alive()`` (whether the IO thread
    runs) and ``render()`` (the ``/metrics`` body and its content type)."""

    def __init__(self, addr: str, *, snapshot: Callable[[], Any], alive: Callable[[], bool],
                 render: Render | None = None) -> None:
        self.addr = addr
        self.host, self.port = "", 0
        try:
            self.unix_socket = unix_address(addr) or ""
            if not self.unix_socket:
                self.host, self.port = parse_host_port(addr)
        except ValueError as exc:
            raise MetricsServerError(f"FORKLESS_METRICS_ADDR={addr!r} is invalid: {exc}") from None
        self.snapshot = snapshot
        self.alive = alive
        self._render = render if render is not None else no_metrics
        self.url: str | None = None
        self._served: Served | None = None
        self._sockets: list[socket.socket] = []  # bound by bind(): TCP
        self._unix: ListeningUnixSocket | None = None  # ... or a unix-domain socket
        self._closed = False
        self._started_at = time.monotonic()

    # ---- lifecycle -------------------------------------------------------------------------

    def bind(self) -> str:
        """Listen on the configured address now, from any thread and before any loop serves it (a
        taken port is refused here: ``MetricsServerError``); its URL (the real port). Once: a
        second call returns the URL; after ``close()`` it is a ``RuntimeError``."""
        if self._closed:
            raise RuntimeError("MetricsServer.bind(): the server was closed (a MetricsServer binds once)")
        if self.url is not None:
            return self.url
        try:
            if self.unix_socket:
                self._unix = listen_unix(self.unix_socket)
            else:
                self._sockets = listen_tcp(self.host, self.port)
        except NoSocket:
            raise MetricsServerError(f"cannot serve metrics on FORKLESS_METRICS_ADDR={self.addr}: no socket could be "
                                     "made for that address (a host that refuses TCP sockets? unix:/path serves on "
                                     "a unix-domain socket)") from None
        except OSError as exc:
            # listen_unix's reasons and a name's resolution are their own sentences; a bind's is shown as the OS says it
            plain = self.unix_socket or not exc.errno or isinstance(exc, socket.gaierror)
            reason = (exc.strerror or exc) if plain or exc.errno is None else os.strerror(exc.errno)
            raise MetricsServerError(f"cannot serve metrics on FORKLESS_METRICS_ADDR={self.addr}: {reason}") from exc
        self._started_at = time.monotonic()
        if self.unix_socket:
            self.url = unix_label(self.unix_socket)
        else:
            host = f"[{self.host}]" if ":" in self.host else self.host
            self.url = f"http://{host}:{self._sockets[0].getsockname()[1]}"
            if not is_loopback(self.host):
                log.warning("metrics and health endpoints are reachable beyond this host on %s "
                            "(FORKLESS_METRICS_ADDR names a non-loopback address)", self.url)
        log.info("metrics on %s", self.where)
        return self.url

    async def start(self, alive: Callable[[], bool] | None = None) -> str:
        """Serve the endpoints on the running loop (``bind()`` first, if not done); return the URL.
        ``alive``: whether the IO thread runs, from now on (else the one given when built). After a
        ``stop(keep_sockets=True)`` it may start again, on another loop."""
        if self._served is not None:
            raise RuntimeError("MetricsServer.start() called while it serves")
        url = self.bind()
        if alive is not None:
            self.alive = alive
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/startedz", self._startedz)
        listening = [self._unix.sock] if self._unix is not None else self._sockets
        self._served = await serve_app(app, sockets=listening, shutdown_timeout_s=1.0)
        return url

    async def stop(self, *, keep_sockets: bool = False) -> None:
        """Stop serving on this loop: close the site and any open scrape connections; then ``close()``,
        unless ``keep_sockets`` (they go on listening for the next ``start``, on another loop)."""
        if self._served is not None:
            served, self._served = self._served, None
            await served.close()
        if not keep_sockets:
            self.close()

    def close(self) -> None:
        """Release the address (the sockets closed, a unix-domain socket's file removed); any
        thread, once it serves on no loop; idempotent."""
        self._closed = True
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()
        unix, self._unix = self._unix, None
        if unix is not None:
            unix.close()

    @property
    def where(self) -> str:
        """Where ``/metrics`` is, for the log: its URL, or ``http://localhost/metrics via unix:/path``."""
        if self.unix_socket:
            return f"http://localhost/metrics via {unix_label(self.unix_socket)}"
        return f"{self.url}/metrics"

    # ---- what the endpoints report ----------------------------------------------------------

    def not_ready_reasons(self, snap: Any) -> list[str]:
        """Why ``/readyz`` says 503 (empty when ready)."""
        reasons = []
        phase = getattr(snap, "phase", "running")
        if phase != "running":  # the start's phases (compiling, restoring, …) and the stop's
            reasons.append(phase.replace("_", " "))
        if snap is None or not snap.compiled:
            reasons.append("the step is not compiled yet")
        if snap is not None and len(snap.feeds) > 1:
            reasons.extend(_feed_reasons(snap))
        elif snap is None or not snap.connected:
            tried = ""
            if snap is not None and snap.connect_failures:
                tried = f", {snap.connect_failures} failed connection attempts so far"
            if snap is not None and snap.last_error:
                tried += f"; last: {snap.last_error}"
            if snap is not None and snap.connects:
                ago = max(0.0, time.time() - snap.connection_since)
                reasons.append(f"not connected to the feed (disconnected {ago:.1f}s ago{tried})")
            else:
                reasons.append(f"not connected to the feed (no connection yet{tried})")
        if phase == "running" and not self.alive():
            reasons.append("the IO thread is stopping")
        return reasons

    # ---- handlers ---------------------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = self._render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _healthz(self, request: web.Request) -> web.Response:
        snap = self.snapshot()
        lag = snap.loop_lag.quantile(0.99) if snap is not None else float("nan")
        alive = bool(self.alive())
        detail = {
            "status": "ok",
            # this very answer comes from the IO loop, or, before the IO thread runs, from the start-up thread
            "io_loop": "alive" if alive else "not running",
            "phase": getattr(snap, "phase", None),
            "io_thread_alive": alive,
            "main_thread_alive": threading.main_thread().is_alive(),
            "connected": bool(snap is not None and snap.connected),
            "io_loop_lag_p99_s": None if lag != lag else round(lag, 6),
            "uptime_s": round(time.monotonic() - self._started_at, 3),
        }
        return web.json_response(detail)

    async def _readyz(self, request: web.Request) -> web.Response:
        snap = self.snapshot()
        reasons = self.not_ready_reasons(snap)
        body: dict = {"status": "not ready" if reasons else "ready", "reasons": reasons}
        if snap is not None and len(snap.feeds) > 1:
            body["feeds"] = {f.name: {"connected": f.io.connected, "required": f.required,
                                      "given_up": f.given_up or None} for f in snap.feeds}
        return web.json_response(body, status=503 if reasons else 200)

    async def _startedz(self, request: web.Request) -> web.Response:
        snap = self.snapshot()
        # a run with no phases of its own (a source -> sink run's view) has started once it serves
        phase = getattr(snap, "phase", "running") if snap is not None else "starting"
        started = phase in STARTED
        return web.json_response({"status": "started" if started else "starting", "phase": phase},
                                 status=200 if started else 503)


# the phases from which on the start is over (controller/stats.py PHASES: the run's phases, in order)
STARTED = ("running", "stopping", "stopped")


def _feed_reasons(snap: Any) -> list[str]:
    """Several feeds: why the feeds keep the process from being ready (see the module rules)."""
    required = [f for f in snap.feeds if f.required]
    if not required:
        return [] if any(f.up for f in snap.feeds) else ["no feed is connected (none is required)"]
    reasons = []
    for f in required:
        if f.given_up:
            reasons.append(f"required feed {f.name!r} gave up: {f.given_up}")
        elif not f.io.connected:
            last = f"; last: {f.io.last_error}" if f.io.last_error else ""
            reasons.append(f"required feed {f.name!r} is not connected ({f.io.connects} connections so far{last})")
    return reasons
