"""MetricsServer: ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP, on the IO thread's loop.

Rules:
- Runs as an aiohttp site on the IO thread's running loop: no thread and no process of its
  own. So an answer from ``/healthz`` is itself the proof that the IO loop is alive; a
  blocked loop shows up as a scrape timeout, which is what an orchestrator's probe needs.
- Binds exactly the ``host:port`` of ``FORKLESS_METRICS_ADDR`` (port 0 picks a free port;
  ``start()`` returns the real URL). The default is off; a non-loopback address is used
  only because the operator wrote it, and is logged as such.
- ``/metrics`` is ``prometheus_client.generate_latest`` over this server's own registry
  (``controller.metrics.make_registry``), made from one ``StatsSnapshot`` per scrape.
- ``/readyz`` is 200 only while connected to the feed and the step is compiled; otherwise
  503 with the reasons. Both health endpoints answer JSON.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from typing import Any

from aiohttp import web

__all__ = ["MetricsServer", "MetricsServerError", "parse_addr"]

log = logging.getLogger("forkless.http")


class MetricsServerError(RuntimeError):
    """``FORKLESS_METRICS_ADDR`` cannot be served (bad address, port in use)."""


def parse_addr(addr: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> ``(host, port)``; raises ``MetricsServerError``."""
    host, sep, port = addr.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise MetricsServerError(f"FORKLESS_METRICS_ADDR={addr!r} is invalid: expected host:port")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetricsServer:
    """Serves the three endpoints for one ``IOThread`` (or anything with the same attributes:
    ``snapshot``, ``stats``, ``alive``, ``client``, ``ready_flag``)."""

    def __init__(self, addr: str, io: Any) -> None:
        self.addr = addr
        self.host, self.port = parse_addr(addr)
        self.io = io
        # prometheus_client is imported only when metrics are served (about 10 MiB of RSS)
        from controller.metrics import make_registry

        self.registry = make_registry(self._snapshot)
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._started_at = time.monotonic()

    # ---- lifecycle (IO loop) ----------------------------------------------------------------

    async def start(self) -> str:
        """Listen on the configured address; return ``http://host:port`` (the real port)."""
        if self._runner is not None:
            raise RuntimeError("MetricsServer.start() called twice")
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise MetricsServerError(f"cannot serve metrics on FORKLESS_METRICS_ADDR={self.addr}: "
                                     f"{os.strerror(exc.errno) if exc.errno else exc}") from exc
        self._runner = runner
        port = runner.addresses[0][1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        self._started_at = time.monotonic()
        if not _is_loopback(self.host):
            log.warning("metrics and health endpoints are reachable beyond this host on %s "
                        "(FORKLESS_METRICS_ADDR names a non-loopback address)", self.url)
        return self.url

    async def stop(self) -> None:
        """Close the listener and any open scrape connections."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ---- what the endpoints report ----------------------------------------------------------

    def _snapshot(self) -> Any:
        snapshot = getattr(self.io, "snapshot", None)
        return snapshot() if snapshot is not None else None

    def _connected(self) -> bool:
        client = getattr(self.io, "client", None)
        stats = client.stats if client is not None else getattr(self.io, "stats", None)
        return bool(stats is not None and stats.connected)

    def not_ready_reasons(self) -> list[str]:
        """Why ``/readyz`` says 503 (empty when ready)."""
        reasons = []
        if not self.io.ready_flag():
            reasons.append("the step is not compiled yet")
        if not self._connected():
            stats = getattr(self.io, "stats", None)
            since = getattr(stats, "state_since", 0.0) or 0.0
            failures = getattr(stats, "connect_failures", 0)
            tried = f", {failures} failed connection attempts so far" if failures else ""
            last = getattr(stats, "last_error", "")
            if last:
                tried += f"; last: {last}"
            if getattr(stats, "connects", 0):
                ago = max(0.0, time.time() - since)
                reasons.append(f"not connected to the feed (disconnected {ago:.1f}s ago{tried})")
            else:
                reasons.append(f"not connected to the feed (no connection yet{tried})")
        if not self.io.alive:
            reasons.append("the IO thread is stopping")
        return reasons

    # ---- handlers ---------------------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        from controller.metrics import render

        body = render(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        stats = getattr(self.io, "stats", None)
        lag = stats.loop_lag.snapshot().quantile(0.99) if stats is not None else float("nan")
        detail = {
            "status": "ok",
            "io_loop": "alive",  # this very answer comes from the IO loop
            "io_thread_alive": bool(self.io.alive),
            "main_thread_alive": threading.main_thread().is_alive(),
            "connected": self._connected(),
            "io_loop_lag_p99_s": None if lag != lag else round(lag, 6),
            "uptime_s": round(time.monotonic() - self._started_at, 3),
        }
        return web.json_response(detail)

    async def _readyz(self, request: web.Request) -> web.Response:
        reasons = self.not_ready_reasons()
        if reasons:
            return web.json_response({"status": "not ready", "reasons": reasons}, status=503)
        return web.json_response({"status": "ready", "reasons": []})
