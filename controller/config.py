"""Configuration: one frozen dataclass, read from ``FORKLESS_*`` environment variables.

Rules:
- Every variable is declared once, in ``VARIABLES``; ``--help``, the README table and
  ``Config.from_env`` are all drawn from that list, so they cannot disagree.
- A bad value raises ``ConfigError`` naming the variable, the value and what is allowed;
  ``app.py`` turns it into exit status 2 before any thread starts.
- Secrets (``SUBSCRIBE``, ``AUTH_TOKEN``, ``HEADERS``) never appear in ``repr``, errors or ``--help``.
- A partitioned JetStream feed (``"partition_count"``) leaves here with its partitions resolved
  (``JetStreamSpec.partitions``): from its ``"partitions"`` or from ``FORKLESS_INSTANCE``/
  ``FORKLESS_INSTANCES``, exactly one of the two; it is the process's only feed, and its
  checkpoints go to ``FORKLESS_CHECKPOINT_BUCKET``, never ``FORKLESS_CHECKPOINT_DIR``.
- JAX's own variables (``JAX_PLATFORMS``, ``JAX_COMPILATION_CACHE_DIR`` …) are not read
  here; they pass through to JAX untouched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

from controller.errors import ConfigError  # defined with the other exceptions; imported from here too
from io_loop.netaddr import parse_host_port, redact_url, redact_urls, url_host_port
from io_loop.partitions import PARTITION_FIELD, instance_share, parse_partitions
from io_loop.settings import REPLY_POLICIES, SEQ_MODES, FeedSpec, IOSettings, JetStreamSpec, RelaySettings

PREFIX = "FORKLESS_"
BUCKET_GROWTH = 4
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class Variable:
    """One ``FORKLESS_*`` variable: its field, how to parse it and what it means."""

    name: str  # without the prefix
    field: str
    parse: Callable[[str], Any]
    allowed: str
    help: str
    secret: bool = False

    @property
    def env(self) -> str:
        return PREFIX + self.name


# ---- parsers: each takes the raw text and returns a value or raises ValueError --------------


def _int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip())
        if value < lo or (hi is not None and value > hi):
            raise ValueError
        return value

    return parse


def _float(lo: float, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text.strip())
        if not math.isfinite(value):
            raise ValueError
        if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
            raise ValueError
        return value

    return parse


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.strip() == "" else parse(text)

    return parse_optional


def _choice(*choices: str, upper: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().upper() if upper else text.strip().lower()
        if value not in choices:
            raise ValueError
        return value

    return parse


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


def _ws_url(text: str) -> str:
    text = text.strip()
    if text == "":
        return ""
    parts = urlsplit(text)  # raises ValueError for some malformed IPv6 literals itself
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError
    url_host_port(text)  # brackets only around an IPv6 address, then nothing or :port (1-65535)
    return text


def _bucket(text: str) -> str:
    """A JetStream bucket name (object store, KV)."""
    text = text.strip()
    if not BUCKET_NAME.fullmatch(text):
        raise ValueError
    return text


def _optional_text(parse: Callable[[str], str]) -> Callable[[str], str]:
    def parse_optional(text: str) -> str:
        return "" if text.strip() == "" else parse(text)

    return parse_optional


def _addr(text: str) -> str:
    text = text.strip()
    if text:
        parse_host_port(text)
    return text


def _json_text(text: str) -> str:
    """A JSON document, or ``@path`` naming a file holding one; returns the JSON text."""
    text = text.strip()
    if text == "":
        return ""
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as f:
            text = f.read()
    json.loads(text)
    return text


def _headers(text: str) -> tuple[tuple[str, str], ...]:
    if text.strip() == "":
        return ()
    value = json.loads(text)
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError
    return tuple((str(k), v) for k, v in value.items())


def _pem_file(text: str) -> str:
    """An existing file holding at least one PEM certificate that OpenSSL accepts."""
    text = text.strip()
    if text:
        if not os.path.isfile(text):
            raise ValueError
        ssl.create_default_context().load_verify_locations(cafile=text)  # ssl.SSLError is an OSError
    return text


def _checkpoint_dir(text: str) -> str:
    """A directory to keep checkpoints in, created if missing: not an existing non-directory,
    and under the nearest existing ancestor, a directory this process may write to."""
    text = text.strip()
    if text == "":
        return ""
    if "\x00" in text or any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in text.split("/")):
        raise ValueError
    probe = os.path.abspath(text)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError
    return text


FEED_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
FEED_KEYS = ("url", "subscribe", "headers", "name", "required", "replies")
# a JetStream feed: an entry with "nats" (docs/jetstream.md)
JETSTREAM_KEYS = ("name", "nats", "stream", "subject", "results", "start", "required", "replies", "token", "creds",
                  "partition_count", "partitions")
MAX_PARTITIONS = 65536
BUCKET_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a JetStream object-store or KV bucket (nats-py's rule, capped)
STREAM_NAME = re.compile(r"[^\s.*>/\\]{1,255}")  # what nats-server accepts as a stream name
SUBJECT_TOKEN = re.compile(r"[^\s.]+")


class ValueProblem(ValueError):
    """A parser's refusal with a detail fit to show (never a secret): appended to the
    variable's ``allowed`` text in the ``ConfigError``."""


