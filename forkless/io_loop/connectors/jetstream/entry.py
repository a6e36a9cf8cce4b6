"""A JetStream entry of ``FORKLESS_FEEDS`` (one with ``"nats"``, docs/jetstream.md) into its ``FeedSpec``: its schema
(a msgspec ``Struct``, the fields' types and bounds declared once), the refusal each field's fault is reported with,
then the checks a schema cannot express (the URLs, the subjects, the partitions, the creds file, one source of
credentials, defaults that depend on another field).

Rules:
- Imported only where ``FORKLESS_FEEDS`` is read (io_loop/feedlist.py): a run without it never loads msgspec.
- A fault is reported by its field's text in ``JETSTREAM_REFUSALS`` (io_loop/connectors/connector.py's
  ``entry_refusal``), never by msgspec's own message, which may quote the value: a secret (``token``, a URL's
  credentials) never reaches an error.
- A pattern is anchored with ``^…\\Z``: msgspec searches it, and ``$`` would let a trailing newline through.
- A partitioned entry's ``"partitions"`` leave here as given, ``()`` when it names none: the feed list resolves
  them from ``FORKLESS_INSTANCE``/``FORKLESS_INSTANCES`` (``PartitionSettings.share``).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from forkless.io_loop.connectors.connector import COMMON_REFUSALS, entry_refusal
from forkless.io_loop.connectors.jetstream.partitions import PARTITION_FIELD, parse_partitions
from forkless.io_loop.connectors.jetstream.settings import JETSTREAM, MAX_PARTITIONS, STREAM_NAME, JetStreamSpec
from forkless.io_loop.errors import ValueProblem
from forkless.io_loop.feedspec import FEED_NAME, FeedSpec
from forkless.io_loop.net.netaddr import is_subject, nats_urls
from forkless.io_loop.settings import ReplyPolicy

__all__ = ["JETSTREAM_FIELDS", "JETSTREAM_REFUSALS", "JetStreamEntry", "jetstream_feed"]

Name = Annotated[str, Meta(pattern=rf"^{FEED_NAME.pattern}\Z")]


class JetStreamEntry(Struct, kw_only=True, forbid_unknown_fields=True):
    """A JetStream feed: an entry with ``"nats"`` (docs/jetstream.md); fields in the documents' order."""

    name: Name | UnsetType = UNSET
    nats: str
    stream: Annotated[str, Meta(pattern=rf"^{STREAM_NAME.pattern}\Z")]
    subject: str = ""
    results: str = ""
    start: Literal["first", "new"] = "first"
    required: bool = True
    replies: ReplyPolicy | UnsetType = UNSET
    token: str = ""
    creds: str = ""
    partition_count: Annotated[int, Meta(ge=1, le=MAX_PARTITIONS)] | UnsetType = UNSET
    partitions: str | UnsetType = UNSET


JETSTREAM_FIELDS: tuple[str, ...] = JetStreamEntry.__struct_fields__
# what each field allows, as a fault of it is reported (after "feed i ('name'): ")
JETSTREAM_REFUSALS: dict[str, str] = {
    **COMMON_REFUSALS,
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


def jetstream_feed(item: dict[str, Any], index: str, where: str, default_replies: ReplyPolicy) -> FeedSpec:
    """The feed of ``item`` (a JSON object of ``FORKLESS_FEEDS`` with ``"nats"``, the ``index``-th),
    ``default_replies`` its policy unless it names one; ``ValueProblem`` ``"{where}: …"`` naming the field,
    never a secret."""
    try:
        entry = msgspec.convert(item, JetStreamEntry)
    except msgspec.ValidationError as exc:
        refusal = entry_refusal(str(exc), item, JETSTREAM_FIELDS, JETSTREAM_REFUSALS,
                                " for a JetStream feed; its fields are")
        raise ValueProblem(f"{where}: {refusal}") from None
    servers = entry.nats
    try:
        if not nats_urls(servers):
            raise ValueError
    except ValueError:
        raise ValueProblem(f"{where}: {JETSTREAM_REFUSALS['nats']}") from None
    subject = entry.subject
    templated = PARTITION_FIELD in subject
    if subject != "" and not is_subject(subject.replace(PARTITION_FIELD, "0") if templated else subject,
                                      wildcards=True):
        raise ValueProblem(f"{where}: {JETSTREAM_REFUSALS['subject']}")
    partition_count, partitions = _partitions(entry, where)
    replies = default_replies if entry.replies is UNSET else entry.replies
    if entry.results == "" and replies != "none":
        raise ValueProblem(f'{where}: "results" is required: the subject its replies are published to '
                           '(unless "replies" is "none")')
    if entry.results != "" and not is_subject(entry.results, wildcards=False):
        raise ValueProblem(f"{where}: {JETSTREAM_REFUSALS['results']}")
    if entry.creds and not os.path.isfile(entry.creds):
        raise ValueProblem(f"{where}: {JETSTREAM_REFUSALS['creds']}")
    sources = [what for what, present in (
        ("a user:password in \"nats\"", any(urlsplit(u.strip()).username for u in servers.split(","))),
        ('"token"', bool(entry.token)), ('"creds"', bool(entry.creds))) if present]
    if len(sources) > 1:
        raise ValueProblem(f"{where}: one source of credentials, not {' and '.join(sources)}")
    spec = JetStreamSpec(entry.stream, subject, entry.results, entry.start, token=entry.token, creds=entry.creds,
                         partition_count=partition_count, partitions=partitions)
    return FeedSpec(index if entry.name is UNSET else entry.name, servers.strip(), required=entry.required,
                    replies=replies, kind=JETSTREAM, options=spec)


def _partitions(entry: JetStreamEntry, where: str) -> tuple[int, tuple[int, ...]]:
    """A JetStream entry's ``"partition_count"`` (0: not partitioned) and ``"partitions"`` (``()``: not given, so
    ``FORKLESS_INSTANCE``/``FORKLESS_INSTANCES`` must give them), and the rule that ``"subject"`` holds
    ``{partition}`` as one whole token exactly when partitioned."""
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
