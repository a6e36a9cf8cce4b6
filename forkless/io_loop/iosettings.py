"""What the IO side reads of the configuration: ``IOSettings``, built by the controller from its validated ``Config``
(``Config.io_settings()``), so a value here was checked there, with the error naming the variable.

Rules:
- It holds the feeds (``feed_specs``, and ``uses_demo_feed`` where the demo feed runs in their place), the step's
  sizes a source reads (``features``, a decoded x's length; ``max_batch``, a chunk's bound), the default detector's
  warm-up (the demo feed plants anomalies after it) and the groups (the IO side's, io_loop/settings.py; the feeds'
  connector rooms'). The composition roots (controller/ioside.py's ``feed_sources``, io_loop/thread.py) hand each
  component the groups it reads as typed constructor arguments, never the whole ``IOSettings`` nor the
  configuration.
- Immutable, so every thread may read it. Secrets stay out of ``repr`` (each group's and each feed's).
- Pure: nothing here reads the environment or validates.
"""

from __future__ import annotations

from dataclasses import dataclass

from forkless.io_loop.connectors.jetstream.settings import PartitionSettings
from forkless.io_loop.connectors.websocket.settings import Credentials, DemoSettings
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.settings import Limits, ReconnectSettings, Timeouts, TlsSettings

__all__ = ["IOSettings"]


@dataclass(frozen=True, kw_only=True)
class IOSettings:
    """Everything the IO side reads (see the module rules)."""

    # the feeds
    feed_specs: tuple[FeedSpec, ...]  # one per connection; a url of "" is the embedded demo feed's
    feeds_from_list: bool  # they came from FORKLESS_FEEDS (else FORKLESS_WS_URL / SUBSCRIBE)
    feed_fatal: str  # "all" or "any"
    uses_demo_feed: bool
    # served beside the feeds
    metrics_addr: str
    # the step's sizes a source reads, and the default detector's warm-up (the demo feed's)
    features: int
    max_batch: int
    warmup: int
    # the groups
    reconnect: ReconnectSettings
    timeouts: Timeouts
    tls: TlsSettings
    credentials: Credentials
    limits: Limits
    demo: DemoSettings
    partitioning: PartitionSettings
