"""The network half of ``--check`` for a JetStream feed (io_loop/probe.py calls it): connect as the
feed would, read its stream, find the stream that stores its results subject. Imported only when
such a feed is configured (nats-py is an optional extra).

Rules:
- It says what it finds through ``say`` and returns the problems: an empty list means the feed can
  be used. A duplicate window of the results stream shorter than a restart needs is a warning, not
  a problem; so is a partitioned feed's checkpoint or lease bucket that does not exist yet (the
  first start makes it).
- A partitioned feed's stream must partition as the feed expects: ``check_partitions``, which the
  feed itself (io_loop/connectors/jetstream/source.py) applies at every connection too.
- Secrets (the URL's user:password, ``token``, the creds file's content) are never shown.
"""

from __future__ import annotations

import asyncio
from typing import Any

from forkless.io_loop.connectors.jetstream.partitions import format_partitions, partition_transform, transform_problems
from forkless.io_loop.connectors.jetstream.settings import JetStreamSpec, PartitionSettings, spec_of
from forkless.io_loop.connectors.jetstream.transport import (
    NatsConnectFailed,
    NatsError,
    NatsNotFound,
    NatsUnavailable,
    Transport,
    connect_options,
    describe_error,
)
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.settings import Timeouts, TlsSettings

__all__ = ["check_partitions", "probe_jetstream"]


async def probe_jetstream(feed: FeedSpec, say: Any, dedupe_window_s: float, timeouts: Timeouts, tls: TlsSettings,
                          partitioning: PartitionSettings) -> list[str]:
    """``--check`` for one JetStream feed: connect as the feed would, read the stream, find the
    stream that stores the results subject and its duplicate window (a warning when shorter than
    ``dedupe_window_s``). A partitioned feed: the stream's subject transform must make its
    partition_count's partitions where its subject has ``{partition}`` (``check_partitions``),
    and the checkpoint and lease buckets are looked for. Prints through ``say``; returns the
    problems (empty: the feed can be used)."""
    loop = asyncio.get_running_loop()
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(describe_error(exc))

    t0 = loop.time()
    try:
        nc = await Transport.connect(timeouts, connect_options(feed, timeouts, tls, error_cb=on_error))
    except NatsConnectFailed as exc:
        if exc.fatal:
            return [f"{feed.shown_url} refused the credentials (the user:password in \"nats\", \"token\" or "
                    "\"creds\")"]
        return [f"cannot connect to {feed.shown_url}: {errors[-1] if errors else exc}"]
    problems: list[str] = []
    try:
        say(f"  connected to {feed.shown_url} in {(loop.time() - t0) * 1000:.1f} ms "
            f"(nats-server {nc.server_version})")
        if not await _probe_stream(feed, nc, say, problems):
            return problems
        await _probe_results(spec_of(feed), nc, say, dedupe_window_s, problems)
        if spec_of(feed).partitioned:
            await _look_for_buckets(partitioning, nc, say)
    except NatsError as exc:
        problems.append(f"asking {feed.shown_url} failed: {exc}")
    finally:
        await nc.close(1.0)
    return problems


async def _probe_stream(feed: FeedSpec, nc: Transport, say: Any, problems: list[str]) -> bool:
    """The feed's stream: what it holds and, partitioned, its partitioning; False when JetStream
    does not answer at all (nothing more to ask)."""
    spec = spec_of(feed)
    try:
        info = await nc.stream_info(spec.stream)
        state = info.state
        consuming = "by partition (below)" if spec.partitioned else repr(spec.subject or "all of it")
        say(f"  stream {spec.stream!r}: {state.messages} messages, sequences {state.first_seq}-{state.last_seq}, "
            f"subjects {', '.join(info.config.subjects or [])}; consuming {consuming} "
            f"from {'its first message' if spec.start == 'first' else 'new messages'} unless a checkpoint "
            "recorded a position")
        if spec.partitioned:
            problems.extend(check_partitions(spec, info.config, say))
    except NatsNotFound:
        problems.append(f"stream {spec.stream!r} not found on {feed.shown_url}")
    except NatsUnavailable:
        problems.append(f"JetStream is not enabled on {feed.shown_url} (nats-server -js)")
        return False
    return True


