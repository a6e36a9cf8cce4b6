"""What a processor declares to the core beyond ``(init, step)``: its ``Description``, a frozen, typed value checked
when it is built. The core keeps what it declares without knowing what it means.

Rules:
- Every module reads it as typed attributes (``processor.description.name``), never with a ``getattr``. Its
  fields and their meaning: docs/embedding/contract.md, "The description".
- What can be checked without the step is checked when it is built (``ProcessorContractError`` naming the field
  and what is allowed); a counter's output, once the step's outputs are known, when compiling (``check_counters``).
- A counter is the sum of its output over the batch's messages whose results are finite; it lives in
  ``MainStats.counters`` and every checkpoint's counts, and is restored from them (``counts_from``).
- Pure: no JAX, no threads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from forkless.controller.errors import ProcessorContractError

__all__ = ["CORE_COUNTS", "CORE_SETTINGS", "INPUT_DTYPES", "Description", "check_counters", "count", "counts_from"]

# counts every checkpoint holds whatever the processor (a counter of this name is refused)
CORE_COUNTS = frozenset({"processed"})
# settings the core writes into checkpoints itself (Recovery.settings, the snapshot, partitioned objects)
CORE_SETTINGS = frozenset({"features", "max_streams", "processor", "processor_version", "devices", "leaves",
                           "partition", "partition_count", "weights"})
# the dtypes batch.x may have (float64 needs JAX's x64 mode: controller/device/compiled.py checks it at compile)
INPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, kw_only=True)
class Description:
    """What the controller must know of a processor besides its two functions (module rules);
    each field has the default a processor that declares nothing gets. Frozen: change one with
    ``dataclasses.replace(description, name=...)``, which checks the new value as building does."""

    name: str | None = None
    """What the processor is (``"ewma"``), written into every checkpoint and matched on restore;
    needed with checkpoints on. None: unnamed (no checkpoints)."""

    version: str = "1"
    """The state's layout and meaning, compared for equality on restore: bump it when they change."""

    per_stream: bool = True
    """Each message's outputs and state depend only on its own stream's rows and input, so the step can
    be sharded by stream over several devices; False: it mixes streams, and more than one device is refused."""

    restore_shared: bool = False
    """On restore, take the shared (not per-stream) leaves from the checkpoint too; False: from ``init``."""

    input_dtype: np.dtype = INPUT_DTYPES[0]
    """``batch.x``'s dtype: float32, or float64 (needs JAX's x64 mode: docs/embedding/contract.md). Given as
    anything ``np.dtype`` takes (``jnp.float64``, ``"float64"``), kept as the ``np.dtype``."""

    counters: Mapping[str, str] = field(default_factory=_empty)
    """Counter name -> the name of a bool or int output, summed over each batch's messages answered with results."""

    settings: Mapping[str, Any] = field(default_factory=_empty)
    """Name -> JSON value: written into every checkpoint and matched on restore (what the state means depends on)."""

    recorded: Mapping[str, Any] = field(default_factory=_empty)
    """Name -> JSON value: written into every checkpoint, never matched."""

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ProcessorContractError(f"Description(name={self.name!r}): name is what the processor is, a "
                                         f"non-empty str (\"ewma\"), or None for a processor without checkpoints")
        who = f"processor {self.name or '(unnamed)'!r}"
        if not isinstance(self.version, str) or not self.version:
            raise ProcessorContractError(f"{who}: Description(version={self.version!r}): version is a non-empty "
                                         f"str, compared for equality on restore (\"1\", \"2\", \"2024-06\")")
        for flag, value in (("per_stream", self.per_stream), ("restore_shared", self.restore_shared)):
            if not isinstance(value, bool):
                raise ProcessorContractError(f"{who}: Description({flag}={value!r}): {flag} is True or False")
        object.__setattr__(self, "input_dtype", _input_dtype(self.input_dtype, who))
        object.__setattr__(self, "counters", _counters(self.counters, who))
        settings, recorded = _settings(self.settings, "settings", who), _settings(self.recorded, "recorded", who)
        both = sorted(settings.keys() & recorded.keys())
        if both:
            raise ProcessorContractError(f"{who}: setting {both[0]!r} is both in settings (matched) and in recorded")
        object.__setattr__(self, "settings", settings)
        object.__setattr__(self, "recorded", recorded)

    def __hash__(self) -> int:  # the mappings are read-only but not hashable: hashed as the JSON they are
        return hash((self.name, self.version, self.per_stream, self.restore_shared, self.input_dtype,
                     json.dumps([dict(self.counters), dict(self.settings), dict(self.recorded)], sort_keys=True)))


