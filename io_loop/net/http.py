"""MetricsServer: ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP, on the IO thread's loop.

Rules:
- Runs as an aiohttp site on the IO thread's running loop: no thread and no process of its
  own. So an answer from ``/healthz`` is itself the proof that the IO loop is alive; a
  blocked loop shows up as a scrape timeout, which is what an orchestrator's probe needs.
- Binds exactly the ``host:port`` of ``FORKLESS_METRICS_ADDR`` (port 0 picks a free port;
  ``start()`` returns the real URL). The default is off; a non-loopback address is used
  only because the operator wrote it, and is logged as such. ``unix:/path`` serves on that
  unix-domain socket instead (started and stopped by io_loop/net/appsite.py, as the demo feed is;
  io_loop/net/unixsocket.py: a live server's socket is never taken
  over, the file is removed at ``stop()``), opening no TCP socket; ``start()`` then returns
  ``unix:/path`` (scraped as ``curl --unix-socket /path http://localhost/metrics``).
- ``/metrics`` is whatever the ``render`` callable it is handed returns (body and content
  type), called once per scrape on this loop; the controller hands it the Prometheus
  exposition of one ``StatsSnapshot`` (``controller.metrics.exposition``). This module knows
  no metric and imports no Prometheus library.
- ``snapshot()`` is the controller's whole-process snapshot (``controller.stats.StatsSnapshot``),
  typed loosely here: the health endpoints read only ``compiled``, ``connected``, ``feeds``,
  ``connects``, ``connect_failures``, ``connection_since``, ``last_error`` and ``loop_lag``.
- ``/readyz`` is 200 only while the step is compiled and connected to the feed; with
  several feeds, to every required one (``"required": false`` in ``FORKLESS_FEEDS`` leaves a
  feed out; if none is required, one connected feed is enough). Otherwise 503 with the
  reasons. With several feeds the answer also says, per feed, whether it is connected,
  required, and why it gave up. Both health endpoints answer JSON.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from forkless.io_loop.errors import MetricsServerError
from forkless.io_loop.net.appsite import NoSocket, Served, serve_app
from forkless.io_loop.net.netaddr import is_loopback, parse_host_port, unix_address, unix_label

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
        self._started_at = time.monotonic()

    # ---- lifecycle (IO loop) ----------------------------------------------------------------

    async def start(self) -> str:
        """Listen on the configured address; return ``http://host:port`` (the real port)."""
        if self._served is not None:
            raise RuntimeError("MetricsServer.start() called twice")
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        try:
            served = await serve_app(app, host=self.host, port=self.port, unix_socket=self.unix_socket,
                                     shutdown_timeout_s=1.0)
        except NoSocket:
            raise MetricsServerError(f"cannot serve metrics on FORKLESS_METRICS_ADDR={self.addr}: no socket could be "
                                     "made for that address (a host that refuses TCP sockets? unix:/path serves on "
                                     "a unix-domain socket)") from None
        except OSError as exc:
            # listen_unix's reasons are its own sentences; asyncio's bind error is shown as the OS says it
            reason = (exc.strerror or exc) if self.unix_socket or not exc.errno else os.strerror(exc.errno)
            raise MetricsServerError(f"cannot serve metrics on FORKLESS_METRICS_ADDR={self.addr}: {reason}") from exc
        self._served = served
        self._started_at = time.monotonic()
        if self.unix_socket:
            self.url = unix_label(self.unix_socket)
            return self.url
        port = served.port
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        if not is_loopback(self.host):
            log.warning("metrics and health endpoints are reachable beyond this host on %s "
                        "(FORKLESS_METRICS_ADDR names a non-loopback address)", self.url)
        return self.url

    async def stop(self) -> None:
        """Close the listener and any open scrape connections."""
        if self._served is not None:
            served, self._served = self._served, None
            await served.close()

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
        if not self.alive():
            reasons.append("the IO thread is stopping")
        return reasons

    # ---- handlers ---------------------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = self._render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _healthz(self, request: web.Request) -> web.Response:
        snap = self.snapshot()
        lag = snap.loop_lag.quantile(0.99) if snap is not None else float("nan")
        detail = {
            "status": "ok",
            "io_loop": "alive",  # this very answer comes from the IO loop
            "io_thread_alive": bool(self.alive()),
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
