"""A source's optional capabilities (io_loop/capabilities.py): methods as small protocols checked with
``isinstance``, values as typed attributes with their defaults read through ``declarations``; the same for a
source that subclasses ``SourceCapabilities`` and one that subclasses nothing (duck typing); no module reads
one by its name as a string, and a misspelt one in a user's source is warned of, never silently a default."""

from __future__ import annotations

import ast
import dataclasses
import typing
import warnings
from pathlib import Path
from typing import Any

import pytest

from forkless.controller.config import Config
from forkless.controller.ioside import feed_plan, feed_source
from forkless.io_loop.capabilities import (
    CAPABILITIES,
    METHODS,
    VALUES,
    CapabilityWarning,
    Declarations,
    SourceCapabilities,
    SupportsAwaiting,
    SupportsBeforeStop,
    SupportsProbe,
    SupportsSummary,
    declarations,
    lookalikes,
)
from forkless.io_loop.connectors.websocket.client import WebSocketSource
from forkless.io_loop.connectors.websocket.demo_source import DemoSource
from forkless.io_loop.counters import SourceStats

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = Declarations(replies="all", required=True, starts_connected=True, replayable=False, overflow=None,
                        buffer=None, send_max_age_s=None, sends_while_disconnected="hold", figures=None)


class Bare:
    """A user's source that subclasses nothing: a name and run."""

    name = "bare"

    async def run(self, ctx: Any) -> None:
        return None


class Declared(SourceCapabilities):
    name = "declared"

    async def run(self, ctx: Any) -> None:
        return None


class Capable(Bare):
    """A user's source that subclasses nothing and declares every method."""

    name = "capable"

    async def before_stop(self, ctx: Any) -> None:
        return None

    def awaiting(self) -> int:
        return 0

    def summary(self) -> str:
        return "fine"

    async def probe(self, codec: Any, say: Any, *, dedupe_window_s: float = 0.0) -> None:
        return None


def test_the_capabilities_are_the_five_methods_and_the_nine_values():
    assert set(METHODS) == {"before_stop", "awaiting", "send_answered", "summary", "probe"}
    assert VALUES == ("replies", "required", "starts_connected", "replayable", "overflow", "buffer", "send_max_age_s",
                      "sends_while_disconnected", "figures")
    assert CAPABILITIES == (*VALUES, *METHODS)
    for method, protocol in METHODS.items():  # each protocol is its one method
        assert [name for name in vars(protocol) if not name.startswith("_")] == [method], protocol


def test_the_values_are_typed_once_on_the_base_and_read_as_the_same_types():
    assert typing.get_type_hints(Declarations) == typing.get_type_hints(SourceCapabilities)
    assert tuple(typing.get_type_hints(SourceCapabilities)) == VALUES
    assert DEFAULTS == Declarations(**{value: vars(SourceCapabilities)[value] for value in VALUES})


def test_a_source_that_declares_nothing_reads_every_default_as_a_subclass_does():
    assert declarations(Bare(), "bare") == declarations(Declared(), "declared") == DEFAULTS
    for protocol in METHODS.values():
        assert not isinstance(Bare(), protocol) and not isinstance(Declared(), protocol), protocol


def test_what_a_source_declares_wins_over_the_default_whether_it_subclasses_or_not():
    stats = SourceStats()
    for source in (Bare(), Declared()):
        source.replies, source.required, source.starts_connected = "none", False, False
        source.overflow, source.buffer, source.figures = "drop_oldest", 7, stats
        assert declarations(source, "s") == dataclasses.replace(
            DEFAULTS, replies="none", required=False, starts_connected=False, overflow="drop_oldest", buffer=7,
            figures=stats)


def test_a_method_is_found_by_isinstance_on_a_source_that_subclasses_nothing_and_none_declares_none():
    capable = Capable()
    assert all(isinstance(capable, protocol) for protocol in
               (SupportsBeforeStop, SupportsAwaiting, SupportsSummary, SupportsProbe))

    class Unsummarised(Capable):
        summary = None  # typing's rule: a method set to None is none

    assert not isinstance(Unsummarised(), SupportsSummary) and isinstance(Unsummarised(), SupportsAwaiting)
    bare = Bare()
    bare.awaiting = lambda: 0  # an instance's own attribute counts as its class's would
    assert isinstance(bare, SupportsAwaiting) and not isinstance(Bare(), SupportsAwaiting)


