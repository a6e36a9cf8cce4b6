"""The feeds' settings (``FeedSettings``) and ``FORKLESS_FEEDS``: its JSON list of feed objects parsed into
``FeedSpec``s, each entry by its connector room's schema, a partitioned feed's partitions resolved (pure but for the
file checks).

Rules:
- The one place an entry's room is chosen: an entry with ``"nats"`` is a JetStream feed's
  (io_loop/connectors/jetstream/entry.py), any other a WebSocket feed's (io_loop/connectors/websocket/entry.py);
  each room's schema decodes and checks its entries. Here, the list: JSON, a non-empty list of objects, names that
  differ, a partitioned feed alone. The rooms' schemas need msgspec, imported only when ``FORKLESS_FEEDS`` is set.
- A refusal is a ``ValueProblem`` naming the feed (by name, else index) and the field, never a secret value (the
  URL's credentials, ``subscribe``, ``headers``, ``token``).
- A partitioned feed (``"partition_count"``) must be the process's only feed; its partitions are its entry's
  ``"partitions"`` or this instance's share (``FORKLESS_INSTANCE``/``FORKLESS_INSTANCES``), exactly one of the two
  (``assign_partitions``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from forkless.io_loop.connectors.jetstream.settings import PartitionSettings
from forkless.io_loop.connectors.websocket import settings as websocket
from forkless.io_loop.errors import ConfigError, ValueProblem
from forkless.io_loop.feedspec import FEED_NAME, FeedSpec
from forkless.io_loop.settings import (
    PREFIX,
    REPLY_POLICIES,
    ReplyPolicy,
    boolean,
    choice,
    json_value,
    setting,
    settings_group,
    text,
)

__all__ = ["FeedSettings", "assign_partitions", "check_feed_credentials", "feed_list", "feeds_text"]


def feed_list(text: str, replies: ReplyPolicy = "all") -> tuple[FeedSpec, ...]:
    """``FORKLESS_FEEDS``: a JSON list of feed objects; raises ``ValueProblem`` naming the feed (by name, else
    index) and the field, never a secret value. ``replies`` is the policy of a feed that names none
    (``FORKLESS_REPLIES``)."""
    if text.strip() == "":
        return ()
    try:
        items = json_value(text)
    except ValueProblem:
        raise
    except ValueError:
        raise ValueProblem("not valid JSON") from None
    if not isinstance(items, list) or not items:
        raise ValueProblem("a non-empty JSON list")
    feeds = []
    for index, item in enumerate(items):
        where = f"feed {index}"
        if not isinstance(item, dict):
            raise ValueProblem(f"{where}: a JSON object")
        name = item.get("name", str(index))
        if isinstance(name, str) and FEED_NAME.fullmatch(name):
            where = f"feed {index} ({name!r})"
        feeds.append(_entry_reader(item)(item, str(index), where, replies))
    names = [feed.name for feed in feeds]
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise ValueProblem(f"feed names must differ: {', '.join(map(repr, doubled))} appear(s) twice")
    partitioned = [i for i, feed in enumerate(feeds) if feed.partitioned]
    if partitioned and len(feeds) > 1:
        i = partitioned[0]
        raise ValueProblem(f"feed {i} ({feeds[i].name!r}) is partitioned (\"partition_count\"), so it must be the "
                           f"only feed of the process ({len(feeds)} are given): its streams are named by the payload's "
                           '"stream" alone, and its checkpoints hold only its partitions\' streams')
    return tuple(feeds)


def _entry_reader(item: dict[str, Any]) -> Callable[[dict[str, Any], str, str, ReplyPolicy], FeedSpec]:
    """The room whose schema reads ``item``: a JetStream entry has ``"nats"``, any other is a WebSocket one;
    ``ValueProblem`` where msgspec, which the schemas are written in, is not installed."""
    try:
        if "nats" in item:
            # the schemas (msgspec Structs), imported only here: a run without FORKLESS_FEEDS never builds them
            from forkless.io_loop.connectors.jetstream.entry import jetstream_feed

            return jetstream_feed
        from forkless.io_loop.connectors.websocket.entry import websocket_feed  # the same reason: msgspec

        return websocket_feed
    except ImportError:  # msgspec does not build for free-threaded CPython 3.13 (docs/performance.md)
        raise ValueProblem("FORKLESS_FEEDS needs msgspec, which is not installed for this interpreter "
                           "(it has no build for free-threaded CPython 3.13; 3.14t and every GIL build have one); "
                           "set FORKLESS_WS_URL for one WebSocket feed instead") from None


def feeds_text(text: str) -> str:
    """``FORKLESS_FEEDS`` as given, or the text of the ``@path`` file it names; checked by ``feed_list``.
    A file that is empty (or blank) is refused, not taken as no feeds: the demo feed would run in the
    configured feeds' place."""
    text = text.strip()
    if text.startswith("@"):
        path = text[1:]
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as exc:
            raise ValueProblem(f"cannot read {path}: {exc.strerror}") from None
        if text == "":
            raise ValueProblem(f"{path} is empty: write the JSON list of feeds in it, or leave FORKLESS_FEEDS unset")
    feed_list(text)
    return text


