"""The default EWMA processor against the one-at-a-time numpy reference; compile behaviour;
the O(B) step (bit-for-bit with the old whole-table loop, donation, no O(S) op); reset_rows."""

from __future__ import annotations

import os
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkless.controller.batching import Batch, pad_batch
from forkless.controller.config import Config
from forkless.controller.device.compiled import compilations, guarded
from forkless.controller.engine import compile_step
from forkless.controller.processor import (
    EPS,
    EWMAState,
    _occurrence_rank,
    default_processor,
    reset_rows,
    row_template,
)
from forkless.controller.slots import StreamSlots
from tests.reference import EWMAReference


def run_batches(cfg, batches, bucket):
    proc = default_processor(cfg)
    state = jax.device_put(proc.init(cfg))
    step = jax.jit(proc.step)
    slots = StreamSlots(cfg.max_streams)
    outs = []
    for streams, x in batches:
        key, _, _ = slots.lookup(streams, now=0.0)
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


def test_occurrence_rank_counts_earlier_rows_with_the_same_key():
    key = jnp.array([3, 1, 3, 3, 2, 1, 9, 9], jnp.int32)
    assert np.asarray(_occurrence_rank(key)).tolist() == [0, 0, 1, 2, 0, 1, 0, 1]


# ---- the O(B) step against the old whole-table loop --------------------------------------


def _old_ewma_step(alpha=0.05, threshold=4.0, warmup=20, eps=EPS):
    """The step as it was before issue 10: a while_loop carrying (and scattering into) the table."""

    def step(state, batch):
        x = batch.x.astype(jnp.float32)
        spare = state.count.shape[0] - 1
        key = jnp.where(batch.valid, batch.key, spare)
        rank = _occurrence_rank(key)
        rank = jnp.where(batch.valid, rank, -1)
        rounds = jnp.max(rank) + 1

        def cond(carry):
            return carry[0] < rounds

        def body(carry):
            r, st, z, n = carry
            active = rank == r
            idx = jnp.where(active, key, spare)
            cnt = st.count[idx]
            mean = st.mean[idx]
            var = st.var[idx]
            first = (cnt == 0)[:, None]
            d = x - mean
            z_r = jnp.where(first, 0.0, d / jnp.sqrt(var + eps))
            new_mean = jnp.where(first, x, mean + alpha * d)
            new_var = jnp.where(first, 0.0, (1.0 - alpha) * (var + alpha * d * d))
            st = EWMAState(
                count=st.count.at[idx].set(cnt + 1),
                mean=st.mean.at[idx].set(new_mean),
                var=st.var.at[idx].set(new_var),
            )
            z = jnp.where(active[:, None], z_r, z)
            n = jnp.where(active, cnt, n)
            return r + 1, st, z, n

        z0 = jnp.zeros_like(x)
        n0 = jnp.zeros(key.shape, jnp.int32)
        _, state, z, n = jax.lax.while_loop(cond, body, (jnp.int32(0), state, z0, n0))
        score = jnp.max(jnp.abs(z), axis=1)
        anomaly = (n >= warmup) & (score > threshold) & batch.valid
        return state, {"z": z, "score": score, "anomaly": anomaly}

    return step


