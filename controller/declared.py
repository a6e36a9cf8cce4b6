"""What a processor declares to the core beyond ``(init, step)``: the counters it wants kept and
the settings its checkpoints record. The core keeps them without knowing what they mean.

Rules:
- Read from the processor object's attributes (a ``Processor`` has them as fields; any other
  object may have them or not): ``counters`` (counter name -> output name), ``settings`` (name ->
  JSON value, recorded in every checkpoint and matched on restore) and ``recorded`` (name ->
  JSON value, recorded only). Absent or None: nothing declared.
- A declaration the core cannot keep is refused when the controller is built
  (``ProcessorContractError``): a counter named as a count of the core's own, a setting named as
  one of the core's, or a value JSON cannot write. A counter's output must exist and be bool or
  integer: checked when compiling (``check_counters``), with the step's outputs known.
- A counter is the sum of its output over the batch's messages whose results are finite (the
  rows answered with results); it lives in ``MainStats.counters``, in every checkpoint's counts
  beside ``processed``, and is restored from them.
- Pure: no JAX, no threads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from forkless.controller.errors import ProcessorContractError

__all__ = ["CORE_COUNTS", "CORE_SETTINGS", "Declared", "check_counters", "count", "declared"]

# counts every checkpoint holds whatever the processor (a counter of this name is refused)
CORE_COUNTS = frozenset({"processed"})
# settings the core writes into checkpoints itself (Recovery.settings, the snapshot, partitioned objects)
CORE_SETTINGS = frozenset({"features", "max_streams", "processor", "processor_version", "devices", "leaves",
                           "partition", "partition_count", "weights"})


class Declared(NamedTuple):
    """A processor's declarations, checked (``declared``)."""

    counters: dict[str, str]  # counter name -> the output it sums
    settings: dict[str, Any]  # recorded in every checkpoint, matched on restore
    recorded: dict[str, Any]  # recorded in every checkpoint, not matched

    def counts_from(self, saved: Mapping[str, Any]) -> dict[str, int]:
        """Each declared counter as a checkpoint's counts hold it (0 where they do not)."""
        return {name: int(saved.get(name, 0)) for name in self.counters}


def declared(processor: Any) -> Declared:
    """``processor``'s declarations (module rules); ``ProcessorContractError`` for one the core cannot keep."""
    who = f"processor {getattr(processor, 'name', None) or '(unnamed)'!r}"
    counters = _mapping(processor, "counters", who)
    for name, output in counters.items():
        if not isinstance(name, str) or not isinstance(output, str):
            raise ProcessorContractError(f"{who}: counters must map a counter's name to an output's name, both "
                                         f"strings: got {name!r}: {output!r}")
        if name in CORE_COUNTS:
            raise ProcessorContractError(f"{who}: counter {name!r} is a count the controller keeps itself: "
                                         f"choose another name")
    settings, recorded = _mapping(processor, "settings", who), _mapping(processor, "recorded", who)
    for name, value in [*settings.items(), *recorded.items()]:
        if not isinstance(name, str) or name in CORE_SETTINGS:
            raise ProcessorContractError(f"{who}: setting {name!r} is one the controller records itself "
                                         f"({', '.join(sorted(CORE_SETTINGS))}): choose another name")
        if name in settings and name in recorded:
            raise ProcessorContractError(f"{who}: setting {name!r} is both in settings (matched) and in recorded")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ProcessorContractError(f"{who}: setting {name!r} = {value!r} cannot be written into a "
                                         f"checkpoint ({exc}): give a JSON value (a number, string, bool, "
                                         f"list or dict of them)") from None
    return Declared(counters, settings, recorded)


def _mapping(processor: Any, attribute: str, who: str) -> dict[Any, Any]:
    value = getattr(processor, attribute, None)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ProcessorContractError(f"{who}: {attribute} must be a mapping (a dict), got {type(value).__name__}")
    return dict(value)


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
        # a flag: count_nonzero (about 1 µs against 5 µs for np.sum on a batch's few rows)
        got = np.count_nonzero(values) if values.dtype == np.bool_ else np.sum(values, dtype=np.int64)
        into[name] = into.get(name, 0) + int(got)
