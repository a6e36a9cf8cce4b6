"""Embedding: results in the host program, custom codecs that cannot kill the IO thread, the
processor contract checked at start. Against the feed server written with the ``websockets``
library (not aiohttp, tests/servers.py), on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkless import Config, Controller, Decoded, JsonCodec, OnResults, Processor, ProcessorContractError
from forkless.controller.processor import default_processor
from tests.harness import UNIT_S, drive
from tests.reference import EWMAReference
from tests.servers import send_frames

ROOT = Path(__file__).resolve().parents[2]
F = 3
WAIT_S = 30.0 * UNIT_S


def _messages(n: int, streams: int = 4) -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"seq": i, "stream": f"s{i % streams}", "x": rng.normal(size=F).round(5).tolist()} for i in range(n)]


def _config(url: str, **changes) -> Config:
    base = dict(ws_url=url, features=F, max_streams=16, max_batch=16, status_s=0, reconnect_min_s=0.1,
                shutdown_timeout_s=5)
    base.update(changes)
    return Config(**base)


def test_on_results_gets_every_processed_message_with_outputs_equal_to_the_reference(feed_server):
    messages = _messages(120)
    seen: list[tuple] = []

    def on_results(seq, stream, outputs):
        assert threading.current_thread() is threading.main_thread()
        for i, s in enumerate(seq):
            seen.append((s, stream[i], {k: v[i] for k, v in outputs.items()}))

    feed = feed_server(send_frames([json.dumps(m) for m in messages]), impl="websockets")
    with Controller(_config(feed.url), sinks=[OnResults(on_results)]) as ctl:
        drive(ctl, lambda: feed.received_count >= len(messages), timeout_s=WAIT_S, what="every reply")
    assert [s for s, _, _ in seen] == [m["seq"] for m in messages]
    ref = EWMAReference()
    for m, (_, stream, out) in zip(messages, seen):
        z, score, anomaly = ref(m["stream"], m["x"])
        assert stream == m["stream"]
        assert out["z"].shape == (F,) and isinstance(out["z"], np.ndarray)
        np.testing.assert_allclose(out["z"], z, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(out["score"], score, rtol=1e-4, atol=1e-4)
        assert bool(out["anomaly"]) == anomaly


class EveryThirdDecodeRaises(JsonCodec):
    def __init__(self) -> None:
        super().__init__(F)
        self.calls = 0

    def decode(self, frame):
        self.calls += 1
        if self.calls % 3 == 0:
            raise ValueError(f"cannot parse frame {self.calls}")
        return super().decode(frame)


def test_a_codec_that_raises_on_every_third_frame_gets_every_frame_answered_and_the_thread_lives(feed_server):
    messages = _messages(90)
    feed = feed_server(send_frames([json.dumps(m) for m in messages]), impl="websockets")
    with Controller(_config(feed.url), codec=EveryThirdDecodeRaises()) as ctl:
        drive(ctl, lambda: feed.received_count >= len(messages), timeout_s=WAIT_S, what="a reply to every frame")
        assert ctl._io is not None and ctl._io.failure is None
    # read after the stop: the IO thread counts a frame once its write returned, which can be after
    # the server has it
    stats = ctl.stats()
    replies = feed.replies()
    errors = [r for r in replies if "error" in r]
    results = [r for r in replies if "error" not in r]
    assert len(replies) == 90 and len(errors) == 30 and len(results) == 60
    assert {e["error"] for e in errors} == {"decode failed"}
    assert sorted(r["seq"] for r in results) == [m["seq"] for i, m in enumerate(messages) if (i + 1) % 3]
    assert stats.errors == {"decode failed": 30}
    assert stats.messages_in == 60 and stats.messages_out == 60 and stats.errors_out == 30


class EncodeRaisesOnSpikes(JsonCodec):
    """``encode_results`` fails for any batch holding seq 5; ``encode_error`` fails too."""

    def encode_results(self, seq, stream, outputs):
        if 5 in seq:
            raise RuntimeError("cannot encode")
        return super().encode_results(seq, stream, outputs)

    def encode_error(self, reason, seq):
        raise RuntimeError("cannot encode errors either")


def test_encode_failures_answer_that_batch_with_errors_and_carry_on(feed_server):
    messages = _messages(12)
    feed = feed_server(send_frames([json.dumps(m) for m in messages]), impl="websockets")
    with Controller(_config(feed.url, max_batch=1), codec=EncodeRaisesOnSpikes(F)) as ctl:
        drive(ctl, lambda: feed.received_count >= len(messages), timeout_s=WAIT_S, what="every reply")
    stats = ctl.stats()  # after the stop, as above
    replies = {r["seq"]: r for r in feed.replies()}
    assert replies[5] == {"error": "encode failed", "seq": 5}  # the fallback JSON error frame
    assert all("z" in replies[s] for s in range(12) if s != 5)
    assert stats.errors == {"encode failed": 1} and stats.messages_out == 11 and stats.errors_out == 1


class ReplyToEvenSeqOnly(JsonCodec):
    def encode_results(self, seq, stream, outputs):
        frames = super().encode_results(seq, stream, outputs)
        return [f if s % 2 == 0 else None for s, f in zip(seq, frames)]


def test_a_codec_that_sends_no_reply_for_some_messages_keeps_the_counts_true(feed_server):
    messages = _messages(40)
    feed = feed_server(send_frames([json.dumps(m) for m in messages]), impl="websockets")
    with Controller(_config(feed.url), codec=ReplyToEvenSeqOnly(F)) as ctl:
        drive(ctl, lambda: ctl.stats().processed >= 40 and feed.received_count >= 20, timeout_s=WAIT_S,
              what="20 replies")
    stats = ctl.stats()  # after the stop: the IO thread counts a frame once its write returned, maybe after
    # the server has it, so a snapshot taken when the server saw the 20th may not count it yet
    feed.wait_for(lambda: len(feed.connections) == 1 and feed.connections[0].closed_at is not None, WAIT_S,
                  "the client's close")
    assert sorted(r["seq"] for r in feed.replies()) == list(range(0, 40, 2))
    assert stats.messages_out == 20 and stats.no_reply == 20 and stats.processed == 40 and stats.errors_out == 0


def _scalar_loss_processor() -> Processor:
    ewma = default_processor(Config(features=F))

    def step(state, batch):
        state, outputs = ewma.step(state, batch)
        return state, {**outputs, "loss": jnp.mean(outputs["score"])}

    return Processor(ewma.init, step)


def test_a_step_with_a_non_batched_output_is_refused_at_start_naming_the_output():
    ctl = Controller(Config(features=F, max_batch=4), processor=_scalar_loss_processor())
    with pytest.raises(ProcessorContractError, match=r"output 'loss' has shape \[\]: outputs must have shape "
                                                     r"\[B, \.\.\.\] \(B = 1"):
        ctl.compile()


def test_a_step_whose_outputs_are_batched_only_at_the_first_bucket_is_refused_at_the_bucket_that_breaks():
    """The first bucket is checked before anything is lowered; every later one on its own
    lowering's trace (controller/engine.py): an output of a fixed length 1 passes at B = 1 only."""
    ewma = default_processor(Config(features=F))

    def step(state, batch):
        state, outputs = ewma.step(state, batch)
        return state, {**outputs, "first": outputs["score"][:1]}

    ctl = Controller(Config(features=F, max_batch=16), processor=Processor(ewma.init, step))
    with pytest.raises(ProcessorContractError, match=r"output 'first' has shape \[1\]: outputs must have shape "
                                                     r"\[B, \.\.\.\] \(B = 4"):
        ctl.compile()


