"""A processor with a deliberately heavy step, for the IO-loop lag measurement.

It is the default EWMA detector plus a chain of ``iters`` dense ``size x size`` matmuls
(about 100 ms on a 2-core CPU with the defaults). The chain's result feeds the score by
``1e-30 * tanh(sum)``, so XLA cannot drop it and the answers stay those of the default
detector. While XLA runs the chain the GIL is released: the IO loop of the forkless design
keeps turning, which is what the lag figures under the heavy step show.

The step's cost is a parameter: ``bench.step_cost`` calibrates ``iters`` (at a smaller
``size``) so that a step takes about 1 ms or 10 ms on the machine at hand, and every design
runs the calibrated processor with ``--heavy-iters N --heavy-size S`` (``processor_for``).

Import it only where JAX is wanted (never in the spawn design's child).

Rules:
- The chain changes no answer: the heavy detector answers as the default one does.
- It imports JAX: only where JAX is wanted.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from forkless.controller.processor import Processor, default_processor

HEAVY_SIZE = 1024
HEAVY_ITERS = 10


def heavy_processor(config: Any, size: int = HEAVY_SIZE, iters: int = HEAVY_ITERS) -> Processor:
    """The default processor whose step also runs ``iters`` ``size x size`` matmuls."""
    base = default_processor(config)

    def step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        state, out = base.step(state, batch)
        # seeded by the batch so the chain is not a constant XLA could fold at compile time
        seed = jnp.sum(batch.x) * 1e-9
        a = jnp.full((size, size), 1.0 / size, jnp.float32) + seed
        h = jax.lax.fori_loop(0, iters, lambda i, h: jnp.tanh(h @ a), a)
        out = dict(out)
        out["score"] = out["score"] + 1e-30 * jnp.tanh(jnp.sum(h))
        return state, out

    return Processor(base.init, step)


def processor_for(config: Any, heavy: bool = False, size: int = 0, iters: int = 0) -> Processor:
    """The processor a design's command line asks for: ``iters`` matmuls of ``size``
    (``size`` 0: ``HEAVY_SIZE``) when ``iters`` > 0, the default heavy step with ``heavy``,
    else the default detector."""
    if iters > 0:
        return heavy_processor(config, size or HEAVY_SIZE, iters)
    if heavy:
        return heavy_processor(config)
    return default_processor(config)
