"""What the IO side reads of the configuration: small frozen value objects, each handed only to what reads it.

Rules:
- Built by the controller from its validated ``Config`` (``Config.io_settings()``), so a
  value here was checked there, with the error naming the variable; nothing here reads the
  environment or validates. ``IOSettings`` holds the feeds and the groups (``GROUPS``:
  reconnect, timeouts, TLS, credentials, limits, the demo feed, partitioning); the
  composition roots (controller/ioside.py's ``feed_sources``, io_loop/thread.py) hand each
  component the groups it reads as typed constructor arguments, never the whole
  ``IOSettings`` nor the configuration.
- A field has the name of the ``Config`` field it comes from (``FORKLESS_<NAME>``), or names
  it with ``_from`` (``ReconnectSettings.min_s`` is ``reconnect_min_s``), so the variable
  behind a value is easy to find; ``feed_specs`` and ``uses_demo_feed`` are what
  ``Config`` derives from ``FORKLESS_WS_URL``/``SUBSCRIBE``/``FEEDS``.
- Immutable, so every thread may read them. Secrets (``auth_token``, ``headers``, a feed's
  ``subscribe`` and ``headers``) stay out of ``repr``.
- The groups are public value objects too (``forkless.Timeouts``, ``forkless.Limits`` …, as httpx's ``Timeout``
  and ``Limits``): a program builds ``Config`` from them (``Config(timeouts=Timeouts(stale_s=30))``) and reads
  them back (``config.timeouts``). Each field's default is its ``Config`` field's
  (tests/controller/settings/test_config.py holds
  it), and a group remembers the fields it was built with (``given_fields``): ``Config`` takes those from it,
  so a group's defaults never override what another argument gives.
- A partitioned JetStream feed's ``partitions`` are already resolved (from its entry's
  ``"partitions"`` or from ``FORKLESS_INSTANCE``/``FORKLESS_INSTANCES``): the IO side consumes
  ``JetStreamSpec.subjects()`` and never works out a share itself (io_loop/connectors/jetstream/partitions.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any, Literal, TypeVar, get_args

from forkless.io_loop.connectors.jetstream.partitions import PARTITION_FIELD, partition_subjects
from forkless.io_loop.net.netaddr import redact_url, redact_urls, unix_label

__all__ = ["DEFAULT_SOURCE_BUFFER", "GROUPS", "OVERFLOW_POLICIES", "REPLY_POLICIES", "SEQ_MODES", "Credentials",
           "DemoSettings", "FeedSpec", "IOSettings", "JetStreamSpec", "Limits", "OverflowPolicy", "PartitionSettings",
           "ReconnectSettings", "RelaySettings", "ReplyPolicy", "Timeouts", "TlsSettings", "config_field",
           "given_fields", "settings_group"]

# what a feed is sent back (FORKLESS_REPLIES, a feed's "replies"): "all" results and error
# replies; "results" no error frames; "none" nothing but the subscription (and the protocol's
# own ping/pong/close): results still reach the controller's sinks and the counters
ReplyPolicy = Literal["all", "results", "none"]
REPLY_POLICIES: tuple[ReplyPolicy, ...] = get_args(ReplyPolicy)
# what a source's emits do beyond its own buffer while inbound is full (FORKLESS_OVERFLOW, a feed's or a
# source's "overflow"; io_loop/spill.py): "block" waits for room, "drop_oldest" drops its oldest waiting item
OverflowPolicy = Literal["block", "drop_oldest"]
OVERFLOW_POLICIES: tuple[OverflowPolicy, ...] = get_args(OverflowPolicy)
# how the relay's feeds number their messages (FORKLESS_RELAY_SEQ), for counting gaps
# (io_loop/connectors/jetstream/publisher.py)
SEQ_MODES = ("feed", "stream", "none")

# messages and events one source may hold while the inbound queue is full (FORKLESS_SOURCE_BUFFER,
# io_loop/spill.py): a 9 s stall of the main loop at 500 trades/s is 4,500 events, beyond the
# 1024 items the inbound queue holds; 20,000 rides out a 40 s stall at that rate, its memory
# bounded at about 20,000 x a message's or an event's size
DEFAULT_SOURCE_BUFFER = 20_000

CONFIG_FIELD = "config_field"  # a group field's metadata: the Config field it comes from (``_from``)
GIVEN = "_given"  # a settings group's record of the fields it was built with (``settings_group``)

G = TypeVar("G")

@dataclass(frozen=True)
class JetStreamSpec:
    """What a JetStream feed of ``FORKLESS_FEEDS`` (an entry with ``"nats"``) adds to its
    ``FeedSpec``: the stream it consumes, the subject filter, the subject its replies are
    published to, where it starts without a checkpoint's position, and its credentials
    (besides a user:password in the URL), which stay out of ``repr``."""

    stream: str
    subject: str = ""  # the consumer's filter; "" consumes the whole stream
    results: str = ""  # replies are published here ("" only with the reply policy "none")
    start: str = "first"  # "first" (the stream's first message) or "new" (what arrives after the start)
    token: str = field(default="", repr=False)
    creds: str = ""  # the path of a NATS .creds file (its content is the secret, the path is not)
    # a partitioned feed (docs/partitions.md): P, the stream's partition count
    # (its subject transform's {{partition(P,…)}}), 0 when not partitioned; ``subject`` then holds
    # ``{partition}`` as one whole token, and ``partitions`` are the ones this instance owns, sorted
    partition_count: int = 0
    partitions: tuple[int, ...] = ()

    @property
    def partitioned(self) -> bool:
        """The feed consumes some of the stream's P partitions (``"partition_count"`` given)."""
        return self.partition_count > 0

    def subjects(self) -> tuple[str, ...]:
        """The consumer's filter subjects: one per owned partition (``subject`` with ``{partition}``
        replaced), else ``(subject,)``, or ``()`` for the whole stream."""
        if self.partitioned:
            return partition_subjects(self.subject, self.partitions)
        return (self.subject,) if self.subject else ()

    @cached_property
    def _partition_token(self) -> int:
        """Where ``subject`` has ``{partition}`` (its token's index), worked out once."""
        return self.subject.split(".").index(PARTITION_FIELD)

    def partition_of_subject(self, subject: str) -> int:
        """The partition a delivered message's subject names: its token where ``subject`` has
        ``{partition}``. ValueError if the feed is not partitioned, or that token is not a
        partition 0..P-1 (a subject the stream's transform did not make)."""
        if not self.partitioned:
            raise ValueError(f"stream {self.stream!r} is not consumed by partition (no partition_count)")
        position = self._partition_token
        tokens = subject.split(".")
        token = tokens[position] if position < len(tokens) else ""
        if not (token.isascii() and token.isdigit() and str(int(token)) == token) or \
                int(token) >= self.partition_count:
            raise ValueError(f"subject {subject!r} has no partition 0-{self.partition_count - 1} where "
                             f"{self.subject!r} has {PARTITION_FIELD}")
        return int(token)


