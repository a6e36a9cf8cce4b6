"""``stream_processor``: a per-row function lifted to a batched O(B) step (arrival order for a
stream repeated in a batch, padding inert, params as state arguments, the contract checked);
the default EWMA detector built on it against the hand-written step it replaced (bit for bit)
and the numpy reference; the Processor's two functions and its description."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkless.controller.batching import Batch, pad_batch
from forkless.controller.config import Config
from forkless.controller.declared import Description
from forkless.controller.device.compiled import check_replicated_unchanged, compilations
from forkless.controller.engine import compile_step
from forkless.controller.errors import ProcessorContractError
from forkless.controller.processor import (
    EWMAState,
    Processor,
    StreamState,
    default_processor,
    ewma_processor,
    reset_rows,
    row_template,
    stream_processor,
)
from tests.controller.test_processor import _table_ops
from tests.reference import EWMAReference
from tests.reference_ewma import reference_ewma_processor

# ---- the Processor's fields ------------------------------------------------------------------


def test_processor_is_its_two_functions_and_a_description_defaulted():
    init, step = (lambda cfg: None), (lambda s, b: (s, {}))
    proc = Processor(init, step)
    assert proc.init is init and proc.step is step and proc.description == Description()
    assert Processor._fields == ("init", "step", "description")
    about = proc.description
    assert (about.name, about.version, about.restore_shared, about.per_stream) == (None, "1", False, True)


def test_the_default_detector_is_named_ewma_however_it_is_obtained():
    for proc in (ewma_processor(), default_processor(Config())):
        about = proc.description
        assert (about.name, about.version, about.restore_shared, about.per_stream) == ("ewma", "1", False, True)


def test_the_helper_passes_its_description_through():
    about = Description(name="toy", version="7b", restore_shared=True)
    proc = stream_processor(lambda p, row, x: (row, {}), init_row=lambda cfg: jnp.zeros(()), description=about)
    assert proc.description is about


def test_the_helper_refuses_a_description_that_says_its_step_mixes_streams():
    with pytest.raises(ProcessorContractError, match=r"per_stream=False.*the helper keeps streams apart"):
        stream_processor(lambda p, row, x: (row, {}), init_row=lambda cfg: jnp.zeros(()),
                         description=Description(name="toy", per_stream=False))


# ---- the EWMA detector on the helper against the hand-written step ----------------------------


def _random_batch(rng, streams, bucket, features):
    """1..bucket messages from a few streams (so they repeat), padded to bucket; padding rows
    carry the spare slot and random x, as a real padded batch could."""
    n = int(rng.integers(1, bucket + 1))
    key = rng.choice(rng.permutation(streams)[:4], size=n).astype(np.int32)
    x = rng.normal(size=(n, features)).astype(np.float32) * rng.choice([0.1, 1.0, 30.0])
    if rng.random() < 0.3:
        x[rng.integers(0, n)] += 50  # a spike, so anomalies are exercised
    batch = pad_batch(x, key, bucket, streams)
    junk = rng.normal(size=batch.x.shape).astype(np.float32)
    return Batch(np.where(batch.valid[:, None], batch.x, junk), batch.key, batch.valid)


def _assert_same(new_state, old_state, new_out, old_out):
    assert sorted(new_out) == sorted(old_out)
    for name in old_out:
        assert np.array_equal(np.asarray(new_out[name]), np.asarray(old_out[name])), name
    for field, new, old in zip(EWMAState._fields, new_state, old_state):
        assert np.array_equal(np.asarray(new), np.asarray(old)), field


@pytest.mark.parametrize("bucket", [1, 4, 16, 64])
def test_the_helper_built_ewma_equals_the_hand_written_step_bit_for_bit(bucket):
    cfg = Config(features=3, max_streams=12, warmup=3)
    new_proc = default_processor(cfg)
    old_proc = reference_ewma_processor(cfg.alpha, cfg.threshold, cfg.warmup)
    new_step, old_step = jax.jit(new_proc.step, donate_argnums=0), jax.jit(old_proc.step, donate_argnums=0)
    new, old = new_proc.init(cfg), old_proc.init(cfg)
    _assert_same(new, old, {}, {})  # the same fresh state
    rng = np.random.default_rng(bucket)
    flagged = repeats = 0
    for _ in range(80):
        batch = _random_batch(rng, cfg.max_streams, bucket, cfg.features)
        new, new_out = new_step(new, batch)
        old, old_out = old_step(old, batch)
        _assert_same(new, old, new_out, old_out)  # every row, padding and spare slot included
        flagged += int(np.asarray(new_out["anomaly"]).sum())
        keys = batch.key[batch.valid]
        repeats += len(keys) - len(set(keys.tolist()))
    assert int(np.asarray(new.count).max()) > cfg.warmup and int(np.asarray(new.count)[-1]) == 0
    assert flagged > 0 and (repeats > 0 or bucket == 1)


def test_the_compiled_helper_built_ewma_equals_the_compiled_hand_written_step():
    # the production path: compile_step's guarded, donated, per-bucket executables
    cfg = Config(features=2, max_streams=9, max_batch=16, warmup=2)
    new = compile_step(default_processor(cfg), cfg)
    old = compile_step(reference_ewma_processor(cfg.alpha, cfg.threshold, cfg.warmup), cfg)
    new_state, old_state = new.take_state(), old.take_state()
    rng = np.random.default_rng(5)
    for _ in range(30):
        bucket = int(rng.choice(cfg.buckets))
        batch = _random_batch(rng, cfg.max_streams, bucket, cfg.features)
        new_state, new_out, new_bad = new.steps[bucket](new_state, batch)
        old_state, old_out, old_bad = old.steps[bucket](old_state, batch)
        _assert_same(new_state, old_state, new_out, old_out)
        assert np.array_equal(np.asarray(new_bad), np.asarray(old_bad))


def test_the_helper_built_ewma_equals_the_numpy_reference_one_message_at_a_time():
    cfg = Config(features=3, max_streams=6, warmup=4)
    proc = default_processor(cfg)
    step = jax.jit(proc.step, donate_argnums=0)
    state = proc.init(cfg)
    ref = EWMAReference(cfg.alpha, cfg.threshold, cfg.warmup)
    rng = np.random.default_rng(11)
    flagged = 0
    for _ in range(60):
        batch = _random_batch(rng, cfg.max_streams, 16, cfg.features)
        state, out = step(state, batch)
        for i in np.flatnonzero(batch.valid):
            z, score, anomaly = ref(int(batch.key[i]), batch.x[i])
            np.testing.assert_allclose(np.asarray(out["z"][i]), z, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(float(out["score"][i]), score, rtol=1e-4, atol=1e-4)
            assert bool(out["anomaly"][i]) == anomaly
            flagged += anomaly
    assert flagged > 0
    assert np.asarray(state.count)[:-1].tolist() == [ref.n.get(s, 0) for s in range(cfg.max_streams)]


def test_the_ewma_state_keeps_its_checkpoint_layout():
    # checkpoints name each leaf "state<path>": state.count, state.mean, state.var, as before
    cfg = Config(features=4, max_streams=7)
    new = default_processor(cfg).init(cfg)
    old = reference_ewma_processor().init(cfg)
    assert isinstance(new, EWMAState)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(new)[0]]
    assert paths == [".count", ".mean", ".var"]
    assert [(a.shape, a.dtype, a.weak_type) for a in new] == [(a.shape, a.dtype, a.weak_type) for a in old]


# ---- the helper on a processor whose results depend on the order of messages ---------------


def _order_processor(params: bool = False, version: str = "1") -> Processor:
    """Per stream: h = 0.5 * h + w * x (w = 1 without params), n = messages seen; outputs the
    h and n a message found and the h it left, so any reordering or lost update shows (exact
    in float32)."""

    def row_step(p, row, x):
        w = 1.0 if p is None else p["w"]
        h = 0.5 * row["h"] + w * x
        return {"h": h, "n": row["n"] + 1}, {"before": row["h"], "after": h, "n": row["n"]}

    def init_row(cfg):
        return {"h": jnp.zeros((cfg.features,), jnp.float32), "n": jnp.zeros((), jnp.int32)}

    def init_params(cfg):
        return {"w": np.arange(1, cfg.features + 1, dtype=np.float32)}

    return stream_processor(row_step, init_row=init_row, init_params=init_params if params else None,
                            description=Description(name="order", version=version))


def _order_reference(messages, features, w=None):
    """(before, n) per message, one message at a time in arrival order, float32 like the step."""
    w = np.ones(features, np.float32) if w is None else w
    h, n, out = {}, {}, []
    for key, x in messages:
        before, seen = h.get(key, np.zeros(features, np.float32)), n.get(key, 0)
        out.append((before, seen))
        h[key], n[key] = np.float32(0.5) * before + w * x, seen + 1
    return out, h, n


@pytest.mark.parametrize("params", [False, True])
def test_repeats_of_a_stream_in_one_batch_run_in_arrival_order(params):
    cfg = Config(features=2, max_streams=5)
    proc = _order_processor(params)
    step = jax.jit(proc.step, donate_argnums=0)
    state = proc.init(cfg)
    w = np.array([1.0, 2.0], np.float32) if params else None
    rng = np.random.default_rng(2)
    messages = []
    for keys in ([3, 1, 3, 3, 0, 1, 3, 2], [1, 1, 1, 1, 1, 1, 1, 1], [4, 0, 4], [2], [0, 1, 2, 3, 4, 0, 1, 2]):
        x = rng.integers(-8, 8, size=(len(keys), 2)).astype(np.float32)
        state, out = step(state, pad_batch(x, np.array(keys, np.int32), 8, cfg.max_streams))
        expected, h, n = _order_reference(messages + list(zip(keys, x)), 2, w)
        for i, (before, seen) in enumerate(expected[len(messages):]):
            assert np.array_equal(np.asarray(out["before"][i]), before) and int(out["n"][i]) == seen
        messages += list(zip(keys, x))
    rows = state.rows if params else state
    for key in range(5):
        assert np.array_equal(np.asarray(rows["h"][key]), h[key]) and int(rows["n"][key]) == n[key]


def test_padding_rows_change_no_row_and_get_zero_outputs():
    # padding rows here carry the key of a stream with state, between two of its messages, and
    # large inputs: only valid says they are padding
    cfg = Config(features=2, max_streams=4)
    proc = _order_processor()
    step = jax.jit(proc.step)
    state, _ = step(proc.init(cfg), pad_batch(np.array([[4, 4], [6, 8]], np.float32), np.array([0, 2], np.int32), 2, 4))
    x = np.array([[1, 2], [100, 100], [3, 4], [100, 100]], np.float32)
    batch = Batch(x, np.array([0, 0, 0, 2], np.int32), np.array([True, False, True, False]))
    state, out = step(state, batch)
    assert np.asarray(state["n"]).tolist() == [3, 0, 1, 0, 0]
    assert np.asarray(state["h"]).tolist() == [[4.5, 6.0], [0, 0], [6, 8], [0, 0], [0, 0]]
    assert np.asarray(out["before"]).tolist() == [[4, 4], [0, 0], [3, 4], [0, 0]]
    assert np.asarray(out["after"]).tolist() == [[3, 4], [0, 0], [4.5, 6], [0, 0]]
    assert np.asarray(out["n"]).tolist() == [1, 0, 2, 0]


def test_an_all_padding_batch_changes_nothing():
    cfg = Config(features=2, max_streams=4)
    proc = _order_processor()
    state = jax.jit(proc.step)(proc.init(cfg), Batch(np.ones((1, 2), np.float32), np.array([4], np.int32),
                                                     np.array([False])))[0]
    assert np.asarray(state["n"]).tolist() == [0] * 5 and not np.asarray(state["h"]).any()


# ---- params: shared leaves of the state, arguments of the step --------------------------------


def test_params_are_state_leaves_passed_to_the_step_not_constants_in_it():
    cfg = Config(features=2, max_streams=4)
    proc = _order_processor(params=True)
    state = proc.init(cfg)
    assert isinstance(state, StreamState) and np.asarray(state.params["w"]).tolist() == [1.0, 2.0]
    batch = pad_batch(np.ones((1, 2), np.float32), np.array([0], np.int32), 1, 4)
    closed = jax.make_jaxpr(proc.step)(state, batch)
    assert all(np.size(c) <= 1 for c in closed.consts)  # no weights baked in
    step = jax.jit(proc.step)
    step(state, batch)
    other = {"w": jax.device_put(np.array([10.0, 20.0], np.float32))}
    before = compilations()
    state = state._replace(params=other)
    state, _ = step(state, batch)
    _, out = step(state, batch)
    assert compilations() == before
    assert np.asarray(out["before"][0]).tolist() == [10.0, 20.0]  # the new weights were used


def test_the_step_returns_the_params_it_was_given_so_they_can_be_replicated():
    cfg = Config(features=2, max_streams=4)
    proc = _order_processor(params=True)
    state = jax.eval_shape(lambda: proc.init(cfg))
    batch = pad_batch(np.ones((1, 2), np.float32), np.array([0], np.int32), 4, 4)
    flags = StreamState(params={"w": False}, rows={"h": True, "n": True})
    check_replicated_unchanged(proc.step, state, batch, flags)  # raises if a params leaf is recomputed


def test_a_params_leaf_with_the_per_stream_leading_axis_is_refused_naming_it():
    cfg = Config(features=2, max_streams=4)
    proc = stream_processor(lambda p, row, x: (row, {}), init_row=lambda c: jnp.zeros(()),
                            init_params=lambda c: {"table": np.zeros((5, 3), np.float32)},
                            description=Description(name="bad"))
    with pytest.raises(ProcessorContractError, match=r"params leaf \['table'\] \(float32\[5, 3\]\).*max_streams \+ 1"):
        proc.init(cfg)


def test_a_row_step_that_changes_a_rows_dtype_is_refused_naming_the_leaf():
    cfg = Config(features=2, max_streams=4)
    proc = stream_processor(lambda p, row, x: ({"n": row["n"] + 0.5}, {}), init_row=lambda c: {"n": 0},
                            description=Description(name="bad"))
    batch = pad_batch(np.ones((1, 2), np.float32), np.array([0], np.int32), 1, 4)
    with pytest.raises(ProcessorContractError, match=r"row\['n'\] int32\[\] came back as float32\[\]"):
        proc.step(proc.init(cfg), batch)


def test_the_slot_template_is_a_fresh_row_and_leaves_the_params_alone():
    cfg = Config(features=2, max_streams=4)
    proc = _order_processor(params=True)
    state = proc.init(cfg)
    template = row_template(state, cfg.max_streams + 1)
    assert template.params == {"w": None}
    assert np.asarray(template.rows["h"]).tolist() == [0.0, 0.0] and int(template.rows["n"]) == 0
    state, _ = jax.jit(proc.step)(state, pad_batch(np.ones((2, 2), np.float32), np.array([1, 2], np.int32), 2, 4))
    state = reset_rows(state, template, jnp.array([1], jnp.int32))
    assert np.asarray(state.rows["n"]).tolist() == [0, 0, 1, 0, 0]
    assert np.asarray(state.params["w"]).tolist() == [1.0, 2.0]


def test_compile_step_accepts_a_helper_processor_with_params_and_steps_it():
    cfg = Config(features=2, max_streams=6, max_batch=16)
    built = compile_step(_order_processor(params=True), cfg)
    state, seen = built.take_state(), 0
    for bucket in cfg.buckets:
        x = np.full((bucket, 2), 2.0, np.float32)
        state, out, bad = built.steps[bucket](state, pad_batch(x, np.zeros(bucket, np.int32), bucket, 6))
        assert not np.asarray(bad).any() and np.asarray(out["n"]).tolist() == list(range(seen, seen + bucket))
        seen += bucket
    assert int(state.rows["n"][0]) == sum(cfg.buckets) and int(state.rows["n"][6]) == 0


# ---- O(B): the compiled step touches the table only with its final scatter ---------------------


def _step_table_ops(proc, cfg, bucket):
    state = jax.eval_shape(lambda: proc.init(cfg))
    batch = Batch(jax.ShapeDtypeStruct((bucket, cfg.features), jnp.float32),
                  jax.ShapeDtypeStruct((bucket,), jnp.int32), jax.ShapeDtypeStruct((bucket,), jnp.bool_))
    return _table_ops(proc.step, (state, batch), cfg.max_streams + 1)


@pytest.mark.parametrize("bucket", [1, 2, 256])
@pytest.mark.parametrize("which", ["ewma", "params"])
def test_only_the_final_scatter_touches_a_million_row_table(which, bucket):
    # no copy, while carry, select or elementwise op of an [S + 1, ...] array: only the scatters
    cfg = Config(features=8, max_streams=1_000_000)
    proc = default_processor(cfg) if which == "ewma" else _order_processor(params=True)
    assert _step_table_ops(proc, cfg, bucket) == []
