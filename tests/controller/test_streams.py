"""Streams come and go; a step costs O(B): the controller's compiled step donates the state,
and idle streams' slots are recycled with their state reset, against the numpy reference."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkless import Runtime
from forkless.controller.batching import Batch
from forkless.controller.config import Config
from forkless.controller.device.compiled import guarded
from forkless.controller.engine import compile_step
from forkless.controller.loop import Controller
from forkless.controller.processor import Processor, default_processor, row_template
from tests.controller.test_loop import chunk, process_all
from tests.controller.test_processor import _aliased_inputs, _table_ops
from tests.fake_io import FakeIO, drain
from tests.reference import EWMAReference

F = 2


def test_the_controllers_compiled_step_updates_the_state_in_place():
    cfg = Config(features=F, max_batch=4, max_streams=64)
    compiled = compile_step(default_processor(cfg), cfg)
    for bucket, step in compiled.steps.items():
        # the three state leaves (count, mean, var) are parameters 0-2 and may alias an output
        assert _aliased_inputs(step.as_text()) == {0, 1, 2}, f"bucket {bucket}: the state is not donated"
    state = compiled.take_state()
    batch = chunk([0], ["a"])
    from forkless.controller.batching import pad_batch

    new_state, _, _ = compiled.steps[1](state, pad_batch(batch.x, np.zeros(1, np.int32), 1, cfg.max_streams))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))  # given to the step, not copied
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_state))


def test_rotating_streams_through_a_smaller_table_never_mix_a_recycled_slot_with_its_previous_owner():
    # 4 slots, 7 streams taking turns: every new stream evicts the least recently seen one,
    # whose slot must come back as a fresh stream's (n = 0), exactly like the reference that
    # forgets an evicted stream
    cfg = Config(features=F, max_batch=4, max_streams=4, max_wait_ms=0.0, status_s=0.0, stream_idle_s=0.0,
                 warmup=2)
    rng = np.random.default_rng(11)
    order = [f"s{(i * 3) % 7}" for i in range(140)]
    xs = rng.normal(size=(140, F)).round(4)
    fake = FakeIO()
    with Controller(cfg, runtime=Runtime(io_factory=fake)) as ctl:
        for i in range(0, 140, 2):
            fake.inbound.put_nowait(chunk([i, i + 1], order[i:i + 2], xs[i:i + 2]))
        process_all(ctl)
        replies = [json.loads(f) for item in drain(fake.outbound) for f in item.frames]
        stats = ctl.stats()
    # the reference: a stream evicted from the 4 most recently seen starts again at n = 0
    ref = EWMAReference(warmup=2)
    recent: list[str] = []
    for i, reply in enumerate(replies):
        name = order[i]
        if name not in recent and len(recent) == 4:
            gone = recent.pop(0)
            ref.n.pop(gone, None)
        if name in recent:
            recent.remove(name)
        recent.append(name)
        z, score, anomaly = ref(name, xs[i])
        assert reply["seq"] == i and reply["stream"] == name
        np.testing.assert_allclose(reply["z"], z, rtol=1e-5, atol=1e-5, err_msg=f"seq {i}")
        np.testing.assert_allclose(reply["score"], score, rtol=1e-5, atol=1e-5)
        assert reply["anomaly"] == anomaly
    assert len(replies) == 140
    assert stats.streams_active == 4 and stats.streams_evicted == 140 - 4 - 0  # every message after 4 evicts
    assert stats.errors == {}


def test_without_stream_idle_s_a_full_table_refuses_new_streams_as_before():
    cfg = Config(features=F, max_batch=4, max_streams=2, max_wait_ms=0.0, status_s=0.0)
    fake = FakeIO()
    with Controller(cfg, runtime=Runtime(io_factory=fake)) as ctl:
        fake.inbound.put_nowait(chunk([0, 1, 2], ["a", "b", "c"]))
        process_all(ctl)
        replies = [json.loads(f) for item in drain(fake.outbound) for f in item.frames]
        stats = ctl.stats()
    assert replies[2] == {"error": "too many streams (FORKLESS_MAX_STREAMS=2)", "seq": 2}
    assert stats.streams_active == 2 and stats.streams_evicted == 0


@pytest.mark.parametrize("bucket", [1, 256])
def test_the_guarded_step_the_controller_compiles_touches_a_million_row_table_only_in_place(bucket):
    cfg = Config(features=8, max_streams=1_000_000)
    proc = default_processor(cfg)
    state = jax.eval_shape(lambda: proc.init(cfg))
    batch = Batch(jax.ShapeDtypeStruct((bucket, cfg.features), jnp.float32),
                  jax.ShapeDtypeStruct((bucket,), jnp.int32), jax.ShapeDtypeStruct((bucket,), jnp.bool_))
    template = jax.eval_shape(lambda s: row_template(s, cfg.max_streams + 1), state)  # the guard's reset rows
    assert _table_ops(guarded(proc.step), (state, batch, template), cfg.max_streams + 1) == []


def test_a_step_that_turns_a_stream_non_finite_answers_with_an_error_and_the_stream_starts_again():
    # a running product per stream: x = 1e30 twice overflows float32 to inf
    def init(config):
        return jnp.ones(config.max_streams + 1, jnp.float32)

    def step(prod, batch):
        new = prod[batch.key] * batch.x[:, 0]
        prod = prod.at[jnp.where(batch.valid, batch.key, prod.shape[0] - 1)].set(jnp.where(batch.valid, new, 1.0))
        return prod, {"prod": new}

    cfg = Config(features=F, max_batch=4, max_streams=4, max_wait_ms=0.0, status_s=0.0)
    fake = FakeIO()
    with Controller(cfg, processor=Processor(init, step), runtime=Runtime(io_factory=fake)) as ctl:
        for i, (name, x) in enumerate([("a", 2.0), ("b", 3.0), ("a", 1e30), ("a", 1e30), ("a", 5.0), ("b", 2.0)]):
            fake.inbound.put_nowait(chunk([i], [name], [[x, 0.0]]))
        process_all(ctl)
        replies = [json.loads(f) for item in drain(fake.outbound) for f in item.frames]
        stats = ctl.stats()
    assert [r.get("prod", r.get("error")) for r in replies] == [
        2.0, 3.0, float(np.float32(2e30)), "processing produced a non-finite result (the stream starts again)",
        5.0, 6.0]  # after the reset, "a" starts again from 1: 5.0, not inf
    assert stats.errors == {"non-finite result": 1}
    assert stats.resets == {"stream reset: non-finite": 1}
    assert stats.processed == 6