def _feed_list(text: str, replies: str = "all") -> tuple[FeedSpec, ...]:
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
            continue
        unknown = sorted(set(item) - set(FEED_KEYS))
        if unknown:
            raise ValueProblem(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                               f"the fields are {', '.join(FEED_KEYS)}")
        if not isinstance(name, str) or not FEED_NAME.fullmatch(name):
            raise ValueProblem(f'{where}: "name" must be 1-64 letters, digits, "_", "." or "-"')
        url = item.get("url")
        try:
            if not isinstance(url, str) or not _ws_url(url):
                raise ValueError
        except ValueError:
            raise ValueProblem(f'{where}: "url" must be a ws:// or wss:// URL (port 1-65535)') from None
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
        feeds.append(FeedSpec(name, url.strip(), subscribe, tuple((str(k), v) for k, v in headers.items()), required,
                              policy))
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


def _nats_urls(text: str) -> str:
    """One nats:// or tls:// URL, or several comma-separated (each with a host, port 1-65535); "" stays ""."""
    text = text.strip()
    for url in text.split(",") if text else ():
        scheme, sep, _ = url.strip().partition("://")
        if scheme not in ("nats", "tls") or not sep:
            raise ValueError
        url_host_port(url.strip())
    return text


def _relay_subject(text: str) -> str:
    """The relay's subject prefix: a NATS subject without wildcards ("" stays "")."""
    text = text.strip()
    if text and not _subject(text, wildcards=False):
        raise ValueError
    return text


def _existing_file(text: str) -> str:
    text = text.strip()
    if text and not os.path.isfile(text):
        raise ValueError
    return text


def _subject(text: Any, *, wildcards: bool) -> bool:
    """A NATS subject: dot-separated tokens without spaces; with ``wildcards``, a token may be
    ``*``, and the last one ``>``."""
    if not isinstance(text, str) or not 0 < len(text) <= 1024:
        return False
    tokens = text.split(".")
    for i, token in enumerate(tokens):
        if not SUBJECT_TOKEN.fullmatch(token):
            return False
        wildcard = token == "*" or (token == ">" and i == len(tokens) - 1)
        if ("*" in token or ">" in token) and not (wildcards and wildcard):
            return False
    return True


def _jetstream_feed(item: dict[str, Any], name: Any, where: str, default_replies: str = "all") -> FeedSpec:
    """One JetStream entry of ``FORKLESS_FEEDS`` (see ``JETSTREAM_KEYS``); ``ValueProblem`` names the
    feed and the field, never a secret (the URL's credentials, ``token``)."""
    unknown = sorted(set(item) - set(JETSTREAM_KEYS))
    if unknown:
        raise ValueProblem(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} for a JetStream feed; "
                           f"its fields are {', '.join(JETSTREAM_KEYS)}")
    if not isinstance(name, str) or not FEED_NAME.fullmatch(name):
        raise ValueProblem(f'{where}: "name" must be 1-64 letters, digits, "_", "." or "-"')
    servers = item["nats"]
    try:
        if not isinstance(servers, str) or not _nats_urls(servers):
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
    if subject != "" and not _subject(subject.replace(PARTITION_FIELD, "0") if templated else subject,
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
    if results != "" and not _subject(results, wildcards=False):
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
    not given, so ``FORKLESS_INSTANCE``/``FORKLESS_INSTANCES`` must give them: ``_assign_partitions``),
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


def _assign_partitions(feeds: tuple[FeedSpec, ...], instance: int | None,
                       instances: int | None) -> tuple[FeedSpec, ...]:
    """The feeds with a partitioned feed's partitions resolved: its own ``"partitions"``, or instance
    ``instance`` of ``instances``'s share of its partition_count; ``ConfigError`` when both are given
    or neither."""
    out = []
    for index, feed in enumerate(feeds):
        spec = feed.jetstream
        if spec is None or not spec.partitioned:
            out.append(feed)
            continue
        label = f"feed {index} ({feed.name!r})"
        where = f"{label} of FORKLESS_FEEDS"
        if instance is not None and instances is not None:
            if spec.partitions:
                raise ConfigError(PREFIX + "INSTANCE", str(instance), f'no FORKLESS_INSTANCE/FORKLESS_INSTANCES '
                                  f'when {where} names its "partitions": either the entry\'s partitions or this '
                                  "instance's share of its partition_count, not both")
            try:
                share = instance_share(instance, instances, spec.partition_count)
            except ValueError as exc:
                raise ConfigError(PREFIX + "INSTANCES", str(instances), f"at most the partition_count of {where} "
                                  f"({spec.partition_count}): {exc}") from None
            spec = dataclasses.replace(spec, partitions=share)
        elif not spec.partitions:
            raise ConfigError(PREFIX + "FEEDS", "<hidden>", f'{label}: a partitioned '
                              'feed ("partition_count") needs the partitions this instance owns: "partitions" in '
                              'the entry (such as "0-5"), or FORKLESS_INSTANCE and FORKLESS_INSTANCES (instance i '
                              "of N owns its contiguous share of the partition_count)")
        out.append(dataclasses.replace(feed, jetstream=spec))
    return tuple(out)


