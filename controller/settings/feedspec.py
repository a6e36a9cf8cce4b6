"""``FORKLESS_FEEDS``: its JSON list of feed objects parsed into ``FeedSpec``s, WebSocket and
JetStream entries alike, a partitioned JetStream entry's ``"partition_count"`` and
``"partitions"`` included (pure but for the file checks).

Rules:
- A refusal is a ``ValueProblem`` naming the feed (by name, else index) and the field, never a
  secret value (the URL's credentials, ``subscribe``, ``headers``, ``token``).
- A partitioned feed (``"partition_count"``) must be the process's only feed. Its partitions
  leave here as its entry gives them, ``()`` when it names none; ``Config.feed_specs`` resolves
  them from ``FORKLESS_INSTANCE``/``FORKLESS_INSTANCES``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any
from urllib.parse import urlsplit

from forkless.controller.settings.values import ValueProblem, is_subject, nats_urls, unix_socket, ws_url
from forkless.io_loop.settings import REPLY_POLICIES, FeedSpec, JetStreamSpec
from forkless.io_loop.sources.partitions import PARTITION_FIELD, parse_partitions

__all__ = ["FEED_KEYS", "FEED_NAME", "JETSTREAM_KEYS", "MAX_PARTITIONS", "STREAM_NAME", "feed_list", "feeds_text"]

FEED_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
FEED_KEYS = ("url", "unix_socket", "subscribe", "headers", "name", "required", "replies", "overflow", "buffer")
# a JetStream feed: an entry with "nats" (docs/jetstream.md)
JETSTREAM_KEYS = ("name", "nats", "stream", "subject", "results", "start", "required", "replies", "token", "creds",
                  "partition_count", "partitions")
MAX_PARTITIONS = 65536
STREAM_NAME = re.compile(r"[^\s.*>/\\]{1,255}")  # what nats-server accepts as a stream name


def feed_list(text: str, replies: str = "all") -> tuple[FeedSpec, ...]:
    """``FORKLESS_FEEDS``: a JSON list of feed objects (see ``FeedSpec``); raises ``ValueProblem``
    naming the feed (by name, else index) and the field, never a secret value. ``replies`` is
    the policy of a feed that names none (``FORKLESS_REPLIES``)."""
    if text.strip() == "":
        return ()
    try:
        items = json.loads(text)
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
        if "nats" in item:  # a JetStream feed: its own fields
            feeds.append(_jetstream_feed(item, name, where, replies))
        else:
            feeds.append(_websocket_feed(item, name, where, replies))
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


def _check_fields_and_name(item: dict[str, Any], name: Any, where: str, keys: tuple[str, ...] | list[str],
                           fields_are: str) -> None:
    """An entry's fields are all known (``keys``) and its ``name`` is well formed; ``ValueProblem`` if not."""
    unknown = sorted(set(item) - set(keys))
    if unknown:
        raise ValueProblem(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}{fields_are} {', '.join(keys)}")
    if not isinstance(name, str) or not FEED_NAME.fullmatch(name):
        raise ValueProblem(f'{where}: "name" must be 1-64 letters, digits, "_", "." or "-"')


def _websocket_feed(item: dict[str, Any], name: Any, where: str, replies: str) -> FeedSpec:
    """One WebSocket entry of ``FORKLESS_FEEDS`` (see ``FEED_KEYS``); ``ValueProblem`` names the
    feed and the field, never a secret (the URL's credentials, ``subscribe``, ``headers``)."""
    _check_fields_and_name(item, name, where, FEED_KEYS, "; the fields are")
    url = item.get("url")
    try:
        if not isinstance(url, str) or not ws_url(url):
            raise ValueError
    except ValueError:
        raise ValueProblem(f'{where}: "url" must be a ws:// or wss:// URL (port 1-65535)') from None
    path = item.get("unix_socket", "")
    try:
        if not isinstance(path, str) or (path.strip() == "" and "unix_socket" in item):
            raise ValueProblem("expected the path of a unix-domain socket (leave the field out for TCP)")
        path = unix_socket(path)
    except ValueProblem as exc:
        raise ValueProblem(f'{where}: "unix_socket" must be the absolute path of a unix-domain socket, the handshake '
                           f'still sending "url"\'s path and host: {exc}') from None
    subscribe = item.get("subscribe", "")
    if subscribe is None:
        subscribe = ""
    elif not isinstance(subscribe, str):
        subscribe = json.dumps(subscribe, separators=(",", ":"))
    headers = item.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise ValueProblem(f'{where}: "headers" must be a JSON object of string values')
    required = item.get("required", True)
    if not isinstance(required, bool):
        raise ValueProblem(f'{where}: "required" must be true or false')
    policy = item.get("replies", replies)
    if policy not in REPLY_POLICIES:
        raise ValueProblem(f'{where}: "replies" must be one of {", ".join(map(repr, REPLY_POLICIES))}')
    overflow = item.get("overflow", "")
    if overflow not in ("", "block", "drop_oldest"):
        raise ValueProblem(f'{where}: "overflow" must be "block" or "drop_oldest"')
    buffer = item.get("buffer")
    if buffer is not None and (type(buffer) is not int or not 0 <= buffer <= 10_000_000):
        raise ValueProblem(f'{where}: "buffer" must be an integer from 0 to 10000000 (messages it may hold while '
                           f'the inbound queue is full)')
    return FeedSpec(name, url.strip(), subscribe, tuple((str(k), v) for k, v in headers.items()), required,
                    policy, overflow=overflow, buffer=buffer, unix_socket=path)


