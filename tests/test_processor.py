"""The default EWMA processor against the one-at-a-time numpy reference; compile behaviour."""

from __future__ import annotations

import jax
import numpy as np

from controller.batching import StreamSlots, pad_batch
from controller.config import Config
from controller.loop import compilations
from controller.processor import default_processor
from tests.reference import EWMAReference


def run_batches(cfg, batches, bucket):
    proc = default_processor(cfg)
    state = jax.device_put(proc.init(cfg))
    step = jax.jit(proc.step)
    slots = StreamSlots(cfg.max_streams)
    outs = []
    for streams, x in batches:
        key, _ = slots.lookup(streams)
        state, out = step(state, pad_batch(x, key, bucket, cfg.max_streams))
        out = jax.device_get(out)
        outs.append({k: np.asarray(v)[: len(streams)] for k, v in out.items()})
    return outs


def test_repeated_streams_in_one_batch_equal_one_at_a_time_processing():
    cfg = Config(features=3, max_streams=8, warmup=2)
    rng = np.random.default_rng(1)
    batches = []
    for b in range(40):
        streams = [f"s{rng.integers(0, 3)}" for _ in range(int(rng.integers(1, 9)))]
        x = rng.normal(size=(len(streams), 3)).astype(np.float32)
        if b % 5 == 4:
            x[-1] += 25  # a spike, so anomalies are exercised too
        batches.append((streams, x))
    outs = run_batches(cfg, batches, bucket=8)
    ref = EWMAReference(warmup=2)
    flagged = 0
    for (streams, x), out in zip(batches, outs):
        for i, s in enumerate(streams):
            z, score, anomaly = ref(s, x[i])
            np.testing.assert_allclose(out["z"][i], z, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(out["score"][i], score, rtol=1e-4, atol=1e-4)
            assert bool(out["anomaly"][i]) == anomaly
            flagged += anomaly
    assert flagged > 0


def test_a_stream_first_seen_gets_zero_z_and_is_never_flagged():
    cfg = Config(features=2, max_streams=4, warmup=0)
    outs = run_batches(cfg, [(["a"], np.array([[100.0, -100.0]], np.float32))], bucket=1)
    assert outs[0]["z"].tolist() == [[0.0, 0.0]] and outs[0]["anomaly"].tolist() == [False]


def test_padding_rows_do_not_change_the_state():
    cfg = Config(features=2, max_streams=4)
    proc = default_processor(cfg)
    state = jax.device_put(proc.init(cfg))
    x = np.array([[1.0, 2.0]], np.float32)
    state1, _ = jax.jit(proc.step)(state, pad_batch(x, np.array([0], np.int32), 4, 4))
    assert np.asarray(state1.count)[:4].tolist() == [1, 0, 0, 0]  # row 4 is the spare slot
    np.testing.assert_array_equal(np.asarray(state1.mean)[1:4], 0)


def test_the_second_call_with_the_same_shape_does_not_recompile():
    cfg = Config(features=2, max_streams=4)
    proc = default_processor(cfg)
    state = jax.device_put(proc.init(cfg))
    step = jax.jit(proc.step)
    batch = pad_batch(np.ones((2, 2), np.float32), np.array([0, 1], np.int32), 2, 4)
    state, _ = step(state, batch)
    before = compilations()
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    assert compilations() == before
