"""The default EWMA detector's step as it was hand-written before issue 21 (the detector is now
built on ``controller.processor.stream_processor``): kept verbatim as the bit-for-bit reference
for the helper-built detector and for the step-time comparison (bench/stream_step.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from forkless.controller.processor import EPS, EWMAState, Processor, _occurrences


def reference_ewma_processor(alpha: float = 0.05, threshold: float = 4.0, warmup: int = 20,
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
