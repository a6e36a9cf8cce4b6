"""Sources are built at the composition root (issue 47): the configuration builds every feed's
source ready made (controller/ioside.py's ``feed_sources``), and the IO thread is handed the list; the
hooks go straight to the sources, never through the IO thread or the feed set, and a partitioned feed's lease
fence goes from the leases its connector owns to the source that connector makes, inside its room (issue 56)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from forkless.controller.codec import JsonCodec
from forkless.controller.config import Config
from forkless.controller.ioside import feed_plan, feed_source, feed_sources
from forkless.io_loop.connectors.websocket.client import WebSocketSource
from forkless.io_loop.connectors.websocket.connector import WebSocketConnector
from forkless.io_loop.connectors.websocket.demo_source import DemoSource
from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import Events
from forkless.io_loop.feeds import FeedSet
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.kinds import connector_for
from forkless.io_loop.thread import IOThread
from tests.harness import UNIT_S

pytestmark = pytest.mark.timeout(60 * UNIT_S)


class Greeter:
    """A user's source that subclasses nothing: one event, then it has no more."""

    name = "mine"

    async def run(self, ctx: Any) -> None:
        await ctx.emit_event({"hello": id(self)})


def test_the_io_thread_runs_the_very_sources_it_is_handed() -> None:
    settings = dataclasses.replace(Config().io_settings(), feed_specs=(FeedSpec("mine", ""),), uses_demo_feed=False)
    source = Greeter()
    io = IOThread(settings, JsonCodec(4), IOStats(), sources=[source])
    side = io.start()
    try:
        item = side.inbound.get(timeout=30 * UNIT_S)
        assert isinstance(item, Events) and item.items == [{"hello": id(source)}]
    finally:
        io.abort()
        assert io.join(30 * UNIT_S)


def test_the_io_thread_refuses_sources_that_are_not_one_per_feed() -> None:
    settings = Config().io_settings()
    with pytest.raises(ValueError, match="IOThread needs one source per feed: 1 feeds, 0 sources"):
        IOThread(settings, JsonCodec(4), IOStats(), sources=[])


def test_the_configuration_builds_each_feed_s_source_with_its_hooks() -> None:
    async def hook(feed: str, connection: Any) -> list[str]:
        return []

    demo = feed_sources(Config().io_settings(), on_connect=hook)
    assert [type(source) for source in demo] == [DemoSource]
    two = Config(feeds='[{"name": "a", "url": "ws://127.0.0.1:1/a"}, {"name": "b", "url": "ws://127.0.0.1:1/b"}]')
    sources = feed_sources(two.io_settings(), on_connect=hook)
    assert [(type(s), s.name, s.on_connect) for s in sources] == [(WebSocketSource, "a", hook),
                                                                   (WebSocketSource, "b", hook)]
    mine = Greeter()
    assert feed_sources(dataclasses.replace(two.io_settings(), feed_specs=(FeedSpec("mine", ""),)),
                        sources={"mine": mine}) == [mine]


def test_a_websocket_feed_and_the_demo_feed_are_decided_by_their_connector_as_a_jetstream_feed_is() -> None:
    """Issue 56: the WebSocket feed is a connector the same way. ``connector_for`` chooses every configured feed's
    connector (a WebSocket feed's, the demo feed's), the plan holds it, and ``feed_source`` makes the source by
    asking it, with the settings groups and the hooks."""
    async def hook(feed: str, connection: Any) -> list[str]:
        return []

    plan = feed_plan(Config(feeds='[{"name": "a", "url": "ws://127.0.0.1:1/a"}, {"name": "b", "url": "ws://h:1/b"}]'))
    assert [(type(c), c.feed.name) for c in plan.connectors] == [(WebSocketConnector, "a"), (WebSocketConnector, "b")]
    connector = plan.connector("a")
    # no position to keep, no partitions, frames may be sent to it
    assert (connector.positions, connector.partitioned, connector.refuses_sends(), plan.sendable("b")) == (
        None, False, "", 1)
    settings = dataclasses.replace(Config().io_settings(), feed_specs=plan.specs, uses_demo_feed=False)
    made = feed_source(plan.specs[0], settings, sources={}, on_connect=hook, before_connect=None, connector=connector)
    assert (type(made), made.name, made.url, made.on_connect) == (WebSocketSource, "a", "ws://127.0.0.1:1/a", hook)
    demo = Config().io_settings()
    (spec,) = demo.feed_specs
    assert type(connector_for(spec)) is WebSocketConnector
    assert type(feed_source(spec, demo, sources={}, on_connect=hook, before_connect=None)) is DemoSource


