"""The JetStream room's settings: what a JetStream feed adds to its ``FeedSpec`` (``JetStreamSpec``) and a
partitioned feed's instances, buckets and leases (``PartitionSettings``), each setting declared once
(io_loop/settings.py's rules).

Rules:
- A ``JetStreamSpec`` is made from a ``FORKLESS_FEEDS`` entry (entry.py); a partitioned feed's ``partitions`` are
  resolved before the IO side sees it (from its entry's ``"partitions"``, or from ``FORKLESS_INSTANCE``/
  ``FORKLESS_INSTANCES``: ``PartitionSettings.share``): the IO side consumes ``JetStreamSpec.subjects()`` and never
  works out a share itself.
- A JetStream feed's credentials (``token``, a ``creds`` file's path, a URL's user:password) stay out of ``repr``
  and errors (the path of a creds file is not the secret, its content is).
- Pure: nothing here opens a socket or imports nats-py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property

from forkless.io_loop.connectors.jetstream.partitions import (
    PARTITION_FIELD,
    instance_share,
    partition_subjects,
)
from forkless.io_loop.errors import ConfigError
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.net.netaddr import redact_urls
from forkless.io_loop.settings import PREFIX, as_text, integer, number, optional, setting, settings_group, text

__all__ = ["BUCKET_NAME", "JETSTREAM", "MAX_PARTITIONS", "STREAM_NAME", "JetStreamSpec", "PartitionSettings", "bucket",
           "spec_of"]

JETSTREAM = "jetstream"  # a FeedSpec's kind for this room's feeds (io_loop/kinds.py finds its connector by it)
BUCKET_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a JetStream object-store or KV bucket (nats-py's rule, capped)
STREAM_NAME = re.compile(r"[^\s.*>/\\]{1,255}")  # what nats-server accepts as a stream name
MAX_PARTITIONS = 65536  # a partitioned feed's "partition_count", and so FORKLESS_INSTANCES, at most


def bucket(text: str) -> str:
    """A JetStream bucket's name (object store, KV)."""
    text = text.strip()
    if not BUCKET_NAME.fullmatch(text):
        raise ValueError
    return text


def _optional_bucket(text: str) -> str:
    return "" if text.strip() == "" else bucket(text)


@dataclass(frozen=True)
class JetStreamSpec:
    """What a JetStream feed of ``FORKLESS_FEEDS`` (an entry with ``"nats"``) adds to its ``FeedSpec`` (its
    ``options``, io_loop/connectors/connector.py's ``FeedOptions``): the stream it consumes, the subject filter,
    the subject its replies are published to, where it starts without a checkpoint's position, and its
    credentials (besides a user:password in the URL), which stay out of ``repr``."""

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

    def with_partitions(self, partitions: tuple[int, ...]) -> JetStreamSpec:
        return replace(self, partitions=tuple(partitions))

    def shown_url(self, url: str) -> str:
        """The server URLs (comma-separated) as logs may show them: no credentials."""
        return redact_urls(url)

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


def spec_of(feed: FeedSpec) -> JetStreamSpec:
    """``feed``'s ``JetStreamSpec`` (its ``options``); ``ValueError`` naming it when it is not a JetStream feed."""
    if not isinstance(feed.options, JetStreamSpec):
        raise ValueError(f"{feed.label} is not a JetStream feed (its entry has no \"nats\")")
    return feed.options


@settings_group
class PartitionSettings:
    """A partitioned JetStream feed's (docs/partitions.md): which instance this is of how many, the buckets on
    its server holding its checkpoints and its partitions' leases, and a lease's length (store.py; ``--check``
    looks for the buckets, probe.py)."""

    instance: int | None = setting(
        "INSTANCE", optional(integer(0, MAX_PARTITIONS - 1)), "this instance's number i (0-based; a StatefulSet "
        "pod's ordinal) among INSTANCES: it owns the contiguous share [i*P/N, (i+1)*P/N) of the partitioned feed's "
        "partition_count P, in place of the entry's \"partitions\" (not both); set together with INSTANCES",
        default=None, allowed="an integer >= 0, or empty")
    instances: int | None = setting(
        "INSTANCES", optional(integer(1, MAX_PARTITIONS)), "N, the number of instances sharing the partitioned "
        "feed's partitions (at most its partition_count); set together with INSTANCE", default=None)
    checkpoint_bucket: str = setting(
        "CHECKPOINT_BUCKET", text(_optional_bucket, "1-64 letters, digits, '_' or '-', or empty"),
        "a partitioned JetStream feed's checkpoints: one object per partition in this JetStream object-store bucket "
        "on the feed's server (created if missing), restored by whichever instance owns the partition; turns "
        "checkpoints on like CHECKPOINT_DIR (not both; the only kind a partitioned feed has)", default="")
    lease_s: float = setting("LEASE_S", number(0.0, lo_open=True), "a partitioned feed's lease on each partition it "
                             "owns: renewed while it runs, released at an orderly stop, expired this long after its "
                             "holder died (a new owner waits for that)", default=10.0)
    lease_bucket: str = setting("LEASE_BUCKET", text(bucket, "1-64 letters, digits, '_' or '-'"), "the JetStream KV "
                                "bucket on the partitioned feed's server that holds the partitions' leases (created "
                                "if missing)", default="forkless-leases")

    def validate(self) -> None:
        """FORKLESS_INSTANCE and FORKLESS_INSTANCES together, the instance one of them."""
        if (self.instance is None) != (self.instances is None):
            given, missing = ("INSTANCE", "INSTANCES") if self.instance is not None else ("INSTANCES", "INSTANCE")
            raise ConfigError(PREFIX + given, as_text(self.instance if given == "INSTANCE" else self.instances),
                              f"set together with FORKLESS_{missing} (both or neither)")
        if self.instance is not None and self.instances is not None and self.instance >= self.instances:
            raise ConfigError(PREFIX + "INSTANCE", str(self.instance), f"an integer from 0 to FORKLESS_INSTANCES - 1 "
                              f"= {self.instances - 1} (instances are numbered from 0)")

    def share(self, count: int, where: str) -> tuple[int, ...]:
        """This instance's share of ``count`` partitions (the feed ``where`` names); ``ConfigError`` naming
        FORKLESS_INSTANCES when there are more instances than partitions, or FORKLESS_INSTANCE when it is unset."""
        if self.instance is None or self.instances is None:
            raise ConfigError(PREFIX + "INSTANCE", "", f"set, with FORKLESS_INSTANCES, for {where} to have its share")
        try:
            return instance_share(self.instance, self.instances, count)
        except ValueError as exc:
            raise ConfigError(PREFIX + "INSTANCES", str(self.instances), f"at most the partition_count of {where} "
                              f"({count}): {exc}") from None
