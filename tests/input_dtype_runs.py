"""A float64 processor's run through the real path, for tests/controller/device/test_input_dtype.py.

    JAX_ENABLE_X64=1 python -m tests.input_dtype_runs OUT.json
    JAX_ENABLE_X64=1 JAX_NUM_CPU_DEVICES=4 python -m tests.input_dtype_runs OUT.json
    JAX_ENABLE_X64=1 JAX_NUM_CPU_DEVICES=2 python -m tests.input_dtype_runs --large-keys OUT.json

JAX's 64-bit mode is process-wide (and the library never turns it on), so this runs in a
subprocess and the test process keeps it off. JSON frames go through the codec the
``Controller`` built and handed its IO side (a fake one: tests/fake_io.py), then the batcher
(several chunks waiting: one batch, concatenated), the engine's layout (padding, or the packed
array of several devices) and the compiled step of a processor that gives its input back.
The figures record every value's bits (``float.hex``), as the processor returned them
(``on_results``) and as the reply frames carry them.
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
from forkless.controller.loop import Controller
from forkless.controller.processor import Processor
from forkless.io_loop.crossing import Chunk
from forkless.io_loop.jsontext import dumps
from tests.fake_io import FakeIO, drain

F = 2
# values float32 cannot hold: a price, a millisecond timestamp, 2**53 - 1, and small ones
MESSAGES = [
    ("btc", [37000.10, 1700000000123]),
    ("eth", [0.1, 1700000000124]),
    ("btc", [37000.11, 1700000000125]),  # the same stream again in the batch
    ("sol", [9007199254740991, -123.456789012345]),
    ("eth", [1e-300, 2.5e17]),
    ("ada", [1.0000000000000002, 1700000000999]),
    ("xrp", [-37000.10, 0]),
    ("xrp", [1700000000126, 37000.12]),  # its previous input: local row 1 of device 0 of 4
]
FRAMES = [  # one message a frame, and a batch frame of three: the batcher concatenates them
    dumps({"seq": 0, "stream": MESSAGES[0][0], "x": MESSAGES[0][1]}),
    dumps([{"seq": i, "stream": MESSAGES[i][0], "x": MESSAGES[i][1]} for i in (1, 2, 3)]),
    dumps({"seq": 4, "stream": MESSAGES[4][0], "x": MESSAGES[4][1]}),
    dumps([{"seq": i, "stream": MESSAGES[i][0], "x": MESSAGES[i][1]} for i in (5, 6, 7)]),
]


def echo_processor(dtype: Any = jnp.float64) -> Processor:
    """Gives back its input (``x``) and its stream's previous input (``prev``: zeros at first),
    kept in a per-stream table of the input dtype: a key unpacked wrongly shows as a wrong ``prev``."""

    def init(config: Any) -> jax.Array:
        return jnp.zeros((config.max_streams + 1, config.features), dtype)

    def step(last: jax.Array, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        # one message at a time, in batch order: a stream twice in a batch reads its first
        def one(table: jax.Array, row: tuple) -> tuple[jax.Array, jax.Array]:
            x, key, valid = row
            prev = table[key]
            return table.at[key].set(jnp.where(valid, x, prev)), prev

        # a scan over the batch carrying the table: fine for a test's table of 9 rows, never
        # for a real one (processor.py's rules)
        table, prev = jax.lax.scan(one, last, (batch.x, batch.key, batch.valid))
        return table, {"x": batch.x, "prev": prev}

    return Processor(init, step, description=Description(input_dtype=dtype))


def run() -> dict[str, Any]:
    results: dict[int, dict[str, Any]] = {}

    def on_results(seq: list[int], stream: list[str], outputs: dict[str, np.ndarray]) -> None:
        for i, s in enumerate(seq):
            results[s] = {name: [float(v).hex() for v in value[i]] for name, value in outputs.items()}
            results[s]["dtypes"] = {name: str(value.dtype) for name, value in outputs.items()}

    fake = FakeIO()
    config = Config(features=F, max_streams=8, max_batch=16, max_wait_ms=10_000.0, status_s=0.0)
    with Controller(config, processor=echo_processor(), sinks=[OnResults(on_results)],
                    runtime=Runtime(io_factory=fake)) as ctl:
        chunk_dtypes = []
        for frame in FRAMES:
            decoded = fake.codec.decode(frame)  # the codec the controller handed its IO side
            assert not decoded.errors, decoded.errors
            chunk_dtypes.append(str(decoded.x.dtype))
            fake.inbound.put_nowait(Chunk(decoded.seq, decoded.stream, decoded.x, 0))
        batches_before = ctl.stats().batches
        while ctl.process_pending():
            pass
        stats = ctl.stats()
        replies = [json.loads(f) for item in drain(fake.outbound) for f in item.frames]
    return {
        "x64": bool(jax.config.jax_enable_x64),
        "devices": len(stats.devices),
        "device_messages": list(stats.device_messages),
        "batches": stats.batches - batches_before,
        "chunk_dtypes": chunk_dtypes,
        "results": {str(k): v for k, v in sorted(results.items())},
        "replies": {str(r["seq"]): {"x": [float(v).hex() for v in r["x"]], "prev": [float(v).hex() for v in r["prev"]]}
                    for r in replies if "error" not in r},
        "errors": [r for r in replies if "error" in r],
        "compilations_after_warmup": stats.compilations_after_warmup,
    }


def expected() -> dict[str, Any]:
    """What an exact path gives: every input's float64 bits, and each stream's previous input."""
    seen: dict[str, list[float]] = {}
    out = {}
    for i, (stream, x) in enumerate(MESSAGES):
        x64 = [float(v) for v in x]
        out[str(i)] = {"x": [v.hex() for v in x64], "prev": [v.hex() for v in seen.get(stream, [0.0] * F)]}
        seen[stream] = x64
    return out


LARGE_STREAMS = 1 << 26  # slots up to 2**26 - 1: local rows above 2**24 on 2 devices, which float32 cannot count


def key_processor() -> Processor:
    """A float64 processor that gives back the key (local row) and ``x`` it was given; its state
    has no per-stream leaf, so a table of 2**26 streams costs nothing."""

    def init(config: Any) -> jax.Array:
        return jnp.zeros((), jnp.int32)

    def step(state: jax.Array, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        return state, {"key": batch.key, "x": batch.x}

    return Processor(init, step, description=Description(input_dtype=jnp.float64))


LARGE_SLOTS = [(1 << 25) + 3, (1 << 26) - 1, 5, (1 << 24) + 1, (1 << 25) + 2, 16_777_217 * 2 + 1]


class _Beyond:
    """A run's configuration with a ``max_streams`` above what the variable accepts."""

    def __init__(self, config: Config, max_streams: int) -> None:
        self._config, self.max_streams = config, max_streams

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def large_keys() -> dict[str, Any]:
    """Slots whose local rows are above 2**24 through the engine of several devices (the
    controller's own slot table of 2**26 names would be too big for a test): the keys each
    device's step got, and the bits of its x."""
    from forkless.controller.engine import compile_step

    # FORKLESS_MAX_STREAMS stops at 10M, so the keys' range is a config's beyond it: the path's
    # arithmetic does not depend on that limit (as compiled.check_row_writes probes a smaller one)
    engine = compile_step(key_processor(), _Beyond(Config(features=F, max_batch=8, status_s=0.0), LARGE_STREAMS))
    slots = np.asarray(LARGE_SLOTS, np.int32)
    x = np.asarray([[float(i) + 0.1, 2.0 ** 60 + 2 * i] for i in range(len(slots))], np.float64)
    layout = engine._layout  # what the step is handed: the laid-out batch's dtype
    laid = layout.lay_out(x, slots)[1]
    stepped = engine.step(x, slots)
    return {"devices": len(engine.devices), "x64": bool(jax.config.jax_enable_x64),
            "keys": stepped.outputs["key"].tolist(), "slots": slots.tolist(),
            "x": [[float(v).hex() for v in row] for row in stepped.outputs["x"]],
            "x_sent": [[float(v).hex() for v in row] for row in x],
            "laid_out": [str(np.asarray(leaf).dtype) for leaf in jax.tree.leaves(laid)]}


def main(argv: list[str]) -> int:
    if argv[0] == "--large-keys":
        Path(argv[1]).write_text(json.dumps(large_keys()))
        return 0
    Path(argv[0]).write_text(json.dumps(run()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