def _feeds_text(text: str) -> str:
    """``FORKLESS_FEEDS`` as given, or the text of the ``@path`` file it names; checked by ``_feed_list``."""
    text = text.strip()
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as exc:
            raise ValueProblem(f"cannot read {text[1:]}: {exc.strerror}") from None
    _feed_list(text)
    return text


def _devices(text: str) -> int | str:
    """``all`` or a count; whether the process has that many devices is known only once JAX
    starts (controller/compiled.py ``use_devices`` checks it, with the same variable named)."""
    text = text.strip().lower()
    return "all" if text == "all" else _int(1, 4096)(text)


VARIABLES: tuple[Variable, ...] = (
    # -- the feed
    Variable("WS_URL", "ws_url", _ws_url, "a ws:// or wss:// URL (port 1-65535), or empty",
             "WebSocket feed to connect to; empty starts the embedded demo feed"),
    Variable("SUBSCRIBE", "subscribe", _json_text, "a JSON text or @path to a file holding one",
             "message sent first on every new connection (empty: none); never logged, as it"
             " often holds credentials", secret=True),
    Variable("AUTH_TOKEN", "auth_token", str.strip, "any text",
             "sent as 'Authorization: Bearer <token>'; never logged", secret=True),
    Variable("HEADERS", "headers", _headers, "a JSON object of string values",
             "extra handshake headers; never logged", secret=True),
    Variable("FEEDS", "feeds", _feeds_text,
             'a JSON list of {"url", "subscribe", "headers", "name", "required", "replies"} objects (WebSocket feeds)'
             ' and {"nats", "stream", "subject", "results", "start", …} objects (JetStream feeds), or @path to a file'
             " holding one; not together with WS_URL or SUBSCRIBE",
             "several feeds in one process, each its own connection (docs/feeds.md, docs/jetstream.md); never"
             " logged", secret=True),
    Variable("SHARED_STREAMS", "shared_streams", _bool, "0 or 1",
             "with several feeds: 1 makes a stream name the same stream on every feed (one state);"
             " 0 keeps feed:stream apart"),
    Variable("FEED_FATAL", "feed_fatal", _choice("all", "any"), "all or any",
             "with several feeds: exit 3 when every feed has given up (all) or when one has (any)"),
    Variable("REPLIES", "replies", _choice(*REPLY_POLICIES), "all, results or none",
             "what the feed is sent back: all (results and error replies), results (no error frames), none"
             " (nothing but SUBSCRIBE; results still reach on_results, the counters and the latency); a"
             ' FORKLESS_FEEDS entry\'s "replies" overrides it for that feed'),
    Variable("CA_FILE", "ca_file", _pem_file, "the path of an existing PEM file of CA certificates",
             "extra CA bundle for wss:// (the system store is always used)"),
    Variable("TLS_INSECURE", "tls_insecure", _bool, "0 or 1",
             "1 turns certificate verification off (logs a warning at every connect)"),
    # -- the model and protocol
    Variable("FEATURES", "features", _int(1, 65536), "an integer from 1 to 65536",
             "length F of every message's vector x"),
    Variable("ALPHA", "alpha", _float(0.0, 1.0, lo_open=True), "a number in (0, 1]",
             "EWMA smoothing factor"),
    Variable("THRESHOLD", "threshold", _float(0.0, lo_open=True), "a number > 0",
             "anomaly when the largest abs(z) of a message exceeds this"),
    Variable("WARMUP", "warmup", _int(0), "an integer >= 0",
             "messages a stream must have had before it can be flagged"),
    Variable("MAX_STREAMS", "max_streams", _int(1, 10_000_000), "an integer from 1 to 10000000",
             "state slots; a new stream past this gets an error reply (unless STREAM_IDLE_S frees one)"),
    Variable("STREAM_IDLE_S", "stream_idle_s", _optional(_float(0.0)), "a number of seconds >= 0, or empty",
             "when every slot is taken, a stream silent for longer than this gives its slot to a new"
             " stream (least recently seen first; its state is reset); empty: slots are never reused"),
    Variable("DEVICES", "devices", _devices, "all, or an integer from 1 to 4096",
             "local JAX devices to use: the stream table is sharded over them by stream (new streams spread"
             " evenly) and each runs its streams' messages; more than the process has exits 2"),
    # -- batching and queues
    Variable("MAX_BATCH", "max_batch", _int(1, 65536), "an integer from 1 to 65536",
             "largest micro-batch (batches are padded to powers of four up to this)"),
    Variable("MAX_WAIT_MS", "max_wait_ms", _float(0.0, 10_000.0), "a number from 0 to 10000",
             "longest a batch keeps collecting messages that are arriving; never waits on an empty queue"),
    Variable("QUEUE_SIZE", "queue_size", _int(1, 1_000_000), "an integer from 1 to 1000000",
             "bound of each queue: inbound chunks (frames read together, at most MAX_BATCH messages"
             " or one frame), outbound batches"),
    Variable("OVERFLOW", "overflow", _choice("block", "drop_oldest"), "block or drop_oldest",
             "inbound queue full: block stops reading the socket; drop_oldest drops and counts"),
    Variable("MAX_MSG_BYTES", "max_msg_bytes", _int(64, 1 << 30), "an integer from 64 to 1073741824",
             "largest frame accepted; a larger one closes the connection with 1009 and reconnects. A JetStream"
             " feed's payload over it is not decoded: one error reply (message too large), counted, acknowledged"),
    Variable("MAX_FRAME_ITEMS", "max_frame_items", _int(1, 1_000_000), "an integer from 1 to 1000000",
             "most messages in one JSON-array frame"),
    # -- connection management
    Variable("HEARTBEAT_S", "heartbeat_s", _float(0.0), "a number >= 0 (0 = off)",
             "ping interval; no pong within half of it drops and reconnects"),
    Variable("STALE_S", "stale_s", _float(0.0), "a number >= 0 (0 = off)",
             "reconnect when no frame has arrived for this long"),
    Variable("CONNECT_TIMEOUT_S", "connect_timeout_s", _float(0.0, lo_open=True), "a number > 0",
             "limit on connecting plus the opening handshake"),
    Variable("RECONNECT_MIN_S", "reconnect_min_s", _float(0.0, lo_open=True), "a number > 0",
             "smallest delay between connection attempts"),
    Variable("RECONNECT_MAX_S", "reconnect_max_s", _float(0.0), "a number >= RECONNECT_MIN_S",
             "largest delay between connection attempts"),
    Variable("RECONNECT_RESET_S", "reconnect_reset_s", _float(0.0), "a number >= 0",
             "a connection must stay up this long before the backoff starts again from the minimum"),
    Variable("RECONNECT_TRIES", "reconnect_tries", _int(0), "an integer >= 0",
             "failed attempts in a row before giving up with exit status 3 (0 = forever)"),
    # -- running
    Variable("DURATION", "duration_s", _optional(_float(0.0, lo_open=True)), "a number of seconds > 0, or empty",
             "stop after this long; empty runs until SIGINT/SIGTERM"),
    Variable("SHUTDOWN_TIMEOUT_S", "shutdown_timeout_s", _float(0.0, lo_open=True), "a number > 0",
             "longest an orderly stop may take before giving up on unsent results"),
    Variable("STATUS_S", "status_s", _float(0.0), "a number >= 0 (0 = off)",
             "seconds between status lines"),
    Variable("LOG_LEVEL", "log_level", _choice(*LOG_LEVELS, upper=True), "one of " + ", ".join(LOG_LEVELS),
             "logging level"),
    Variable("LOG_FORMAT", "log_format", _choice("text", "json"), "text or json",
             "json writes one JSON object per log line"),
    Variable("METRICS_ADDR", "metrics_addr", _addr, "host:port, or empty",
             "serve /metrics, /healthz, /readyz there (empty: off)"),
    # -- the demo feed
    Variable("DEMO_RATE", "demo_rate", _float(0.0, 100_000.0, lo_open=True), "a number in (0, 100000]",
             "demo feed messages per second (all streams together)"),
    Variable("DEMO_STREAMS", "demo_streams", _int(1, 100_000), "an integer from 1 to 100000",
             "number of demo feed streams"),
    # -- checkpoints
    Variable("CHECKPOINT_DIR", "checkpoint_dir", _checkpoint_dir,
             "a writable directory path (created if missing), or empty",
             "keep checkpoints of the state and the stream table here (empty: off)"),
    Variable("CHECKPOINT_BUCKET", "checkpoint_bucket", _optional_text(_bucket),
             "1-64 letters, digits, '_' or '-', or empty",
             "a partitioned JetStream feed's checkpoints: one object per partition in this JetStream object-store"
             " bucket on the feed's server (created if missing), restored by whichever instance owns the partition;"
             " turns checkpoints on like CHECKPOINT_DIR (not both; the only kind a partitioned feed has)"),
    Variable("CHECKPOINT_S", "checkpoint_s", _float(0.0, lo_open=True), "a number > 0",
             "seconds between checkpoints; one more is written at every orderly stop"),
    Variable("CHECKPOINT_KEEP", "checkpoint_keep", _int(1, 1000), "an integer from 1 to 1000",
             "newest checkpoints kept; older ones are deleted after each successful write"),
    Variable("CHECKPOINT_RESTORE", "checkpoint_restore", _choice("auto", "never"), "auto or never",
             "auto: start from the newest complete checkpoint (a damaged one is skipped; one written with"
             " other FEATURES/MAX_STREAMS/processor exits 2; every one damaged: a JetStream feed exits 2 unless"
             ' its "start" is "first" and its stream still holds every message from sequence 1, which it then'
             " consumes again); never: start empty (the explicit way to accept a lost checkpoint or position)"),
    Variable("CHECKPOINT_PRIORITY", "checkpoint_priority", _choice("idle", "normal"), "idle or normal",
             "idle: the periodic checkpoints are written at the OS's idle priority (Linux SCHED_IDLE), never"
             " taking a core from the steps, but slowed or skipped on a host whose cores other processes keep"
             " busy; normal: at the process's own priority. The stop's checkpoint is written at normal priority"),
    # -- partitioned instances (a JetStream feed with "partition_count")
    Variable("INSTANCE", "instance", _optional(_int(0, MAX_PARTITIONS - 1)), "an integer >= 0, or empty",
             "this instance's number i (0-based; a StatefulSet pod's ordinal) among INSTANCES: it owns the"
             " contiguous share [i*P/N, (i+1)*P/N) of the partitioned feed's partition_count P, in place of the"
             ' entry\'s "partitions" (not both); set together with INSTANCES'),
    Variable("INSTANCES", "instances", _optional(_int(1, MAX_PARTITIONS)), "an integer from 1 to 65536, or empty",
             "N, the number of instances sharing the partitioned feed's partitions (at most its partition_count);"
             " set together with INSTANCE"),
    Variable("LEASE_S", "lease_s", _float(0.0, lo_open=True), "a number > 0",
             "a partitioned feed's lease on each partition it owns: renewed while it runs, released at an orderly"
             " stop, expired this long after its holder died (a new owner waits for that)"),
    Variable("LEASE_BUCKET", "lease_bucket", _bucket, "1-64 letters, digits, '_' or '-'",
             "the JetStream KV bucket on the partitioned feed's server that holds the partitions' leases (created"
             " if missing)"),
    # -- the relay (forkless relay: docs/relay.md)
    Variable("RELAY_NATS", "relay_nats", _nats_urls, "one nats:// or tls:// URL, or several comma-separated",
             "forkless relay: the NATS server(s) to publish to (a user:password in the URL is never logged);"
             " required for the relay"),
    Variable("RELAY_SUBJECT", "relay_subject", _relay_subject, "a NATS subject without wildcards",
             "forkless relay: each message is published to <this>.<escaped stream name>; required for the relay"),
    Variable("RELAY_TOKEN", "relay_token", str.strip, "any text",
             "forkless relay: the NATS token to connect with; never logged", secret=True),
    Variable("RELAY_CREDS", "relay_creds", _existing_file, "the path of an existing NATS .creds file",
             "forkless relay: the NATS credentials file to connect with"),
    Variable("RELAY_SEQ", "relay_seq", _choice(*SEQ_MODES), "feed, stream or none",
             "forkless relay: how the feeds number their messages, for counting gaps: feed (one seq per feed, +1"
             " per message, as the demo feed's), stream (one seq per stream), none (no gap counting)"),
)


