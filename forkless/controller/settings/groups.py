"""The controller side's settings groups, each setting declared once (io_loop/settings.py's rules), and the small
value objects its components read.

Rules:
- A group here is public (``forkless.StepSettings`` …): a program builds ``Config`` from them and reads them back
  (``config.step``); each setting's variable, rule, default and meaning is its field's declaration, nowhere else.
- A setting that depends on where the step runs is resolved once, at the compile (``StepSettings.on_platform``),
  and everything after reads that one.
- The composition roots hand each component the group it reads, never the whole ``Config``
  (tests/controller/settings/test_controller_settings.py); the device side takes a ``StepShape``, which a
  ``Config`` also is. ``InstanceSettings`` is built only by ``Config`` and declares no setting.
- Immutable, so every thread may read them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from forkless.io_loop.connectors.jetstream.settings import PartitionSettings
from forkless.io_loop.errors import EXIT_LOSSY_STOP
from forkless.io_loop.net.netaddr import listen_address
from forkless.io_loop.settings import (
    ReconnectSettings,
    Timeouts,
    TlsSettings,
    choice,
    integer,
    number,
    optional,
    setting,
    settings_group,
    settled,
    text,
    word_or_count,
)

__all__ = ["BUCKET_GROWTH", "LOG_LEVELS", "CheckpointSettings", "DetectorSettings", "InstanceSettings",
           "LoopSettings", "RunSettings", "StepSettings", "StepShape", "batch_buckets"]

BUCKET_GROWTH = 4
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def checkpoint_dir(text: str) -> str:
    """A directory to keep checkpoints in, created if missing: not an existing non-directory,
    and under the nearest existing ancestor, a directory this process may write to."""
    text = text.strip()
    if text == "":
        return ""
    if "\x00" in text or any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in text.split("/")):
        raise ValueError
    existing = os.path.abspath(text)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError
    return text


@settings_group
class StepSettings:
    """The step's sizes and where it runs: a message's x is [features], a per-stream leaf has max_streams + 1 rows,
    the largest batch is max_batch (``buckets`` are the sizes compiled), ``devices`` ("all" or how many) and
    ``steps_in_flight`` ("auto" or how many; a number once compiled: ``on_platform``). Read by ``compile_step`` and
    what it builds: the ``Engine``, its layout, the kept programs' key and the contract's row-writes check
    (controller/engine.py, controller/device/); the IO side reads features and max_batch too (a decoded x's
    length, a chunk's bound)."""

    features: int = setting("FEATURES", integer(1, 65536), "length F of every message's vector x", default=8)
    max_streams: int = setting("MAX_STREAMS", integer(1, 10_000_000), "state slots; a new stream past this gets an "
                               "error reply (unless STREAM_IDLE_S frees one)", default=4096)
    max_batch: int = setting("MAX_BATCH", integer(1, 65536), "largest micro-batch (batches are padded to powers of "
                             "four up to this)", default=256)
    devices: int | str = setting(
        "DEVICES", word_or_count("all", 4096), "local JAX devices to use: the stream table is sharded over them by "
        "stream (new streams spread evenly) and each runs its streams' messages; more than the process has exits 2",
        default="all")
    steps_in_flight: int | str = setting(
        "STEPS_IN_FLIGHT", word_or_count("auto", 64), "steps dispatched to the device before the oldest one's "
        "results are handed over: the next batch's step (a closed batch's: full, or collecting for MAX_WAIT_MS) "
        "starts while earlier ones run and their results are copied to the host (results, their order, checkpoints "
        "and replays unchanged; docs/performance.md). 1: one step at a time; auto: 1 on the CPU, 2 on an "
        "accelerator", default="auto")

    @property
    def buckets(self) -> tuple[int, ...]:
        """The batch sizes the step is compiled for (``batch_buckets``)."""
        return batch_buckets(self.max_batch)

    @classmethod
    def on_platform(cls, shape: StepShape, platform: str) -> StepSettings:
        """``shape``'s settings as the step runs on ``platform`` (the first device's: "cpu", "tpu" …), with
        ``steps_in_flight`` resolved to its depth: its number, or for ``auto`` the platform's default (on the CPU
        a second step in flight gains nothing; an accelerator's round trip is latency the next step can hide:
        bench/docs/steps-in-flight.md). The one place it is resolved (``compile_step`` calls it)."""
        given = shape.steps_in_flight
        depth = int(given) if given != "auto" else 1 if platform == "cpu" else 2
        return settled(cls, features=shape.features, max_streams=shape.max_streams, max_batch=shape.max_batch,
                       devices=shape.devices, steps_in_flight=depth)


@settings_group
class LoopSettings:
    """The main thread's loop (controller/loop.py): how long a batch collects, when an idle stream's slot is given
    to a new one, and how the threads wait for each other (io_loop/waiting.py)."""

    max_wait_ms: float = setting("MAX_WAIT_MS", number(0.0, 10_000.0), "longest a batch keeps collecting messages "
                                 "that are arriving; never waits on an empty queue (while steps are in flight, a "
                                 "batch joins them once full or collecting this long)", default=2.0)
    stream_idle_s: float | None = setting(
        "STREAM_IDLE_S", optional(number(0.0, unit=" of seconds")), "when every slot is taken, a stream silent for "
        "longer than this gives its slot to a new stream (least recently seen first; its state is reset); empty: "
        "slots are never reused", default=None)
    handoff: str = setting(
        "HANDOFF", choice("auto", "park", "spin"), "how the threads wait for each other: park sleeps until woken; "
        "spin keeps the IO loop awake while a step is in flight and 2 ms after (it yields its core between looks, "
        "the GIL released; under the GIL the main thread blocks on the step meanwhile, without one it spins too): "
        "replies are taken without waking a sleeping loop, for a busy core (docs/performance.md); auto: spin on an "
        "accelerator, park on the CPU",
        default="auto")


@settings_group
class DetectorSettings:
    """The default detector's (``processor.default_processor``; the demo feed plants anomalies after its warm-up):
    a processor of your own ignores them."""

    alpha: float = setting("ALPHA", number(0.0, 1.0, lo_open=True), "the default detector's EWMA smoothing factor",
                           default=0.05)
    threshold: float = setting("THRESHOLD", number(0.0, lo_open=True), "the default detector flags a message whose "
                               "largest abs(z) exceeds this", default=4.0)
    warmup: int = setting("WARMUP", integer(0), "messages a stream must have had before the default detector can "
                          "flag it", default=20)


@settings_group(moved={"bucket": "checkpoint_bucket"})
class CheckpointSettings:
    """Where and how often checkpoints are written and whether one is restored. Read by the checkpoint writer and
    the choice of its store (controller/checkpoints/checkpointer.py), recovery (controller/recovery.py)
    and the loop's start (restore or not); a partitioned feed keeps its checkpoints in its bucket instead
    (``PartitionSettings.checkpoint_bucket``)."""

    dir: str = setting("CHECKPOINT_DIR", text(checkpoint_dir, "a writable directory path (created if missing), or "
                                              "empty"),
                       "keep checkpoints of the state and the stream table here (empty: off)", default="")
    every_s: float = setting("CHECKPOINT_S", number(0.0, lo_open=True), "seconds between checkpoints; one more is "
                             "written at every orderly stop", default=60.0)
    keep: int = setting("CHECKPOINT_KEEP", integer(1, 1000), "newest checkpoints kept; older ones are deleted after "
                        "each successful write", default=3)
    restore: str = setting(
        "CHECKPOINT_RESTORE", choice("auto", "never"), "auto: start from the newest complete checkpoint (a damaged "
        "one is skipped; one written with other FEATURES/MAX_STREAMS/processor exits 2; every one damaged: a "
        'JetStream feed exits 2 unless its "start" is "first" and its stream still holds every message from '
        "sequence 1, which it then consumes again); never: start empty (the explicit way to accept a lost "
        "checkpoint or position)", default="auto")
    priority: str = setting(
        "CHECKPOINT_PRIORITY", choice("idle", "normal"), "idle: the periodic checkpoints are written at the OS's "
        "idle priority (Linux SCHED_IDLE), never taking a core from the steps, but slowed or skipped on a host whose "
        "cores other processes keep busy; normal: at the process's own priority. The stop's checkpoint is written "
        "at normal priority", default="idle")

    @property
    def on(self) -> bool:
        """A directory is configured: checkpoints are written there (and restored unless ``restore`` is
        ``"never"``); a partitioned feed's bucket or an embedding program's own store turns them on too, given
        beside these."""
        return self.dir != ""


@settings_group
class RunSettings:
    """How the process runs and what it reports: how long, its status lines, its logs, the metrics address, and
    the exit status of a stop that lost messages."""

    duration_s: float | None = setting(
        "DURATION", optional(number(0.0, lo_open=True, unit=" of seconds")), "stop after this long (a stop "
        "requested then: SHUTDOWN_TIMEOUT_S bounds it from there, as from a SIGTERM); empty runs until "
        "SIGINT/SIGTERM/SIGHUP", default=None, keyword="duration_s")
    status_s: float = setting("STATUS_S", number(0.0), "seconds between status lines (0: off)", default=1.0)
    log_level: str = setting("LOG_LEVEL", choice(*LOG_LEVELS, upper=True), "logging level", default="INFO",
                             allowed="one of " + ", ".join(LOG_LEVELS))
    log_format: str = setting("LOG_FORMAT", choice("text", "json"), "json writes one JSON object per log line",
                              default="text")
    metrics_addr: str = setting(
        "METRICS_ADDR", text(listen_address, "host:port, or unix:/path (an absolute path in an existing writable "
                             "directory), or empty"),
        "serve /metrics, /healthz, /readyz, /startedz there (empty: off); unix:/path serves them on a unix-domain "
        "socket, made at the start and removed at the stop", default="")
    lossy_stop_exit: int = setting("LOSSY_STOP_EXIT", integer(0, 125), "exit status of an orderly stop that lost "
                                   "messages (dropped, unanswered; 0: exit as a clean stop)", default=EXIT_LOSSY_STOP)


@dataclass(frozen=True, kw_only=True)
class InstanceSettings:
    """A partitioned instance's (controller/partitions/partitioned.py's ``PartitionOwner``): its partitions' settings
    (which instance of how many, its leases' and checkpoint objects' buckets, a lease's length: the JetStream room's
    ``PartitionSettings``, what its store reads), the checkpoint objects kept per partition
    (FORKLESS_CHECKPOINT_KEEP), the streams a restore may put in the state (FORKLESS_MAX_STREAMS), and the groups its
    store's connection reads (the IO side's own)."""

    partitioning: PartitionSettings
    keep: int
    max_streams: int
    timeouts: Timeouts
    reconnect: ReconnectSettings
    tls: TlsSettings

    @property
    def instance(self) -> int | None:
        return self.partitioning.instance

    @property
    def instances(self) -> int | None:
        return self.partitioning.instances


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes the step is compiled for: powers of four below ``max_batch``, and it.

    Each compiled size costs start-up time and resident memory, while padding a batch costs
    little device time, so sizes grow by 4x rather than 2x.
    """
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= BUCKET_GROWTH
    sizes.append(max_batch)
    return tuple(sizes)


class StepShape(Protocol):
    """What compiling and running the step reads (controller/engine.py, controller/device/): a
    ``StepSettings``, or a ``Config`` itself (tests and benchmarks hand one), or anything with these."""

    @property
    def features(self) -> int: ...
    @property
    def max_streams(self) -> int: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def buckets(self) -> tuple[int, ...]: ...
    @property
    def devices(self) -> int | str: ...
    @property
    def steps_in_flight(self) -> int | str: ...
