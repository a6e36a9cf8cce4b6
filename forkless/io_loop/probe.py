"""The network half of ``--check``: can the metrics address be bound, and does the feed answer?

Rules:
- Each probe raises ``ProbeFailed(reason)`` with one human sentence, or says what it found through ``say`` and
  returns; the exit status is the preflight's business (controller/commands/check.py).
- The feed probe asks each feed's source, made as every run's are, to try itself (its ``probe``): this module knows
  no kind of feed and imports none of their modules. A user's source without one is said and passed. With several
  feeds each is probed, and the probe fails naming every one that fails.
- A metrics address ``unix:/path`` is bound and removed as the server would: no TCP socket is opened for it.
- The probes run on a loop of their own in a thread of their own ("forkless-check", ``run_in_thread``), so
  ``--check`` may be called from inside a running loop; what a probe raises is raised in the caller.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

from forkless.io_loop.capabilities import SupportsProbe
from forkless.io_loop.decoding import FrameDecoder
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.loopthread import run_in_thread
from forkless.io_loop.net.netaddr import parse_host_port, unix_address, unix_label
from forkless.io_loop.net.unixsocket import listen_unix
from forkless.io_loop.source import Source

__all__ = ["ProbeFailed", "check_metrics_addr", "probe_feed"]


class ProbeFailed(Exception):
    """One probe failed; ``str`` is the reason, fit to print."""


def check_metrics_addr(addr: str, say: Callable[[str], None]) -> None:
    """Bind (and release) the metrics address, as the metrics server will."""
    try:
        path = unix_address(addr)
    except ValueError as exc:
        raise ProbeFailed(f"cannot listen on FORKLESS_METRICS_ADDR={addr}: {exc}") from None
    if path is not None:
        _check_unix_listener(path, "FORKLESS_METRICS_ADDR")
        say(f"  {addr}: free; /metrics, /healthz, /readyz and /startedz will be served on that unix-domain socket")
        return
    try:
        host, port = parse_host_port(addr)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except (OSError, ValueError) as exc:
        raise ProbeFailed(f"cannot listen on FORKLESS_METRICS_ADDR={addr}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    say(f"  {addr}: free; /metrics, /healthz, /readyz and /startedz will be served there")


def _check_unix_listener(path: str, variable: str) -> None:
    """The unix-domain socket ``path`` can be listened on (io_loop/net/unixsocket.py's rules): bound once,
    then removed (a stale socket file found there is removed too, as the server would)."""
    try:
        listen_unix(path).close()
    except OSError as exc:
        raise ProbeFailed(f"cannot listen on {variable}={unix_label(path)}: {exc.strerror or exc}") from None


def probe_feed(feeds: Sequence[FeedSpec], sources: Sequence[Source], codec: FrameDecoder,
               say: Callable[[str], None], *, dedupe_window_s: float = 180.0) -> None:
    """Connect once to each feed (or the embedded demo feed): ``sources``, one per spec of ``feeds``, each
    probes itself; see the module rules. ``dedupe_window_s``: the duplicate window a JetStream feed's
    results stream should have."""
    if len(sources) != len(feeds):
        raise ValueError(f"probe_feed needs one source per feed: {len(feeds)} feeds, {len(sources)} sources")
    run_in_thread(lambda: _probe_feed(feeds, sources, codec, say, dedupe_window_s), name="forkless-check")


async def _probe_feed(feeds: Sequence[FeedSpec], sources: Sequence[Source], codec: FrameDecoder,
                      say: Callable[[str], None], dedupe_window_s: float) -> None:
    if len(feeds) == 1:
        await _probe_source(sources[0], codec, say, dedupe_window_s)
        return
    failed = []
    for feed, source in zip(feeds, sources):
        say(f"  {feed.label}{'' if feed.required else ' (not required)'}:")
        try:
            await _probe_source(source, codec, lambda line: say("  " + line), dedupe_window_s)
        except ProbeFailed as exc:
            say(f"    FAILED: {exc}")
            failed.append(f"feed {feed.name!r}")
    if failed:
        raise ProbeFailed(f"{len(failed)} of {len(feeds)} feeds failed: {', '.join(failed)} (see above)")


async def _probe_source(source: Any, codec: FrameDecoder, say: Callable[[str], None], dedupe_window_s: float) -> None:
    """One feed's source tries itself (its ``probe``, io_loop/capabilities.py); one without is said and passed."""
    if not isinstance(source, SupportsProbe):
        say(f"  source {source.name!r} declares no probe(): not tried")
        return
    await source.probe(codec, say, dedupe_window_s=dedupe_window_s)
