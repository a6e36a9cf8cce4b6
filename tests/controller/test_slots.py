"""Stream slots with idle recycling: literal inputs, no clock; and recycled slots end to end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkless.controller.batching import pad_batch
from forkless.controller.config import Config
from forkless.controller.processor import default_processor, reset_rows, row_template
from forkless.controller.slots import StreamSlots
from tests.reference import EWMAReference


def test_new_streams_take_slots_in_order_of_first_sight():
    slots = StreamSlots(4)
    got, ok, recycled = slots.lookup(["b", "a", "b", "c"], now=0.0)
    assert got.tolist() == [0, 1, 0, 2] and ok.all() and recycled == []
    assert got.dtype == np.int32 and len(slots) == 3


def test_a_full_table_refuses_a_new_stream_when_no_stream_is_idle():
    slots = StreamSlots(2, idle_s=10.0)
    slots.lookup(["a", "b"], now=0.0)
    got, ok, recycled = slots.lookup(["c", "a"], now=5.0)
    assert got.tolist() == [2, 0] and ok.tolist() == [False, True] and recycled == []
    assert len(slots) == 2 and slots.evicted == 0
    assert [name for name, _, _ in slots.items()] == ["b", "a"]  # the refused "c" is not remembered


def test_a_stream_is_evicted_only_when_idle_for_strictly_more_than_idle_s():
    slots = StreamSlots(1, idle_s=2.0)
    slots.lookup(["a"], now=1.0)
    assert slots.lookup(["b"], now=3.0)[1].tolist() == [False]  # idle exactly 2.0: kept
    got, ok, recycled = slots.lookup(["b"], now=3.5)
    assert got.tolist() == [0] and ok.tolist() == [True] and recycled == [0]


def test_the_least_recently_seen_stream_is_evicted_first():
    slots = StreamSlots(3, idle_s=0.0)
    slots.lookup(["a", "b", "c"], now=0.0)
    slots.lookup(["a"], now=1.0)  # now b (slot 1) is the least recently seen, then c, then a
    got, ok, recycled = slots.lookup(["x", "y", "z"], now=2.0)
    assert got.tolist() == [1, 2, 0] and ok.all() and recycled == [1, 2, 0]
    assert slots.evicted == 3 and len(slots) == 3


def test_seeing_a_stream_again_keeps_its_slot_and_makes_it_most_recent():
    slots = StreamSlots(2, idle_s=0.0)
    slots.lookup(["a", "b"], now=0.0)
    got, _, _ = slots.lookup(["b", "a", "b"], now=1.0)
    assert got.tolist() == [1, 0, 1]
    assert [(name, slot, seen) for name, slot, seen in slots.items()] == [("a", 0, 1.0), ("b", 1, 1.0)]


def test_a_stream_seen_earlier_in_the_same_call_is_never_evicted_by_it():
    slots = StreamSlots(2, idle_s=0.0)
    slots.lookup(["old"], now=0.0)
    got, ok, recycled = slots.lookup(["a", "b", "c"], now=5.0)
    # "a" takes the free slot, "b" evicts the idle "old", "c" finds only streams seen now
    assert got.tolist() == [1, 0, 2] and ok.tolist() == [True, True, False] and recycled == [0]
    assert slots.evicted == 1 and sorted(name for name, _, _ in slots.items()) == ["a", "b"]


def test_an_evicted_stream_that_comes_back_is_new():
    slots = StreamSlots(2, idle_s=1.0)
    slots.lookup(["a", "b"], now=0.0)
    slots.lookup(["c"], now=2.0)  # evicts a from slot 0
    got, ok, recycled = slots.lookup(["a"], now=4.0)  # evicts b from slot 1
    assert got.tolist() == [1] and ok.all() and recycled == [1] and slots.evicted == 2


def test_idle_s_must_not_be_negative():
    with pytest.raises(ValueError, match="idle_s"):
        StreamSlots(4, idle_s=-1.0)


def test_many_more_streams_than_slots_cost_constant_time_per_message():
    # 200,000 new streams through 16 slots: each evicts the least recent in O(1)
    slots = StreamSlots(16, idle_s=0.0)
    names = [f"stream-{i}" for i in range(200_000)]
    total = 0
    for start in range(0, len(names), 256):
        _, ok, recycled = slots.lookup(names[start:start + 256], now=float(start))
        assert ok[:16].all() and ok.sum() == 16  # a call can take each of the 16 slots once
        total += len(recycled)
    assert slots.evicted == total and len(slots) == 16


def test_export_then_restore_gives_a_table_that_behaves_the_same():
    a = StreamSlots(3, idle_s=1.0)
    a.lookup(["x", "y", "z"], now=0.0)
    a.lookup(["x"], now=5.0)
    names, slot_arr, seen = a.export()
    assert names.tolist() == ["y", "z", "x"] and slot_arr.tolist() == [1, 2, 0]
    assert slot_arr.dtype == np.int32 and seen.tolist() == [0.0, 0.0, 5.0]
    b = StreamSlots(3, idle_s=1.0)
    b.restore(names, slot_arr, seen)
    assert list(b.items()) == list(a.items()) and len(b) == 3 and b.evicted == 0
    for table in (a, b):
        # "new" evicts y, x keeps its slot, y comes back new and evicts z, "other" finds x not idle
        got, ok, recycled = table.lookup(["new", "x", "y", "other"], now=5.5)
        assert got.tolist() == [1, 0, 2, 3] and ok.tolist() == [True, True, True, False]
        assert recycled == [1, 2] and table.evicted == 2
    assert list(a.items()) == list(b.items())


def test_export_of_an_empty_table_restores_to_an_empty_table():
    b = StreamSlots(3)
    b.restore(*StreamSlots(3).export())
    assert len(b) == 0 and b.lookup(["a"], now=0.0)[0].tolist() == [0]


def test_restore_refuses_slots_that_are_not_zero_to_n():
    with pytest.raises(ValueError, match=r"slots must be 0 \.\. n - 1"):
        StreamSlots(3).restore(["a", "b"], [0, 2], [0.0, 0.0])
    with pytest.raises(ValueError, match="twice"):
        StreamSlots(3).restore(["a", "a"], [0, 1], [0.0, 0.0])


# ---- end to end: recycled slots never mix a new stream with its slot's previous owner -----


def test_streams_rotating_through_a_small_table_equal_the_reference_that_forgets_evicted_streams():
    cfg = Config(features=3, max_streams=4, warmup=2)
    bucket = 8
    proc = default_processor(cfg)
    state = jax.device_put(proc.init(cfg))
    template = row_template(proc.init(cfg), cfg.max_streams + 1)
    step = jax.jit(proc.step, donate_argnums=0)
    reset = jax.jit(reset_rows, donate_argnums=0)
    slots = StreamSlots(cfg.max_streams, idle_s=1.0)
    ref = EWMAReference(warmup=cfg.warmup)
    owner: dict[int, str] = {}
    rng = np.random.default_rng(5)
    checked = refused = 0
    for b in range(120):
        now = 0.4 * b
        window = (b // 6) % 9  # the active streams drift over a pool of 12
        streams = [f"s{window + int(rng.integers(0, 4))}" for _ in range(int(rng.integers(1, bucket + 1)))]
        x = rng.normal(size=(len(streams), cfg.features)).astype(np.float32)
        key, ok, recycled = slots.lookup(streams, now)
        changed = []
        for i, name in enumerate(streams):
            if ok[i] and owner.get(int(key[i])) != name:
                if int(key[i]) in owner:
                    changed.append(int(key[i]))
                owner[int(key[i])] = name
                for table in (ref.n, ref.mean, ref.var):  # an evicted stream comes back new
                    table.pop(name, None)
        assert recycled == changed
        if recycled:
            idx = np.full(bucket, cfg.max_streams, np.int32)
            idx[: len(recycled)] = recycled
            state = reset(state, template, jnp.asarray(idx))
        good = np.flatnonzero(ok)
        state, out = step(state, pad_batch(x[good], key[good], bucket, cfg.max_streams))
        out = jax.device_get(out)
        refused += len(streams) - len(good)
        for row, i in enumerate(good):
            z, score, anomaly = ref(streams[i], x[i])
            np.testing.assert_allclose(out["z"][row], z, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(out["score"][row], score, rtol=1e-5, atol=1e-5)
            assert bool(out["anomaly"][row]) == anomaly
            checked += 1
    assert slots.evicted > 10 and refused > 0 and checked > 300
