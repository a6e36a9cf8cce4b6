"""One ``FORKLESS_FEEDS`` entry into a ``FeedSpec``: its kind's schema (a msgspec ``Struct`` for a
WebSocket entry and one for a JetStream entry, the fields' types and bounds declared once), the
refusal each field's fault is reported with, then the checks a schema cannot express
(``feedspec.feed_list`` imports this only when ``FORKLESS_FEEDS`` is set: a run without it never
loads msgspec; pure but for the file check of ``"creds"``).

Rules:
- What a type, a ``Literal`` or a ``Meta`` bound can say is said here, not checked by hand; what
  they cannot (a URL's syntax, a socket path, a NATS subject, partitions, a file, one source of
  credentials, defaults that depend on another field) is checked after the decode, here.
- A fault is reported by its field's text in ``REFUSALS`` (the field, what is allowed), never by
  msgspec's own message, which may quote the value: a secret (``subscribe``, ``headers``,
  ``token``, a URL's credentials) never reaches an error.
- A pattern is anchored with ``^…\\Z``: msgspec searches it, and ``$`` would let a trailing
  newline through.
- An entry with several faults is refused for one: the schema's first (in the entry's order of
  fields), else the first of the checks after it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from forkless.controller.settings.values import (
    FEED_NAME,
    MAX_PARTITIONS,
    STREAM_NAME,
    ValueProblem,
    is_subject,
    nats_urls,
    unix_socket,
    ws_url,
)
from forkless.io_loop.connectors.jetstream.partitions import PARTITION_FIELD, parse_partitions
from forkless.io_loop.settings import REPLY_POLICIES, FeedSpec, JetStreamSpec, ReplyPolicy

__all__ = ["FEED_KEYS", "JETSTREAM_KEYS", "REFUSALS", "JetStreamEntry", "WebSocketEntry", "entry", "feed_spec"]

Name = Annotated[str, Meta(pattern=rf"^{FEED_NAME.pattern}\Z")]
Replies = ReplyPolicy  # each policy, declared once in io_loop/settings.py


class WebSocketEntry(Struct, kw_only=True, forbid_unknown_fields=True):
    """A WebSocket feed: an entry without ``"nats"`` (docs/feeds.md); fields in the documents' order."""

    url: str
    unix_socket: str | UnsetType = UNSET  # present and empty is refused: leave it out for TCP
    subscribe: Any = ""  # a JSON text, or any JSON value sent as its compact text
    headers: dict[str, str] = {}
    name: Name | UnsetType = UNSET  # the entry's index when unset
    required: bool = True
    replies: Replies | UnsetType = UNSET  # FORKLESS_REPLIES when unset
    overflow: Literal["", "block", "drop_oldest"] = ""
    buffer: Annotated[int, Meta(ge=0, le=10_000_000)] | None = None


class JetStreamEntry(Struct, kw_only=True, forbid_unknown_fields=True):
    """A JetStream feed: an entry with ``"nats"`` (docs/jetstream.md); fields in the documents' order."""

    name: Name | UnsetType = UNSET
    nats: str
    stream: Annotated[str, Meta(pattern=rf"^{STREAM_NAME.pattern}\Z")]
    subject: str = ""
    results: str = ""
    start: Literal["first", "new"] = "first"
    required: bool = True
    replies: Replies | UnsetType = UNSET
    token: str = ""
    creds: str = ""
    partition_count: Annotated[int, Meta(ge=1, le=MAX_PARTITIONS)] | UnsetType = UNSET
    partitions: str | UnsetType = UNSET


FEED_KEYS: tuple[str, ...] = WebSocketEntry.__struct_fields__
JETSTREAM_KEYS: tuple[str, ...] = JetStreamEntry.__struct_fields__

UNIX_SOCKET = ('"unix_socket" must be the absolute path of a unix-domain socket, the handshake still sending '
               '"url"\'s path and host')