@dataclass(frozen=True)
class Config:
    """Everything the controller and the IO thread read; immutable once built.

    Build it directly (``Config(features=4, ws_url=...)``) or with ``Config.from_env()``.
    ``validate()`` runs on construction, so a ``Config`` that exists is a valid one.
    """

    ws_url: str = ""
    # a JSON text; in code also a JSON value (dict, list …), kept as its compact JSON text
    subscribe: str = field(default="", repr=False)
    auth_token: str = field(default="", repr=False)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    feeds: str = field(default="", repr=False)
    shared_streams: bool = False
    feed_fatal: str = "all"
    replies: str = "all"
    ca_file: str = ""
    tls_insecure: bool = False
    features: int = 8
    alpha: float = 0.05
    threshold: float = 4.0
    warmup: int = 20
    max_streams: int = 4096
    stream_idle_s: float | None = None
    devices: int | str = "all"
    max_batch: int = 256
    max_wait_ms: float = 2.0
    queue_size: int = 1024
    overflow: str = "block"
    max_msg_bytes: int = 1 << 20
    max_frame_items: int = 10_000
    heartbeat_s: float = 15.0
    stale_s: float = 0.0
    connect_timeout_s: float = 10.0
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    reconnect_reset_s: float = 5.0
    reconnect_tries: int = 0
    duration_s: float | None = None
    shutdown_timeout_s: float = 10.0
    status_s: float = 1.0
    log_level: str = "INFO"
    log_format: str = "text"
    metrics_addr: str = ""
    demo_rate: float = 200.0
    demo_streams: int = 8
    checkpoint_dir: str = ""
    checkpoint_s: float = 60.0
    checkpoint_keep: int = 3
    checkpoint_restore: str = "auto"
    checkpoint_priority: str = "idle"
    checkpoint_bucket: str = ""
    instance: int | None = None
    instances: int | None = None
    lease_s: float = 10.0
    lease_bucket: str = "forkless-leases"
    relay_nats: str = ""
    relay_subject: str = ""
    relay_token: str = field(default="", repr=False)
    relay_creds: str = ""
    relay_seq: str = "feed"

    def __post_init__(self) -> None:
        if not isinstance(self.subscribe, str):  # a JSON value given in code: stored as the text to send
            object.__setattr__(self, "subscribe", _subscribe_text(self.subscribe))
        self.validate()

    def validate(self) -> None:
        """Check every field with the same rules as the environment, plus cross-field rules."""
        for var in VARIABLES:
            value = getattr(self, var.field)
            text = _as_text(value)
            try:
                parsed = var.parse(text)
            except (ValueError, TypeError, OSError) as exc:
                raise ConfigError(var.env, _shown(var, text), _allowed(var, exc)) from None
            if parsed != value:
                raise ConfigError(var.env, _shown(var, text), var.allowed)
        if self.feeds and (self.ws_url or self.subscribe):
            both = "FORKLESS_WS_URL" if self.ws_url else "FORKLESS_SUBSCRIBE"
            raise ConfigError(PREFIX + "FEEDS", "<hidden>", f"either FORKLESS_FEEDS or {both} (the one-feed "
                              "shorthand), not both: move that feed into the FORKLESS_FEEDS list")
        self._validate_partitions()
        self._validate_credentials()
        relay_sources = [what for what, present in (
            ("a user:password in FORKLESS_RELAY_NATS", any(urlsplit(u.strip()).username
                                                           for u in self.relay_nats.split(",") if u.strip())),
            ("FORKLESS_RELAY_TOKEN", bool(self.relay_token)), ("FORKLESS_RELAY_CREDS", bool(self.relay_creds)))
            if present]
        if len(relay_sources) > 1:
            raise ConfigError(PREFIX + ("RELAY_TOKEN" if self.relay_token else "RELAY_CREDS"), "<hidden>",
                              f"one source of credentials for the relay, not {' and '.join(relay_sources)}")
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ConfigError(PREFIX + "RECONNECT_MAX_S", str(self.reconnect_max_s),
                              f"a number >= FORKLESS_RECONNECT_MIN_S ({self.reconnect_min_s})")

    def _validate_credentials(self) -> None:
        """One source of handshake credentials per feed: URL user:password, AUTH_TOKEN, or an
        Authorization header in HEADERS or the feed's headers (aiohttp refuses two at once, and mid-run)."""
        several = bool(self.feeds)
        for feed in self.feed_specs if (self.ws_url or several) else ():
            if feed.jetstream is not None:  # checked with its entry (_jetstream_feed)
                continue
            sources = []
            where = f"in {feed.label}" if several else "in FORKLESS_WS_URL"
            if urlsplit(feed.url).username or urlsplit(feed.url).password:
                sources.append(f"credentials {where} (user:password@)")
            if self.auth_token:
                sources.append("FORKLESS_AUTH_TOKEN")
            if any(name.lower() == "authorization" for name, _ in self.headers):
                sources.append("an Authorization header in FORKLESS_HEADERS")
            if any(name.lower() == "authorization" for name, _ in feed.headers):
                sources.append(f"an Authorization header in the headers of {feed.label}")
            if len(sources) > 1:
                raise ConfigError(PREFIX + ("AUTH_TOKEN" if self.auth_token else "FEEDS" if several else "HEADERS"),
                                  "<hidden>", f"one source of credentials, not {' and '.join(sources)}")
        if not self.ws_url and not several and self.auth_token and \
                any(name.lower() == "authorization" for name, _ in self.headers):
            raise ConfigError(PREFIX + "AUTH_TOKEN", "<hidden>", "one source of credentials, not "
                              "FORKLESS_AUTH_TOKEN and an Authorization header in FORKLESS_HEADERS")

    def _validate_partitions(self) -> None:
        """A partitioned JetStream feed and what goes with it: its partitions from exactly one place,
        FORKLESS_INSTANCE with FORKLESS_INSTANCES, its checkpoints in the bucket and nowhere else."""
        if (self.instance is None) != (self.instances is None):
            given, missing = ("INSTANCE", "INSTANCES") if self.instance is not None else ("INSTANCES", "INSTANCE")
            raise ConfigError(PREFIX + given, _as_text(getattr(self, given.lower())),
                              f"set together with FORKLESS_{missing} (both or neither)")
        if self.instance is not None and self.instances is not None and self.instance >= self.instances:
            raise ConfigError(PREFIX + "INSTANCE", str(self.instance), f"an integer from 0 to FORKLESS_INSTANCES - 1 "
                              f"= {self.instances - 1} (instances are numbered from 0)")
        if self.checkpoint_bucket and self.checkpoint_dir:
            raise ConfigError(PREFIX + "CHECKPOINT_BUCKET", self.checkpoint_bucket, "either FORKLESS_CHECKPOINT_BUCKET "
                              "(a partitioned feed's checkpoints) or FORKLESS_CHECKPOINT_DIR, not both")
        partitioned = [feed for feed in self.feed_specs if feed.jetstream is not None and feed.jetstream.partitioned]
        if not partitioned:
            if self.instance is not None:
                raise ConfigError(PREFIX + "INSTANCE", str(self.instance), "no FORKLESS_INSTANCE/FORKLESS_INSTANCES "
                                  "without a partitioned JetStream feed (a FORKLESS_FEEDS entry with "
                                  '"partition_count"):'
                                  " every instance would consume the whole feed")
            if self.checkpoint_bucket:
                raise ConfigError(PREFIX + "CHECKPOINT_BUCKET", self.checkpoint_bucket, "a partitioned JetStream feed "
                                  '(a FORKLESS_FEEDS entry with "partition_count"), whose server holds the bucket; '
                                  "other feeds keep their checkpoints in FORKLESS_CHECKPOINT_DIR")
        elif self.checkpoint_dir:
            raise ConfigError(PREFIX + "CHECKPOINT_DIR", self.checkpoint_dir, f"empty with a partitioned feed "
                              f"({partitioned[0].label}): its checkpoints are kept per partition in "
                              "FORKLESS_CHECKPOINT_BUCKET, where any instance can restore them")

    @property
    def buckets(self) -> tuple[int, ...]:
        """Batch sizes the step is compiled for: powers of four below ``max_batch``, and it.

        Each compiled size costs start-up time and several MiB of resident memory, while
        padding a batch costs little device time, so sizes grow by 4x rather than 2x.
        """
        sizes = []
        size = 1
        while size < self.max_batch:
            sizes.append(size)
            size *= BUCKET_GROWTH
        sizes.append(self.max_batch)
        return tuple(sizes)

    @property
    def uses_demo_feed(self) -> bool:
        """Neither ``FORKLESS_WS_URL`` nor ``FORKLESS_FEEDS`` is set: the embedded demo feed runs."""
        return self.ws_url == "" and self.feeds == ""

    @cached_property
    def feed_specs(self) -> tuple[FeedSpec, ...]:
        """The feeds to connect to: ``FORKLESS_FEEDS``, else one feed named ``0`` from
        ``FORKLESS_WS_URL``/``FORKLESS_SUBSCRIBE`` (its url is empty for the demo feed)."""
        if self.feeds:
            return _assign_partitions(_feed_list(self.feeds, self.replies), self.instance, self.instances)
        return (FeedSpec("0", self.ws_url, self.subscribe, replies=self.replies),)

    @property
    def stream_keys_by_feed(self) -> bool:
        """True when a stream is identified by (feed, stream): several feeds, not shared."""
        return len(self.feed_specs) > 1 and not self.shared_streams

    @property
    def checkpoints_on(self) -> bool:
        """``FORKLESS_CHECKPOINT_DIR`` or ``FORKLESS_CHECKPOINT_BUCKET`` is set: checkpoints are
        written (and restored unless ``FORKLESS_CHECKPOINT_RESTORE=never``)."""
        return self.checkpoint_dir != "" or self.checkpoint_bucket != ""

    def io_settings(self) -> IOSettings:
        """What the IO side reads of this configuration (io_loop/settings.py): its fields by the
        same names, ``feed_specs`` and ``uses_demo_feed`` as derived here."""
        return IOSettings(feeds_from_list=self.feeds != "",
                          **{f.name: getattr(self, f.name) for f in dataclasses.fields(IOSettings)
                             if f.name != "feeds_from_list"})

    def relay_settings(self) -> tuple[IOSettings, RelaySettings]:
        """What ``forkless relay`` runs with: the IO side's settings (its feeds never sent a reply)
        and the publisher's; ``ConfigError`` naming the variable (or the feed) the relay cannot use:
        FORKLESS_RELAY_NATS or FORKLESS_RELAY_SUBJECT unset, a JetStream entry in FORKLESS_FEEDS,
        FORKLESS_OVERFLOW=drop_oldest (the relay never drops a message)."""
        for var, value in (("RELAY_NATS", self.relay_nats), ("RELAY_SUBJECT", self.relay_subject)):
            if not value:
                raise ConfigError(PREFIX + var, "", f"to be set for the relay: {_variable(var).allowed}")
        for index, spec in enumerate(self.feed_specs):
            if spec.jetstream is not None:
                raise ConfigError(PREFIX + "FEEDS", "<hidden>", f"WebSocket feeds only for the relay: feed {index} "
                                  f"({spec.name!r}) is a JetStream feed (\"nats\"); the relay publishes to "
                                  "FORKLESS_RELAY_NATS, it does not read a stream")
        if self.overflow != "block":
            raise ConfigError(PREFIX + "OVERFLOW", self.overflow, "block for the relay: it never drops a message "
                              "(a full inbound queue stops reading the socket)")
        io = self.io_settings()
        io = dataclasses.replace(io, feed_specs=tuple(dataclasses.replace(spec, replies="none")
                                                      for spec in io.feed_specs))
        target = FeedSpec("relay", self.relay_nats, jetstream=JetStreamSpec("", token=self.relay_token,
                                                                              creds=self.relay_creds))
        return io, RelaySettings(target, self.relay_subject, self.relay_seq, self.max_batch)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Read every ``FORKLESS_*`` variable that is set; unset ones keep their default."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for var in VARIABLES:
            if var.env not in environ:
                continue
            raw = environ[var.env]
            try:
                values[var.field] = var.parse(raw)
            except (ValueError, TypeError, OSError) as exc:
                raise ConfigError(var.env, _shown(var, raw), _allowed(var, exc)) from None
        values.update(overrides)
        config = cls(**values)
        if config.uses_demo_feed and config.demo_streams > config.max_streams:
            raise ConfigError(PREFIX + "DEMO_STREAMS", str(config.demo_streams),
                              f"at most FORKLESS_MAX_STREAMS ({config.max_streams}) when the demo feed runs")
        return config


