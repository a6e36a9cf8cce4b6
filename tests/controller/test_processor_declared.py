"""What a processor declares to the core: the counters it wants kept (an output summed per batch
over the finite messages, kept across a restore) and the settings its checkpoints record (matched
on restore, or recorded only). The default detector declares ``anomalies`` and records alpha,
threshold and warm-up; a processor that declares nothing gets neither."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

from forkless import Runtime
from forkless.controller.checkpoints.checkpoint import list_checkpoints, read_checkpoint
from forkless.controller.config import Config
from forkless.controller.declared import Description
from forkless.controller.device.compiled import compilations
from forkless.controller.errors import CheckpointMismatch, ProcessorContractError
from forkless.controller.loop import Controller
from forkless.controller.metrics import metric_families
from forkless.controller.processor import Processor, default_processor
from forkless.controller.stats import status_line
from tests.controller.test_loop import chunk, process_all
from tests.fake_io import FakeIO, drain

F = 2
NAN_AT = 13.0  # a message with this x[0] gives a non-finite output: it is refused, never counted


def config(directory: Path, **changes) -> Config:
    return Config(features=F, max_batch=4, max_streams=8, max_wait_ms=0.0, status_s=0.0,
                  checkpoint_dir=str(directory), **changes)


class Totals(NamedTuple):
    total: jax.Array  # float32 [S + 1, F]: per stream


def spike_counter(limit: float = 5.0, *, declare: bool = True) -> Processor:
    """Per stream the running total of x; ``spike`` when x[0] > ``limit``, counted as "spikes"
    (and ``limit``, which decides what a spike is, declared as a setting) when ``declare``."""

    def init(cfg):
        return Totals(jnp.zeros((cfg.max_streams + 1, cfg.features), jnp.float32))

    def step(state, batch):
        spare = state.total.shape[0] - 1
        key = jnp.where(batch.valid, batch.key, spare)
        total = state.total[key] + batch.x  # one message per stream per batch in these tests
        poison = jnp.where(batch.x[:, :1] == NAN_AT, jnp.nan, 1.0)
        spike = (batch.x[:, 0] > limit) & batch.valid
        return Totals(state.total.at[key].set(total)), {"out": total * poison, "spike": spike}

    if not declare:
        return Processor(init, step, description=Description(name="spikes"))
    return Processor(init, step, description=Description(name="spikes", counters={"spikes": "spike"},
                                                         settings={"limit": limit}))


def run(directory: Path, processor: Processor | None, messages: list[float], **changes):
    """One run of stream "a" over ``messages`` (one a batch); the final snapshot and the
    controller; the stop writes a checkpoint."""
    fake = FakeIO()
    with Controller(config(directory, **changes), processor=processor, runtime=Runtime(io_factory=fake)) as ctl:
        for i, x in enumerate(messages):
            fake.inbound.put_nowait(chunk([i], ["a"], [[x, 0.0]]))
            process_all(ctl)
    drain(fake.outbound)
    return ctl.stats(), ctl


class Header(NamedTuple):
    counts: dict
    settings: dict


def newest(directory: Path) -> Header:
    """The newest checkpoint's counts and settings, as written."""
    header, _ = read_checkpoint(list_checkpoints(directory)[-1])
    return Header(header["counts"], header["settings"])


def test_a_declared_counter_sums_its_output_over_the_finite_messages(tmp_path):
    snap, _ = run(tmp_path, spike_counter(), [1.0, 6.0, 7.0, NAN_AT, 2.0])
    assert snap.counters == {"spikes": 2}  # 6 and 7; 13 is a spike but its result is non-finite
    assert snap.errors == {"non-finite result": 1}


def test_a_declared_counter_is_in_the_status_line_and_the_metrics(tmp_path):
    snap, _ = run(tmp_path, spike_counter(), [6.0, 7.0])
    assert "| spikes 2 |" in status_line(snap, None)
    assert "anomalies" not in status_line(snap, None)
    families = {fam.name: fam for fam in metric_families(snap)}
    assert "forkless_anomalies" not in families
    assert [(s.labels, s.value) for s in families["forkless_processor_counts"].samples] == \
        [({"name": "spikes"}, 2.0)]


def test_a_declared_counter_is_in_the_checkpoint_and_restored_from_it(tmp_path):
    run(tmp_path, spike_counter(), [6.0, 7.0, 1.0])
    assert newest(tmp_path).counts == {"processed": 3, "spikes": 2}
    snap, _ = run(tmp_path, spike_counter(), [8.0])
    # this process's counters start at 0; what the checkpoint counted is restored beside them, and the stop's
    # checkpoint records the sum
    assert snap.counters == {"spikes": 1} and snap.processed == 1
    assert snap.restored_counters == {"spikes": 2} and snap.restored_processed == 3
    assert newest(tmp_path).counts == {"processed": 4, "spikes": 3}