# what each field allows, as a fault of it is reported (after "feed i ('name'): ")
REFUSALS: dict[str, str] = {
    "url": '"url" must be a ws:// or wss:// URL (port 1-65535)',
    "unix_socket": f"{UNIX_SOCKET}: expected the path of a unix-domain socket (leave the field out for TCP)",
    "headers": '"headers" must be a JSON object of string values',
    "name": '"name" must be 1-64 letters, digits, "_", "." or "-"',
    "required": '"required" must be true or false',
    "replies": f'"replies" must be one of {", ".join(map(repr, REPLY_POLICIES))}',
    "overflow": '"overflow" must be "block" or "drop_oldest"',
    "buffer": '"buffer" must be an integer from 0 to 10000000 (messages it may hold while the inbound queue is full)',
    "nats": '"nats" must be one nats:// or tls:// URL, or several comma-separated (host, port 1-65535)',
    "stream": '"stream" must name a JetStream stream (1-255 characters, no spaces, ".", "*", ">", "/" or "\\")',
    "subject": '"subject" must be a NATS subject filter such as "ticks.>" (dot-separated tokens, "*" for one token, '
               '">" last), or left out for the whole stream',
    "results": '"results" must be a NATS subject without wildcards, such as "scores"',
    "start": '"start" must be "first" or "new"',
    "token": '"token" must be a string',
    "creds": '"creds" must be the path of an existing NATS .creds file',
    "partition_count": f'"partition_count" must be an integer from 1 to {MAX_PARTITIONS} (P, as in the stream\'s '
                       "subject transform {{partition(P,1)}})",
    "partitions": '"partitions" must be a string of partitions and ranges, such as "0-5" or "0,2,7-9"',
}
# where msgspec's message says which field: "… - at `$.buffer`", "… - at `$.headers[...]`", or
# "Object missing required field `url`" (the entry itself)
_AT_FIELD = re.compile(r" - at `\$\.(\w+)")
_MISSING = re.compile(r"^Object missing required field `(\w+)`")
_UNKNOWN = "Object contains unknown field"


def entry(item: dict[str, Any], where: str) -> WebSocketEntry | JetStreamEntry:
    """``item`` (a JSON object of ``FORKLESS_FEEDS``) as its kind's ``Struct``: a JetStream entry
    when it has ``"nats"``; ``ValueProblem`` ``"{where}: …"`` with the faulty field's refusal."""
    kind: type[WebSocketEntry | JetStreamEntry] = JetStreamEntry if "nats" in item else WebSocketEntry
    try:
        return msgspec.convert(item, kind)
    except msgspec.ValidationError as exc:
        raise ValueProblem(f"{where}: {_refusal(str(exc), item, kind)}") from None


def _refusal(message: str, item: dict[str, Any], kind: type[Struct]) -> str:
    """The text for msgspec's ``message`` about ``item``: its field's refusal, or the unknown
    fields (all of them, sorted) with the fields there are."""
    keys = kind.__struct_fields__
    if message.startswith(_UNKNOWN):
        unknown = ", ".join(map(repr, sorted(set(item) - set(keys))))
        fields_are = " for a JetStream feed; its fields are" if kind is JetStreamEntry else "; the fields are"
        return f"unknown field(s) {unknown}{fields_are} {', '.join(keys)}"
    found = _MISSING.match(message) or _AT_FIELD.search(message)
    field = found.group(1) if found else ""
    # a message of a form not foreseen names no value either: only the fields there are
    return REFUSALS.get(field, f"not a feed entry: its fields are {', '.join(keys)}")


def feed_spec(item: dict[str, Any], index: str, where: str, replies: ReplyPolicy) -> FeedSpec:
    """The feed of ``item`` (a JSON object of ``FORKLESS_FEEDS``, the ``index``-th), ``replies`` its
    policy unless it names one; ``ValueProblem`` ``"{where}: …"`` naming the field, never a secret."""
    decoded = entry(item, where)
    if isinstance(decoded, JetStreamEntry):
        return _jetstream_feed(decoded, index, where, replies)
    return _websocket_feed(decoded, index, where, replies)


def _websocket_feed(entry: WebSocketEntry, index: str, where: str, replies: ReplyPolicy) -> FeedSpec:
    """A WebSocket entry checked where its schema cannot (the URL, the socket's path)."""
    try:
        if not ws_url(entry.url):
            raise ValueError
    except ValueError:
        raise ValueProblem(f"{where}: {REFUSALS['url']}") from None
    path = ""
    if entry.unix_socket is not UNSET:
        if entry.unix_socket.strip() == "":
            raise ValueProblem(f"{where}: {REFUSALS['unix_socket']}")
        try:
            path = unix_socket(entry.unix_socket)
        except ValueProblem as exc:
            raise ValueProblem(f"{where}: {UNIX_SOCKET}: {exc}") from None
    subscribe = entry.subscribe
    if subscribe is None:
        subscribe = ""
    elif not isinstance(subscribe, str):
        subscribe = json.dumps(subscribe, separators=(",", ":"))
    return FeedSpec(index if entry.name is UNSET else entry.name, entry.url.strip(), subscribe,
                    tuple(entry.headers.items()), entry.required, replies if entry.replies is UNSET else entry.replies,
                    overflow=entry.overflow, buffer=entry.buffer, unix_socket=path)


