"""Live weights (controller/device/weights.py, ``Controller.set_weights``): a processor's parameters
swapped while it runs, between two batches, with nothing compiled again and every stream's state kept.

Against a fake IO side (tests/fake_io.py), so which batch runs with which weights is exact: the
results are compared with a one-message-at-a-time numpy reference that switches weights at the
same message. The values are small integers and halves, exact in float32, so equality is exact.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from forkless import EVENTS_ONLY, OnResults, Runtime
from forkless.controller.checkpoints.checkpoint import list_checkpoints, read_checkpoint
from forkless.controller.config import Config
from forkless.controller.declared import Description
from forkless.controller.device.compiled import compilations
from forkless.controller.loop import Controller
from forkless.controller.processor import ewma_processor, stream_processor
from forkless.io_loop.crossing import Chunk
from tests.fake_io import FakeIO
from tests.harness import UNIT_S, run_app

F = 2
CONFIG = Config(features=F, max_batch=4, max_streams=8, max_wait_ms=0.0, status_s=0.0)
OLD = {"w": np.array([1.0, 2.0], np.float32), "b": np.float32(0.5)}
NEW = {"w": np.array([3.0, -1.0], np.float32), "b": np.float32(-1.5)}


def _processor() -> Any:
    """Per stream, a running sum of ``x @ w + b``: the state carries every earlier message's
    weights, so a swap that lost the state, or applied at another message, shows in ``acc``."""

    def init_row(config: Any) -> dict[str, Any]:
        return {"acc": jnp.zeros((), jnp.float32)}

    def row_step(params: Any, row: Any, x: Any) -> tuple[Any, dict[str, Any]]:
        y = x @ params["w"] + params["b"]
        return {"acc": row["acc"] + y}, {"y": y, "acc": row["acc"] + y}

    return stream_processor(row_step, init_row=init_row, init_params=lambda config: dict(OLD),
                            description=Description(name="weighted-sum"))


PROCESSOR = _processor()  # one object: every controller below reuses one compilation


def _messages(start: int, n: int) -> list[tuple[int, str, list[float]]]:
    return [(i, f"s{i % 3}", [float(i % 5 - 2), float(i % 3)]) for i in range(start, start + n)]


def _reference(before: Sequence[tuple[int, str, list[float]]], after: Sequence[tuple[int, str, list[float]]]
               ) -> dict[int, tuple[float, float]]:
    """One message at a time: ``before`` with the old weights, ``after`` with the new ones, one
    running sum per stream across both."""
    acc: dict[str, np.float32] = {}
    out = {}
    for messages, weights in ((before, OLD), (after, NEW)):
        for seq, stream, x in messages:
            y = np.float32(np.asarray(x, np.float32) @ weights["w"] + weights["b"])
            acc[stream] = np.float32(acc.get(stream, np.float32(0)) + y)
            out[seq] = (float(y), float(acc[stream]))
    return out


def _feed(fake: FakeIO, ctl: Controller, messages: Sequence[tuple[int, str, list[float]]], size: int = 3) -> None:
    for at in range(0, len(messages), size):
        part = messages[at:at + size]
        fake.inbound.put_nowait(Chunk([m[0] for m in part], [m[1] for m in part],
                                      np.array([m[2] for m in part], np.float32), 0))
        while ctl.process_pending():
            pass


def _run(config: Config, swap: Any) -> tuple[Controller, dict[int, tuple[float, float]], int]:
    """12 messages, ``swap(ctl)`` between two batches, 12 more; the results and the compilations
    counted from the swap to the end."""
    results: dict[int, tuple[float, float]] = {}

    def on_results(seq: list[int], stream: list[str], outputs: dict[str, np.ndarray]) -> None:
        for i, s in enumerate(seq):
            results[s] = (float(outputs["y"][i]), float(outputs["acc"][i]))

    fake = FakeIO()
    with Controller(config, processor=PROCESSOR, sinks=[OnResults(on_results)],
                    runtime=Runtime(io_factory=fake)) as ctl:
        _feed(fake, ctl, _messages(0, 12))
        compiled = compilations()
        swap(ctl)
        _feed(fake, ctl, _messages(12, 12))
        compiled = compilations() - compiled
    return ctl, results, compiled


def test_a_swap_applies_between_two_batches_keeps_the_state_and_compiles_nothing():
    batches_before: list[int] = []

    def swap(ctl: Controller) -> None:
        batches_before.append(ctl.stats().batches)
        assert ctl.set_weights(NEW, version="v2") == "v2"

    ctl, results, compiled = _run(CONFIG, swap)
    assert results == _reference(_messages(0, 12), _messages(12, 12))
    assert compiled == 0 and ctl.stats().compilations_after_warmup == 0
    weights = ctl.stats().weights
    assert (weights.version, weights.since_step, weights.since_messages, weights.swaps) == \
        ("v2", batches_before[0], 12, 1)


def test_a_swap_offered_from_another_thread_applies_before_the_next_batch():
    def swap(ctl: Controller) -> None:
        thread = threading.Thread(target=ctl.set_weights, args=(NEW,))
        thread.start()
        thread.join()

    ctl, results, compiled = _run(CONFIG, swap)
    assert results == _reference(_messages(0, 12), _messages(12, 12)) and compiled == 0
    weights = ctl.stats().weights
    assert weights.version == weights.digest and weights.swaps == 1  # no version given: named by its digest


def test_the_checkpoint_names_the_weights_its_state_was_produced_with(tmp_path):
    offered: list[str] = []
    ctl, _, _ = _run(CONFIG.replace(checkpoint_dir=str(tmp_path)),
                     lambda ctl: offered.append(ctl.set_weights(NEW, version="retrained-2")))
    header, _ = read_checkpoint(list_checkpoints(tmp_path)[-1])  # the stop's checkpoint
    recorded = header["settings"]["weights"]
    assert recorded == {"version": "retrained-2", "digest": ctl.stats().weights.digest, "since_step": 4,
                        "since_messages": 12, "swaps": 1}


@pytest.mark.parametrize("restore_shared", [False, True])
def test_a_checkpoint_of_swapped_weights_with_a_0_d_leaf_restores_on_the_next_start(tmp_path, restore_shared):
    """The params hold a 0-d leaf ("b"): the checkpoint keeps it 0-d, so the same program's next start
    restores its state, and with restore_shared=True its swapped weights and their version too."""
    # the same step: its compilation is reused
    processor = PROCESSOR._replace(description=Description(name="weighted-sum", restore_shared=restore_shared))
    config = CONFIG.replace(checkpoint_dir=str(tmp_path))
    fake = FakeIO()
    with Controller(config, processor=processor, runtime=Runtime(io_factory=fake)) as ctl:
        _feed(fake, ctl, _messages(0, 12))
        ctl.set_weights(NEW, version="v2")
        _feed(fake, ctl, _messages(12, 12))
    acc = np.asarray(ctl.state.rows["acc"]).copy()
    with Controller(config, processor=processor, runtime=Runtime(io_factory=FakeIO())) as again:
        assert again.restored_from is not None and again.stats().restored_processed == 24  # counters start at 0
        np.testing.assert_array_equal(np.asarray(again.state.rows["acc"]), acc)  # every stream's running sum
        b, weights = again.state.params["b"], again.stats().weights
        assert np.shape(b) == () and float(b) == float(NEW["b"] if restore_shared else OLD["b"])
        assert weights.version == ("v2" if restore_shared else "init")


@pytest.mark.parametrize(("params", "named"), [
    ({"w": np.zeros(3, np.float32), "b": np.float32(0)}, "params['w'] is float32[3], and the compiled step "
                                                         "takes float32[2]"),
    ({"w": np.zeros(2, np.float64), "b": np.float32(0)}, "params['w'] is float64[2]"),
    ({"w": np.zeros(2, np.float32)}, "tree structure"),
    ({"w": [1.0, 2.0], "b": np.float32(0)}, "tree structure"),  # a list is a container, not an array
])
def test_a_swap_of_other_shapes_dtypes_or_structure_is_refused_naming_what_differs(params, named):
    fake = FakeIO()
    with Controller(CONFIG, processor=PROCESSOR, runtime=Runtime(io_factory=fake)) as ctl:
        with pytest.raises(ValueError, match="set_weights") as raised:
            ctl.set_weights(params)
        assert named in str(raised.value)
        assert ctl.stats().weights.version == "init" and ctl.stats().weights.swaps == 0


class _Idle:
    name = "idle"

    async def run(self, ctx: Any) -> None:
        pass


def test_set_weights_is_refused_where_there_are_no_weights_to_swap():
    with pytest.raises(RuntimeError, match="call start"):
        Controller(CONFIG, processor=PROCESSOR, runtime=Runtime(io_factory=FakeIO())).set_weights(NEW)
    with Controller(CONFIG, processor=ewma_processor(), runtime=Runtime(io_factory=FakeIO())) as ctl:
        assert ctl.stats().weights is None
        with pytest.raises(ValueError, match="not a StreamState"):
            ctl.set_weights(NEW)
    events_only = Controller(Config(max_streams=8), processor=EVENTS_ONLY, sources=[_Idle()])
    with pytest.raises(RuntimeError, match="events-only controller runs no processor"):
        events_only.set_weights(NEW)


def test_set_weights_out_of_order_is_refused_naming_the_state_and_nothing_is_offered():
    ctl = Controller(CONFIG, processor=PROCESSOR, runtime=Runtime(io_factory=FakeIO()))
    ctl.compile()  # compiled, not started: still refused (no step will run until start(), and start() may restore)
    with pytest.raises(RuntimeError, match=r"set_weights\(\): call start\(\)"):
        ctl.set_weights(NEW)
    assert not ctl.engine.live_weights.pending
    with ctl:
        pass
    with pytest.raises(RuntimeError, match=r"set_weights\(\): the controller has stopped") as raised:
        ctl.set_weights(NEW, version="late")  # no step would ever apply them
    assert "send()" not in str(raised.value)
    with pytest.raises(RuntimeError, match="has stopped"):  # send() refuses the same way
        ctl.send("0", "frame")
    weights = ctl.stats().weights
    assert (weights.version, weights.swaps) == ("init", 0) and not ctl.engine.live_weights.pending


def test_weights_offered_but_never_applied_before_the_stop_are_logged(caplog):
    with Controller(CONFIG, processor=PROCESSOR, runtime=Runtime(io_factory=FakeIO())) as ctl:
        assert ctl.set_weights(NEW, version="v9") == "v9"  # no batch comes after them
    assert ctl.stats().weights.version == "init"
    assert any("weights 'v9'" in r.getMessage() and "never applied" in r.getMessage() for r in caplog.records)


SEVERAL_DEVICES = """
from tests.controller import test_live_weights as t
ctl, results, compiled = t._run(t.CONFIG.replace(devices=2), lambda ctl: ctl.set_weights(t.NEW, version="v2"))
assert len(ctl.stats().devices) == 2, ctl.stats().devices
assert results == t._reference(t._messages(0, 12), t._messages(12, 12)), results
print("swapped on", len(ctl.stats().devices), "devices;", compiled, "compiled;", ctl.stats().weights.version)
"""


def test_a_swap_on_several_devices_puts_the_weights_on_every_device_and_compiles_nothing():
    proc = run_app(env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, program=("-c", SEVERAL_DEVICES),
                   timeout_s=120 * UNIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "swapped on 2 devices; 0 compiled; v2" in proc.stdout