def test_a_declared_setting_is_recorded_and_another_value_is_refused_at_restore(tmp_path):
    run(tmp_path, spike_counter(limit=5.0), [6.0])
    assert newest(tmp_path).settings["limit"] == 5.0
    ctl = Controller(config(tmp_path), processor=spike_counter(limit=3.0), runtime=Runtime(io_factory=FakeIO()))
    before = compilations()
    with pytest.raises(CheckpointMismatch) as raised:
        ctl.start()
    assert (raised.value.setting, raised.value.saved, raised.value.current) == ("limit", 5.0, 3.0)
    assert compilations() == before  # refused before anything was compiled


def test_a_processor_declaring_nothing_records_no_detector_settings_and_no_counts_of_its_own(tmp_path):
    snap, _ = run(tmp_path, spike_counter(declare=False), [6.0])
    restored = newest(tmp_path)
    assert restored.counts == {"processed": 1}
    assert not {"alpha", "threshold", "warmup", "anomalies", "limit"} & set(restored.settings)
    assert snap.counters == {} and snap.anomalies == 0
    assert "anomalies" not in status_line(snap, None)


def test_the_default_detector_counts_anomalies_and_records_its_settings(tmp_path):
    snap, _ = run(tmp_path, None, [0.0] * 3 + [50.0], warmup=2)
    assert snap.counters == {"anomalies": 1} and snap.anomalies == 1
    assert "| anomalies 1 |" in status_line(snap, None)
    assert {fam.name: fam for fam in metric_families(snap)}["forkless_anomalies"].samples[0].value == 1
    restored = newest(tmp_path)
    assert restored.counts == {"processed": 4, "anomalies": 1}
    assert {k: restored.settings[k] for k in ("alpha", "threshold", "warmup")} == \
        {"alpha": 0.05, "threshold": 4.0, "warmup": 2}


def test_the_default_detectors_settings_are_recorded_only_so_tuning_them_keeps_the_state(tmp_path):
    run(tmp_path, None, [0.0] * 3 + [50.0], warmup=2)
    snap, ctl = run(tmp_path, None, [0.0], warmup=5, alpha=0.1, threshold=3.0)
    assert ctl.restored_from is not None
    assert (snap.restored_counters["anomalies"], snap.restored_processed, snap.processed) == (1, 4, 1)
    assert newest(tmp_path).counts == {"processed": 5, "anomalies": 1}


def test_an_old_default_checkpoint_with_anomalies_in_its_counts_restores_them(tmp_path):
    # what any checkpoint of the default detector holds, before and after the counters were declared
    run(tmp_path, default_processor(config(tmp_path, warmup=2)), [0.0] * 3 + [50.0], warmup=2)
    snap, _ = run(tmp_path, None, [], warmup=2)
    assert snap.restored_counters == {"anomalies": 1} and snap.anomalies == 0


def test_a_counter_of_an_output_the_step_does_not_return_is_refused_when_compiling(tmp_path):
    made = spike_counter()
    wrong = made._replace(description=dataclasses.replace(made.description, counters={"spikes": "spiky"}))
    with pytest.raises(ProcessorContractError, match=r"counter 'spikes'.*output 'spiky'.*'out', 'spike'"):
        Controller(Config(features=F), processor=wrong, runtime=Runtime(io_factory=FakeIO())).start()


def test_a_counter_of_a_float_output_is_refused_when_compiling(tmp_path):
    made = spike_counter()
    wrong = made._replace(description=dataclasses.replace(made.description, counters={"totals": "out"}))
    with pytest.raises(ProcessorContractError, match=r"counter 'totals'.*output 'out' is float32.*bool or int"):
        Controller(Config(features=F), processor=wrong, runtime=Runtime(io_factory=FakeIO())).start()


@pytest.mark.parametrize("declared, what", [
    (dict(counters={"processed": "spike"}), "counter 'processed'"),
    (dict(settings={"features": 3}), "setting 'features'"),
    (dict(settings={"limit": object()}), "setting 'limit'"),
], ids=["counter-processed", "setting-features", "setting-not-json"])
def test_a_declaration_the_core_cannot_keep_is_refused_when_the_description_is_built(declared, what):
    with pytest.raises(ProcessorContractError, match=what):
        Description(name="spikes", **declared)