def _jetstream_feed(entry: JetStreamEntry, index: str, where: str, default_replies: ReplyPolicy) -> FeedSpec:
    """A JetStream entry checked where its schema cannot (the URLs, the subjects, the partitions,
    the creds file, one source of credentials)."""
    servers = entry.nats
    try:
        if not nats_urls(servers):
            raise ValueError
    except ValueError:
        raise ValueProblem(f"{where}: {REFUSALS['nats']}") from None
    subject = entry.subject
    templated = PARTITION_FIELD in subject
    if subject != "" and not is_subject(subject.replace(PARTITION_FIELD, "0") if templated else subject,
                                      wildcards=True):
        raise ValueProblem(f"{where}: {REFUSALS['subject']}")
    partition_count, partitions = _partitions(entry, where)
    replies = default_replies if entry.replies is UNSET else entry.replies
    if entry.results == "" and replies != "none":
        raise ValueProblem(f'{where}: "results" is required: the subject its replies are published to '
                           '(unless "replies" is "none")')
    if entry.results != "" and not is_subject(entry.results, wildcards=False):
        raise ValueProblem(f"{where}: {REFUSALS['results']}")
    if entry.creds and not os.path.isfile(entry.creds):
        raise ValueProblem(f"{where}: {REFUSALS['creds']}")
    sources = [what for what, present in (
        ("a user:password in \"nats\"", any(urlsplit(u.strip()).username for u in servers.split(","))),
        ('"token"', bool(entry.token)), ('"creds"', bool(entry.creds))) if present]
    if len(sources) > 1:
        raise ValueProblem(f"{where}: one source of credentials, not {' and '.join(sources)}")
    spec = JetStreamSpec(entry.stream, subject, entry.results, entry.start, token=entry.token, creds=entry.creds,
                         partition_count=partition_count, partitions=partitions)
    return FeedSpec(index if entry.name is UNSET else entry.name, servers.strip(), required=entry.required,
                    replies=replies, jetstream=spec)


def _partitions(entry: JetStreamEntry, where: str) -> tuple[int, tuple[int, ...]]:
    """A JetStream entry's ``"partition_count"`` (0: not partitioned) and ``"partitions"`` (``()``:
    not given, so ``FORKLESS_INSTANCE``/``FORKLESS_INSTANCES`` must give them: ``Config.feed_specs``),
    and the rule that ``"subject"`` holds ``{partition}`` as one whole token exactly when partitioned."""
    count, subject = entry.partition_count, entry.subject
    if count is UNSET:
        if entry.partitions is not UNSET:
            raise ValueProblem(f'{where}: "partitions" needs "partition_count" (P, the stream\'s number of '
                               "partitions, as in its subject transform's {{partition(P,1)}})")
        if PARTITION_FIELD in subject:
            raise ValueProblem(f'{where}: "subject" holds {PARTITION_FIELD} but the feed has no "partition_count": '
                               f'give "partition_count" (P) to consume by partition, or a subject without '
                               f"{PARTITION_FIELD}")
        return 0, ()
    if subject.split(".").count(PARTITION_FIELD) != 1 or subject.count(PARTITION_FIELD) != 1:
        raise ValueProblem(f'{where}: "subject" of a partitioned feed must hold {PARTITION_FIELD} once, as one whole '
                           f'token, where the stream\'s subject transform puts the partition, such as '
                           f'"ticks.{PARTITION_FIELD}.>"')
    if entry.partitions is UNSET:
        return count, ()
    try:
        return count, parse_partitions(entry.partitions, count)
    except ValueError as exc:
        raise ValueProblem(f'{where}: "partitions" must be partitions and ranges of 0-{count - 1}, such as "0-5" '
                           f'or "0,2,7-9": {exc}') from None