def _random_batch(rng, streams, bucket, features):
    """A batch of 1..bucket messages from a few streams (so they repeat), padded to bucket."""
    n = int(rng.integers(1, bucket + 1))
    key = rng.integers(0, min(streams, 5), size=n).astype(np.int32) * (streams // 5 or 1)
    x = rng.normal(size=(n, features)).astype(np.float32) * rng.choice([0.1, 1.0, 30.0])
    if rng.random() < 0.3:
        x[rng.integers(0, n)] += 50  # a spike
    return pad_batch(x, key, bucket, streams)


def test_the_step_equals_the_old_whole_table_loop_bit_for_bit():
    cfg = Config(features=4, max_streams=20, warmup=3)
    proc = default_processor(cfg)
    new_step = jax.jit(proc.step, donate_argnums=0)
    old_step = jax.jit(_old_ewma_step(cfg.alpha, cfg.threshold, cfg.warmup))
    new = jax.device_put(proc.init(cfg))
    old = jax.device_put(proc.init(cfg))
    rng = np.random.default_rng(7)
    flagged = 0
    for _ in range(60):
        batch = _random_batch(rng, cfg.max_streams, 16, cfg.features)
        new, out_new = new_step(new, batch)
        old, out_old = old_step(old, batch)
        for name in ("z", "score", "anomaly"):
            np.testing.assert_array_equal(np.asarray(out_new[name]), np.asarray(out_old[name]))
        flagged += int(np.asarray(out_new["anomaly"]).sum())
        # the old loop scribbled on the spare slot; the streams' rows must agree exactly
        for name in ("count", "mean", "var"):
            np.testing.assert_array_equal(np.asarray(getattr(new, name))[:-1],
                                          np.asarray(getattr(old, name))[:-1])
    assert flagged > 0 and int(np.asarray(new.count).max()) > cfg.warmup
    np.testing.assert_array_equal(np.asarray(new.count)[-1], 0)  # the spare slot is untouched


def test_a_stream_repeated_across_a_whole_batch_equals_the_old_loop_bit_for_bit():
    cfg = Config(features=2, max_streams=3, warmup=1)
    proc = default_processor(cfg)
    x = np.random.default_rng(3).normal(size=(8, 2)).astype(np.float32)
    batch = pad_batch(x, np.full(8, 1, np.int32), 8, cfg.max_streams)
    new, out_new = jax.jit(proc.step)(jax.device_put(proc.init(cfg)), batch)
    old, out_old = jax.jit(_old_ewma_step(warmup=1))(jax.device_put(proc.init(cfg)), batch)
    np.testing.assert_array_equal(np.asarray(out_new["z"]), np.asarray(out_old["z"]))
    np.testing.assert_array_equal(np.asarray(new.mean)[1], np.asarray(old.mean)[1])
    np.testing.assert_array_equal(np.asarray(new.var)[1], np.asarray(old.var)[1])
    assert np.asarray(new.count).tolist() == [0, 8, 0, 0]


# ---- donation ----------------------------------------------------------------------------


def _example(cfg, bucket=4):
    x = np.ones((bucket, cfg.features), np.float32)
    return pad_batch(x, np.arange(bucket, dtype=np.int32) % cfg.max_streams, bucket, cfg.max_streams)


def _aliased_inputs(hlo: str) -> set[int]:
    """Parameter numbers that the compiled module's input_output_alias lets an output reuse."""
    header = hlo.splitlines()[0]
    match = re.search(r"input_output_alias=\{(.*?)\s\}, ", header)
    if not match:
        return set()
    return {int(p) for p in re.findall(r"\{\d*\}: \((\d+), \{\}, (?:may|must)-alias\)", match.group(1))}


def test_the_donated_step_compiles_with_every_state_buffer_aliased_and_no_warning():
    cfg = Config(features=3, max_streams=16)
    proc = default_processor(cfg)
    state = jax.device_put(proc.init(cfg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = jax.jit(proc.step, donate_argnums=0).lower(state, _example(cfg)).compile()
    assert not [w for w in caught if "donated" in str(w.message).lower()]
    assert _aliased_inputs(compiled.as_text()) == {0, 1, 2}  # count, mean, var


def test_without_donation_nothing_is_aliased():
    # so the assertion above would fail if donate_argnums were dropped
    cfg = Config(features=3, max_streams=16)
    proc = default_processor(cfg)
    compiled = jax.jit(proc.step).lower(jax.device_put(proc.init(cfg)), _example(cfg)).compile()
    assert _aliased_inputs(compiled.as_text()) == set()


def test_the_donated_step_deletes_the_state_passed_in():
    cfg = Config(features=3, max_streams=16)
    proc = default_processor(cfg)
    old = jax.device_put(proc.init(cfg))
    new, _ = jax.jit(proc.step, donate_argnums=0)(old, _example(cfg))
    jax.block_until_ready(new)
    assert old.count.is_deleted() and old.mean.is_deleted() and old.var.is_deleted()
    assert not new.count.is_deleted()


# ---- the step costs O(B): no op but the scatter touches the table -------------------------


def _table_ops(fn, args, rows: int) -> list[str]:
    """Opcodes of ``jit(fn, donate_argnums=0)(*args)``'s HLO that produce a table-shaped array.

    A table-shaped array has ``rows`` (``max_streams + 1``) as a dimension. A scatter or a
    dynamic-update-slice (what XLA makes of a scatter of one row), alone or as the root of
    its fusion, updates the donated table in place and costs O(B); parameters and the
    output tuple are free. Anything else producing a table shape (a while loop carrying
    it, a copy, an elementwise op, a select) is an O(S) pass.
    """
    hlo = jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()
    roots: dict[str, str] = {}
    instructions: list[tuple[str, str, str]] = []  # (shape, opcode, rest of the line)
    computation = ""
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%(\S+) \(.*\{$", line)
        if head:
            computation = head.group(1)
            continue
        inst = re.match(r"\s*(ROOT )?%\S+ = (.*?) ([a-z][a-z0-9-]*)\((.*)$", line)
        if inst:
            if inst.group(1):
                roots[computation] = inst.group(3)
            instructions.append((inst.group(2), inst.group(3), inst.group(4)))
    table = re.compile(rf"\[{rows}[,\]]")
    in_place = ("scatter", "dynamic-update-slice")
    found = []
    for shape, opcode, rest in instructions:
        if not table.search(shape) or opcode in ("parameter", "tuple", *in_place):
            continue
        called = re.search(r"calls=%(\S+?),", rest)
        if opcode == "fusion" and called and roots.get(called.group(1)) in in_place:
            continue
        found.append(opcode)
    return found


def _step_table_ops(step, cfg, bucket) -> list[str]:
    state = jax.eval_shape(lambda: default_processor(cfg).init(cfg))
    batch = Batch(jax.ShapeDtypeStruct((bucket, cfg.features), jnp.float32),
                  jax.ShapeDtypeStruct((bucket,), jnp.int32), jax.ShapeDtypeStruct((bucket,), jnp.bool_))
    return _table_ops(step, (state, batch), cfg.max_streams + 1)


@pytest.mark.parametrize("bucket", [1, 2, 256])
def test_only_the_final_scatter_touches_a_million_row_table(bucket):
    # B = 1 matters: XLA turns its gathers into dynamic slices it likes to duplicate into
    # later consumers, which once made it copy the table before updating it
    cfg = Config(features=8, max_streams=1_000_000)
    assert _step_table_ops(default_processor(cfg).step, cfg, bucket) == []


@pytest.mark.parametrize("bucket", [1, 256])
def test_the_table_check_flags_the_old_whole_table_loop(bucket):
    # the check above is not vacuous: the old step carries the table through a while loop
    cfg = Config(features=8, max_streams=1_000_000)
    assert {"while", "copy"} & set(_step_table_ops(_old_ewma_step(), cfg, bucket))


@pytest.mark.parametrize("k", [1, 64])
def test_reset_rows_only_scatters_into_a_million_row_table(k):
    cfg = Config(features=8, max_streams=1_000_000)
    state = jax.eval_shape(lambda: default_processor(cfg).init(cfg))
    template = jax.eval_shape(lambda: row_template(default_processor(cfg).init(cfg), cfg.max_streams + 1))
    idx = jax.ShapeDtypeStruct((k,), jnp.int32)
    assert _table_ops(reset_rows, (state, template, idx), cfg.max_streams + 1) == []


def _thread_cpus() -> dict[int, set[int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # ended meanwhile
            pass
    return out


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="XLA:CPU splits ops across threads only with several CPUs")
def test_the_controller_compiles_the_table_ops_unsplit_and_gives_every_thread_its_cpus_back():
    # A 2 MB table: XLA:CPU prices a gather/scatter into it by its bytes and, left alone,
    # splits it into one task per thread (a hand-off each, for B rows)
    cfg = Config(features=8, max_streams=65_536, max_batch=256)
    proc = default_processor(cfg)
    example = pad_batch(np.ones((3, 8), np.float32), np.arange(3, dtype=np.int32), 256, cfg.max_streams)
    # the control is not stored in the session's persistent compilation cache (tests/conftest.py):
    # the cache's key does not hold the CPUs a compile could use, so compile_step would load it
    name = "jax_persistent_cache_min_compile_time_secs"
    kept_from_cache = getattr(jax.config, name)
    jax.config.update(name, 1e9)
    try:
        state = jax.device_put(proc.init(cfg))
        template = row_template(state, cfg.max_streams + 1)
        plain = jax.jit(guarded(proc.step), donate_argnums=0).lower(state, example, template).compile()
    finally:
        jax.config.update(name, kept_from_cache)
    assert "outer_dimension_partitions" in plain.as_text()  # the control: this is what it guards against
    before = _thread_cpus()
    compiled = compile_step(proc, cfg)
    after = _thread_cpus()
    assert compiled.steps and all("outer_dimension_partitions" not in s.as_text() for s in compiled.steps.values())
    kept = [tid for tid in before if tid in after]
    assert {tid: after[tid] for tid in kept} == {tid: before[tid] for tid in kept}
    main = before[threading.get_native_id()]
    assert all(after[tid] == main for tid in after if tid not in before)  # threads started while compiling
    assert len(main) >= 2


# ---- reset_rows ----------------------------------------------------------------------------


def test_reset_rows_sets_exactly_the_given_rows_to_the_template():
    cfg = Config(features=2, max_streams=5)
    proc = default_processor(cfg)
    template = row_template(proc.init(cfg), cfg.max_streams + 1)
    state = EWMAState(count=jnp.arange(6, dtype=jnp.int32) + 10,
                      mean=jnp.arange(12, dtype=jnp.float32).reshape(6, 2) + 1,
                      var=jnp.full((6, 2), 7.0, jnp.float32))
    idx = jnp.array([1, 3, 5, 5], jnp.int32)  # padded with the spare slot 5
    out = jax.jit(reset_rows, donate_argnums=0)(state, template, idx)
    assert np.asarray(out.count).tolist() == [10, 0, 12, 0, 14, 0]
    assert np.asarray(out.mean).tolist() == [[1, 2], [0, 0], [5, 6], [0, 0], [9, 10], [0, 0]]
    assert np.asarray(out.var).tolist() == [[7, 7], [0, 0], [7, 7], [0, 0], [7, 7], [0, 0]]


def test_row_template_keeps_row_zero_of_per_stream_leaves_and_leaves_others_alone():
    state = {"per_stream": jnp.full((4, 3), 2.0), "shared": jnp.ones((3,)), "step": jnp.zeros(())}
    template = row_template(state, 4)
    assert template["shared"] is None and template["step"] is None
    assert np.asarray(template["per_stream"]).tolist() == [2.0, 2.0, 2.0]
    out = reset_rows({"per_stream": jnp.zeros((4, 3)), "shared": jnp.full((3,), 5.0), "step": jnp.ones(())},
                     template, jnp.array([2], jnp.int32))
    assert np.asarray(out["per_stream"])[:, 0].tolist() == [0.0, 0.0, 2.0, 0.0]
    assert np.asarray(out["shared"]).tolist() == [5.0, 5.0, 5.0] and float(out["step"]) == 1.0