@dataclass(frozen=True)
class FeedSpec:
    """One feed of ``FORKLESS_FEEDS`` (or the one ``FORKLESS_WS_URL`` names): where to connect,
    what to send first, extra handshake headers. ``name`` labels its metrics, logs and (with
    several feeds, unless ``FORKLESS_SHARED_STREAMS=1``) its streams' identities; ``replies``
    says what it is sent back. ``unix_socket``: a WebSocket feed reached through that
    unix-domain socket, ``url`` then giving only the handshake's path and Host (and TLS's
    server name for wss://)."""

    name: str
    url: str
    subscribe: str = field(default="", repr=False)  # sent as is on every new connection
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    required: bool = True  # /readyz waits for it
    replies: ReplyPolicy = "all"
    # its own overflow (io_loop/spill.py): "" and None take FORKLESS_OVERFLOW and FORKLESS_SOURCE_BUFFER
    overflow: str = ""
    buffer: int | None = None
    # a JetStream feed: ``url`` holds its NATS server URL(s), comma-separated (io_loop/connectors/jetstream/source.py)
    jetstream: JetStreamSpec | None = None
    unix_socket: str = ""  # a WebSocket feed's unix-domain socket ("": TCP to the URL's host and port)

    def __repr__(self) -> str:  # the URL without credentials (user:password@ in a URL is a secret)
        via = f", unix_socket={self.unix_socket!r}" if self.unix_socket else ""
        return (f"FeedSpec(name={self.name!r}, url={self.shown_url!r}{via}, required={self.required!r}, "
                f"replies={self.replies!r}, jetstream={self.jetstream!r})")

    @property
    def websocket(self) -> bool:
        """A WebSocket feed (or the demo feed's, a user's source's place): not a connector's (a JetStream feed's)."""
        return self.jetstream is None

    @property
    def partitioned(self) -> bool:
        """It consumes some of its stream's partitions (a JetStream entry with ``"partition_count"``)."""
        return self.jetstream is not None and self.jetstream.partitioned

    @property
    def partition_count(self) -> int:
        """Its stream's partitions (0: not partitioned)."""
        return self.jetstream.partition_count if self.jetstream is not None else 0

    @property
    def partitions(self) -> tuple[int, ...]:
        """The partitions this instance owns, as resolved (``with_partitions``) or given in its entry."""
        return self.jetstream.partitions if self.jetstream is not None else ()

    def with_partitions(self, partitions: tuple[int, ...]) -> FeedSpec:
        """This partitioned feed owning ``partitions`` (config.py resolves them from FORKLESS_INSTANCE)."""
        if self.jetstream is None:
            raise ValueError(f"{self.label} is not partitioned")
        return replace(self, jetstream=replace(self.jetstream, partitions=tuple(partitions)))

    @property
    def shown_url(self) -> str:
        """The URL(s) as logs may show them: no credentials, no query."""
        return redact_urls(self.url) if self.jetstream is not None else redact_url(self.url)

    @property
    def label(self) -> str:
        """How messages name it: ``feed 'name' (ws://host/path)``, never with credentials or query;
        ``feed 'name' (ws://host/path via unix:/path)`` through a unix-domain socket."""
        if not self.url:  # a user's own source (or the demo feed, before its address is known)
            return f"feed {self.name!r}"
        via = f" via {unix_label(self.unix_socket)}" if self.unix_socket else ""
        return f"feed {self.name!r} ({self.shown_url}{via})"


