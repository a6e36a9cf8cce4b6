"""A user's program with a replayable source of its own, for the exactly-once test across kill -9
(tests/io_loop/test_source_restart.py), written against the public API only.

    python -m tests.source_program INPUT FINAL CHECKPOINT_DIR [GAP_S [HOLD_AT GATE]]

The source reads INPUT's lines (one frame each, a JSON list of messages), its position the line's
number, GAP_S seconds apart (0.004); after a restart it replays from ``ctx.resume_from`` inclusive.
With HOLD_AT and GATE it waits before line HOLD_AT until the file GATE exists, so that a run the
test kills cannot have finished first however slow the machine. When every line has been
handed over it says so with an event; the program then stops in order and writes FINAL: the last
count the processor gave each stream (the state's own count, so a message applied twice or never
shows).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from forkless import Config, Controller, Description, OnResults, Processor


def init(config: Config) -> dict[str, Any]:
    return {"n": jnp.zeros(config.max_streams + 1)}


def step(state: dict[str, Any], batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    n = state["n"].at[batch.key].add(batch.valid.astype(jnp.float32))
    return {"n": n}, {"n": n[batch.key]}


def working_step(state: dict[str, Any], batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``step`` plus matrix products whose result is dropped (x 0): enough work that XLA:CPU
    dispatches the step asynchronously instead of running it inline, so steps are in flight."""
    m = jnp.full((256, 256), 0.01)
    for _ in range(3):
        m = jnp.tanh(m @ m + 0.1)
    new_state, out = step(state, batch)
    return new_state, {"n": out["n"] + jnp.minimum(m.sum(), 0.0) * 0.0}


def steps_seen_done_late(after_s: float = 0.02) -> None:
    """Test-only, for the line these programs print: a step is seen done (``Engine.ready``) only
    once ``after_s`` has passed since its dispatch, so the batches that come meanwhile are
    dispatched while it is in flight however fast this machine runs it (finishing one still
    waits for the device as before; only when the loop looks, not what it gets, changes)."""
    import time

    from forkless.controller.engine import Engine

    dispatch, ready, began = Engine.dispatch, Engine.ready, {}

    def dispatch_noted(self: Engine, x: Any, key: Any) -> Any:
        pending = dispatch(self, x, key)
        began[id(pending)] = time.monotonic()
        return pending

    def ready_late(self: Engine, pending: Any) -> bool:
        return time.monotonic() - began.get(id(pending), 0.0) >= after_s and ready(self, pending)

    Engine.dispatch, Engine.ready = dispatch_noted, ready_late


class LinesSource:
    name = "lines"
    replies = "none"

    def __init__(self, path: str, gap_s: float, hold_at: int = -1, gate: str = "") -> None:
        self.lines = Path(path).read_text().splitlines()
        self.gap_s = gap_s
        self.hold_at, self.gate = hold_at, Path(gate)

    async def run(self, ctx: Any) -> None:
        start = 0 if ctx.resume_from is None else ctx.resume_from
        print(f"resumed at {ctx.resume_from}", flush=True)

        async def read() -> None:
            for number in range(start, len(self.lines)):
                if number == self.hold_at:
                    print(f"holding at {number}", flush=True)
                    while not self.gate.exists():
                        await asyncio.sleep(0.02)
                await ctx.emit(self.lines[number], position=number)
                await asyncio.sleep(self.gap_s)
            await ctx.emit_event("done")

        reader = asyncio.create_task(read())
        async for _ in ctx.outgoing():
            pass
        reader.cancel()


def main() -> int:
    source_path, final_path, checkpoint_dir = sys.argv[1:4]
    gap_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.004
    hold_at, gate = (int(sys.argv[5]), sys.argv[6]) if len(sys.argv) > 6 else (-1, "")
    config = Config.from_env(features=1, max_batch=2, max_wait_ms=1.0, checkpoint_dir=checkpoint_dir,
                             checkpoint_s=0.2, status_s=0.0)
    last: dict[str, float] = {}
    done: list[str] = []

    def on_results(seq: list[Any], stream: list[str], outputs: dict[str, Any]) -> None:
        for name, n in zip(stream, outputs["n"].tolist()):
            last[name] = n

    # SOURCE_PROGRAM_WORK=1: the step with work (FORKLESS_STEPS_IN_FLIGHT > 1: really in flight),
    # driven by run(), which keeps steps in flight between its calls (checkpoints settle them)
    work = os.environ.get("SOURCE_PROGRAM_WORK") == "1"
    if work:
        steps_seen_done_late()
    processor = Processor(init, working_step if work else step, description=Description(name="count", version="1"))
    source = LinesSource(source_path, gap_s, hold_at, gate)

    def on_event(source: str, event: Any) -> None:
        done.append(event)
        if work:
            ctl.request_stop()

    ctl = Controller(config, processor=processor, sources=[source], sinks=[OnResults(on_results)], on_event=on_event)
    if work:
        ctl.run()
        print(f"restored from {ctl.restored_from}", flush=True)
    else:
        with ctl:
            print(f"restored from {ctl.restored_from}", flush=True)
            while not done:
                ctl.process_pending(timeout=0.05)
    print(f"most steps in flight {ctl._intake.flight.most}", flush=True)  # private: read for the test only
    Path(final_path).write_text(json.dumps(last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