def _jetstream_feed(item: dict[str, Any], name: Any, where: str, default_replies: str = "all") -> FeedSpec:
    """One JetStream entry of ``FORKLESS_FEEDS`` (see ``JETSTREAM_KEYS``); ``ValueProblem`` names the
    feed and the field, never a secret (the URL's credentials, ``token``)."""
    _check_fields_and_name(item, name, where, JETSTREAM_KEYS, " for a JetStream feed; its fields are")
    servers = item["nats"]
    try:
        if not isinstance(servers, str) or not nats_urls(servers):
            raise ValueError
    except ValueError:
        raise ValueProblem(f'{where}: "nats" must be one nats:// or tls:// URL, or several comma-separated '
                           "(host, port 1-65535)") from None
    stream = item.get("stream")
    if not isinstance(stream, str) or not STREAM_NAME.fullmatch(stream):
        raise ValueProblem(f'{where}: "stream" must name a JetStream stream (1-255 characters, no spaces, '
                           '".", "*", ">", "/" or "\\")')
    subject = item.get("subject", "")
    templated = isinstance(subject, str) and PARTITION_FIELD in subject
    if subject != "" and not is_subject(subject.replace(PARTITION_FIELD, "0") if templated else subject,
                                      wildcards=True):
        raise ValueProblem(f'{where}: "subject" must be a NATS subject filter such as "ticks.>" (dot-separated '
                           'tokens, "*" for one token, ">" last), or left out for the whole stream')
    partition_count, partitions = _partitions(item, subject, where)
    replies = item.get("replies", default_replies)
    if replies not in REPLY_POLICIES:
        raise ValueProblem(f'{where}: "replies" must be one of {", ".join(map(repr, REPLY_POLICIES))}')
    results = item.get("results", "")
    if results == "" and replies != "none":
        raise ValueProblem(f'{where}: "results" is required: the subject its replies are published to '
                           '(unless "replies" is "none")')
    if results != "" and not is_subject(results, wildcards=False):
        raise ValueProblem(f'{where}: "results" must be a NATS subject without wildcards, such as "scores"')
    start = item.get("start", "first")
    if start not in ("first", "new"):
        raise ValueProblem(f'{where}: "start" must be "first" or "new"')
    required = item.get("required", True)
    if not isinstance(required, bool):
        raise ValueProblem(f'{where}: "required" must be true or false')
    token = item.get("token", "")
    if not isinstance(token, str):
        raise ValueProblem(f'{where}: "token" must be a string')
    creds = item.get("creds", "")
    if not isinstance(creds, str) or (creds and not os.path.isfile(creds)):
        raise ValueProblem(f'{where}: "creds" must be the path of an existing NATS .creds file')
    sources = [what for what, present in (
        ("a user:password in \"nats\"", any(urlsplit(u.strip()).username for u in servers.split(","))),
        ('"token"', bool(token)), ('"creds"', bool(creds))) if present]
    if len(sources) > 1:
        raise ValueProblem(f"{where}: one source of credentials, not {' and '.join(sources)}")
    return FeedSpec(name, servers.strip(), required=required, replies=replies,
                    jetstream=JetStreamSpec(stream, subject, results, start, token=token, creds=creds,
                                            partition_count=partition_count, partitions=partitions))


def _partitions(item: dict[str, Any], subject: str, where: str) -> tuple[int, tuple[int, ...]]:
    """A JetStream entry's ``"partition_count"`` (0: not partitioned) and ``"partitions"`` (``()``:
    not given, so ``FORKLESS_INSTANCE``/``FORKLESS_INSTANCES`` must give them: ``Config.feed_specs``),
    and the rule that ``"subject"`` holds ``{partition}`` as one whole token exactly when partitioned."""
    count = item.get("partition_count", 0)
    if "partition_count" not in item:
        if "partitions" in item:
            raise ValueProblem(f'{where}: "partitions" needs "partition_count" (P, the stream\'s number of '
                               "partitions, as in its subject transform's {{partition(P,1)}})")
        if PARTITION_FIELD in subject:
            raise ValueProblem(f'{where}: "subject" holds {PARTITION_FIELD} but the feed has no "partition_count": '
                               f'give "partition_count" (P) to consume by partition, or a subject without '
                               f"{PARTITION_FIELD}")
        return 0, ()
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_PARTITIONS:
        raise ValueProblem(f'{where}: "partition_count" must be an integer from 1 to {MAX_PARTITIONS} (P, as in the '
                           "stream's subject transform {{partition(P,1)}})")
    if subject.split(".").count(PARTITION_FIELD) != 1 or subject.count(PARTITION_FIELD) != 1:
        raise ValueProblem(f'{where}: "subject" of a partitioned feed must hold {PARTITION_FIELD} once, as one whole '
                           f'token, where the stream\'s subject transform puts the partition, such as '
                           f'"ticks.{PARTITION_FIELD}.>"')
    if "partitions" not in item:
        return count, ()
    text = item["partitions"]
    if not isinstance(text, str):
        raise ValueProblem(f'{where}: "partitions" must be a string of partitions and ranges, such as "0-5" or '
                           '"0,2,7-9"')
    try:
        return count, parse_partitions(text, count)
    except ValueError as exc:
        raise ValueProblem(f'{where}: "partitions" must be partitions and ranges of 0-{count - 1}, such as "0-5" '
                           f'or "0,2,7-9": {exc}') from None


def feeds_text(text: str) -> str:
    """``FORKLESS_FEEDS`` as given, or the text of the ``@path`` file it names; checked by ``feed_list``."""
    text = text.strip()
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as exc:
            raise ValueProblem(f"cannot read {text[1:]}: {exc.strerror}") from None
    feed_list(text)
    return text