def _from(config_field: str, **kwargs: Any) -> Any:
    """A field whose value is ``Config.<config_field>`` (``FORKLESS_<CONFIG_FIELD>``), named otherwise here."""
    return field(metadata={CONFIG_FIELD: config_field}, **kwargs)


def settings_group(cls: type[G]) -> type[G]:
    """A settings group (a frozen, keyword-only dataclass) that remembers which of its fields it was built with
    (``given_fields``): ``Config(limits=Limits(queue_size=64))`` takes ``queue_size`` from it, and a field it
    shares with another group (``features``) from that group, a keyword or ``Config``'s default."""
    build = cls.__init__

    @functools.wraps(build)
    def __init__(self: Any, **values: Any) -> None:
        build(self, **values)
        object.__setattr__(self, GIVEN, frozenset(values))

    cls.__init__ = __init__  # type: ignore[method-assign]  # the dataclass's, wrapped
    return cls


def given_fields(group: Any) -> frozenset[str]:
    """The fields ``group`` was built with (``settings_group``): all of them where one was built from a
    ``Config`` (``config.limits``) or by ``dataclasses.replace``."""
    return getattr(group, GIVEN, frozenset(f.name for f in fields(group)))


@settings_group
@dataclass(frozen=True, kw_only=True)
class ReconnectSettings:
    """How a connection is retried (io_loop/backoff.py's ``Backoff.of``): FORKLESS_RECONNECT_MIN_S, _MAX_S,
    _RESET_S, _TRIES; read by every connection's loop (WebSocket, JetStream, the store, the relay)."""

    min_s: float = _from("reconnect_min_s", default=0.5)
    max_s: float = _from("reconnect_max_s", default=30.0)
    reset_s: float = _from("reconnect_reset_s", default=5.0)
    tries: int = _from("reconnect_tries", default=0)  # failures in a row before giving up (0: never)


@settings_group
@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """How long a connection's steps may take (io_loop/connectors/websocket/connect.py,
    io_loop/connectors/jetstream/transport.py, the stop): FORKLESS_CONNECT_TIMEOUT_S, _HEARTBEAT_S, _STALE_S,
    _SHUTDOWN_TIMEOUT_S."""

    connect_timeout_s: float = 10.0  # a connection and its handshake; a JetStream API call
    heartbeat_s: float = 15.0  # the WebSocket ping / the NATS ping interval (0: none)
    stale_s: float = 0.0  # a WebSocket feed with no frame for this long is reconnected (0: never)
    shutdown_timeout_s: float = 10.0  # the orderly stop's bound


@settings_group
@dataclass(frozen=True, kw_only=True)
class TlsSettings:
    """How a TLS connection is verified (io_loop/net/tls.py's ``make_ssl_context``)."""

    ca_file: str = ""  # FORKLESS_CA_FILE, added to the system trust store
    insecure: bool = _from("tls_insecure", default=False)  # FORKLESS_TLS_INSECURE: verification off


@settings_group
@dataclass(frozen=True, kw_only=True)
class Credentials:
    """What every WebSocket handshake carries (io_loop/connectors/websocket/connect.py's ``handshake_headers``), kept
    out of ``repr``: FORKLESS_HEADERS and FORKLESS_AUTH_TOKEN (a feed's own headers are its ``FeedSpec``'s)."""

    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    auth_token: str = field(default="", repr=False)


