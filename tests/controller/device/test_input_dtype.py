"""A processor's input dtype (``Processor.input_dtype``): float32 by default, or float64, carried
from the codec to the step without a float32 round trip.

The pieces with literal inputs here (JAX's 64-bit mode stays off in this process); the whole
path with x64 on in a subprocess (tests/input_dtype_runs.py), on one device and on 4 forced
CPU devices, bit for bit against the float64 values of the JSON input.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkless import Runtime
from forkless.controller.batching import pad_batch
from forkless.controller.codec import Decoded, GuardedCodec, JsonCodec
from forkless.controller.config import Config
from forkless.controller.declared import Description
from forkless.controller.device.compiled import check_platform_dtypes
from forkless.controller.device.placement import Placement
from forkless.controller.errors import ProcessorContractError
from forkless.controller.loop import Controller
from forkless.controller.processor import default_processor
from forkless.io_loop.jsontext import dumps
from tests import input_dtype_runs
from tests.fake_io import FakeIO
from tests.harness import ROOT, UNIT_S, app_env

PRICE, MILLIS = 37000.10, 1700000000123  # float32 makes them 37000.1015625 and 1700000038912


def test_float32_cannot_hold_the_values_these_tests_are_about():
    assert float(np.float32(PRICE)) == 37000.1015625 and float(np.float32(MILLIS)) == 1700000038912.0


# ---- the pieces, literal --------------------------------------------------------------------------


def test_the_codec_builds_x_in_the_declared_dtype_from_the_parsed_numbers():
    one = dumps({"seq": 1, "stream": "btc", "x": [PRICE, MILLIS]})
    batch = dumps([{"seq": 2, "stream": "btc", "x": [PRICE, MILLIS]}, {"seq": 3, "stream": "a", "x": [1, 2]}])
    for frame in (one, batch):
        d = JsonCodec(2, dtype=np.float64).decode(frame)
        assert d.x.dtype == np.float64 and d.x[0].tolist() == [PRICE, MILLIS]
        d32 = JsonCodec(2).decode(frame)  # the default: float32, as before
        assert d32.x.dtype == np.float32 and d32.x[0].tolist() == [37000.1015625, 1700000038912.0]


def test_a_codec_that_returns_float32_for_a_float64_processor_is_cast_up():
    class Float32Codec:
        def decode(self, frame):
            return Decoded([1], ["a"], np.array([[PRICE, 2.0]], np.float32))

    d = GuardedCodec(Float32Codec(), 2, dtype=np.float64).decode("x")
    assert d.x.dtype == np.float64 and d.x.tolist() == [[37000.1015625, 2.0]]  # the codec's precision
    # the built-in codec in another dtype than the processor's is cast up too, not run unwrapped
    d = GuardedCodec(JsonCodec(2), 2, dtype=np.float64).decode(dumps({"seq": 1, "stream": "a", "x": [1, 2]}))
    assert d.x.dtype == np.float64


def test_padding_and_the_packed_batch_of_several_devices_keep_float64_bits():
    x = np.array([[PRICE, MILLIS], [-PRICE, 0.1]])
    batch = pad_batch(x, np.array([3, 5], np.int32), 4, 9, np.float64)
    assert batch.x.dtype == np.float64 and np.array_equal(batch.x[:2], x) and not batch.x[2:].any()
    assert pad_batch(x, np.array([3, 5], np.int32), 4, 9).x.dtype == np.float32  # the default, as before
    place = Placement(devices=4, max_streams=10)
    slots = np.array([5, 0], np.int32)
    route = place.route(slots, (1, 4))
    packed = place.pack(x, slots, route, np.float64)  # uint32 words: x's bits (two a value), key, valid
    assert packed.dtype == np.uint32 and packed.shape == (4, 6)
    assert np.array_equal(np.ascontiguousarray(packed[route.positions, :4]).view(np.float64), x)
    assert packed[:, 4].tolist() == [0, 1, 3, 3]  # local rows (slot // 4); the spare, 3
    assert packed[:, 5].tolist() == [1, 1, 0, 0]


# ---- the contract: refused at compile -----------------------------------------------------------


def _echo64() -> Any:
    return input_dtype_runs.echo_processor(jnp.float64)


def test_a_float64_processor_with_x64_off_is_refused_at_compile_naming_the_fix():
    assert not jax.config.jax_enable_x64, "this test process keeps JAX's 64-bit mode off"
    ctl = Controller(Config(features=2, max_batch=4, max_streams=8), processor=_echo64(),
                     runtime=Runtime(io_factory=FakeIO()))
    with pytest.raises(ProcessorContractError) as err:
        ctl.compile()
    message = str(err.value)
    assert "input_dtype=float64" in message and "64-bit mode" in message
    assert 'jax.config.update("jax_enable_x64", True)' in message and "JAX_ENABLE_X64=1" in message
    assert not jax.config.jax_enable_x64  # the library did not turn it on


@pytest.mark.parametrize("dtype", [np.int32, jnp.bfloat16, np.float16, "nonsense", None])
def test_an_input_dtype_other_than_float32_or_float64_is_refused_when_the_description_is_built(dtype):
    with pytest.raises(ProcessorContractError, match=r"is not supported: .* float32 \(the default\) or float64"):
        Description(name="ewma", input_dtype=dtype)


def test_the_default_processor_gets_a_float32_codec_as_before():
    fake = FakeIO()
    with Controller(Config(features=2, max_batch=4, max_streams=8), runtime=Runtime(io_factory=fake)):
        assert fake.codec.decode(dumps({"seq": 1, "stream": "a", "x": [PRICE, 1]})).x.dtype == np.float32
        assert fake.codec.decode == fake.codec.codec.decode  # the built-in codec still runs unwrapped


# ---- on a TPU, float64 is not IEEE double: refused (the platform string faked here) -----------------


def test_a_float64_processor_on_a_tpu_is_refused_saying_what_its_float64_is():
    shapes = jax.ShapeDtypeStruct((9, 2), np.float64)
    with pytest.raises(ProcessorContractError) as err:
        check_platform_dtypes(_echo64(), shapes, "tpu")
    message = str(err.value)
    assert "input_dtype=float64" in message and "on a TPU, float64 is not IEEE double" in message
    assert "1e300 became inf" in message and "input_dtype=float32" in message and "JAX_PLATFORMS=cpu" in message
    for platform in ("cpu", "gpu"):  # IEEE double there
        check_platform_dtypes(_echo64(), shapes, platform)


def test_a_float64_state_leaf_on_a_tpu_is_warned_about_naming_it(caplog):
    processor = default_processor(Config(features=2))  # float32 input
    shapes = {"mean": jax.ShapeDtypeStruct((9, 2), np.float64), "count": jax.ShapeDtypeStruct((9,), np.int32)}
    with caplog.at_level("WARNING", logger="forkless.compile"):
        check_platform_dtypes(processor, shapes, "tpu")
    [record] = caplog.records
    assert "['mean']" in record.getMessage() and "not IEEE double" in record.getMessage()
    assert "dtype=jnp.float32" in record.getMessage() and "count" not in record.getMessage()
    caplog.clear()
    check_platform_dtypes(processor, shapes, "cpu")
    assert not caplog.records


# ---- the whole path, with x64 on (a subprocess) ----------------------------------------------------


def _run(tmp_path: Path, env: dict[str, str]) -> dict[str, Any]:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "tests.input_dtype_runs", str(out)], cwd=ROOT,
                          env=app_env({"JAX_ENABLE_X64": "1", **env}), capture_output=True, text=True,
                          timeout=180 * UNIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("devices", [1, 4])
def test_float64_inputs_reach_the_processor_and_come_back_bit_for_bit(tmp_path, devices):
    figures = _run(tmp_path, {"JAX_NUM_CPU_DEVICES": str(devices)})
    assert figures["x64"] and figures["devices"] == devices
    assert figures["batches"] == 1  # four chunks, concatenated by the batcher into one batch
    assert figures["chunk_dtypes"] == ["float64"] * 4
    if devices == 4:
        assert all(figures["device_messages"])  # every device ran some
    want = input_dtype_runs.expected()
    assert want["0"]["x"] == [PRICE.hex(), float(MILLIS).hex()]
    got = {seq: {"x": r["x"], "prev": r["prev"]} for seq, r in figures["results"].items()}
    assert got == want  # what the step returned: the input's bits, and each stream's previous input
    assert all(r["dtypes"] == {"x": "float64", "prev": "float64"} for r in figures["results"].values())
    assert figures["replies"] == want and figures["errors"] == []  # and the JSON replies carry them
    assert figures["compilations_after_warmup"] == 0


def test_keys_above_2_to_the_24_are_routed_right_with_a_float64_processor_on_several_devices(tmp_path):
    """Issue 48: the several-device layout carried the key's bits in the float64 batch, and a
    TPU's copy of a float64 array does not keep bits (small keys came back 0: every message to
    row 0). Now the key travels in integer words: exact on any device, at any size."""
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "tests.input_dtype_runs", "--large-keys", str(out)], cwd=ROOT,
                          env=app_env({"JAX_ENABLE_X64": "1", "JAX_NUM_CPU_DEVICES": "2"}), capture_output=True,
                          text=True, timeout=180 * UNIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["x64"] and got["devices"] == 2
    assert max(got["keys"]) > 2 ** 24
    assert got["keys"] == [slot // 2 for slot in got["slots"]]  # each slot's local row on its device
    assert got["x"] == got["x_sent"]  # and x's float64 bits with it
    assert all(dtype in ("uint32", "int32", "bool") for dtype in got["laid_out"])  # no float array carries a key