def assign_partitions(feeds: tuple[FeedSpec, ...], partitioning: PartitionSettings) -> tuple[FeedSpec, ...]:
    """The feeds with a partitioned feed's partitions resolved: its own ``"partitions"``, or this instance's share
    of its partition_count (``PartitionSettings.share``); ``ConfigError`` when both are given or neither."""
    out = []
    for index, feed in enumerate(feeds):
        if not feed.partitioned:
            out.append(feed)
            continue
        label = f"feed {index} ({feed.name!r})"
        if partitioning.instance is not None:
            if feed.partitions:
                raise ConfigError(PREFIX + "INSTANCE", str(partitioning.instance), f"no FORKLESS_INSTANCE/"
                                  f"FORKLESS_INSTANCES when {label} of FORKLESS_FEEDS names its \"partitions\": either "
                                  "the entry's partitions or this instance's share of its partition_count, not both")
            feed = feed.with_partitions(partitioning.share(feed.partition_count, f"{label} of FORKLESS_FEEDS"))
        elif not feed.partitions:
            raise ConfigError(PREFIX + "FEEDS", "<hidden>", f'{label}: a partitioned feed ("partition_count") needs '
                              'the partitions this instance owns: "partitions" in the entry (such as "0-5"), or '
                              "FORKLESS_INSTANCE and FORKLESS_INSTANCES (instance i of N owns its contiguous share of "
                              "the partition_count)")
        out.append(feed)
    return tuple(out)


def check_feed_credentials(feeds: tuple[FeedSpec, ...], credentials: websocket.Credentials, variable: str) -> None:
    """One source of handshake credentials for each WebSocket feed among ``feeds`` (the WebSocket room's
    ``check_credentials``: a JetStream feed's are its entry's, checked with it); ``variable`` names the feeds."""
    for feed in feeds:
        if feed.kind == websocket.WEBSOCKET:
            websocket.check_credentials(feed, credentials, variable)


@settings_group
class FeedSettings:
    """Which feeds run beside the one-feed shorthand (``FORKLESS_FEEDS``), and how several behave together."""

    feeds: str = setting(
        "FEEDS", text(feeds_text, 'a JSON list of {"url", "unix_socket", "subscribe", "headers", "name", "required", '
                      '"replies", "overflow", "buffer"} objects (WebSocket feeds) and {"nats", "stream", "subject", '
                      '"results", "start", …} objects (JetStream feeds), or @path to a file holding one; not '
                      "together with WS_URL or SUBSCRIBE"),
        "several feeds in one process, each its own connection (docs/feeds.md, docs/jetstream.md); never logged",
        default="", secret=True)
    shared_streams: bool = setting("SHARED_STREAMS", boolean, "with several feeds: 1 makes a stream name the same "
                                   "stream on every feed (one state); 0 keeps feed:stream apart", default=False)
    feed_fatal: str = setting("FEED_FATAL", choice("all", "any"), "with several feeds: exit 3 when every feed has "
                              "given up (all) or when one has (any)", default="all")
    replies: ReplyPolicy = setting("REPLIES", choice(*REPLY_POLICIES), "what the feed is sent back: all (results and "
                                   "error replies), results (no error frames), none (nothing but SUBSCRIBE; results "
                                   "still reach the sinks, the counters and the latency); a FORKLESS_FEEDS entry's "
                                   "\"replies\" overrides it for that feed", default="all")

    def specs(self, partitioning: PartitionSettings) -> tuple[FeedSpec, ...]:
        """The feeds of ``FORKLESS_FEEDS``, each with its reply policy and its partitions resolved."""
        return assign_partitions(feed_list(self.feeds, self.replies), partitioning)