def _input_dtype(declared: Any, who: str) -> np.dtype:
    """``declared`` as an ``np.dtype`` if it is float32 or float64; ``ProcessorContractError`` otherwise."""
    try:
        dtype = np.dtype(declared) if declared is not None else None  # np.dtype(None) is float64
    except TypeError:
        dtype = None
    if dtype is None or dtype not in INPUT_DTYPES:
        raise ProcessorContractError(f"{who}: input_dtype {declared!r} is not supported: the processor's input "
                                     f"(batch.x) is float32 (the default) or float64")
    return dtype


def _mapping(value: Any, field_name: str, who: str) -> dict[Any, Any]:
    if value is None:  # None: nothing declared
        return {}
    if not isinstance(value, Mapping):
        raise ProcessorContractError(f"{who}: {field_name} must be a mapping (a dict), got {type(value).__name__}")
    return dict(value)


def _counters(value: Any, who: str) -> Mapping[str, str]:
    counters = _mapping(value, "counters", who)
    for name, output in counters.items():
        if not isinstance(name, str) or not isinstance(output, str):
            raise ProcessorContractError(f"{who}: counters must map a counter's name to an output's name, both "
                                         f"strings: got {name!r}: {output!r}")
        if name in CORE_COUNTS:
            raise ProcessorContractError(f"{who}: counter {name!r} is a count the controller keeps itself: "
                                         f"choose another name")
    return MappingProxyType(counters)


def _settings(value: Any, field_name: str, who: str) -> Mapping[str, Any]:
    settings = _mapping(value, field_name, who)
    for name, setting in settings.items():
        if not isinstance(name, str) or name in CORE_SETTINGS:
            raise ProcessorContractError(f"{who}: setting {name!r} is one the controller records itself "
                                         f"({', '.join(sorted(CORE_SETTINGS))}): choose another name")
        try:
            json.dumps(setting, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ProcessorContractError(f"{who}: setting {name!r} = {setting!r} cannot be written into a "
                                         f"checkpoint ({exc}): give a JSON value (a number, string, bool, "
                                         f"list or dict of them)") from None
    return MappingProxyType(settings)


def counts_from(counters: Mapping[str, str], saved: Mapping[str, Any]) -> dict[str, int]:
    """Each declared counter as a checkpoint's counts hold it (0 where they do not)."""
    return {name: int(saved.get(name, 0)) for name in counters}


def check_counters(counters: Mapping[str, str], outputs: Mapping[str, Any]) -> None:
    """``ProcessorContractError`` unless every counter's output is among ``outputs`` (the step's
    output shapes, ``jax.eval_shape``'s) and is bool or integer."""
    for name, output in counters.items():
        if output not in outputs:
            raise ProcessorContractError(f"counter {name!r} sums output {output!r}, which the step does not return "
                                         f"(its outputs: {', '.join(map(repr, outputs))})")
        dtype = np.dtype(outputs[output].dtype)
        if dtype != np.bool_ and not np.issubdtype(dtype, np.integer):
            raise ProcessorContractError(f"counter {name!r}: output {output!r} is {dtype.name}; a counter sums a "
                                         f"bool or int output (a flag or a count per message)")


def count(counters: Mapping[str, str], outputs: Mapping[str, np.ndarray], keep: np.ndarray | None,
          into: dict[str, int]) -> None:
    """Add each counter's output, summed over the rows ``keep`` selects (None: every row), to ``into``."""
    for name, output in counters.items():
        values = outputs[output] if keep is None else outputs[output][keep]
        # a flag: count_nonzero, cheaper than np.sum on a batch's few rows
        got = np.count_nonzero(values) if values.dtype == np.bool_ else np.sum(values, dtype=np.int64)
        into[name] = into.get(name, 0) + int(got)
