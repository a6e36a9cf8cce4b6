"""Processors: a pure ``(init, step)`` pair, JAX style, and the default EWMA z-score detector.

Rules:
- ``init(config) -> state`` builds the state pytree; the controller puts it on the device
  once and keeps it there across batches and reconnects.
- ``step(state, batch) -> (state, outputs)`` is pure and jittable. ``batch`` is a
  ``controller.batching.Batch`` (x, key, valid) padded to a bucket size B; ``outputs`` is a
  dict of arrays with leading axis B. Rows with ``valid=False`` are padding: they must not
  change the state, and their outputs are discarded.
- ``key`` is the message's stream slot in ``[0, max_streams)``; padding rows carry the spare
  slot ``max_streams``, so per-stream state should have ``max_streams + 1`` rows (a leaf is
  per-stream when its leading axis is ``max_streams + 1``).
- The controller jits ``step`` with ``donate_argnums=0``: the state passed in is *donated*,
  its buffers are reused for the new state and deleted. A caller keeps only the state
  ``step`` returns and never touches the one it passed in.
- A step must cost O(B), not O(max_streams): the table may hold 10^7 rows. Gather the
  batch's rows once (``state.mean[batch.key]`` -> [B, F]), compute on [B, ...] arrays only,
  and write back once (``state.mean.at[key].set(rows)``); with the state donated XLA
  updates the table in place. Never carry the whole table through a ``while_loop``/``scan``
  and never build a new [S + 1, ...] array (``jnp.where`` over the table, ``+`` on it): each
  is a full pass, and a loop carry is a full copy. Keep every read of the table ahead of
  the write: an output that uses a gathered row directly may be fused with the gather and
  scheduled after the write, and XLA then copies the whole table to keep the old row
  (``compiled.as_text()`` shows a ``copy`` of an [S + 1, ...] array). Pass such values
  through the computation that produces the write, as the EWMA step does with its counts.
  Write only the batch's rows (``batch.key``, padding included) of a per-stream leaf: a
  checkpoint being copied between steps saves exactly those rows before each step
  (controller/checkpoint.py), so a step that wrote other rows would make it inexact.
- Several devices (``FORKLESS_DEVICES``): the same ``(init, step)`` runs unchanged; the
  controller shards it. A leaf whose leading axis is ``max_streams + 1`` is per-stream and
  is split by stream over the devices; any other leaf (shared weights, say) is replicated on
  every device, and ``step`` must return it unchanged (checked when compiling). On each
  device ``step`` sees that device's shard: per-stream leaves of ``R`` rows (row ``R - 1``
  its spare), a batch of ``Bd`` rows whose ``key`` is a local row. So take the spare row
  from the state (``leaf.shape[0] - 1``), never from ``config.max_streams``; on one device
  the two are the same. A step that mixes streams (a reduction over the batch, a read of
  another stream's row) gives other results on several devices: build it with
  ``per_stream=False`` and it is refused there, with an error naming ``FORKLESS_DEVICES=1``.
- Slot recycling: when a stream's slot is handed to a new stream, the controller resets
  that slot with ``reset_rows(state, template, slots)`` (template from ``row_template``)
  before the step that runs the new stream's first message. ``init`` must therefore build
  per-stream rows that are all equal ("a fresh stream"), as zeros are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

EPS = 1e-6


class Processor(NamedTuple):
    """A model the controller can run: two pure functions, like an optax transform."""

    init: Callable[[Any], Any]
    step: Callable[[Any, Any], tuple[Any, dict[str, Any]]]
    # True: each message's outputs and state depend only on its own stream's rows and input,
    # so the step can be sharded by stream over several devices; False refuses more than one
    per_stream: bool = True
    # batch.x's dtype: jnp.float32, or jnp.float64 (needs JAX's x64 mode: EMBEDDING.md)
    input_dtype: Any = jnp.float32


class EWMAState(NamedTuple):
    """Per-stream state; row ``max_streams`` is the spare slot used by padding."""

    count: jax.Array  # int32 [S + 1]   messages seen per stream
    mean: jax.Array  # float32 [S + 1, F]
    var: jax.Array  # float32 [S + 1, F]


def ewma_processor(alpha: float = 0.05, threshold: float = 4.0, warmup: int = 20,
                   eps: float = EPS) -> Processor:
    """The per-stream EWMA z-score anomaly detector.

    Per stream, in arrival order, with n = how many earlier messages that stream had:
    n == 0: z = 0, mean = x, var = 0; otherwise d = x - mean, z = d / sqrt(var + eps),
    mean += alpha * d, var = (1 - alpha) * (var + alpha * d**2).
    score = max |z|; anomaly = n >= warmup and score > threshold.

    A stream may appear several times in one batch; the result equals processing the
    messages one at a time, bit for bit. The step gathers the batch's rows from the table
    once, groups rows by their occurrence rank within the batch (first appearance of each
    stream, second, …) and runs one vectorised round per rank on [B, F] arrays, a later
    occurrence reading what its previous occurrence left; then it scatters each stream's
    last occurrence back into the table once. A batch of distinct streams costs one round,
    and no round touches the table, so a step costs O(B·F·rounds) whatever ``max_streams``.
    """

    def init(config: Any) -> EWMAState:
        slots, features = config.max_streams + 1, config.features
        # one XLA computation, not kept: run eagerly, the zeros would leave four compiled ops in
        # JAX's cache for the life of the process (about 5 MiB resident on the CPU)
        return jax.jit(lambda: EWMAState(
            count=jnp.zeros((slots,), jnp.int32),
            mean=jnp.zeros((slots, features), jnp.float32),
            var=jnp.zeros((slots, features), jnp.float32),
        ))()

    def step(state: EWMAState, batch: Any) -> tuple[EWMAState, dict[str, jax.Array]]:
        x = batch.x.astype(jnp.float32)
        spare = state.count.shape[0] - 1
        key = jnp.where(batch.valid, batch.key, spare)
        rank, prev, last = _occurrences(key)
        rank = jnp.where(batch.valid, rank, -1)
        rounds = jnp.max(rank) + 1
        # the only reads of the table: one gather of the batch's rows
        count0, mean0, var0 = state.count[key], state.mean[key], state.var[key]

        def cond(carry: tuple) -> jax.Array:
            return carry[0] < rounds

        def body(carry: tuple) -> tuple:
            # post_* [B, ...]: each row's stream statistics after that row's update. Before its
            # round a row still holds its gathered table row, so a first occurrence (prev =
            # itself) reads the table and a later one what its previous occurrence left.
            r, post_count, post_mean, post_var, z, n = carry
            active = rank == r
            cnt = post_count[prev]
            mean = post_mean[prev]
            var = post_var[prev]
            first = (cnt == 0)[:, None]
            d = x - mean
            z_r = jnp.where(first, 0.0, d / jnp.sqrt(var + eps))
            new_mean = jnp.where(first, x, mean + alpha * d)
            new_var = jnp.where(first, 0.0, (1.0 - alpha) * (var + alpha * d * d))
            act = active[:, None]
            return (r + 1, jnp.where(active, cnt + 1, post_count), jnp.where(act, new_mean, post_mean),
                    jnp.where(act, new_var, post_var), jnp.where(act, z_r, z), jnp.where(active, cnt, n))

        # Everything used after the loop comes out of it: were a gathered row used there
        # directly, XLA could fuse the gather into a consumer scheduled after the scatter
        # and would then copy the whole table to keep the old row readable (it did, at B = 1).
        init = (jnp.int32(0), count0, mean0, var0, jnp.zeros_like(x), jnp.zeros(key.shape, jnp.int32))
        _, post_count, post_mean, post_var, z, n = jax.lax.while_loop(cond, body, init)
        # the only write: one scatter of each stream's last occurrence; padding rows and
        # earlier occurrences get an out-of-range index and are dropped
        out = jnp.where(last & batch.valid, key, state.count.shape[0])
        state = EWMAState(
            count=state.count.at[out].set(post_count, mode="drop"),
            mean=state.mean.at[out].set(post_mean, mode="drop"),
            var=state.var.at[out].set(post_var, mode="drop"),
        )
        score = jnp.max(jnp.abs(z), axis=1)
        anomaly = (n >= warmup) & (score > threshold) & batch.valid
        return state, {"z": z, "score": score, "anomaly": anomaly}

    return Processor(init, step)


def _occurrences(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row of a batch: its occurrence rank, its previous occurrence, and whether it is last.

    ``rank[i]``: how many earlier rows have the same key; ``prev[i]``: the row of the
    previous occurrence of the same key (``i`` itself for a first occurrence);
    ``last[i]``: no later row has the same key. One stable sort, O(B log B).
    """
    b = key.shape[0]
    pos = jnp.arange(b, dtype=jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sorted_key = key[order]
    run_start = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
    run_end = jnp.concatenate([sorted_key[1:] != sorted_key[:-1], jnp.ones((1,), bool)])
    first_of_run = jax.lax.cummax(jnp.where(run_start, pos, 0))
    before = jnp.concatenate([order[:1], order[:-1]])  # the row sorted just before
    prev_sorted = jnp.where(run_start, order, before)
    rank = jnp.zeros(b, jnp.int32).at[order].set(pos - first_of_run)
    prev = jnp.zeros(b, jnp.int32).at[order].set(prev_sorted)
    last = jnp.zeros(b, bool).at[order].set(run_end)
    return rank, prev, last


def _occurrence_rank(key: jax.Array) -> jax.Array:
    """For each row, how many earlier rows of the batch have the same key (O(B log B))."""
    return _occurrences(key)[0]


def row_template(state: Any, slots: int) -> Any:
    """One fresh row per per-stream leaf of ``state``, for ``reset_rows``.

    ``state`` is a fresh ``init(config)`` state and ``slots`` the length of its per-stream
    leading axis, ``max_streams + 1``. A leaf whose leading axis is ``slots`` becomes its
    row 0; any other leaf (weights shared by all streams, say) becomes ``None``, which
    ``reset_rows`` leaves alone. Build it once, at start-up, and keep it on the device.
    """
    return jax.tree.map(lambda leaf: leaf[0] if _per_stream(leaf, slots) else None, state)


def reset_rows(state: Any, template: Any, idx: jax.Array) -> Any:
    """``state`` with the rows ``idx`` (int32 [K]) of every per-stream leaf set to ``template``.

    Call it, jitted with ``donate_argnums=0``, on the slots a ``StreamSlots.lookup`` reported
    as recycled, before the step that runs their new streams' messages, so a new stream
    never inherits its slot's previous owner. Pad ``idx`` to a fixed K with the spare slot
    ``max_streams`` (resetting it is harmless). Costs O(K) with the state donated.
    """
    return jax.tree.map(lambda row, leaf: leaf if row is None else leaf.at[idx].set(row),
                        template, state, is_leaf=lambda row: row is None)


def _per_stream(leaf: Any, slots: int) -> bool:
    shape = getattr(leaf, "shape", ())
    return len(shape) >= 1 and shape[0] == slots


def default_processor(config: Any) -> Processor:
    """The EWMA detector with the configuration's alpha, threshold and warm-up."""
    return ewma_processor(alpha=config.alpha, threshold=config.threshold, warmup=config.warmup)