@pytest.mark.parametrize("declared, error, says", [
    (dict(replies="some"), ValueError, "source 's' has replies='some'; expected one of all, results, none"),
    (dict(required="yes"), TypeError, "source 's' has required='yes'; expected True or False"),
    (dict(overflow="drop"), ValueError, "source 's' has overflow='drop'; expected one of block, drop_oldest"),
    (dict(buffer=-1), ValueError, r"source 's' has buffer=-1; expected an int >= 0"),
    (dict(figures={"fetched": 1}), TypeError, "source 's' has figures=.*; expected a .*SourceStats"),
    (dict(send_max_age_s=0), ValueError, "source 's' has send_max_age_s=0; expected a finite number of seconds > 0"),
    (dict(send_max_age_s="1"), TypeError, "source 's' has send_max_age_s='1'; expected a number of seconds"),
    (dict(sends_while_disconnected="drop"), ValueError, "source 's' has sends_while_disconnected='drop'; expected "
                                                         "'hold'"),
    (dict(replayable=True, overflow="drop_oldest"), ValueError, "source 's' is replayable and has "
                                                                "overflow='drop_oldest'"),
], ids=["replies", "required", "overflow", "buffer", "figures", "max-age-0", "max-age-text", "sends-while-down",
        "replayable-drop-oldest"])
def test_a_value_that_is_not_allowed_is_refused_naming_the_source_and_the_attribute(declared, error, says):
    source = Bare()
    source.__dict__.update(declared)
    with pytest.raises(error, match=says):
        declarations(source, "s")
    source.name = "s"
    with pytest.raises(error, match=says):  # and so when the controller is handed the source
        feed_plan(Config(), [source])


def test_a_method_capability_declared_as_no_method_is_refused_when_the_controller_is_handed_it():
    source = Bare()
    source.name, source.summary = "s", "a fine run"
    with pytest.raises(TypeError, match=r"source 's' declares summary = 'a fine run': a method, summary\(\)"):
        feed_plan(Config(), [source])


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


# ---- a misspelt capability ------------------------------------------------------------------------------------


class Misspelt(Bare):
    """A user's source with a typo in a value and in a method: without the warning each were silently no
    declaration (replies would stay "all", the stop would not wait for its fills)."""

    name = "misspelt"
    replys = "none"

    def awaitng(self) -> int:
        return 3


def test_a_misspelt_capability_is_warned_of_naming_the_source_the_attribute_and_the_capability_it_looks_like():
    with pytest.warns(CapabilityWarning) as warned:
        specs = feed_plan(Config(), [Misspelt()]).specs
    said = sorted(str(w.message) for w in warned)
    assert len(said) == 2
    assert said[0].startswith("source 'misspelt' has 'awaitng', which is no source capability: did you mean "
                              "'awaiting'? As it is, 'awaitng' declares nothing and 'awaiting' keeps its default")
    assert said[1].startswith("source 'misspelt' has 'replys', which is no source capability: did you mean "
                              "'replies'?")
    assert specs[0].replies == "all"  # as it is: the warning says so, the value is not guessed


def test_a_method_is_compared_with_the_methods_and_a_value_with_the_values():
    class Lookalikes(Bare):
        name = "lookalikes"
        Required = False  # case aside, a capability
        buffers = 3
        required_fields = ("x",)  # a name of its own, not close enough

        def replay(self) -> None:  # a method: replayable is a value, so no look-alike
            return None

        def summarize(self) -> str:
            return ""

    assert sorted(lookalikes(Lookalikes())) == [("Required", "required"), ("buffers", "buffer"),
                                                ("summarize", "summary")]


def test_no_built_in_source_looks_like_it_misspells_a_capability():
    from forkless.io_loop.feedspec import FeedSpec  # beside its one use, as the probe tests below do

    settings = Config().io_settings()
    made = [feed_source(spec, settings, sources={}, on_connect=None, before_connect=None)
            for spec in (FeedSpec("f", "ws://127.0.0.1:1/feed", kind="websocket"),
                         FeedSpec("demo", "", kind="websocket"))]
    jetstream = pytest.importorskip("forkless.io_loop.connectors.jetstream.source")
    assert [lookalikes(source) for source in made] == [[], []]
    assert lookalikes(jetstream.JetStreamSource) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", CapabilityWarning)
        feed_plan(Config(), [Bare(), Declared(), Capable()])