def test_a_websocket_connector_refuses_what_only_a_jetstream_feed_does_naming_the_feed() -> None:
    connector = connector_for(FeedSpec("a", "ws://127.0.0.1:1/a", kind="websocket"))
    settings = Config().io_settings()
    with pytest.raises(ValueError, match=r"feed 'a' \(ws://127.0.0.1:1/a\) is a WebSocket feed: it owns no partitions"):
        connector.own_partitions(settings.partitioning, timeouts=settings.timeouts, reconnect=settings.reconnect,
                                 tls=settings.tls)
    assert connector.describe(settings.partitioning) == [] and connector.refuses_relay() == ""
    # no url, and the demo feed does not run: nowhere to connect
    nowhere = connector_for(FeedSpec("b", "", kind="websocket"))
    with pytest.raises(ValueError, match="feed 'b' has no url and the demo feed does not run"):
        feed_source(FeedSpec("b", "", kind="websocket"), dataclasses.replace(settings, uses_demo_feed=False),
                    sources={}, on_connect=None, before_connect=None, connector=nowhere)
    with pytest.raises(ValueError, match=r"feed 'c' has no connector: its kind '' is none of 'websocket', 'jetstream'"):
        connector_for(FeedSpec("c", ""))  # a program's own source's spec: handed in made, never a connector's


def test_neither_the_io_thread_nor_the_feed_set_carries_hooks_or_the_fence() -> None:
    for cls in (IOThread, FeedSet):
        carried = {"on_connect", "before_connect", "fence"} & set(inspect.signature(cls).parameters)
        assert not carried, f"{cls.__name__} carries {carried}: hand them to the sources at the composition root"


def test_the_lease_fence_is_a_typed_object_handed_inside_the_connector_s_room_and_nowhere_else() -> None:
    """No parameter, keyword or dictionary key named ``fence`` outside io_loop/connectors/jetstream/ (the leases,
    the connector that owns them, the source and its publisher): the controller and the feed set never carry it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    room = root / "io_loop" / "connectors" / "jetstream"
    carried = []
    for path in [*(root / "controller").rglob("*.py"), *(root / "io_loop").rglob("*.py")]:
        if room in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.arg):
                names = [node.arg]
            elif isinstance(node, ast.keyword):
                names = [node.arg or ""]
            elif isinstance(node, ast.Dict):
                names = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if "fence" in names:
                carried.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not carried, f"the fence is carried outside the connector's room: {carried}"


def test_the_demo_feed_s_tally_is_its_source_s_summary_line_read_straight_from_the_source() -> None:
    settings = Config().io_settings()
    sources = feed_sources(settings)
    io = IOThread(settings, JsonCodec(4), IOStats(), sources=sources)
    assert io.summaries() == [sources[0].summary()] == [
        "demo feed: 0 sent, 0 answered, 0 errors; injected anomalies 0: detected 0 (recall n/a), "
        "false flags 0 (precision n/a)"]


class Tallier(Greeter):
    """A user's source that keeps a summary line (the ``summary`` capability)."""

    name = "tally"

    def summary(self) -> str:
        return "tally: 3 greetings"


def test_every_source_s_summary_line_is_the_io_thread_s_in_the_sources_order_and_none_without() -> None:
    specs = (FeedSpec("tally", ""), FeedSpec("mine", ""), FeedSpec("again", ""))
    settings = dataclasses.replace(Config().io_settings(), feed_specs=specs, uses_demo_feed=False)
    again = Tallier()
    again.name = "again"
    io = IOThread(settings, JsonCodec(4), IOStats(), sources=[Tallier(), Greeter(), again])
    assert io.summaries() == ["tally: 3 greetings", "tally: 3 greetings"]


def test_only_the_composition_roots_take_the_whole_io_settings_every_component_its_groups():
    """Each IO component is handed the settings groups it reads (io_loop/settings.py: timeouts, reconnect, TLS,
    credentials, limits, the demo feed's, partitioning); only the composition roots import ``IOSettings``: in
    io_loop the feed set (feeds.py) and the IO thread; controller/ioside.py's ``feed_sources`` builds the sources."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    takers = set()
    for path in (root / "io_loop").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and any(alias.name == "IOSettings" for alias in node.names):
                takers.add(path.relative_to(root).as_posix())
    assert takers == {"io_loop/feeds.py", "io_loop/thread.py"}
