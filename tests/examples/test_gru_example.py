"""examples/gru.py: the per-symbol GRU built with ``stream_processor`` equals a plain numpy GRU
run one message at a time in arrival order; its weights come from the file; it compiles
through ``compile_step`` and runs in the controller, on one device and on two."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from examples.gru import gru_processor, load_weights, save_random_weights
from forkless.controller.batching import Batch, pad_batch
from forkless.controller.config import Config
from forkless.controller.declared import Description
from forkless.controller.engine import compile_step
from forkless.controller.processor import StreamState
from tests.harness import ROOT, UNIT_S, app_env

F, H = 3, 8


def numpy_gru(weights, messages):
    """Per message, in arrival order, one stream at a time (float64): the outputs, and each
    stream's final hidden state."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    def sigmoid(v):
        return 1.0 / (1.0 + np.exp(-v))

    hidden, outs = {}, []
    for key, x in messages:
        h = hidden.get(key, np.zeros(H))
        gx, gh = x @ w["w_x"] + w["b_x"], h @ w["w_h"] + w["b_h"]
        z, r = sigmoid(gx[:H] + gh[:H]), sigmoid(gx[H:2 * H] + gh[H:2 * H])
        n = np.tanh(gx[2 * H:] + r * gh[2 * H:])
        new = (1 - z) * n + z * h
        outs.append({"h": new, "prediction": new @ w["w_out"] + w["b_out"],
                     "surprise": np.max(np.abs(x - (h @ w["w_out"] + w["b_out"])))})
        hidden[key] = new
    return outs, hidden


