"""The IO side as the controller sees it: the interface it drives, and the real one's factory.

Rules:
- The controller starts, stops and observes the IO side only through ``IOSide``: the real one is
  ``io_loop.thread.IOThread``; tests use a fake on plain queues (tests/fake_io.py), as httpx's ``MockTransport``
  tests a client. Before the start it holds a ``NoIOSide``, so it never asks whether there is one.
- The IO thread gets what it needs as constructor arguments, never attributes set on it from outside.
- Every feed's source is built here (``feed_sources``; the relay and ``--check`` call it too): a user's by its
  name, a configured feed's by its connector, found once by ``connector_for`` in ``feed_plan``. The controller asks
  a feed's connector, never its kind; nothing here imports a connector's room, and the IO side imports none of the
  sources' modules. A partitioned feed's source is fenced by the leases its connector owns.
- The controller's sinks are checked when it is built (``checked_sinks``) and handed to the real IO thread.
- What the controller reads of the IO side is its snapshot, but for ``feed_ended``: ``Controller.send``'s check,
  two reads and no copy, as a whole snapshot per send costs (bench/docs/exchange-session-cost.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from forkless.controller.checkpoints.positions import UserPositions
from forkless.controller.codec import Codec
from forkless.controller.config import Config
from forkless.controller.stats import StatsSnapshot
from forkless.io_loop.capabilities import check_methods, declarations, warn_lookalikes
from forkless.io_loop.connectors.connector import Connector, PositionCodec
from forkless.io_loop.connectors.websocket.before_connect import BeforeConnect
from forkless.io_loop.connectors.websocket.on_connect import OnConnect
from forkless.io_loop.counters import IOSnapshot, IOStats
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.iosettings import IOSettings
from forkless.io_loop.kinds import connector_for
from forkless.io_loop.sends import declared_send_policy
from forkless.io_loop.sinks.sink import ResultSink, check_sink
from forkless.io_loop.source import Source
from forkless.io_loop.thread import IOThread
from forkless.io_loop.waiting import PARK, WaitSettings

__all__ = ["FeedPlan", "IOFactory", "IOSide", "NoIOSide", "checked_sinks", "feed_plan",
           "feed_source", "feed_sources", "io_thread", "with_hooks"]


class FeedPlan(NamedTuple):
    """What the controller runs: every feed's spec in order (the configured feeds, then the
    user's own sources), the user's sources by name, whether the demo feed runs, the user's sinks, and the
    configured feeds' connectors (``connector_for``; the demo feed's is made where its source is)."""

    specs: tuple[FeedSpec, ...]
    sources: dict[str, Source]
    uses_demo_feed: bool
    sinks: tuple[ResultSink, ...] = ()  # the controller's sinks of results on the IO thread (``checked_sinks``)
    connectors: tuple[Connector, ...] = ()  # the configured feeds', in order
    # each feed's deadline for what ``Controller.send`` hands it without a ``max_age_s`` (a source's
    # ``send_max_age_s``, io_loop/sends.py; None: none), in the order of ``specs`` (empty: none for any)
    send_max_age_s: tuple[float | None, ...] = ()

    def connector(self, name: str) -> Connector | None:
        """The connector of the configured feed named ``name`` (None: a user's source, or no such feed)."""
        return next((c for c in self.connectors if c.feed.name == name), None)

    def partitioned(self) -> Connector | None:
        """The connector of the feed whose partitions this instance owns (config.py allows one at most)."""
        return next((c for c in self.connectors if c.partitioned), None)

    def position_codecs(self) -> dict[str, PositionCodec]:
        """Each replayable feed's ``PositionCodec`` by name: a connector's, a user's source's (``UserPositions``)."""
        codecs: dict[str, PositionCodec] = {c.feed.name: c.positions for c in self.connectors
                                            if c.positions is not None}
        codecs.update({name: UserPositions(name) for name in self.sources})
        return codecs

    def sendable(self, feed: str) -> int:
        """The index of the feed or source named ``feed``, to which ``Controller.send`` may hand
        frames; ``ValueError`` naming the choices for an unknown name, or why a connector's feed takes none."""
        index = next((i for i, spec in enumerate(self.specs) if spec.name == feed), None)
        if index is None:
            raise ValueError(f"no feed or source is named {feed!r}; there are: "
                             f"{', '.join(repr(spec.name) for spec in self.specs)}")
        connector = self.connector(feed)
        refused = connector.refuses_sends() if connector is not None else ""
        if refused:
            raise ValueError(refused)
        return index

    def refuse_ended(self, why: str, index: int, frames: int) -> None:
        """``Controller.send``'s refusal of feed ``index`` once it has ended (``why``, from
        ``IOSide.feed_ended``: a source whose ``run`` returned, a feed given up; "" while it takes
        frames): ``RuntimeError`` naming it and why. What reaches one that ends after this check is
        counted and logged by the IO side (``sent_unsent``)."""
        if why:
            raise RuntimeError(f"send({self.specs[index].name!r}): {frames} frames not sent: the source has ended "
                               f"({why}); nothing more is written to it in this run")

    def stream_prefixes(self, shared_streams: bool) -> list[str] | None:
        """With several feeds (unless ``FORKLESS_SHARED_STREAMS=1``) a stream's key is "feed:stream":
        each feed's prefix; None when a stream's key is its name."""
        return [spec.name + ":" for spec in self.specs] if len(self.specs) > 1 and not shared_streams else None


def feed_plan(config: Config, sources: Sequence[Source] = (), *, check_demo: bool = True,
              sinks: Sequence[ResultSink] = ()) -> FeedPlan:
    """The one place that decides which feeds run: the configured ones (``FORKLESS_WS_URL``,
    ``FORKLESS_FEEDS``) beside the user's own ``sources``; with sources and nothing configured,
    the sources run instead of the embedded demo feed. The demo feed's settings are checked
    only when it runs (``ConfigError``: ``Config.check_demo_feed``); ``check_demo=False``: an IO
    side of the caller's own runs no demo feed (the tests' fake). ``sinks``: ``checked_sinks``."""
    sinks = checked_sinks(sinks)
    configured = () if config.uses_demo_feed else config.feed_specs
    connectors = tuple(connector_for(spec) for spec in configured)
    if not sources:
        if config.uses_demo_feed and check_demo:  # its settings are checked only when it runs
            config.check_demo_feed()
        return FeedPlan(config.feed_specs, {}, config.uses_demo_feed, sinks, connectors)
    taken = {spec.name for spec in configured}
    specs: list[FeedSpec] = list(configured)
    by_name: dict[str, Source] = {}
    for source in sources:
        name = getattr(source, "name", None)
        if not isinstance(name, str) or not name or not callable(getattr(source, "run", None)):
            raise TypeError(f"a source is an object with a non-empty str name and async run(ctx) "
                            f"(controller.Source); got {source!r}")
        if name in taken:
            names = ", ".join(sorted(spec.name for spec in configured)) or "none"
            raise ValueError(f"two feeds or sources are named {name!r}: each source needs a name of its own "
                             f"(the configured feeds are {names})")
        # what it declares (io_loop/capabilities.py): its values checked, its methods methods, a look-alike warned of
        declared = declarations(source, name)
        check_methods(source, name)
        warn_lookalikes(source, name)
        taken.add(name)
        by_name[name] = source
        specs.append(FeedSpec(name, "", replies=declared.replies, required=declared.required))
    max_ages = tuple(declared_send_policy(by_name[spec.name], spec.name)[0] if spec.name in by_name else None
                     for spec in specs)
    return FeedPlan(tuple(specs), by_name, False, sinks, connectors, max_ages)


def checked_sinks(sinks: Sequence[ResultSink]) -> tuple[ResultSink, ...]:
    """``Controller(sinks=...)``'s sinks on the IO thread checked: each an object with a non-empty str ``name`` and
    ``async run(ctx)`` (``TypeError``), and names of their own (``ValueError``)."""
    sinks = tuple(sinks)
    for sink in sinks:
        check_sink(sink, "ResultSink")
    names = [sink.name for sink in sinks]
    if len(set(names)) < len(names):
        raise ValueError(f"two sinks are named alike ({', '.join(map(repr, names))}): each needs a name of its own")
    return sinks


def feed_source(spec: FeedSpec, settings: IOSettings, *, sources: Mapping[str, Source],
                on_connect: OnConnect | None, before_connect: BeforeConnect | None,
                connector: Connector | None = None) -> Source:
    """The source of one feed: a user's source by its name, else the one its connector makes (``connector``, else
    ``connector_for``'s), handed the settings groups, the demo feed's settings where it runs, and the hooks."""
    if spec.name in sources:  # a user's own source
        return sources[spec.name]
    s = settings
    connector = connector if connector is not None else connector_for(spec)
    return connector.source(timeouts=s.timeouts, reconnect=s.reconnect, tls=s.tls, limits=s.limits,
                            credentials=s.credentials, partitioning=s.partitioning,
                            demo=s.demo if s.uses_demo_feed else None, features=s.features, warmup=s.warmup,
                            on_connect=on_connect, before_connect=before_connect, feeds_from_list=s.feeds_from_list)


def feed_sources(settings: IOSettings, *, sources: Mapping[str, Source] | None = None,
                 on_connect: OnConnect | None = None, before_connect: BeforeConnect | None = None,
                 connectors: Mapping[str, Connector] | None = None) -> list[Source]:
    """Every configured feed's source, one per ``settings.feed_specs`` (``feed_source``), for the
    composition root to hand the IO thread; ``connectors``: the feeds' connectors by name, made by the composition
    root (a partitioned feed's owns its partitions, whose fence its source gets)."""
    connectors = connectors or {}
    return [feed_source(spec, settings, sources=sources or {}, on_connect=on_connect, before_connect=before_connect,
                        connector=connectors.get(spec.name)) for spec in settings.feed_specs]


class IOSide(Protocol):
    """What the controller needs from the IO side; ``io_loop.thread.IOThread`` is the real one,
    and tests use a fake built on plain queues (tests/fake_io.py) with the same interface."""

    failure: BaseException | None
    metrics_url: str | None

    def start(self) -> Any: ...  # -> an object with ``inbound`` and ``outbound`` sync queues

    def request_stop(self, deadline: float | None = None) -> None: ...

    def join(self, timeout: float | None = None) -> bool: ...

    def abort(self) -> None: ...

    def raise_if_failed(self) -> None: ...

    def snapshot(self) -> IOSnapshot: ...

    def feed_ended(self, index: int) -> str: ...  # why feed ``index`` takes no more frames ("" while it does)

    def cpu_seconds(self) -> float: ...  # the IO thread's CPU seconds so far, from any thread (NaN: unknown)

    def summaries(self) -> list[str]: ...  # each source's summary() line (the demo feed's tally)


class NoIOSide:
    """The IO side before one is started (or when a stop ended the start first): nothing runs, its
    counters read as they are, and the calls that act on a running one do nothing."""

    failure: BaseException | None = None
    metrics_url: str | None = None

    def __init__(self, stats: IOStats) -> None:
        self._stats = stats

    def abort(self) -> None:
        pass

    def request_stop(self, deadline: float | None = None) -> None:
        pass

    def raise_if_failed(self) -> None:
        pass

    def snapshot(self) -> IOSnapshot:
        return self._stats.snapshot()

    def feed_ended(self, index: int) -> str:
        return ""

    def cpu_seconds(self) -> float:
        return math.nan

    def summaries(self) -> list[str]:
        return []


IOFactory = Callable[[Config, Codec, IOStats, Callable[[], StatsSnapshot]], IOSide]
"""Builds the IO side (``Controller(runtime=forkless.Runtime(io_factory=...))``); the connect hooks
(``Controller(connect=forkless.ConnectHooks(...))``) are bound into the default one (the real IO thread), and a
custom factory (the tests' fake IO side) makes no connections to call them on."""


def with_hooks(io_factory: IOFactory, *, on_connect: OnConnect | None,
               before_connect: BeforeConnect | None) -> IOFactory:
    """``io_factory`` with the embedder's connect hooks bound in, where it is the real IO thread's
    (a custom factory, the tests' fake IO side, makes no connections to call them on)."""
    hooks: dict[str, Any] = {name: hook for name, hook in (("on_connect", on_connect),
                                                           ("before_connect", before_connect)) if hook is not None}
    return functools.partial(io_factory, **hooks) if io_factory is io_thread and hooks else io_factory


def io_thread(config: Config, codec: Codec, stats: IOStats, snapshot: Callable[[], StatsSnapshot], *,
               on_connect: OnConnect | None = None, before_connect: BeforeConnect | None = None,
               positions: dict[str, Any] | None = None, plan: FeedPlan | None = None,
               acknowledged: Any = None, wait: WaitSettings = PARK, connection_events: bool = False,
               metrics: Any = None) -> IOSide:
    """The real IO side; ``positions``: the replayable feeds' positions a restored checkpoint
    recorded (passed only when there are some); ``plan``: the feeds with the user's own sources, sinks and the
    feeds' connectors (passed only when there are some: a partitioned feed's connector fences the source it makes
    with the leases it owns); ``acknowledged``: signalled as replies are acknowledged (io_loop/sinks/sink.py,
    passed where feeds keep positions); ``connection_events``: each feed hands over a ``ConnectionEvent`` at each
    change of its connection (passed only when asked for: ``OnEvent(fn, connections=True)``); ``metrics``:
    the metrics server the controller bound and served while it started, for the IO thread to serve from now on
    (controller/lifetime/endpoints.py, passed where ``FORKLESS_METRICS_ADDR`` is set). The plan's sinks
    (``FeedPlan.sinks``) are handed each batch's results."""
    render = None
    if config.run.metrics_addr and metrics is None:
        from forkless.controller.metrics import exposition  # only when served: prometheus_client is about 10 MiB of RSS

        render = exposition(snapshot)
    settings = config.io_settings()
    if plan is not None:
        settings = dataclasses.replace(settings, feed_specs=plan.specs, uses_demo_feed=plan.uses_demo_feed)
    # every feed's source built here, the composition root: the hooks go straight to them, and the plan's
    # connectors make theirs (a partitioned feed's fenced by the leases its connector owns)
    sources = feed_sources(settings, sources=plan.sources if plan is not None else None, on_connect=on_connect,
                           before_connect=before_connect,
                           connectors={c.feed.name: c for c in plan.connectors} if plan is not None else None)
    result_sinks = plan.sinks if plan is not None else ()
    return IOThread(settings, codec, stats, stats_snapshot=snapshot, render_metrics=render, sources=sources,
                    positions=positions, acknowledged=acknowledged, result_sinks=result_sinks, wait=wait,
                    connection_events=connection_events, metrics=metrics)
