"""The accelerator's path on the CPU (issue 48): one packed array in and one out per step, the
checkpoint cloned on the device, and the choices that follow the argument or ``jax.config``.

On an accelerator each array a step takes or gives is one transfer, so there ``OneDevice``
packs the batch into uint32 words and the results into bytes; on the CPU it keeps the arrays
it reads in place. ``layouts.accelerated`` chooses by the device's platform string; here it is
made to say yes on the CPU, so the real controller runs the accelerator's path and is held
against the CPU's own, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest

from forkless.controller import engine as engine_module
from forkless.controller.device import layouts
from tests import device_runs
from tests.harness import ROOT, UNIT_S, app_env

SCENARIOS = ("spread", "eviction", "non_finite", "replicated")


def _runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, accelerated: bool) -> dict[str, Any]:
    monkeypatch.setattr(layouts, "accelerated", lambda platform: accelerated)
    runs = {name: getattr(device_runs, name)() for name in SCENARIOS}
    directory = str(tmp_path / ("accelerated" if accelerated else "cpu"))
    runs["checkpoint_first"] = device_runs.checkpoint_run(directory, first=True)
    runs["checkpoint_second"] = device_runs.checkpoint_run(directory, first=False)
    return json.loads(json.dumps(runs))


def test_the_accelerators_packed_path_gives_the_cpus_results_bit_for_bit(monkeypatch, tmp_path):
    cpu = _runs(monkeypatch, tmp_path, accelerated=False)
    packed = _runs(monkeypatch, tmp_path, accelerated=True)
    for name in (*SCENARIOS, "checkpoint_first", "checkpoint_second"):
        assert packed[name]["results"] == cpu[name]["results"], name
        assert packed[name]["errors"] == cpu[name]["errors"], name
        assert packed[name]["resets"] == cpu[name]["resets"], name
        assert packed[name]["compilations_after_warmup"] == 0, name
    assert packed["checkpoint_second"]["restored"]  # the stop's checkpoint, cloned on the device


def test_a_packed_step_takes_one_integer_array_and_gives_one_byte_array_with_the_same_results():
    from forkless.controller.config import Config
    from forkless.controller.processor import default_processor

    config = Config(features=3, max_streams=8, max_batch=4)
    processor = default_processor(config)
    x, key = np.random.default_rng(2).standard_normal((3, 3)).astype(np.float32), np.array([7, 0, 7], np.int32)
    got = {}
    for packed in (True, False):
        layout = layouts.OneDevice(processor, config, jax.devices()[0], packed=packed)
        state = layout.fresh()
        layout.check(processor.step, state, 4)
        template = layout.compile_template(state)(state)
        step = layout.lower(layout.jit(processor.step, True), state, template, 4).compile()
        bucket, batch, route, written = layout.lay_out(x, key)
        assert bucket == 4 and route is None and written.tolist() == [7, 0, 7, 8]  # padding writes the spare row
        _state, *ran = step(state, batch, template)
        if packed:
            assert (batch.dtype, batch.shape) == (np.uint32, (4, 5))  # x's bits, the key, valid: one array
            assert [(leaf.dtype, leaf.shape[0]) for leaf in ran] == [(np.uint8, 4)]  # every output: one array
        stepped = layout.results(tuple(ran), 3, route, jax.device_get)
        got[packed] = ({k: v.tobytes() for k, v in stepped.outputs.items()}, stepped.bad.tolist())
    assert got[True] == got[False] and len(got[True][0]) >= 2


TWO_DEVICES = """
import json, sys, jax
from forkless.controller.device import layouts
from forkless.controller.config import Config
from forkless.controller.processor import default_processor
config = Config(features=2, max_streams=8, max_batch=4)
second = jax.devices()[1]
layout = layouts.OneDevice(default_processor(config), config, second)
state = layout.fresh()
print(json.dumps(sorted({str(d) for leaf in jax.tree.leaves(state) for d in leaf.devices()} | {"want:" + str(second)})))
"""


def test_one_device_puts_the_state_on_the_device_it_is_given():
    done = subprocess.run([sys.executable, "-c", TWO_DEVICES], cwd=ROOT, env=app_env({"JAX_NUM_CPU_DEVICES": "2"}),
                          capture_output=True, text=True, timeout=120 * UNIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got == ["cpu:1", "want:cpu:1"]


def test_the_persistent_cache_set_in_jax_config_caches_every_bucket_and_is_given_back(tmp_path, monkeypatch):
    """Set in ``jax.config`` (not JAX_COMPILATION_CACHE_DIR), the cache still gets every bucket
    (JAX's 1 s threshold lowered while the steps compile); a threshold the host set is kept."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in names}  # the session's shared cache (conftest)
    try:
        jax.config.update(names[0], str(tmp_path))
        jax.config.update(names[1], engine_module.JAX_MIN_COMPILE_TIME_S)  # JAX's default
        with engine_module._cache_every_compile():
            inside = getattr(jax.config, names[1])
        after = getattr(jax.config, names[1])
        jax.config.update(names[1], 5.0)  # the host's own threshold: left alone
        with engine_module._cache_every_compile():
            own = getattr(jax.config, names[1])
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
    assert (inside, after, own) == (0.0, 1.0, 5.0)
