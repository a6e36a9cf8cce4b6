"""Runs of the controller used by tests/controller/device/test_devices.py, on however many devices this process has.

    JAX_NUM_CPU_DEVICES=4 python -m tests.device_runs WRITE_DIR RESTORE_DIR OUT.json

JAX fixes its device count when its backend starts, so a run on 4 forced CPU devices is a
subprocess: one for every run test_devices.py makes on 4 devices (``on_four``: the scenarios
one step at a time and with three steps in flight, the first half of the checkpoint feed
written into WRITE_DIR, the second half restored from RESTORE_DIR), so that its start, its
JAX and the compiles its runs share are paid once. The same functions run in the test
process for the one-device results. Each run
feeds literal batches through the real ``Controller`` (a fake IO side: one chunk is one
batch, ``max_wait_ms=0``) and records, per message, the outputs exactly as the step
returned them (float32 values as Python floats: equal floats are equal bits), the error
replies, and facts about the run (devices, shardings, compilations after warm-up).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from forkless import OnResults, Runtime
from forkless.controller.config import Config
from forkless.controller.declared import Description
from forkless.controller.errors import ProcessorContractError
from forkless.controller.loop import Controller
from forkless.controller.processor import Processor
from forkless.io_loop.crossing import Chunk
from tests.fake_io import FakeIO, drain

F = 3


def batches_of(names: list[str], sizes: list[int], seed: int) -> list[tuple[list[int], list[str], np.ndarray]]:
    """``names`` cut into batches of ``sizes`` (seq = position), with reproducible features."""
    xs = np.random.default_rng(seed).normal(size=(len(names), F)).round(4).astype(np.float32)
    out, at = [], 0
    for size in sizes:
        out.append((list(range(at, at + size)), names[at:at + size], xs[at:at + size]))
        at += size
    assert at == len(names)
    return out


def run(config: Config, batches: list, processor: Processor | None = None, depth: int = 1) -> dict[str, Any]:
    """Every batch through a started controller; what came out and what the run looked like.
    ``depth``: FORKLESS_STEPS_IN_FLIGHT, every batch queued before the first is taken where above 1."""
    results: dict[int, dict[str, Any]] = {}

    def on_results(seq: list[int], stream: list[str], outputs: dict[str, np.ndarray]) -> None:
        for i, s in enumerate(seq):
            results[s] = {"stream": stream[i], **{k: v[i].tolist() for k, v in outputs.items()}}

    fake = FakeIO()
    config = config.replace(steps_in_flight=depth)
    with Controller(config, processor=processor, sinks=[OnResults(on_results)],
                    runtime=Runtime(io_factory=fake)) as ctl:
        for seqs, names, xs in batches:
            fake.inbound.put_nowait(Chunk(seqs, names, np.asarray(xs, np.float32), 0))
            while depth == 1 and ctl.process_pending():
                pass
        while ctl.process_pending():
            pass
        frames = [json.loads(f) for item in drain(fake.outbound) for f in item.frames]
        stats = ctl.stats()
        shardings = {jax.tree_util.keystr(path): {"spec": str(getattr(leaf.sharding, "spec", None)),
                                                  "devices": len(leaf.sharding.device_set),
                                                  "shape": list(leaf.shape)}
                     for path, leaf in jax.tree_util.tree_flatten_with_path(ctl.state)[0]}
        restored = ctl.restored_from
    return {
        "results": {str(k): v for k, v in sorted(results.items())},
        "errors": {str(f["seq"]): f["error"] for f in frames if "error" in f},
        "devices": list(stats.devices),
        "device_messages": list(stats.device_messages),
        "device_rows": stats.device_rows,
        "compilations_after_warmup": stats.compilations_after_warmup,
        "streams_evicted": stats.streams_evicted,
        "resets": stats.resets,
        "shardings": shardings,
        "restored": restored is not None,
    }


# ---- processors ------------------------------------------------------------------------------


def product_processor() -> Processor:
    """A running product per stream: x = 1e30 twice overflows float32 to inf."""

    def init(config: Any) -> jax.Array:
        return jnp.ones(config.max_streams + 1, jnp.float32)

    def step(prod: jax.Array, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        new = prod[batch.key] * batch.x[:, 0]
        prod = prod.at[jnp.where(batch.valid, batch.key, prod.shape[0] - 1)].set(jnp.where(batch.valid, new, 1.0))
        return prod, {"prod": new}

    return Processor(init, step, description=Description(name="device-runs"))


def weighted_count_processor(change_weights: bool = False, per_stream: bool = True) -> Processor:
    """Per-stream counts plus weights shared by every stream (a leaf that is not per-stream)."""

    def init(config: Any) -> dict[str, jax.Array]:
        return {"count": jnp.zeros(config.max_streams + 1, jnp.int32),
                "weights": jnp.arange(1, config.features + 1, dtype=jnp.float32)}

    def step(state: dict[str, jax.Array], batch: Any) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        count = state["count"].at[batch.key].add(batch.valid.astype(jnp.int32))
        weights = state["weights"] * 1.5 if change_weights else state["weights"]
        return {"count": count, "weights": weights}, {"count": count[batch.key], "dot": batch.x @ weights}

    return Processor(init, step, description=Description(name="device-runs-mixing", per_stream=per_stream))


# ---- the runs ----------------------------------------------------------------------------------


def _spread_batches() -> list:
    rng = np.random.default_rng(3)
    sizes = [1, 16, 5, 16, 2, 9, 16, 3, 16, 7]
    return batches_of([f"s{k}" for k in rng.integers(0, 9, size=sum(sizes))], sizes, seed=1)


# eight streams, then full batches of streams that all live on device 0 of 4 (slots 0 and 4),
# then one batch spread over all of them
SKEWED_NAMES = ([f"s{k}" for k in range(8)] + [f"s{k}" for k in (0, 4) * 8] + [f"s{k}" for k in (4, 0, 4, 4) * 4]
                + [f"s{k}" for k in range(8)])
BATCHES = {"spread": _spread_batches(), "skewed": batches_of(SKEWED_NAMES, [8, 16, 16, 8], seed=2)}


def spread(depth: int = 1) -> dict[str, Any]:
    """9 streams over a table of 10, batches of 1 to 16 messages, streams repeating in a batch."""
    return run(Config(features=F, max_streams=10, max_batch=16, max_wait_ms=0.0, status_s=0.0, warmup=3),
               BATCHES["spread"], depth=depth)


def skewed(depth: int = 1) -> dict[str, Any]:
    """Whole batches whose streams all live on one device (``SKEWED_NAMES``)."""
    return run(Config(features=F, max_streams=16, max_batch=16, max_wait_ms=0.0, status_s=0.0, warmup=3),
               BATCHES["skewed"], depth=depth)


EVICTION_ORDER = [f"s{(i * 3) % 11}" for i in range(66)]


def eviction(depth: int = 1) -> dict[str, Any]:
    """11 streams taking turns through a table of 6 slots (FORKLESS_STREAM_IDLE_S=0: every new
    stream takes the least recently seen stream's slot, reset), batches of 3."""
    return run(Config(features=F, max_streams=6, max_batch=4, max_wait_ms=0.0, status_s=0.0, stream_idle_s=0.0,
                      warmup=2), batches_of(EVICTION_ORDER, [3] * 22, seed=3), depth=depth)


NON_FINITE = [("a", 2.0), ("b", 3.0), ("c", 7.0), ("a", 1e30), ("a", 1e30), ("a", 5.0), ("b", 2.0), ("c", 1.0)]


def non_finite(depth: int = 1) -> dict[str, Any]:
    """A stream whose product overflows is answered with an error and starts again from 1."""
    batches = [([i], [name], np.array([[x, 0.0, 0.0]], np.float32)) for i, (name, x) in enumerate(NON_FINITE)]
    return run(Config(features=F, max_streams=5, max_batch=4, max_wait_ms=0.0, status_s=0.0), batches,
               product_processor(), depth=depth)


def replicated(depth: int = 1) -> dict[str, Any]:
    """A processor with a leaf shared by all streams: it is replicated on every device."""
    names = [f"s{k % 5}" for k in range(20)]
    return run(Config(features=F, max_streams=8, max_batch=4, max_wait_ms=0.0, status_s=0.0),
               batches_of(names, [4] * 5, seed=4), weighted_count_processor(), depth=depth)


def refused(processor: Processor) -> str:
    """The start-up error of a processor that cannot be sharded ("" if it starts)."""
    try:
        run(Config(features=F, max_streams=8, max_batch=4, max_wait_ms=0.0, status_s=0.0), [], processor)
    except ProcessorContractError as exc:
        return str(exc)
    return ""


def scenarios(depth: int = 1) -> dict[str, Any]:
    return {
        "jax_devices": len(jax.local_devices()),
        "spread": spread(depth),
        "skewed": skewed(depth),
        "eviction": eviction(depth),
        "non_finite": non_finite(depth),
        "replicated": replicated(depth),
        "refused_changed_replicated_leaf": refused(weighted_count_processor(change_weights=True)),
        "refused_not_per_stream": refused(weighted_count_processor(per_stream=False)),
    }


CHECKPOINT_NAMES = [f"s{k}" for k in np.random.default_rng(5).integers(0, 7, size=60)]
CHECKPOINT_BATCHES = batches_of(CHECKPOINT_NAMES, [6, 10, 4, 10, 8, 12, 10], seed=5)
CHECKPOINT_SPLIT = 3  # batches before the stop (and its checkpoint), the rest after the restore


def checkpoint_run(directory: str, first: bool) -> dict[str, Any]:
    """The first part of a feed, stopped with a final checkpoint in ``directory``; or (not
    ``first``) a new controller restoring it and running the rest."""
    part = CHECKPOINT_BATCHES[:CHECKPOINT_SPLIT] if first else CHECKPOINT_BATCHES[CHECKPOINT_SPLIT:]
    return run(Config(features=F, max_streams=9, max_batch=16, max_wait_ms=0.0, status_s=0.0, warmup=3,
                      checkpoint_dir=directory), part)


def main(argv: list[str]) -> int:
    write_dir, restore_dir, out = argv
    figures = {"scenarios": scenarios(), "in_flight": scenarios(depth=3),
               "checkpoint_first": checkpoint_run(write_dir, first=True),
               "checkpoint_second": checkpoint_run(restore_dir, first=False)}
    Path(out).write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