def batches(seed, count=25, bucket=8, streams=6):
    """(keys, x) batches of 1..bucket messages from a few streams, so streams repeat in a batch."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(1, bucket + 1))
        out.append((rng.integers(0, 3, size=n).astype(np.int32) * (streams // 3),
                    rng.normal(size=(n, F)).astype(np.float32)))
    return out


def run_gru(path, cfg, feed, bucket=8):
    proc = gru_processor(path, features=F, hidden=H)
    step = jax.jit(proc.step, donate_argnums=0)
    state, outs = proc.init(cfg), []
    for keys, x in feed:
        batch = pad_batch(x, keys, bucket, cfg.max_streams)
        # padding rows with inputs of their own: only valid marks them
        batch = Batch(np.where(batch.valid[:, None], batch.x, 9.0).astype(np.float32), batch.key, batch.valid)
        state, out = step(state, batch)
        outs.extend({k: np.asarray(v[i]) for k, v in out.items()} for i in range(len(keys)))
    return state, outs


@pytest.fixture
def weights_file(tmp_path):
    path = tmp_path / "gru.npz"
    save_random_weights(path, features=F, hidden=H, seed=1, scale=1.5)
    return path


def test_the_batched_gru_equals_a_per_message_loop_in_arrival_order(weights_file):
    cfg = Config(features=F, max_streams=6)
    feed = batches(seed=3)
    assert any(len(set(keys.tolist())) < len(keys) for keys, _ in feed)  # repeats inside a batch
    state, outs = run_gru(weights_file, cfg, feed)
    expected, hidden = numpy_gru(load_weights(weights_file, features=F, hidden=H),
                                 [(int(k), x) for keys, xs in feed for k, x in zip(keys, xs)])
    assert len(outs) == len(expected)
    for got, want in zip(outs, expected):
        for name in ("h", "prediction", "surprise"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert isinstance(state, StreamState)
    rows = np.asarray(state.rows)
    for key in range(cfg.max_streams + 1):
        np.testing.assert_allclose(rows[key], hidden.get(key, np.zeros(H)), rtol=1e-5, atol=1e-5)


def test_the_weights_come_from_the_file(tmp_path, weights_file):
    cfg = Config(features=F, max_streams=6)
    other = tmp_path / "other.npz"
    save_random_weights(other, features=F, hidden=H, seed=2, scale=1.5)
    feed = batches(seed=4, count=5)
    _, first = run_gru(weights_file, cfg, feed)
    _, again = run_gru(weights_file, cfg, feed)
    _, second = run_gru(other, cfg, feed)
    assert all(np.array_equal(a["h"], b["h"]) for a, b in zip(first, again))
    assert not any(np.allclose(a["h"], b["h"]) for a, b in zip(first, second))
    state = gru_processor(other, features=F, hidden=H).init(cfg)
    assert np.array_equal(np.asarray(state.params["w_h"]), np.load(other)["w_h"])


def test_a_weights_file_that_does_not_fit_is_refused_naming_the_array(tmp_path, weights_file):
    with pytest.raises(ValueError, match=r"w_x has shape \[3, 24\], expected \[3, 12\] for features=3, hidden=4"):
        gru_processor(weights_file, features=F, hidden=4)
    partial = tmp_path / "partial.npz"
    np.savez(partial, **{k: v for k, v in np.load(weights_file).items() if k != "b_out"})
    with pytest.raises(ValueError, match="no array 'b_out'"):
        gru_processor(partial, features=F, hidden=H)
    with pytest.raises(ValueError, match="FORKLESS_FEATURES=2"):
        gru_processor(weights_file, features=F, hidden=H).init(Config(features=2))


def test_the_gru_is_named_gru_and_compiles_through_compile_step(weights_file):
    cfg = Config(features=F, max_streams=10, max_batch=16)
    proc = gru_processor(weights_file, features=F, hidden=H)
    assert proc.description == Description(name="gru")
    built = compile_step(proc, cfg)
    state = built.take_state()
    rng = np.random.default_rng(0)
    for bucket in cfg.buckets:
        keys = rng.integers(0, 3, size=bucket).astype(np.int32)
        x = rng.normal(size=(bucket, F)).astype(np.float32)
        state, out, bad = built.steps[bucket](state, pad_batch(x, keys, bucket, cfg.max_streams))
        assert not np.asarray(bad).any()
        assert {k: v.shape for k, v in out.items()} == {"h": (bucket, H), "prediction": (bucket, F),
                                                         "surprise": (bucket,)}


TWO_DEVICES = """
import json, sys
import numpy as np
from forkless.controller.config import Config
from examples.gru import gru_processor
from tests.device_runs import batches_of, run
names = [f"s{k}" for k in np.random.default_rng(5).integers(0, 5, size=40)]
cfg = Config(features=3, max_streams=8, max_batch=16, max_wait_ms=0.0, status_s=0.0)
out = run(cfg, batches_of(names, [1, 16, 7, 16], seed=6), gru_processor(sys.argv[1], features=3, hidden=8))
json.dump({"devices": out["devices"], "results": out["results"], "errors": out["errors"],
           "inputs": [[n, x.tolist()] for _, ns, xs in batches_of(names, [1, 16, 7, 16], seed=6)
                      for n, x in zip(ns, xs)]}, sys.stdout)
"""


def test_on_two_devices_the_controller_runs_it_sharded_with_the_weights_replicated(weights_file):
    done = subprocess.run([sys.executable, "-c", TWO_DEVICES, str(weights_file)], cwd=ROOT,
                          env=app_env({"JAX_NUM_CPU_DEVICES": "2"}), capture_output=True, text=True,
                          timeout=180 * UNIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert len(got["devices"]) == 2 and not got["errors"]
    messages = [(name, np.array(x, np.float32)) for name, x in got["inputs"]]
    expected, _ = numpy_gru(load_weights(weights_file, features=F, hidden=H), messages)
    assert len(got["results"]) == len(expected) == 40
    for seq, want in enumerate(expected):
        result = got["results"][str(seq)]
        assert result["stream"] == messages[seq][0]
        np.testing.assert_allclose(result["h"], want["h"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result["surprise"], want["surprise"], rtol=1e-5, atol=1e-5)