@settings_group
@dataclass(frozen=True, kw_only=True)
class Limits:
    """The sizes of what a source reads and hands over (io_loop/source.py, io_loop/spill.py, the bridge):
    FORKLESS_FEATURES and _MAX_BATCH (the step's too: ``StepSettings``), _QUEUE_SIZE, _OVERFLOW,
    _MAX_MSG_BYTES, _SOURCE_BUFFER."""

    features: int = 8
    max_batch: int = 256  # a chunk handed over holds at most a batch's messages (or one frame's)
    queue_size: int = 1024
    overflow: str = "block"  # "block" or "drop_oldest": a source's own buffer full (io_loop/spill.py)
    max_msg_bytes: int = 1 << 20
    # messages and events each source may hold while inbound is full (io_loop/spill.py)
    source_buffer: int = DEFAULT_SOURCE_BUFFER


@settings_group
@dataclass(frozen=True, kw_only=True)
class DemoSettings:
    """The embedded demo feed's (io_loop/connectors/websocket/demo_source.py): FORKLESS_DEMO_RATE, _STREAMS,
    _UNIX_SOCKET, and what its messages carry (FORKLESS_FEATURES values each)."""

    rate: float = _from("demo_rate", default=200.0)
    streams: int = _from("demo_streams", default=8)
    features: int = 8
    # messages each demo stream sends before the demo feed plants anomalies in it: the default
    # detector's warm-up (FORKLESS_WARMUP), which the demo feed's recall is scored against
    warmup: int = 20
    # the demo feed serves on this unix-domain socket, and is read through it ("": loopback TCP)
    unix_socket: str = _from("demo_unix_socket", default="")


@settings_group
@dataclass(frozen=True, kw_only=True)
class PartitionSettings:
    """A partitioned feed's checkpoints ("": none) and leases: JetStream buckets on its server
    (io_loop/connectors/jetstream/store.py; ``--check`` looks for them, io_loop/connectors/jetstream/probe.py):
    FORKLESS_CHECKPOINT_BUCKET (``CheckpointSettings.bucket`` too), _LEASE_BUCKET, _LEASE_S."""

    checkpoint_bucket: str = ""
    lease_bucket: str = "forkless-leases"
    lease_s: float = 10.0


# the groups of IOSettings, by the name of its field holding each (Config.io_settings builds them)
GROUPS = {"reconnect": ReconnectSettings, "timeouts": Timeouts, "tls": TlsSettings, "credentials": Credentials,
          "limits": Limits, "demo": DemoSettings, "partitioning": PartitionSettings}


def config_field(f: Any) -> str:
    """The ``Config`` field a group's field comes from: its own name unless ``_from`` names another."""
    return f.metadata.get(CONFIG_FIELD, f.name)


@dataclass(frozen=True, kw_only=True)
class IOSettings:
    """Everything the IO side reads (see the module rules): the feeds, and the groups of settings that the
    composition roots (controller/ioside.py's ``feed_sources``, io_loop/thread.py) hand each component, only the
    ones it reads."""

    # the feeds
    feed_specs: tuple[FeedSpec, ...]  # one per connection; a url of "" is the embedded demo feed's
    feeds_from_list: bool  # they came from FORKLESS_FEEDS (else FORKLESS_WS_URL / SUBSCRIBE)
    feed_fatal: str  # "all" or "any"
    uses_demo_feed: bool
    # served beside the feeds
    metrics_addr: str
    # the groups (GROUPS)
    reconnect: ReconnectSettings
    timeouts: Timeouts
    tls: TlsSettings
    credentials: Credentials
    limits: Limits
    demo: DemoSettings
    partitioning: PartitionSettings = PartitionSettings()


@dataclass(frozen=True)
class RelaySettings:
    """What the relay's publisher reads (io_loop/connectors/jetstream/publisher.py), from ``Config.relay_settings()``:
    its NATS
    server(s), described as a JetStream feed's are (``target.url`` comma-separated, the token and
    creds in ``target.jetstream``, its stream name unused), the subject prefix
    (FORKLESS_RELAY_SUBJECT), how the feeds number their messages (FORKLESS_RELAY_SEQ), the
    most messages it holds unacknowledged (FORKLESS_RELAY_MAX_HELD), and the groups its connection reads (the IO
    side's own)."""

    target: FeedSpec
    subject: str
    seq: str = "feed"  # one of SEQ_MODES
    max_held: int = 256
    timeouts: Timeouts = field(kw_only=True)
    reconnect: ReconnectSettings = field(kw_only=True)
    tls: TlsSettings = field(kw_only=True)
