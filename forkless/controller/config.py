"""Configuration: one frozen dataclass, read from ``FORKLESS_*`` environment variables.

Rules:
- Every variable is declared once, in ``VARIABLES`` (``controller/settings/variables.py``), with its
  rule (``controller/settings/values.py``: its text parsed, a value given in code checked by its
  type and bounds as it is); a field's default here is its variable's default.
- A bad value raises ``ConfigError`` naming the variable, the value and what is allowed;
  ``app.py`` turns it into exit status 2 before any thread starts.
- Secrets (``SUBSCRIBE``, ``AUTH_TOKEN``, ``HEADERS``) never appear in ``repr``, errors or ``--help``.
- A partitioned JetStream feed (``"partition_count"``) leaves here with its partitions resolved
  (``JetStreamSpec.partitions``): from its ``"partitions"`` or from ``FORKLESS_INSTANCE``/
  ``FORKLESS_INSTANCES``, exactly one of the two; it is the process's only feed, and its
  checkpoints go to ``FORKLESS_CHECKPOINT_BUCKET``, never ``FORKLESS_CHECKPOINT_DIR``.
- What a component reads is built here, in one place per group: the IO side's (``io_settings``,
  io_loop/settings.py) and the controller side's (``checkpoint_settings``, ``instance_settings``,
  ``step_settings``: controller/settings/groups.py); the composition roots hand each component its
  groups, never the whole ``Config``.
- The groups are public value objects (``SETTINGS_GROUPS``, as httpx's ``Timeout`` and ``Limits``): a
  ``Config`` is built from them as well as from its fields (``Config(reconnect=ReconnectSettings(max_s=60),
  features=4)``), takes from each group the fields it was built with (``given_fields``), refuses a field
  given twice with two values (``TypeError`` naming both), and gives each back (``config.reconnect``). The
  environment is read by the loader, ``Config.from_env``; its keyword arguments (fields or groups) win.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

from forkless.controller.errors import ConfigError
from forkless.controller.settings.feedspec import feed_list
from forkless.controller.settings.groups import CheckpointSettings, InstanceSettings, StepSettings, batch_buckets
from forkless.controller.settings.values import ValueProblem
from forkless.controller.settings.variables import PREFIX, VARIABLES, Variable, as_text, variable
from forkless.io_loop.connectors.jetstream.partitions import instance_share
from forkless.io_loop.errors import EXIT_LOSSY_STOP
from forkless.io_loop.net.netaddr import redact_url, redact_urls
from forkless.io_loop.settings import (
    DEFAULT_SOURCE_BUFFER,
    GROUPS,
    Credentials,
    DemoSettings,
    FeedSpec,
    IOSettings,
    JetStreamSpec,
    Limits,
    PartitionSettings,
    ReconnectSettings,
    RelaySettings,
    ReplyPolicy,
    Timeouts,
    TlsSettings,
    config_field,
    given_fields,
)

__all__ = ["SETTINGS_GROUPS", "Config"]

# the settings groups a Config is built from and gives back, by the name of its argument and property
# (``Config(step=StepSettings(...))``, ``config.step``): the IO side's (GROUPS) and the controller side's
SETTINGS_GROUPS: dict[str, type[Any]] = {"step": StepSettings, "checkpoints": CheckpointSettings, **GROUPS}


def _built_from_groups(cls: type[Config]) -> type[Config]:
    """``Config``'s ``__init__`` taking the settings groups beside the fields (``_flat_settings``), its
    signature saying so (``help(Config)``, ``inspect.signature``)."""
    build: Callable[..., None] = cls.__init__

    @functools.wraps(build)
    def __init__(self: Config, *args: Any, **settings: Any) -> None:
        build(self, *args, **_flat_settings(settings))

    parameters = list(inspect.signature(build).parameters.values())
    parameters += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                     annotation=f"{group.__name__} | None") for name, group in SETTINGS_GROUPS.items()]
    __init__.__signature__ = inspect.signature(build).replace(parameters=parameters)  # type: ignore[attr-defined]  # inspect reads it
    cls.__init__ = __init__  # type: ignore[method-assign]  # the dataclass's, wrapped
    return cls


@_built_from_groups
@dataclass(frozen=True)
class Config:
    """Everything the controller and the IO thread read; immutable once built.

    Build it directly (``Config(features=4, ws_url=...)``), from settings groups
    (``Config(reconnect=ReconnectSettings(max_s=60), checkpoints=CheckpointSettings(dir="ckpt"))``, any mix of
    the two), or with ``Config.from_env()``; read a group back as ``config.reconnect``, ``config.checkpoints`` …
    ``validate()`` runs on construction, so a ``Config`` that exists is a valid one.
    """

    ws_url: str = ""
    ws_unix_socket: str = ""  # connect to ws_url's feed through this unix-domain socket
    # a JSON text; in code also a JSON value (dict, list …), kept as its compact JSON text
    subscribe: str = field(default="", repr=False)
    auth_token: str = field(default="", repr=False)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    feeds: str = field(default="", repr=False)
    shared_streams: bool = False
    feed_fatal: str = "all"
    replies: ReplyPolicy = "all"
    ca_file: str = ""
    tls_insecure: bool = False
    features: int = 8
    # the default detector's (read only where it is built: processor.default_processor; the
    # demo feed plants anomalies after the warm-up): a processor of your own ignores them
    alpha: float = 0.05
    threshold: float = 4.0
    warmup: int = 20
    max_streams: int = 4096
    stream_idle_s: float | None = None
    devices: int | str = "all"
    max_batch: int = 256
    max_wait_ms: float = 2.0
    steps_in_flight: int | str = "auto"
    handoff: str = "auto"
    queue_size: int = 1024
    overflow: str = "block"
    source_buffer: int = DEFAULT_SOURCE_BUFFER
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
    lossy_stop_exit: int = EXIT_LOSSY_STOP  # the program's exit status after an orderly stop that lost messages
    status_s: float = 1.0
    log_level: str = "INFO"
    log_format: str = "text"
    metrics_addr: str = ""
    demo_rate: float = 200.0
    demo_streams: int = 8
    demo_unix_socket: str = ""  # the demo feed serves (and is read) on this unix-domain socket
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
    relay_max_held: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.subscribe, str):  # a JSON value given in code: stored as the text to send
            object.__setattr__(self, "subscribe", _subscribe_text(self.subscribe))
        self.validate()

    def validate(self) -> None:
        """Check every field by its variable's rule (its type and bounds, as it is), plus cross-field rules."""
        for var in VARIABLES:
            value = getattr(self, var.field)
            try:
                var.check(value)
            except (ValueError, TypeError, OSError) as exc:
                raise ConfigError(var.env, _shown(var, value), _allowed(var, exc)) from None
        if self.feeds and (self.ws_url or self.subscribe):
            both = "FORKLESS_WS_URL" if self.ws_url else "FORKLESS_SUBSCRIBE"
            raise ConfigError(PREFIX + "FEEDS", "<hidden>", f"either FORKLESS_FEEDS or {both} (the one-feed "
                              "shorthand), not both: move that feed into the FORKLESS_FEEDS list")
        self._validate_unix_sockets()
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

    def _validate_unix_sockets(self) -> None:
        """FORKLESS_WS_UNIX_SOCKET goes with FORKLESS_WS_URL (the handshake's path and Host), never with
        FORKLESS_FEEDS (whose entries take "unix_socket"); FORKLESS_DEMO_UNIX_SOCKET only with the demo feed."""
        if self.ws_unix_socket and self.feeds:
            raise ConfigError(PREFIX + "WS_UNIX_SOCKET", self.ws_unix_socket, 'empty with FORKLESS_FEEDS: give each '
                              'feed\'s socket as its entry\'s "unix_socket"')
        if self.ws_unix_socket and not self.ws_url:
            raise ConfigError(PREFIX + "WS_UNIX_SOCKET", self.ws_unix_socket, "set together with FORKLESS_WS_URL, "
                              "whose path and host the handshake sends through the socket (e.g. ws://localhost/feed); "
                              "for the embedded demo feed on a unix-domain socket, FORKLESS_DEMO_UNIX_SOCKET")
        if self.demo_unix_socket and not self.uses_demo_feed:
            raise ConfigError(PREFIX + "DEMO_UNIX_SOCKET", self.demo_unix_socket, f"empty when {self.feed_variable} "
                              "is set: the embedded demo feed runs only without a feed of your own (a feed's own "
                              'socket is FORKLESS_WS_UNIX_SOCKET, or "unix_socket" in its FORKLESS_FEEDS entry)')

    def _validate_credentials(self) -> None:
        """One source of handshake credentials per feed: URL user:password, AUTH_TOKEN, or an
        Authorization header in HEADERS or the feed's headers (aiohttp refuses two at once, and mid-run)."""
        several = bool(self.feeds)
        for feed in self.feed_specs if (self.ws_url or several) else ():
            if not feed.websocket:  # a connector's credentials are checked with its entry
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
            raise ConfigError(PREFIX + given, as_text(getattr(self, given.lower())),
                              f"set together with FORKLESS_{missing} (both or neither)")
        if self.instance is not None and self.instances is not None and self.instance >= self.instances:
            raise ConfigError(PREFIX + "INSTANCE", str(self.instance), f"an integer from 0 to FORKLESS_INSTANCES - 1 "
                              f"= {self.instances - 1} (instances are numbered from 0)")
        if self.checkpoint_bucket and self.checkpoint_dir:
            raise ConfigError(PREFIX + "CHECKPOINT_BUCKET", self.checkpoint_bucket, "either FORKLESS_CHECKPOINT_BUCKET "
                              "(a partitioned feed's checkpoints) or FORKLESS_CHECKPOINT_DIR, not both")
        partitioned = [feed for feed in self.feed_specs if feed.partitioned]
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
        """Batch sizes the step is compiled for (``batch_buckets``, controller/settings/groups.py)."""
        return batch_buckets(self.max_batch)

    # ---- the settings groups (SETTINGS_GROUPS), each from the fields it names -----------------------------

    @property
    def step(self) -> StepSettings:
        """The step's sizes and where it runs: features, max_streams, max_batch, devices, steps_in_flight."""
        return self._group(StepSettings)

    @property
    def checkpoints(self) -> CheckpointSettings:
        """Where and how often checkpoints are written, and whether one is restored (checkpoint_*)."""
        return self._group(CheckpointSettings)

    @property
    def reconnect(self) -> ReconnectSettings:
        """How a connection is retried (reconnect_min_s, _max_s, _reset_s, _tries)."""
        return self._group(ReconnectSettings)

    @property
    def timeouts(self) -> Timeouts:
        """How long a connection's steps may take: connect_timeout_s, heartbeat_s, stale_s, shutdown_timeout_s."""
        return self._group(Timeouts)

    @property
    def tls(self) -> TlsSettings:
        """How a TLS connection is verified: ca_file, tls_insecure."""
        return self._group(TlsSettings)

    @property
    def credentials(self) -> Credentials:
        """What every WebSocket handshake carries: headers, auth_token (kept out of ``repr``)."""
        return self._group(Credentials)

    @property
    def limits(self) -> Limits:
        """The sizes of what a source reads and hands over: features, max_batch, queue_size, overflow,
        max_msg_bytes, source_buffer."""
        return self._group(Limits)

    @property
    def demo(self) -> DemoSettings:
        """The embedded demo feed's: demo_rate, demo_streams, demo_unix_socket, features, warmup."""
        return self._group(DemoSettings)

    @property
    def partitioning(self) -> PartitionSettings:
        """A partitioned feed's buckets and leases: checkpoint_bucket, lease_bucket, lease_s."""
        return self._group(PartitionSettings)

    @property
    def feed_variable(self) -> str:
        """The variable that configures the feeds: ``FORKLESS_FEEDS``, ``FORKLESS_WS_URL``, or "" (neither:
        the embedded demo feed's place, or an embedding program's own sources)."""
        return PREFIX + "FEEDS" if self.feeds else PREFIX + "WS_URL" if self.ws_url else ""

    @property
    def uses_demo_feed(self) -> bool:
        """Neither ``FORKLESS_WS_URL`` nor ``FORKLESS_FEEDS`` is set: the embedded demo feed runs."""
        return self.ws_url == "" and self.feeds == ""

    @cached_property
    def feed_specs(self) -> tuple[FeedSpec, ...]:
        """The feeds to connect to: ``FORKLESS_FEEDS``, else one feed named ``0`` from
        ``FORKLESS_WS_URL``/``FORKLESS_SUBSCRIBE`` (its url is empty for the demo feed)."""
        if self.feeds:
            return _assign_partitions(feed_list(self.feeds, self.replies), self.instance, self.instances)
        return (FeedSpec("0", self.ws_url, self.subscribe, replies=self.replies, unix_socket=self.ws_unix_socket),)

    @property
    def stream_keys_by_feed(self) -> bool:
        """True when a stream is identified by (feed, stream): several feeds, not shared."""
        return len(self.feed_specs) > 1 and not self.shared_streams

    @property
    def checkpoints_on(self) -> bool:
        """``FORKLESS_CHECKPOINT_DIR`` or ``FORKLESS_CHECKPOINT_BUCKET`` is set: checkpoints are
        written (and restored unless ``FORKLESS_CHECKPOINT_RESTORE=never``)."""
        return self.checkpoint_settings().on

    def io_settings(self) -> IOSettings:
        """What the IO side reads of this configuration (io_loop/settings.py): ``feed_specs`` and
        ``uses_demo_feed`` as derived here, and each group's fields from the fields they name
        (the demo feed's warm-up is the default detector's, FORKLESS_WARMUP: when it starts
        planting anomalies)."""
        groups = {name: self._group(group) for name, group in GROUPS.items()}
        return IOSettings(feed_specs=self.feed_specs, feeds_from_list=self.feeds != "", feed_fatal=self.feed_fatal,
                          uses_demo_feed=self.uses_demo_feed, metrics_addr=self.metrics_addr, **groups)

    def checkpoint_settings(self) -> CheckpointSettings:
        """What the checkpoints' writer, their store's choice and recovery read (controller/settings/groups.py):
        ``checkpoints``."""
        return self.checkpoints

    def instance_settings(self) -> InstanceSettings:
        """What a partitioned instance's leases and checkpoint objects read (controller/settings/groups.py): its
        store connects as the IO side's connections do, with their groups."""
        io = self.io_settings()
        return self._group(InstanceSettings, partitioning=io.partitioning, timeouts=io.timeouts,
                           reconnect=io.reconnect, tls=io.tls)

    def step_settings(self) -> StepSettings:
        """What compiling and running the step reads (controller/settings/groups.py): controller/engine.py and
        controller/device/: ``step``."""
        return self.step

    def _group(self, group: type, **given: Any) -> Any:
        """A settings group, each field not ``given`` from the field it names (``config_field``)."""
        return group(**{f.name: getattr(self, config_field(f)) for f in dataclasses.fields(group)
                        if f.name not in given}, **given)

    def relay_settings(self) -> tuple[IOSettings, RelaySettings]:
        """What ``forkless relay`` runs with: the IO side's settings (its feeds never sent a reply)
        and the publisher's; ``ConfigError`` naming the variable (or the feed) the relay cannot use:
        FORKLESS_RELAY_NATS or FORKLESS_RELAY_SUBJECT unset, a JetStream entry in FORKLESS_FEEDS,
        FORKLESS_OVERFLOW=drop_oldest (the relay never drops a message)."""
        for var, value in (("RELAY_NATS", self.relay_nats), ("RELAY_SUBJECT", self.relay_subject)):
            if not value:
                raise ConfigError(PREFIX + var, "", f"to be set for the relay: {variable(var).allowed}")
        for index, spec in enumerate(self.feed_specs):
            if not spec.websocket:
                raise ConfigError(PREFIX + "FEEDS", "<hidden>", f"WebSocket feeds only for the relay: feed {index} "
                                  f"({spec.name!r}) is a JetStream feed (\"nats\"); the relay publishes to "
                                  "FORKLESS_RELAY_NATS, it does not read a stream")
        if self.overflow != "block":
            raise ConfigError(PREFIX + "OVERFLOW", self.overflow, "block for the relay: it never drops a message "
                              "(a full inbound queue stops reading the socket)")
        for index, spec in enumerate(self.feed_specs):
            if spec.overflow not in ("", "block"):
                raise ConfigError(PREFIX + "FEEDS", "<hidden>", f'"overflow" block for the relay: feed {index} '
                                  f"({spec.name!r}) has {spec.overflow!r}; the relay never drops a message")
        io = self.io_settings()
        io = dataclasses.replace(io, feed_specs=tuple(dataclasses.replace(spec, replies="none")
                                                      for spec in io.feed_specs))
        target = FeedSpec("relay", self.relay_nats, jetstream=JetStreamSpec("", token=self.relay_token,
                                                                              creds=self.relay_creds))
        return io, RelaySettings(target, self.relay_subject, self.relay_seq, self.relay_max_held, timeouts=io.timeouts,
                                 reconnect=io.reconnect, tls=io.tls)

    def replace(self, **changes: Any) -> Config:
        """This configuration with ``changes``: fields, or settings groups (the fields each was built with)."""
        return dataclasses.replace(self, **_flat_settings(changes))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Read every ``FORKLESS_*`` variable that is set; unset ones keep their default. ``overrides`` (fields,
        or settings groups: ``checkpoints=CheckpointSettings(dir=...)``) win over the environment."""
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
        values.update(_flat_settings(overrides))
        return cls(**values)

    def check_demo_feed(self) -> None:
        """The demo feed's own settings, checked only where it runs (``feed_plan``: no feed
        configured and no source of the embedding program's; the program checks it up front):
        ``ConfigError`` when ``FORKLESS_DEMO_STREAMS`` exceeds ``FORKLESS_MAX_STREAMS``."""
        if self.demo_streams > self.max_streams:
            raise ConfigError(PREFIX + "DEMO_STREAMS", str(self.demo_streams),
                              f"at most FORKLESS_MAX_STREAMS ({self.max_streams}) when the demo feed runs")


def _flat_settings(given: Mapping[str, Any]) -> dict[str, Any]:
    """``Config``'s keyword arguments with each settings group (``SETTINGS_GROUPS``) spread into the fields it
    names: the fields it was built with (``given_fields``), so its defaults override nothing. A field given
    twice with two values (a keyword and a group, or two groups sharing it: ``features``) is a ``TypeError``
    naming both, as is a group argument that is not its group."""
    flat = {name: value for name, value in given.items() if name not in SETTINGS_GROUPS}
    where = {name: f"{name}=" for name in flat}  # how each field was given, for the error
    for argument, kind in SETTINGS_GROUPS.items():
        group = given.get(argument)
        if group is None:
            continue
        if not isinstance(group, kind):
            raise TypeError(f"Config({argument}=...) takes a forkless.{kind.__name__} (such as "
                            f"{argument}={kind.__name__}(...)), not {type(group).__name__}")
        chosen = given_fields(group)
        for f in dataclasses.fields(group):
            if f.name not in chosen:
                continue
            name, value, how = config_field(f), getattr(group, f.name), f"{argument}={kind.__name__}({f.name}=...)"
            if name in flat and flat[name] != value:
                raise TypeError(f"Config(...) got two values for {name}: as {where[name]} and as {how}; give it once")
            flat[name], where[name] = value, how
    return flat


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


def _assign_partitions(feeds: tuple[FeedSpec, ...], instance: int | None,
                       instances: int | None) -> tuple[FeedSpec, ...]:
    """The feeds with a partitioned feed's partitions resolved: its own ``"partitions"``, or instance
    ``instance`` of ``instances``'s share of its partition_count; ``ConfigError`` when both are given
    or neither."""
    out = []
    for index, feed in enumerate(feeds):
        if not feed.partitioned:
            out.append(feed)
            continue
        label = f"feed {index} ({feed.name!r})"
        where = f"{label} of FORKLESS_FEEDS"
        if instance is not None and instances is not None:
            if feed.partitions:
                raise ConfigError(PREFIX + "INSTANCE", str(instance), f'no FORKLESS_INSTANCE/FORKLESS_INSTANCES '
                                  f'when {where} names its "partitions": either the entry\'s partitions or this '
                                  "instance's share of its partition_count, not both")
            try:
                share = instance_share(instance, instances, feed.partition_count)
            except ValueError as exc:
                raise ConfigError(PREFIX + "INSTANCES", str(instances), f"at most the partition_count of {where} "
                                  f"({feed.partition_count}): {exc}") from None
            feed = feed.with_partitions(share)
        elif not feed.partitions:
            raise ConfigError(PREFIX + "FEEDS", "<hidden>", f'{label}: a partitioned '
                              'feed ("partition_count") needs the partitions this instance owns: "partitions" in '
                              'the entry (such as "0-5"), or FORKLESS_INSTANCE and FORKLESS_INSTANCES (instance i '
                              "of N owns its contiguous share of the partition_count)")
        out.append(feed)
    return tuple(out)


def _allowed(var: Variable, exc: BaseException) -> str:
    """What the variable allows, plus the parser's detail when it gave one (``ValueProblem``)."""
    return f"{var.allowed}: {exc}" if isinstance(exc, ValueProblem) else var.allowed


def _shown(var: Variable, value: Any) -> str:
    """A bad value (its text, or a value given in code) as an error may show it: written as the
    variable would be (``as_text``), secrets hidden, URLs without credentials or query."""
    if var.secret:
        return "<hidden>"
    text = as_text(value) if value is None or isinstance(value, (str, int, float)) else str(value)
    if var.field == "ws_url":
        return redact_url(text.strip())
    if var.field == "relay_nats":
        return redact_urls(text.strip())
    return text
