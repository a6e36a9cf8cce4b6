"""Configuration: ``Config`` is its settings groups, read from ``FORKLESS_*`` environment variables or given in code.

Rules:
- Every setting is declared once, as a field of one settings group in the room that reads it (io_loop/settings.py's
  rules). ``GROUPS`` lists the groups by the name ``Config`` takes and gives each by (``config.step``);
  ``VARIABLES``, the environment's reader, ``--help`` and docs/variables.md are drawn from their declarations.
- A ``Config`` is built from groups, from keywords (a variable's name in lower case: ``Config(max_batch=16)``), or
  both: a group gives only the fields it was built with (``given_fields``), so its defaults never override another
  argument. A setting given twice with two values, or an unknown keyword, is a ``TypeError``.
- A bad value raises ``ConfigError`` naming the variable, the value and what is allowed, where it is given; the
  rules between groups are checked here (``validate``). Secrets never appear in ``repr``, errors or ``--help``.
- What a component reads is built here, one place each (``io_settings``, ``instance_settings``); the composition
  roots hand each component its groups, never the whole ``Config``.
- The controller never asks which kind a feed is: what a feed is asked goes through its ``FeedSpec`` and connector.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from forkless.controller.settings.groups import (
    CheckpointSettings,
    DetectorSettings,
    InstanceSettings,
    LoopSettings,
    RunSettings,
    StepSettings,
)
from forkless.io_loop.connectors.jetstream.settings import PartitionSettings
from forkless.io_loop.connectors.websocket.settings import Credentials, DemoSettings, WebSocketSettings
from forkless.io_loop.errors import ConfigError
from forkless.io_loop.feedlist import FeedSettings, check_feed_credentials
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.iosettings import IOSettings
from forkless.io_loop.relay.settings import RelaySettings
from forkless.io_loop.renamed import deprecated
from forkless.io_loop.settings import (
    PREFIX,
    Limits,
    ReconnectSettings,
    Setting,
    Timeouts,
    TlsSettings,
    given_fields,
    holding_moved,
    moved_fields,
    settings_of,
)

__all__ = ["GROUPS", "VARIABLES", "Config", "variable"]

# the settings groups a Config is, by the name of its argument and property (``Config(step=StepSettings(...))``,
# ``config.step``), in the order the documents list their variables
GROUPS: dict[str, type] = {
    "websocket": WebSocketSettings,
    "credentials": Credentials,
    "feeding": FeedSettings,
    "tls": TlsSettings,
    "step": StepSettings,
    "detector": DetectorSettings,
    "loop": LoopSettings,
    "limits": Limits,
    "timeouts": Timeouts,
    "reconnect": ReconnectSettings,
    "run": RunSettings,
    "demo": DemoSettings,
    "checkpoints": CheckpointSettings,
    "partitioning": PartitionSettings,
    "relay": RelaySettings,
}
# every setting, in the groups' order: what --help, --check and docs/variables.md list
VARIABLES: tuple[Setting, ...] = tuple(declared for group in GROUPS.values() for declared in settings_of(group))
_KEYWORDS: dict[str, Setting] = {declared.keyword: declared for declared in VARIABLES}
_GROUP_NAME: dict[type, str] = {group: name for name, group in GROUPS.items()}
if len(_KEYWORDS) != len(VARIABLES) or set(_KEYWORDS) & set(GROUPS):
    raise RuntimeError("two settings share a keyword, or a setting's keyword is a group's name")  # a declaring error


def variable(name: str) -> Setting:
    """The setting of the variable named ``name`` (without the prefix)."""
    return next(declared for declared in VARIABLES if declared.name == name)


@dataclass(frozen=True, init=False)
class Config:
    """Everything the controller and the IO thread read, as settings groups; immutable once built.

    Build it from groups (``Config(reconnect=ReconnectSettings(max_s=60), checkpoints=CheckpointSettings(dir=...))``),
    from keywords named as the variables are (``Config(features=4, ws_url=...)``), any mix of the two, or with
    ``Config.from_env()``; read a group back as ``config.reconnect``, ``config.checkpoints`` …, a setting as
    ``config.reconnect.max_s`` or by its keyword, ``config.reconnect_max_s``. A ``Config`` that exists is a valid one.
    """

    websocket: WebSocketSettings
    credentials: Credentials
    feeding: FeedSettings
    tls: TlsSettings
    step: StepSettings
    detector: DetectorSettings
    loop: LoopSettings
    limits: Limits
    timeouts: Timeouts
    reconnect: ReconnectSettings
    run: RunSettings
    demo: DemoSettings
    checkpoints: CheckpointSettings
    partitioning: PartitionSettings
    relay: RelaySettings

    def __init__(self, **settings: Any) -> None:
        for name, group in _groups(settings).items():
            object.__setattr__(self, name, group)
        for name, group in GROUPS.items():  # a deprecated read of a moved field (config.limits.features) still works
            moved = group.__moved__  # type: ignore[attr-defined]
            if moved:
                holding_moved(getattr(self, name), {keyword: getattr(self, keyword) for keyword in moved.values()})
        self.validate()

    def __getattr__(self, name: str) -> Any:
        """A setting read by its keyword (``config.max_batch`` is ``config.step.max_batch``)."""
        declared = _KEYWORDS.get(name) if not name.startswith("_") else None
        if declared is None:
            raise AttributeError(f"'Config' object has no attribute {name!r}")
        return getattr(getattr(self, _GROUP_NAME[declared.group]), declared.field)  # type: ignore[index]

    def validate(self) -> None:
        """The rules between groups (each group checked its own values when it was made)."""
        feeds, ws = self.feeding.feeds, self.websocket
        if feeds and (ws.url or ws.subscribe):
            both = "FORKLESS_WS_URL" if ws.url else "FORKLESS_SUBSCRIBE"
            raise ConfigError(PREFIX + "FEEDS", "<hidden>", f"either FORKLESS_FEEDS or {both} (the one-feed "
                              "shorthand), not both: move that feed into the FORKLESS_FEEDS list")
        if ws.unix_socket and feeds:
            raise ConfigError(PREFIX + "WS_UNIX_SOCKET", ws.unix_socket, 'empty with FORKLESS_FEEDS: give each '
                              'feed\'s socket as its entry\'s "unix_socket"')
        if ws.unix_socket and not ws.url:
            raise ConfigError(PREFIX + "WS_UNIX_SOCKET", ws.unix_socket, "set together with FORKLESS_WS_URL, "
                              "whose path and host the handshake sends through the socket (e.g. ws://localhost/feed); "
                              "for the embedded demo feed on a unix-domain socket, FORKLESS_DEMO_UNIX_SOCKET")
        if self.demo.unix_socket and not self.uses_demo_feed:
            raise ConfigError(PREFIX + "DEMO_UNIX_SOCKET", self.demo.unix_socket, f"empty when {self.feed_variable} "
                              "is set: the embedded demo feed runs only without a feed of your own (a feed's own "
                              'socket is FORKLESS_WS_UNIX_SOCKET, or "unix_socket" in its FORKLESS_FEEDS entry)')
        self._validate_partitions()
        self._validate_credentials()

    def _validate_credentials(self) -> None:
        """One source of handshake credentials per WebSocket feed (``check_credentials``), and for the feeds that
        have no URL here (the demo feed's place, a program's own sources) FORKLESS_AUTH_TOKEN or an Authorization
        header, not both."""
        named = PREFIX + ("FEEDS" if self.feeding.feeds else "HEADERS")
        check_feed_credentials(self.feed_specs, self.credentials, named)

    def _validate_partitions(self) -> None:
        """A partitioned feed and what goes with it: FORKLESS_INSTANCE and its checkpoints' bucket only with one,
        its checkpoints in the bucket and nowhere else."""
        parts, checkpoint_dir = self.partitioning, self.checkpoints.dir
        if parts.checkpoint_bucket and checkpoint_dir:
            raise ConfigError(PREFIX + "CHECKPOINT_BUCKET", parts.checkpoint_bucket, "either "
                              "FORKLESS_CHECKPOINT_BUCKET (a partitioned feed's checkpoints) or "
                              "FORKLESS_CHECKPOINT_DIR, not both")
        partitioned = [feed for feed in self.feed_specs if feed.partitioned]
        if not partitioned:
            if parts.instance is not None:
                raise ConfigError(PREFIX + "INSTANCE", str(parts.instance), "no FORKLESS_INSTANCE/FORKLESS_INSTANCES "
                                  "without a partitioned JetStream feed (a FORKLESS_FEEDS entry with "
                                  '"partition_count"): every instance would consume the whole feed')
            if parts.checkpoint_bucket:
                raise ConfigError(PREFIX + "CHECKPOINT_BUCKET", parts.checkpoint_bucket, "a partitioned JetStream "
                                  'feed (a FORKLESS_FEEDS entry with "partition_count"), whose server holds the '
                                  "bucket; other feeds keep their checkpoints in FORKLESS_CHECKPOINT_DIR")
        elif checkpoint_dir:
            raise ConfigError(PREFIX + "CHECKPOINT_DIR", checkpoint_dir, f"empty with a partitioned feed "
                              f"({partitioned[0].label}): its checkpoints are kept per partition in "
                              "FORKLESS_CHECKPOINT_BUCKET, where any instance can restore them")

    # ---- what is derived from the groups ------------------------------------------------------------

    @property
    def buckets(self) -> tuple[int, ...]:
        """Batch sizes the step is compiled for (``StepSettings.buckets``)."""
        return self.step.buckets

    @property
    def feed_variable(self) -> str:
        """The variable that configures the feeds: ``FORKLESS_FEEDS``, ``FORKLESS_WS_URL``, or "" (neither:
        the embedded demo feed's place, or an embedding program's own sources)."""
        return PREFIX + "FEEDS" if self.feeding.feeds else PREFIX + "WS_URL" if self.websocket.url else ""

    @property
    def uses_demo_feed(self) -> bool:
        """Neither ``FORKLESS_WS_URL`` nor ``FORKLESS_FEEDS`` is set: the embedded demo feed runs."""
        return self.feed_variable == ""

    @cached_property
    def feed_specs(self) -> tuple[FeedSpec, ...]:
        """The feeds to connect to: ``FORKLESS_FEEDS``, else one feed named ``0`` from
        ``FORKLESS_WS_URL``/``FORKLESS_SUBSCRIBE`` (its url is empty for the demo feed)."""
        if self.feeding.feeds:
            return self.feeding.specs(self.partitioning)
        return (self.websocket.feed(self.feeding.replies),)

    @property
    def stream_keys_by_feed(self) -> bool:
        """True when a stream is identified by (feed, stream): several feeds, not shared."""
        return len(self.feed_specs) > 1 and not self.feeding.shared_streams

    @property
    def checkpoints_on(self) -> bool:
        """``FORKLESS_CHECKPOINT_DIR`` or ``FORKLESS_CHECKPOINT_BUCKET`` is set: checkpoints are
        written (and restored unless ``FORKLESS_CHECKPOINT_RESTORE=never``)."""
        return self.checkpoints.on or self.partitioning.checkpoint_bucket != ""

    def io_settings(self) -> IOSettings:
        """What the IO side reads of this configuration (io_loop/iosettings.py): ``feed_specs`` and
        ``uses_demo_feed`` as derived here, the step's sizes a source reads, the default detector's warm-up (the
        demo feed plants anomalies after it) and the IO side's groups."""
        return IOSettings(feed_specs=self.feed_specs, feeds_from_list=self.feeding.feeds != "",
                          feed_fatal=self.feeding.feed_fatal, uses_demo_feed=self.uses_demo_feed,
                          metrics_addr=self.run.metrics_addr, features=self.step.features,
                          max_batch=self.step.max_batch, warmup=self.detector.warmup, reconnect=self.reconnect,
                          timeouts=self.timeouts, tls=self.tls, credentials=self.credentials, limits=self.limits,
                          demo=self.demo, partitioning=self.partitioning)

    def instance_settings(self) -> InstanceSettings:
        """What a partitioned instance's leases and checkpoint objects read (controller/settings/groups.py): its
        store connects as the IO side's connections do, with their groups."""
        return InstanceSettings(partitioning=self.partitioning, keep=self.checkpoints.keep,
                                max_streams=self.step.max_streams, timeouts=self.timeouts, reconnect=self.reconnect,
                                tls=self.tls)

    # ---- deprecated (io_loop/renamed.py): what these built is a group of the Config now ---------------

    def step_settings(self) -> StepSettings:
        """Deprecated: ``config.step``."""
        deprecated("config.step_settings()", error=AttributeError)
        return self.step

    def checkpoint_settings(self) -> CheckpointSettings:
        """Deprecated: ``config.checkpoints`` (a partitioned feed's bucket: ``config.partitioning``)."""
        deprecated("config.checkpoint_settings()", error=AttributeError)
        return self.checkpoints

    def relay_settings(self) -> tuple[IOSettings, RelaySettings]:
        """Deprecated: ``config.relay`` and ``config.io_settings()`` (the relay's command checks them together)."""
        deprecated("config.relay_settings()", error=AttributeError)
        self.relay.required()
        io = self.io_settings()
        return dataclasses.replace(io, feed_specs=tuple(dataclasses.replace(spec, replies="none")
                                                        for spec in io.feed_specs)), self.relay

    def replace(self, **changes: Any) -> Config:
        """This configuration with ``changes``: keywords, or settings groups (the fields each was built with)."""
        changed = _settings(changes)
        return Config(**{name: dataclasses.replace(getattr(self, name), **{
            declared.field: changed[declared.keyword] for declared in settings_of(kind) if declared.keyword in changed})
            for name, kind in GROUPS.items()})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Read every ``FORKLESS_*`` variable that is set; unset ones keep their default. ``overrides`` (keywords,
        or settings groups: ``checkpoints=CheckpointSettings(dir=...)``) win over the environment."""
        environ = os.environ if environ is None else environ
        values = {declared.keyword: declared.parse(environ[declared.env]) for declared in VARIABLES
                  if declared.env in environ}
        values.update(_settings(overrides))
        return cls(**values)

    def check_demo_feed(self) -> None:
        """The demo feed's own settings, checked only where it runs (``feed_plan``: no feed
        configured and no source of the embedding program's; the program checks it up front):
        ``ConfigError`` when ``FORKLESS_DEMO_STREAMS`` exceeds ``FORKLESS_MAX_STREAMS``."""
        if self.demo.streams > self.step.max_streams:
            raise ConfigError(PREFIX + "DEMO_STREAMS", str(self.demo.streams),
                              f"at most FORKLESS_MAX_STREAMS ({self.step.max_streams}) when the demo feed runs")


def _groups(given: Mapping[str, Any]) -> dict[str, Any]:
    """Each group of a ``Config`` from its keyword arguments (``_settings``), every field not given its default."""
    values = _settings(given)
    return {name: kind(**{declared.field: values.get(declared.keyword, declared.default)
                          for declared in settings_of(kind)})
            for name, kind in GROUPS.items()}


def _settings(given: Mapping[str, Any]) -> dict[str, Any]:
    """``Config``'s keyword arguments as settings by keyword: a keyword its setting, a group argument the fields it
    was built with (and a field that moved out of it, where it lives now). ``TypeError`` for an unknown keyword, a
    group argument that is not its group, or a setting given twice with two values (named both ways, never its
    value)."""
    values: dict[str, Any] = {}
    where: dict[str, str] = {}

    def put(keyword: str, value: Any, how: str) -> None:
        if keyword in where and values[keyword] != value:
            raise TypeError(f"Config(...) got two values for {keyword}: as {where[keyword]} and as {how}; give it once")
        values[keyword], where[keyword] = value, how

    for name, value in given.items():
        if name in GROUPS:
            continue
        if name not in _KEYWORDS:
            near = difflib.get_close_matches(name, [*_KEYWORDS, *GROUPS], n=1)
            raise TypeError(f"Config() got an unexpected keyword argument {name!r}"
                            + (f": did you mean {near[0]!r}?" if near else ""))
        put(name, value, f"{name}=")
    for argument, kind in GROUPS.items():
        group = given.get(argument)
        if group is None:
            continue
        if not isinstance(group, kind):
            raise TypeError(f"Config({argument}=...) takes a forkless.{kind.__name__} (such as "
                            f"{argument}={kind.__name__}(...)), not {type(group).__name__}")
        chosen = given_fields(group)
        for declared in settings_of(kind):
            if declared.field in chosen:
                put(declared.keyword, getattr(group, declared.field),
                    f"{argument}={kind.__name__}({declared.field}=...)")
        for keyword, value in moved_fields(group).items():
            put(keyword, value, f"{argument}={kind.__name__}(...)")
    return values
