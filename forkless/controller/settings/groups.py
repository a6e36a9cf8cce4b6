"""What the controller's components read of the configuration: small frozen value objects, each handed only to
what reads it (the IO side's are io_loop/settings.py's).

Rules:
- Built from the validated ``Config`` in one place each (``Config.checkpoint_settings()``,
  ``Config.instance_settings()``, ``Config.step_settings()``), so a value here was checked there,
  with the error naming the variable; nothing here reads the environment or validates.
- A setting that depends on where the step runs is resolved once, where that is known: the compile
  (``StepSettings.on_platform``, called by ``compile_step``) turns FORKLESS_STEPS_IN_FLIGHT's ``auto`` into
  its depth, and the engine, the compiled step, the kept programs' key and the loop read that one.
- The composition roots (controller/loop.py, the commands) build them and hand each component the group
  it reads as a typed argument, never the whole ``Config``
  (tests/controller/settings/test_controller_settings.py holds that
  for the checkpoints, a partitioned instance's leases and the device side: controller/engine.py and
  controller/device/, typed ``StepShape``, which ``StepSettings`` and ``Config`` both are, so a test or a
  benchmark may hand them a ``Config``).
- A field has the name of the ``Config`` field it comes from, or names it with ``_from``
  (``CheckpointSettings.every_s`` is ``checkpoint_s``), as io_loop/settings.py's do: its
  ``config_field`` tells which. A group may hold the IO side's groups where it connects as the IO
  side does (a partitioned instance's store: timeouts, reconnect, TLS).
- Immutable, so every thread may read them. ``CheckpointSettings`` and ``StepSettings`` are public value objects
  as the IO side's groups are (io_loop/settings.py's rules: ``settings_group``, each default its ``Config``
  field's); ``InstanceSettings`` is built only by ``Config``, from the others, and has no defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from forkless.io_loop.settings import (
    CONFIG_FIELD,
    PartitionSettings,
    ReconnectSettings,
    Timeouts,
    TlsSettings,
    settings_group,
)

__all__ = ["BUCKET_GROWTH", "CheckpointSettings", "InstanceSettings", "StepSettings", "StepShape", "batch_buckets"]

BUCKET_GROWTH = 4


def _from(config_field: str, **kwargs: Any) -> Any:
    """A field whose value is ``Config.<config_field>`` (``FORKLESS_<CONFIG_FIELD>``), named otherwise here."""
    return field(metadata={CONFIG_FIELD: config_field}, **kwargs)


@settings_group
@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    """Where and how often checkpoints are written and whether one is restored: FORKLESS_CHECKPOINT_DIR,
    _S, _KEEP, _RESTORE, _PRIORITY and _BUCKET (a partitioned feed's). Read by the checkpoint writer and
    the choice of its store (controller/checkpoints/checkpointer.py), recovery (controller/checkpoints/recovery.py)
    and the loop's start (restore or not)."""

    dir: str = _from("checkpoint_dir", default="")  # "": no directory (the bucket, a program's own store, or off)
    every_s: float = _from("checkpoint_s", default=60.0)
    keep: int = _from("checkpoint_keep", default=3)  # the newest kept
    restore: str = _from("checkpoint_restore", default="auto")  # "auto" or "never"
    # "idle": the writer thread is the OS's background work
    priority: str = _from("checkpoint_priority", default="idle")
    bucket: str = _from("checkpoint_bucket", default="")  # a partitioned feed's objects ("": none)

    @property
    def on(self) -> bool:
        """A directory or a bucket is configured: checkpoints are written (and restored unless ``restore``
        is ``"never"``); an embedding program's own store turns them on too, given beside these."""
        return self.dir != "" or self.bucket != ""


@dataclass(frozen=True, kw_only=True)
class InstanceSettings:
    """A partitioned instance's (controller/partitions/partitioned.py's ``PartitionOwner``): which it is of how
    many (FORKLESS_INSTANCE and _INSTANCES, None when its feed's entry names its partitions; the instances are
    recorded in the deployment record), its leases' and checkpoint objects' buckets and a lease's length (the
    IO side's ``PartitionSettings``, what its store reads), the checkpoint objects kept per partition
    (FORKLESS_CHECKPOINT_KEEP), the streams a restore may put in the state (FORKLESS_MAX_STREAMS), and the
    groups its store's connection reads (the IO side's own)."""

    instance: int | None
    instances: int | None
    partitioning: PartitionSettings
    keep: int = _from("checkpoint_keep")
    max_streams: int
    timeouts: Timeouts
    reconnect: ReconnectSettings
    tls: TlsSettings


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes the step is compiled for: powers of four below ``max_batch``, and it.

    Each compiled size costs start-up time and several MiB of resident memory, while
    padding a batch costs little device time, so sizes grow by 4x rather than 2x.
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


@settings_group
@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """The step's sizes and where it runs: FORKLESS_FEATURES (a message's x is [features]),
    _MAX_STREAMS (a per-stream leaf has max_streams + 1 rows), _MAX_BATCH (the largest batch;
    ``buckets`` are the sizes compiled), _DEVICES ("all" or how many) and _STEPS_IN_FLIGHT ("auto"
    or how many; a number once compiled: ``on_platform``). Read by ``compile_step`` and what it builds:
    the ``Engine``, its layout, the kept programs' key and the contract's probe (controller/engine.py,
    controller/device/)."""

    features: int = 8
    max_streams: int = 4096
    max_batch: int = 256
    devices: int | str = "all"
    steps_in_flight: int | str = "auto"

    @property
    def buckets(self) -> tuple[int, ...]:
        """The batch sizes the step is compiled for (``batch_buckets``)."""
        return batch_buckets(self.max_batch)

    @classmethod
    def on_platform(cls, shape: StepShape, platform: str) -> StepSettings:
        """``shape``'s settings as the step runs on ``platform`` (the first device's: "cpu", "tpu" …), with
        ``steps_in_flight`` resolved to its depth: its number, or for ``auto`` the measured default
        (bench/docs/steps-in-flight.md: on the CPU a small step runs inline, in its dispatch, and a larger one
        competes for the same cores, so a second in flight gains nothing; an accelerator's round trip is
        latency the next step can hide). The one place it is resolved (``compile_step`` calls it)."""
        setting = shape.steps_in_flight
        depth = int(setting) if setting != "auto" else 1 if platform == "cpu" else 2
        return cls(features=shape.features, max_streams=shape.max_streams, max_batch=shape.max_batch,
                   devices=shape.devices, steps_in_flight=depth)