def _subscribe_text(value: Any) -> str:
    """``Config(subscribe=...)`` given a JSON value in code (a dict or list, say): its compact
    JSON text, the form ``subscribe`` is kept and sent in, as for a ``FORKLESS_FEEDS`` entry's;
    ``None`` means none. Anything ``json`` cannot write is a ``ConfigError`` (the value hidden)."""
    if value is None:
        return ""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise ConfigError(PREFIX + "SUBSCRIBE", "<hidden>",
                          "a JSON text or @path to a file holding one, or in code a JSON-serialisable value "
                          f"(a dict or list of str, numbers, bool, None), not this {type(value).__name__}, "
                          "which json cannot write (it is or holds a set, bytes, NaN, another object …)") from None


def _variable(name: str) -> Variable:
    return next(var for var in VARIABLES if var.name == name)


def _allowed(var: Variable, exc: BaseException) -> str:
    """What the variable allows, plus the parser's detail when it gave one (``ValueProblem``)."""
    return f"{var.allowed}: {exc}" if isinstance(exc, ValueProblem) else var.allowed


def _shown(var: Variable, text: str) -> str:
    """A bad value as an error may show it: secrets hidden, URLs without credentials or query."""
    if var.secret:
        return "<hidden>"
    if var.field == "ws_url":
        return redact_url(text.strip())
    if var.field == "relay_nats":
        return redact_urls(text.strip())
    return text


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return json.dumps(dict(value))
    return str(value)


