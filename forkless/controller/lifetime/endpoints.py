"""Endpoints: a controller's ``/metrics``, ``/healthz``, ``/readyz`` and ``/startedz`` from the first second of its
start to its stop.

Rules:
- With ``FORKLESS_METRICS_ADDR`` set, ``open_endpoints`` binds it first thing in ``Controller.start()``: a taken
  port is a ``MetricsServerError`` (exit 2) before anything is restored or compiled.
- While the controller restores, compiles and waits for leases, the endpoints are served by a thread of their own,
  "forkless-startup": ``/healthz`` 200 with the phase, ``/readyz`` 503 naming it, ``/metrics`` ``forkless_phase``.
- ``hand_over()`` ends that thread (the sockets left listening: a scrape meanwhile waits in the backlog) and gives
  the server to the IO thread, which serves and releases it from then on; ``close()`` leaves a server handed over
  alone, releases one that was not, and is idempotent. Without the address: ``NoEndpoints``, the same calls.
- ``serve_last_books``: a run ended by a lost lease (exit 3) serves its last books on the same address until one
  ``/metrics`` scrape has read them or ``FORKLESS_LEASE_S`` has passed, so the "lease lost" it counted is scraped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from forkless.controller.config import Config
from forkless.io_loop.errors import MetricsServerError
from forkless.io_loop.loopthread import LoopThread

__all__ = ["Endpoints", "NoEndpoints", "open_endpoints", "serve_last_books"]

log = logging.getLogger("forkless.controller")

START_S = 10.0  # how long the start-up thread may take to serve (it starts a site on sockets bound already)
END_S = 5.0  # how long ending it may take (it closes that site: milliseconds)


class NoEndpoints:
    """No ``FORKLESS_METRICS_ADDR``: nothing served, nothing handed over."""

    url: str | None = None

    def hand_over(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class Endpoints:
    """A bound metrics server, served on the start-up thread until ``hand_over()`` (see the module rules)."""

    def __init__(self, server: Any) -> None:
        self.server = server  # io_loop/net/http.py's MetricsServer, bound
        self._thread = LoopThread("forkless-startup", cleanup_s=1.0)
        self._done: asyncio.Event | None = None  # set on the start-up thread's loop: its serving ends
        self._handed = False

    @property
    def url(self) -> str | None:
        """Where the endpoints are: ``http://host:port`` (the real port), or ``unix:/path``."""
        return self.server.url

    def start(self) -> None:
        """Serve on the start-up thread; ``MetricsServerError`` if it does not serve."""
        if not self._thread.start(self._serve, START_S):
            raise MetricsServerError(f"the metrics endpoints on FORKLESS_METRICS_ADDR={self.server.addr} were not "
                                     f"served within {START_S:g}s of the start")
        failure = self._thread.failure
        if failure is not None:
            raise MetricsServerError(f"cannot serve metrics on FORKLESS_METRICS_ADDR={self.server.addr}: "
                                     f"{failure!r}") from failure

    async def _serve(self) -> None:
        self._done = asyncio.Event()
        await self.server.start()
        self._thread.ready()
        try:
            await self._done.wait()
        finally:
            await self.server.stop(keep_sockets=True)

    def hand_over(self) -> dict[str, Any]:
        """End the start-up thread's serving; the IO side's argument that hands it the server."""
        self._end_thread()
        self._handed = True
        return {"metrics": self.server}

    def close(self) -> None:
        """End the start-up thread, and release the address unless the IO thread took it; idempotent."""
        self._end_thread()
        if not self._handed:
            self.server.close()

    def _end_thread(self) -> None:
        done = self._done
        if done is not None and self._thread.call_soon(done.set) and not self._thread.join(END_S):
            log.warning("the thread serving the metrics endpoints during the start did not end within %gs; "
                        "leaving it behind (a daemon)", END_S)


def open_endpoints(config: Config, snapshot: Callable[[], Any]) -> Endpoints | NoEndpoints:
    """``FORKLESS_METRICS_ADDR`` bound now and served from now on (see the module rules); ``snapshot``: the
    controller's ``stats``. ``MetricsServerError`` for an address that cannot be listened on."""
    if not config.run.metrics_addr:
        return NoEndpoints()
    # only when served: prometheus_client is about 10 MiB of RSS, aiohttp.web 1.7 MiB
    from forkless.controller.metrics import exposition
    from forkless.io_loop.net.http import MetricsServer

    server = MetricsServer(config.run.metrics_addr, snapshot=snapshot, alive=lambda: False, render=exposition(snapshot))
    server.bind()
    endpoints = Endpoints(server)
    try:
        endpoints.start()
    except BaseException:
        endpoints.close()
        raise
    return endpoints


def serve_last_books(config: Config, snapshot: Callable[[], Any], within_s: float) -> bool:
    """After a run that ended on a lost lease: ``snapshot``'s books (the controller's ``stats``, its last)
    served on ``FORKLESS_METRICS_ADDR`` until a ``/metrics`` scrape has read them, at most ``within_s`` (see
    the module rules). True when one did; False without an address, or when none came (or the address
    could not be had again: logged)."""
    if not config.metrics_addr:
        return False
    # only when served: prometheus_client is about 10 MiB of RSS, aiohttp.web 1.7 MiB
    from forkless.controller.metrics import exposition
    from forkless.io_loop.net.http import MetricsServer

    scraped = threading.Event()
    render = exposition(snapshot)

    def counted() -> tuple[bytes, str]:
        answer = render()
        scraped.set()
        return answer

    server = MetricsServer(config.metrics_addr, snapshot=snapshot, alive=lambda: False, render=counted)
    try:
        server.bind()
        endpoints = Endpoints(server)
        endpoints.start()
    except MetricsServerError as exc:
        log.warning("the last books could not be served for a scrape before the exit: %s", exc)
        server.close()
        return False
    try:
        log.info("serving the last books on %s until a scrape reads them (at most %gs)", server.where, within_s)
        return scraped.wait(within_s)
    finally:
        endpoints.close()
