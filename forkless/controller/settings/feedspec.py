"""``FORKLESS_FEEDS``: its JSON list of feed objects parsed into ``FeedSpec``s, WebSocket and
JetStream entries alike, a partitioned JetStream entry's ``"partition_count"`` and
``"partitions"`` included (pure but for the file checks).

Rules:
- Each entry is decoded by its kind's schema and checked where a schema cannot say (``feedschema``);
  here, the list: JSON, a non-empty list of objects, names that differ, a partitioned feed alone.
- A refusal is a ``ValueProblem`` naming the feed (by name, else index) and the field, never a
  secret value (the URL's credentials, ``subscribe``, ``headers``, ``token``).
- A partitioned feed (``"partition_count"``) must be the process's only feed. Its partitions
  leave here as its entry gives them, ``()`` when it names none; ``Config.feed_specs`` resolves
  them from ``FORKLESS_INSTANCE``/``FORKLESS_INSTANCES``.
"""

from __future__ import annotations

from forkless.controller.settings.values import FEED_NAME, ValueProblem, json_value
from forkless.io_loop.settings import FeedSpec, ReplyPolicy

__all__ = ["feed_list", "feeds_text"]


def feed_list(text: str, replies: ReplyPolicy = "all") -> tuple[FeedSpec, ...]:
    """``FORKLESS_FEEDS``: a JSON list of feed objects (see ``FeedSpec``); raises ``ValueProblem``
    naming the feed (by name, else index) and the field, never a secret value. ``replies`` is
    the policy of a feed that names none (``FORKLESS_REPLIES``)."""
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
    # the entries' schema (msgspec Structs), imported only here: a run without FORKLESS_FEEDS never builds it
    try:
        from forkless.controller.settings.feedschema import feed_spec
    except ImportError:  # msgspec does not build for free-threaded CPython 3.13 (docs/performance.md)
        raise ValueProblem("FORKLESS_FEEDS needs msgspec, which is not installed for this interpreter "
                           "(it has no build for free-threaded CPython 3.13; 3.14t and every GIL build have one); "
                           "set FORKLESS_WS_URL for one WebSocket feed instead") from None

    feeds = []
    for index, item in enumerate(items):
        where = f"feed {index}"
        if not isinstance(item, dict):
            raise ValueProblem(f"{where}: a JSON object")
        name = item.get("name", str(index))
        if isinstance(name, str) and FEED_NAME.fullmatch(name):
            where = f"feed {index} ({name!r})"
        feeds.append(feed_spec(item, str(index), where, replies))
    names = [feed.name for feed in feeds]
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise ValueProblem(f"feed names must differ: {', '.join(map(repr, doubled))} appear(s) twice")
    partitioned = [i for i, feed in enumerate(feeds) if feed.jetstream is not None and feed.jetstream.partitioned]
    if partitioned and len(feeds) > 1:
        i = partitioned[0]
        raise ValueProblem(f"feed {i} ({feeds[i].name!r}) is partitioned (\"partition_count\"), so it must be the "
                           f"only feed of the process ({len(feeds)} are given): its streams are named by the payload's "
                           '"stream" alone, and its checkpoints hold only its partitions\' streams')
    return tuple(feeds)


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
