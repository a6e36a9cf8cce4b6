"""A source's optional capabilities (io_loop/capabilities.py): declared once, with their defaults,
read in one place, the same for a source that subclasses ``SourceCapabilities`` and one that
subclasses nothing (duck typing)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from forkless.controller.config import Config
from forkless.controller.ioside import feed_plan, feed_source
from forkless.io_loop.capabilities import CAPABILITIES, DEFAULTS, SourceCapabilities, capability
from forkless.io_loop.connectors.websocket.client import WebSocketSource
from forkless.io_loop.connectors.websocket.demo_source import DemoSource

ROOT = Path(__file__).resolve().parents[1]


class Bare:
    """A user's source that subclasses nothing: a name and run."""

    name = "bare"

    async def run(self, ctx: Any) -> None:
        return None


class Declared(SourceCapabilities):
    name = "declared"

    async def run(self, ctx: Any) -> None:
        return None


def test_a_source_that_declares_nothing_reads_every_default_as_a_subclass_does() -> None:
    assert set(CAPABILITIES) == {"replies", "required", "starts_connected", "replayable", "overflow", "buffer",
                                 "figures", "before_stop", "awaiting", "summary", "probe", "send_max_age_s",
                                 "sends_while_disconnected"}
    for name in CAPABILITIES:
        assert capability(Bare(), name) == capability(Declared(), name) == DEFAULTS[name], name


def test_what_a_source_declares_wins_over_the_default_whether_it_subclasses_or_not() -> None:
    bare, sub = Bare(), Declared()
    for source in (bare, sub):
        source.replies, source.required, source.starts_connected = "none", False, False
        assert (capability(source, "replies"), capability(source, "required"),
                capability(source, "starts_connected")) == ("none", False, False)


def test_a_name_that_is_no_capability_is_a_key_error_naming_the_declared_ones() -> None:
    with pytest.raises(KeyError, match="'replys' is no source capability; the declared ones are replies, required"):
        capability(Bare(), "replys")


def test_the_plan_reads_a_duck_typed_source_and_a_subclass_alike() -> None:
    class Quiet(SourceCapabilities):
        name = "quiet"
        replies = "none"
        required = False

        async def run(self, ctx: Any) -> None:
            return None

    specs = feed_plan(Config(), [Bare(), Declared(), Quiet()]).specs
    assert [(s.name, s.replies, s.required) for s in specs] == [
        ("bare", "all", True), ("declared", "all", True), ("quiet", "none", False)]


def test_the_built_in_sources_declare_their_capabilities_on_the_one_base() -> None:
    assert issubclass(WebSocketSource, SourceCapabilities)
    assert issubclass(DemoSource, SourceCapabilities)
    jetstream = pytest.importorskip("forkless.io_loop.connectors.jetstream.source")
    assert issubclass(jetstream.JetStreamSource, SourceCapabilities)


def _reads_of_a_capability(path: Path) -> list[str]:
    """``getattr(x, "<capability>", …)`` / ``hasattr(x, "<capability>")`` where x is a source."""
    text = path.read_text()
    found = []
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in CAPABILITIES and "source" in ast.get_source_segment(text, node.args[0])):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.get_source_segment(text, node)}")
    return found


def test_every_optional_attribute_of_a_source_is_read_through_capability() -> None:
    paths = [path for folder in ("io_loop", "controller") for path in sorted((ROOT / folder).rglob("*.py"))]
    assert ROOT / "io_loop/probe.py" in paths  # the walk goes into the rooms
    reads = [read for path in paths if path.name != "capabilities.py" for read in _reads_of_a_capability(path)]
    assert not reads, "read these through io_loop/capabilities.py's capability(source, name):\n" + "\n".join(reads)


def test_every_capability_is_documented_on_its_page() -> None:
    page = (ROOT / "docs/embedding/capabilities.md").read_text()
    missing = [name for name in CAPABILITIES if f"`{name}" not in page]
    assert not missing, f"docs/embedding/capabilities.md does not document {missing}"


def test_each_built_in_source_declares_its_probe() -> None:
    from forkless.io_loop.settings import FeedSpec

    settings = Config().io_settings()
    made = {spec.name: feed_source(spec, settings, sources={}, on_connect=None, before_connect=None)
            for spec in (FeedSpec("f", "ws://127.0.0.1:1/feed"), FeedSpec("demo", ""))}
    assert (type(made["f"]), type(made["demo"])) == (WebSocketSource, DemoSource)
    assert callable(capability(made["f"], "probe")) and callable(capability(made["demo"], "probe"))
    assert "probe" in vars(pytest.importorskip("forkless.io_loop.connectors.jetstream.source").JetStreamSource)


def test_the_feed_probe_asks_each_source_handed_to_it_and_passes_one_without_a_probe() -> None:
    # the probe knows no kind of feed: a user's source is probed by its own probe() as the built-in ones are
    from forkless.controller.codec import JsonCodec
    from forkless.io_loop.probe import ProbeFailed, probe_feed
    from forkless.io_loop.settings import FeedSpec

    class Probed(Bare):
        name = "probed"

        async def probe(self, codec: Any, say: Any, *, dedupe_window_s: float = 0.0) -> None:
            say(f"  probed with a window of {dedupe_window_s:g} s")
            raise ProbeFailed("it is down")

    specs = (FeedSpec("probed", ""), FeedSpec("bare", ""))
    lines: list[str] = []
    with pytest.raises(ProbeFailed, match=r"1 of 2 feeds failed: feed 'probed' \(see above\)"):
        probe_feed(specs, [Probed(), Bare()], JsonCodec(4), lines.append, dedupe_window_s=7)
    assert lines == ["  feed 'probed':", "    probed with a window of 7 s", "    FAILED: it is down",
                     "  feed 'bare':", "    source 'bare' declares no probe(): not tried"]
    with pytest.raises(ValueError, match="probe_feed needs one source per feed: 2 feeds, 1 sources"):
        probe_feed(specs, [Bare()], JsonCodec(4), lines.append)


def test_check_of_the_demo_feed_says_what_it_did_and_leaves_the_demo_logger_s_level_as_it_was() -> None:
    import logging

    from forkless.controller.codec import JsonCodec
    from forkless.controller.commands.check import probe_feeds

    demo_log = logging.getLogger("forkless.demo_feed")
    before = demo_log.level
    config = Config()
    lines: list[str] = []
    probe_feeds(config.io_settings(), JsonCodec(config.features), lines.append)
    assert lines[0].startswith("  FORKLESS_WS_URL is unset: started the embedded demo feed on ")
    assert lines[-1] == "  closed the connection (code 1000)"
    assert demo_log.level == before
