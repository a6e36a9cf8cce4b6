"""Processors: a pure ``(init, step)`` pair, JAX style, and the default EWMA z-score detector.

Rules:
- ``init(config) -> state`` builds the state pytree; the controller puts it on the device
  once and keeps it there across batches and reconnects.
- ``step(state, batch) -> (state, outputs)`` is pure and jittable. ``batch`` is a
  ``controller.batching.Batch`` (x, key, valid) padded to a bucket size B; ``outputs`` is a
  dict of arrays with leading axis B. Rows with ``valid=False`` are padding: they must not
  change the state, and their outputs are discarded.
- ``key`` is the message's stream slot in ``[0, max_streams)``; padding rows carry the spare
  slot ``max_streams``, so per-stream state should have ``max_streams + 1`` rows.
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
    messages one at a time. The step groups rows by their occurrence rank within the batch
    (first appearance of each stream, second, …) and runs one vectorised round per rank,
    so a batch of distinct streams costs one round.
    """

    def init(config: Any) -> EWMAState:
        slots = config.max_streams + 1
        return EWMAState(
            count=jnp.zeros((slots,), jnp.int32),
            mean=jnp.zeros((slots, config.features), jnp.float32),
            var=jnp.zeros((slots, config.features), jnp.float32),
        )

    def step(state: EWMAState, batch: Any) -> tuple[EWMAState, dict[str, jax.Array]]:
        x = batch.x.astype(jnp.float32)
        spare = state.count.shape[0] - 1
        key = jnp.where(batch.valid, batch.key, spare)
        rank = _occurrence_rank(key)
        rank = jnp.where(batch.valid, rank, -1)
        rounds = jnp.max(rank) + 1

        def cond(carry: tuple) -> jax.Array:
            return carry[0] < rounds

        def body(carry: tuple) -> tuple:
            r, st, z, n = carry
            active = rank == r
            idx = jnp.where(active, key, spare)
            cnt = st.count[idx]
            mean = st.mean[idx]
            var = st.var[idx]
            first = (cnt == 0)[:, None]
            d = x - mean
            z_r = jnp.where(first, 0.0, d / jnp.sqrt(var + eps))
            new_mean = jnp.where(first, x, mean + alpha * d)
            new_var = jnp.where(first, 0.0, (1.0 - alpha) * (var + alpha * d * d))
            st = EWMAState(
                count=st.count.at[idx].set(cnt + 1),
                mean=st.mean.at[idx].set(new_mean),
                var=st.var.at[idx].set(new_var),
            )
            z = jnp.where(active[:, None], z_r, z)
            n = jnp.where(active, cnt, n)
            return r + 1, st, z, n

        z0 = jnp.zeros_like(x)
        n0 = jnp.zeros(key.shape, jnp.int32)
        _, state, z, n = jax.lax.while_loop(cond, body, (jnp.int32(0), state, z0, n0))
        score = jnp.max(jnp.abs(z), axis=1)
        anomaly = (n >= warmup) & (score > threshold) & batch.valid
        return state, {"z": z, "score": score, "anomaly": anomaly}

    return Processor(init, step)


def _occurrence_rank(key: jax.Array) -> jax.Array:
    """For each row, how many earlier rows of the batch have the same key (O(B log B))."""
    b = key.shape[0]
    pos = jnp.arange(b, dtype=jnp.int32)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    run_start = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
    first_of_run = jax.lax.cummax(jnp.where(run_start, pos, 0))
    return jnp.zeros(b, jnp.int32).at[order].set(pos - first_of_run)


def default_processor(config: Any) -> Processor:
    """The EWMA detector with the configuration's alpha, threshold and warm-up."""
    return ewma_processor(alpha=config.alpha, threshold=config.threshold, warmup=config.warmup)