def help_text() -> str:
    """The variable table for ``python app.py --help``: name, default, meaning."""
    defaults = Config()
    lines = []
    for var in VARIABLES:
        default = getattr(defaults, var.field)
        shown = "(unset)" if default in (None, "", ()) else _as_text(default)
        lines.append(f"  {var.env:<28} default {shown:<10} {var.help}")
    return "\n".join(lines)


def variables_table_markdown(names: tuple[str, ...] | None = None) -> str:
    """The Markdown table of the variables (the README's, between ``<!-- variables:start/end -->``).

    ``names`` (full ``FORKLESS_*`` names) picks a subset, in ``VARIABLES`` order; ``gendocs.py``
    writes the table into the documents and ``tests/test_docs.py`` checks they hold it.
    """
    defaults = Config()
    known = {var.env for var in VARIABLES}
    unknown = sorted(set(names or ()) - known)
    if unknown:
        raise ValueError(f"not forkless variables: {', '.join(unknown)}")
    lines = ["| variable | default | allowed | meaning |", "|---|---|---|---|"]
    for var in VARIABLES:
        if names is not None and var.env not in names:
            continue
        default = getattr(defaults, var.field)
        shown = "(unset)" if default in (None, "", ()) else f"`{_as_text(default)}`"
        lines.append(f"| `{var.env}` | {shown} | {var.allowed} | {var.help} |")
    return "\n".join(lines) + "\n"