async def _probe_results(spec: JetStreamSpec, nc: Transport, say: Any, dedupe_window_s: float,
                         problems: list[str]) -> None:
    """The stream that stores the results subject, and whether its duplicate window covers a restart."""
    if not spec.results:
        say("  no results subject (\"replies\": \"none\")")
        return
    try:
        name = await nc.find_stream_name_by_subject(spec.results)
        window = (await nc.stream_info(name)).config.duplicate_window or 0.0
        say(f"  results subject {spec.results!r}: stored by stream {name!r}, duplicate window {window:g} s")
        if window < dedupe_window_s:
            say(f"  WARNING: the duplicate window of {name!r} ({window:g} s) is shorter than 2 x "
                f"FORKLESS_CHECKPOINT_S + 60 s = {dedupe_window_s:g} s: after a restart, a result published "
                "again may be stored twice")
    except NatsNotFound:
        problems.append(f"no stream stores the results subject {spec.results!r}")


def check_partitions(spec: JetStreamSpec, config: Any, say: Any) -> list[str]:
    """A partitioned feed against its stream's configuration (nats-py's ``StreamConfig``): the
    subject transforms of the stream and of its sources and mirror that write a partition must
    agree with the feed's partition_count and subject; at least one must. Prints what it finds
    and this instance's partitions; returns the problems."""
    transforms = []  # (where, src, dest)
    if config.subject_transform is not None:
        transforms.append(("the stream's", config.subject_transform))
    for source in [*(config.sources or []), *([config.mirror] if config.mirror is not None else [])]:
        for transform in source.subject_transforms or []:
            transforms.append((f"source {source.name!r}'s", transform))
    found = [(where, t) for where, raw in transforms
             if (t := partition_transform(raw.src or ">", raw.dest or "")) is not None]
    count = spec.partition_count
    if not found:
        have = "; ".join(f"{where} {raw.src!r} -> {raw.dest!r}" for where, raw in transforms) or "none"
        return [f"stream {spec.stream!r} has no subject transform writing a partition (its subject transforms: "
                f"{have}), but the feed's \"partition_count\" is {count}: give the stream one such as "
                f"'ticks.*' -> 'ticks.{{{{partition({count},1)}}}}.{{{{wildcard(1)}}}}' (docs/partitions.md)"]
    problems: list[str] = []
    for where, transform in found:
        wrong = transform_problems(spec.subject, count, transform)
        problems.extend(f"stream {spec.stream!r}: {problem}" for problem in wrong)
        if not wrong:
            say(f"  partitioned by {where} subject transform {transform}: {count} partitions, as the feed's "
                f"\"partition_count\"; its subject {spec.subject!r} takes the partition where the transform "
                "writes it")
    subjects = spec.subjects()
    shown = ", ".join(subjects[:4]) + (f", … ({len(subjects)} subjects)" if len(subjects) > 4 else "")
    say(f"  this instance's partitions: {format_partitions(spec.partitions)} ({len(spec.partitions)} of {count}); "
        f"consuming {shown}")
    return problems


async def _look_for_buckets(partitioning: PartitionSettings, nc: Transport, say: Any) -> None:
    """Say whether a partitioned feed's checkpoint bucket (``FORKLESS_CHECKPOINT_BUCKET``, a JetStream
    object store) and lease bucket (``FORKLESS_LEASE_BUCKET``, a KV bucket) exist; one that does
    not is made at the first start, so it is no problem."""
    buckets = [("lease bucket", partitioning.lease_bucket, "KV", "KV_")]
    if partitioning.checkpoint_bucket:
        buckets.insert(0, ("checkpoint bucket", partitioning.checkpoint_bucket, "object store", "OBJ_"))
    else:
        say('  no FORKLESS_CHECKPOINT_BUCKET: no checkpoints; every start consumes its partitions from "start"')
    for what, name, kind, prefix in buckets:
        try:
            state = (await nc.stream_info(prefix + name)).state
        except NatsNotFound:
            say(f"  {what} {name!r} ({kind}): does not exist yet; the first instance to start creates it")
            continue
        say(f"  {what} {name!r} ({kind}, stream {prefix + name}): exists, {state.messages} messages, "
            f"{state.bytes} bytes")