def test_the_built_in_sources_declare_their_capabilities_on_the_one_base() -> None:
    assert issubclass(WebSocketSource, SourceCapabilities)
    assert issubclass(DemoSource, SourceCapabilities)
    jetstream = pytest.importorskip("forkless.io_loop.connectors.jetstream.source")
    assert issubclass(jetstream.JetStreamSource, SourceCapabilities)


def _reads_of_a_capability(text: str, where: str) -> list[str]:
    """``getattr(x, "<capability>", …)`` / ``hasattr(x, "<capability>")`` where x is a source, and any call
    of a function named ``capability`` (the string-keyed reader there was), in ``text``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        by_string = (node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                     and isinstance(node.args[1], ast.Constant) and node.args[1].value in CAPABILITIES
                     and "source" in ast.get_source_segment(text, node.args[0]))
        if by_string or node.func.id == "capability":
            found.append(f"{where}:{node.lineno}: {ast.get_source_segment(text, node)}")
    return found


def test_no_module_reads_a_capability_of_a_source_by_its_name_as_a_string() -> None:
    paths = [path for folder in ("io_loop", "controller") for path in sorted((ROOT / folder).rglob("*.py"))]
    assert ROOT / "io_loop/probe.py" in paths  # the walk goes into the rooms
    reads = [read for path in paths for read in _reads_of_a_capability(path.read_text(), str(path.relative_to(ROOT)))]
    assert not reads, ("read these through io_loop/capabilities.py: isinstance with its protocols, or "
                       "declarations(source, name):\n" + "\n".join(reads))


def test_the_scan_finds_a_read_by_string_and_passes_a_typed_one() -> None:
    by_string = ("def f(source):\n"
                 "    return (getattr(source, 'awaiting', None), hasattr(self.source, 'probe'),\n"
                 "            capability(source, 'x'))\n")
    assert [read.split(": ", 1)[1] for read in _reads_of_a_capability(by_string, "sample")] == [
        "getattr(source, 'awaiting', None)", "hasattr(self.source, 'probe')", "capability(source, 'x')"]
    typed = ("def f(source):\n"
             "    return (isinstance(source, SupportsAwaiting), declarations(source, 'x').replies,\n"
             "            getattr(spec, 'buffer'))\n")
    assert _reads_of_a_capability(typed, "sample") == []


def test_every_capability_is_documented_on_its_page() -> None:
    page = (ROOT / "docs/embedding/capabilities.md").read_text()
    missing = [name for name in CAPABILITIES if f"`{name}" not in page]
    missing += [protocol.__name__ for protocol in METHODS.values() if protocol.__name__ not in page]
    assert not missing, f"docs/embedding/capabilities.md does not document {missing}"


def test_each_built_in_source_declares_its_probe() -> None:
    from forkless.io_loop.feedspec import FeedSpec

    settings = Config().io_settings()
    made = {spec.name: feed_source(spec, settings, sources={}, on_connect=None, before_connect=None)
            for spec in (FeedSpec("f", "ws://127.0.0.1:1/feed", kind="websocket"),
                         FeedSpec("demo", "", kind="websocket"))}
    assert (type(made["f"]), type(made["demo"])) == (WebSocketSource, DemoSource)
    assert isinstance(made["f"], SupportsProbe) and isinstance(made["demo"], SupportsProbe)
    assert "probe" in vars(pytest.importorskip("forkless.io_loop.connectors.jetstream.source").JetStreamSource)


def test_the_feed_probe_asks_each_source_handed_to_it_and_passes_one_without_a_probe() -> None:
    # the probe knows no kind of feed: a user's source is probed by its own probe() as the built-in ones are
    from forkless.controller.codec import JsonCodec
    from forkless.io_loop.feedspec import FeedSpec
    from forkless.io_loop.probe import ProbeFailed, probe_feed

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
