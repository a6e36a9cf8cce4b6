"""The executables ``compile_step`` built, kept for the next ``compile_step`` of the same program in this process.

Rules:
- A program is what the compiled step and reset are a function of: the processor's ``init`` and ``step`` (the
  function objects, as ``jax.jit`` caches by its function), its declared counters and input dtype, the state's
  shapes and dtypes, the batch sizes, ``features``, ``max_streams``, the device, and the JAX and XLA settings that
  change a trace or a compilation. Equal programs compile to equal executables, so a second ``Controller`` of the
  same processor in one process traces and loads nothing.
- Kept only where that is sure: one device, ``init`` and ``step`` plain functions (not bound methods or callable
  objects). As with ``jax.jit``, a trace that read a global since changed is not redone: build a new processor to
  change what it computes (``ewma_processor`` and ``stream_processor`` return new functions each call).
- The newest ``KEPT`` programs are kept, their executables only: the state never (each ``compile_step`` builds its
  own), the processor's functions weakly, so nothing they close over outlives the program that uses them.
"""

from __future__ import annotations

import os
import types
import weakref
from typing import Any, NamedTuple

import jax

from forkless.controller.processor import Processor, description_of
from forkless.controller.settings.groups import StepShape

__all__ = ["KEPT", "Kept", "forget", "keep", "kept", "program_key"]

KEPT = 8  # programs kept, the newest

# the JAX settings that change what a trace builds (besides the shapes and dtypes in the key)
_TRACE_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                   "jax_numpy_dtype_promotion", "jax_debug_nans", "jax_debug_infs", "jax_disable_jit")


class Kept(NamedTuple):
    """A program's executables: the step per bucket, the slot reset and the reset's fresh rows
    (taken from each engine's own fresh state)."""

    steps: dict[int, Any]
    reset: Any
    template: Any
    outputs: tuple[Any, ...] = ()  # where a packed step puts each output (layouts.OneDevice.fields)


# insertion order is age; each of these calls is one dict operation (atomic in CPython), so two
# controllers compiling at once in two threads need no lock: at worst both compile a program
_kept: dict[tuple[Any, ...], Kept] = {}


def program_key(processor: Processor, settings: StepShape, devices: list[Any], shapes: Any) -> tuple[Any, ...] | None:
    """The program's key, or None where it is not kept (several devices, an ``init`` or
    ``step`` that is not a plain function, something unhashable): then it is compiled, and its
    contract checked, as if never seen."""
    init, step, described = processor.init, processor.step, description_of(processor)
    if len(devices) != 1 or not isinstance(init, types.FunctionType) or not isinstance(step, types.FunctionType):
        return None
    counters, dtype = described.counters, described.input_dtype
    leaves, treedef = jax.tree.flatten(shapes)
    key = (weakref.ref(init), weakref.ref(step), tuple(sorted(counters.items())), str(dtype), treedef,
           tuple((tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False))) for leaf in leaves),
           tuple(settings.buckets), settings.max_batch, settings.features, settings.max_streams, devices[0],
           tuple(str(getattr(jax.config, name, None)) for name in _TRACE_SETTINGS), os.environ.get("XLA_FLAGS", ""))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def kept(key: tuple[Any, ...] | None) -> Kept | None:
    """The program's executables, if they were kept."""
    return None if key is None else _kept.get(key)


def keep(key: tuple[Any, ...] | None, steps: dict[int, Any], reset: Any, template: Any,
         outputs: tuple[Any, ...] = ()) -> None:
    """Keep a program's executables (the oldest dropped beyond ``KEPT``)."""
    if key is None:
        return
    _kept[key] = Kept(dict(steps), reset, template, outputs)
    while len(_kept) > KEPT:
        try:
            del _kept[next(iter(_kept))]
        except (KeyError, RuntimeError, StopIteration):  # another thread took it first
            break


def forget() -> None:
    """Drop every kept program (their executables are freed once no engine uses them)."""
    _kept.clear()