class SumState(NamedTuple):
    total: jax.Array  # float32 [S + 1, F]


def _sum_processor(write) -> Processor:
    """A running sum per stream whose write-back is ``write(table, key, rows)``."""

    def init(config):
        return SumState(jnp.zeros((config.max_streams + 1, config.features), jnp.float32))

    def step(state, batch):
        spare = state.total.shape[0] - 1
        key = jnp.where(batch.valid, batch.key, spare)
        rows = state.total[key] + batch.x  # (repeats inside a batch are not this test's business)
        return SumState(write(state.total, key, rows)), {"total": rows}

    return Processor(init, step)


@pytest.mark.parametrize("write, rows", [
    (lambda table, key, rows: (table * 0.5).at[key].set(rows), "every row"),
    (lambda table, key, rows: table.at[key].set(rows).at[(key + 1) % table.shape[0]].add(1.0), "the next row"),
], ids=["decays-every-row", "writes-a-neighbour"])
def test_a_step_that_writes_rows_outside_its_batch_is_refused_at_compile_naming_the_leaf(write, rows):
    ctl = Controller(Config(features=F, max_batch=4), processor=_sum_processor(write))
    with pytest.raises(ProcessorContractError, match=r"state leaf \.total is per-stream .* step wrote rows other "
                                                     r"than its batch's"):
        ctl.compile()


def test_a_step_that_writes_only_its_batchs_rows_passes_the_row_check():
    ctl = Controller(Config(features=F, max_batch=4), processor=_sum_processor(
        lambda table, key, rows: table.at[key].set(rows)))
    ctl.compile()
    assert ctl.engine is not None


def test_the_app_exits_2_with_one_line_for_a_processor_that_breaks_the_contract():
    code = ("import sys, app, tests.docs.test_embedding as t; "
            "sys.exit(app.main([], processor=t._scalar_loss_processor()))")
    env = {"JAX_PLATFORMS": "cpu", "FORKLESS_FEATURES": str(F), "FORKLESS_DURATION": "5", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert "forkless: processor error: output 'loss' has shape []: outputs must have shape [B, ...]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_decode_returning_columns_of_the_wrong_shape_is_a_decode_failure_not_a_crash():
    from forkless.controller.codec import GuardedCodec

    class Bad:
        def decode(self, frame):
            return Decoded([1], ["a"], np.zeros((1, F + 1), np.float32))

    guarded = GuardedCodec(Bad(), F)
    assert guarded.decode("x").errors == [("decode failed", None)]
