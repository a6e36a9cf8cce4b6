"""Ahead-of-time compilation of the step for every bucket size, and the compilation counter.

Rules:
- One implementation, used by the controller loop, the preflight (``--check``) and the
  benchmark's spawn design, so all three run the same compiled code.
- ``compile_step`` puts the processor's initial state on the device and compiles the step
  once per bucket with example batches of that size, with the state DONATED (the caller
  keeps only the state a step returns), plus the slot reset (``processor.reset_rows``) for
  up to ``max_batch`` recycled slots; after it nothing compiles again (``compilations()``
  stays flat, which tests pin).
- The processor contract is checked on the compiled shapes, so a violation stops the start
  with ``ProcessorContractError`` naming the output, its shape and the rule, instead of an
  IndexError at the first message: ``outputs`` is a dict of arrays with leading axis B (the
  bucket size), and ``step`` returns a state of the same structure, shapes and dtypes.
- Each compiled step is the processor's step wrapped by ``guarded``: messages whose outputs
  or stream state come out non-finite are marked on the device (the loop then resets them).
- Every XLA compilation in this process is counted from JAX's own monitoring events.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from controller.batching import Batch, pad_batch
from controller.errors import ProcessorContractError
from controller.processor import reset_rows, row_template

__all__ = ["CompiledStep", "compilations", "compile_step", "example_batch"]

_COMPILATIONS = [0]


def _on_event(event: str, duration: float, **_: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILATIONS[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compilations() -> int:
    """XLA compilations so far in this process."""
    return _COMPILATIONS[0]


@dataclass
class CompiledStep:
    """The initial device state, one compiled step per bucket size (state donated), and the
    compiled slot reset: ``reset(state, template, idx)`` with idx int32 [max_batch]."""

    state: Any
    steps: dict[int, Any]
    devices: tuple[str, ...]
    template: Any = None
    reset: Any = None


def example_batch(features: int, bucket: int, spare_slot: int) -> Batch:
    """An all-padding batch of ``bucket`` rows: the shapes and dtypes every real batch has."""
    return pad_batch(np.zeros((0, features), np.float32), np.zeros(0, np.int32), bucket, spare_slot)


def compile_step(processor: Any, config: Any,
                 on_compiled: Callable[[int, float], None] | None = None) -> CompiledStep:
    """Initialise the state on the device and compile ``processor.step`` for ``config.buckets``;
    ``on_compiled(bucket, seconds)`` is called after each (the preflight prints it)."""
    cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if cache_dir and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # our buckets compile in well under JAX's default 1 s threshold: cache them all
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    state = jax.device_put(processor.init(config))
    template = row_template(state, config.max_streams + 1)
    reset = jax.jit(reset_rows, donate_argnums=0).lower(
        state, template, np.zeros(config.max_batch, np.int32)).compile()
    # the state is donated: XLA updates the table in place, so a step costs O(B), not O(S)
    jitted = jax.jit(guarded(processor.step), donate_argnums=0)
    steps = {}
    for bucket in config.buckets:
        example = example_batch(config.features, bucket, config.max_streams)
        # checked on the bare step's shapes first: the guard below needs [B, ...] outputs
        check_contract(state, jax.eval_shape(processor.step, state, example), bucket)
        t0 = time.perf_counter()
        steps[bucket] = jitted.lower(state, example).compile()
        if on_compiled is not None:
            on_compiled(bucket, time.perf_counter() - t0)
    return CompiledStep(state, steps, tuple(str(d) for d in jax.devices()), template, reset)


def guarded(step: Callable[[Any, Batch], tuple[Any, dict[str, Any]]]
            ) -> Callable[[Any, Batch], tuple[Any, dict[str, Any], Any]]:
    """``step`` plus the finiteness guard: ``(state, batch) -> (state, outputs, bad)``.

    ``bad`` (bool [B]) marks the messages with a NaN or an infinity in any float output; the
    caller answers them with an error and resets their streams (the compiled ``reset``, rarely
    needed, so not paid on every step), so a stream whose state went non-finite starts again
    instead of staying poisoned. It checks the outputs only: reading the batch's rows of the
    table back after the step's in-place write measured +55 µs a step on the CPU (about a
    third of it), against +15 µs for the outputs. A processor whose state could go non-finite
    without its outputs showing it must keep its arithmetic within range (the default
    detector does: README "Reliability")."""

    def guarded_step(state: Any, batch: Batch) -> tuple[Any, dict[str, Any], Any]:
        new_state, outputs = step(state, batch)
        n = batch.key.shape[0]
        finite = jnp.ones(n, bool)
        for value in outputs.values():
            if jnp.issubdtype(value.dtype, jnp.inexact):
                finite &= jnp.isfinite(value.reshape(n, -1)).all(axis=1)
        return new_state, outputs, ~finite & batch.valid

    return guarded_step


def check_contract(state: Any, out_info: Any, bucket: int) -> None:
    """Raise ``ProcessorContractError`` unless ``out_info`` (the compiled step's output shapes
    for a batch of ``bucket`` rows) is ``(state of the same shapes, {name: [B, ...]})``."""
    rule = f"outputs must have shape [B, ...] (B = {bucket}, the rows of the padded batch)"
    if not (isinstance(out_info, tuple) and len(out_info) == 2):
        raise ProcessorContractError("step must return (state, outputs)")
    new_state, outputs = out_info
    before = jax.tree.structure(state)
    if jax.tree.structure(new_state) != before:
        raise ProcessorContractError(f"step must return a state of the same structure as it was given: "
                                     f"got {jax.tree.structure(new_state)}, expected {before}")
    for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
        if (old.shape, old.dtype) != (new.shape, new.dtype):
            raise ProcessorContractError(f"step must return state leaves of unchanged shape and dtype: "
                                         f"{old.dtype}{list(old.shape)} came back as {new.dtype}{list(new.shape)}")
    if not isinstance(outputs, dict) or not all(isinstance(k, str) for k in outputs):
        raise ProcessorContractError(f"step must return outputs as a dict of arrays keyed by name, "
                                     f"got {type(outputs).__name__}")
    for name, leaf in outputs.items():
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape or shape[0] != bucket:
            raise ProcessorContractError(f"output {name!r} has shape {list(shape)}: {rule}")
