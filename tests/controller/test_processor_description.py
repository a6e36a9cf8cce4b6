"""A processor is ``Processor(init, step, description=Description(...))``: the description is a
frozen, typed value checked when it is built (an error names the field and what is allowed), the
spelling before it (``Processor(init, step, name=...)``, removed in 0.2.0) raises naming the new one,
any other object is refused naming ``Processor``, and
checkpoints written before the description restore into processors written with it
(tests/data/before_description: written by the code before it, ``tests/controller/test_processor_declared.py``'s
runs)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

from forkless import CheckpointMismatch, Controller, Description, Processor, ProcessorContractError, Runtime
from forkless.controller.config import Config
from forkless.controller.processor import default_processor, ewma_processor, stream_processor
from tests.controller.test_processor_declared import config, run, spike_counter
from tests.fake_io import FakeIO

BEFORE = Path(__file__).resolve().parents[1] / "data" / "before_description"


def _init(shape: Any) -> Any:
    return jnp.zeros((shape.max_streams + 1,), jnp.float32)


def _step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    return state, {"x": batch.x}


# ---- the Description: typed, frozen, checked when built -----------------------------------------


@pytest.mark.parametrize("fields, names", [
    (dict(name=3), r"Description\(name=3\): name is what the processor is, a non-empty str"),
    (dict(name=""), r"Description\(name=''\): name is .* a non-empty str"),
    (dict(name="x", version=2), r"processor 'x': Description\(version=2\): version is a non-empty str"),
    (dict(per_stream="yes"), r"Description\(per_stream='yes'\): per_stream is True or False"),
    (dict(restore_shared=1), r"Description\(restore_shared=1\): restore_shared is True or False"),
    (dict(input_dtype=np.int32), r"input_dtype .*int32.* is not supported: .*float32 \(the default\) or float64"),
    (dict(counters=["spike"]), r"counters must be a mapping \(a dict\), got list"),
    (dict(counters={"spikes": 1}), r"counters must map a counter's name to an output's name, both strings"),
    (dict(counters={"processed": "spike"}), r"counter 'processed' is a count the controller keeps itself"),
    (dict(settings={"max_streams": 3}), r"setting 'max_streams' is one the controller records itself"),
    (dict(recorded={"when": object()}), r"setting 'when' = .* cannot be written into a checkpoint"),
    (dict(settings={"a": 1}, recorded={"a": 2}), r"setting 'a' is both in settings \(matched\) and in recorded"),
], ids=["name-int", "name-empty", "version-int", "per-stream-str", "restore-shared-int", "input-dtype-int32",
        "counters-list", "counter-output-int", "counter-processed", "setting-core-name", "recorded-not-json",
        "setting-and-recorded"])
def test_a_description_refuses_a_wrong_field_when_built_naming_it_and_what_is_allowed(fields, names):
    with pytest.raises(ProcessorContractError, match=names):
        Description(**fields)


def test_a_description_is_frozen_and_a_replaced_field_is_checked_as_building_checks_it():
    about = Description(name="ewma")
    with pytest.raises(dataclasses.FrozenInstanceError):
        about.name = "other"  # type: ignore[misc]
    assert dataclasses.replace(about, version="2").version == "2"
    with pytest.raises(ProcessorContractError, match="version is a non-empty str"):
        dataclasses.replace(about, version=2)


def test_a_description_keeps_its_values_typed_and_its_mappings_read_only():
    counters = {"spikes": "spike"}
    about = Description(name="spikes", input_dtype=jnp.float64, counters=counters, settings=None)
    counters["more"] = "spike"  # the caller's dict changing later changes nothing
    assert about.input_dtype == np.dtype(np.float64) and isinstance(about.input_dtype, np.dtype)
    assert dict(about.counters) == {"spikes": "spike"} and dict(about.settings) == {}
    with pytest.raises(TypeError):
        about.counters["other"] = "spike"  # type: ignore[index]
    assert about == Description(name="spikes", input_dtype="float64", counters={"spikes": "spike"})
    assert hash(about) == hash(Description(name="spikes", input_dtype="float64", counters={"spikes": "spike"}))


def test_the_default_detector_describes_itself_in_the_new_form():
    assert default_processor(Config()).description == ewma_processor().description == Description(
        name="ewma", counters={"anomalies": "anomaly"}, recorded={"alpha": 0.05, "threshold": 4.0, "warmup": 20})


# ---- the spelling before the Description --------------------------------------------------------
# Removed in 0.2.0 (deprecated in 0.1.0): each old spelling raises naming the Description's, tests/controller/
# test_renamed.py (the one deprecation policy).


def test_an_old_field_beside_the_description_is_refused_naming_the_description_spelling():
    with pytest.raises(TypeError, match=r"Processor\(init, step, counters=\{'processed': 'x'\}\) was removed in "
                                        r"forkless 0\.2\.0: write Processor\(init, step, description=Description\("):
        Processor(_init, _step, counters={"processed": "x"})
    with pytest.raises(TypeError, match=r"Description\(per_stream=False\)"):  # the old third positional field
        Processor(_init, _step, False)


@pytest.mark.parametrize("build, says", [
    (lambda: Processor(_init, _step, description=Description(), name="x"),
     "Processor(init, step, name='x') was removed in forkless 0.2.0"),
    (lambda: Processor(_init, _step, nmae="x"),
     "unexpected keyword 'nmae': it takes init, step and description=Description(...)"),
    (lambda: Processor(_init, "step"), "init and step are functions"),
    (lambda: stream_processor(lambda p, r, x: (r, {}), init_row=_init, per_stream=True),
     "stream_processor got an unexpected keyword 'per_stream'"),
], ids=["description-and-old-keyword", "misspelt-keyword", "step-not-callable", "helper-per-stream"])
def test_a_processor_built_wrongly_is_a_type_error_naming_what_is_taken(build, says):
    with pytest.raises(TypeError, match=says.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        build()


def test_an_object_that_is_no_processor_is_refused_naming_processor_and_its_description():
    class OwnProcessor(NamedTuple):  # how one was written before: init, step and the fields as attributes
        init: Any
        step: Any
        name: str = "mine"

    with pytest.raises(TypeError, match=r"a processor is a forkless\.Processor\(init, step, "
                                        r"description=Description\(\.\.\.\)\); got OwnProcessor"):
        Controller(Config(features=2), processor=OwnProcessor(_init, _step), runtime=Runtime(io_factory=FakeIO()))


# ---- checkpoints written before the Description --------------------------------------------------


def test_a_checkpoint_written_before_the_description_restores_its_identity_counters_and_settings(tmp_path):
    # written by the code before the Description: spike_counter(limit=5.0) over 6, 7, 1 (two spikes)
    shutil.copytree(BEFORE / "spikes", tmp_path, dirs_exist_ok=True)
    snap, ctl = run(tmp_path, spike_counter(limit=5.0), [8.0])
    assert ctl.recovery.restored_from is not None and "ckpt-000000000.fkc" in ctl.recovery.restored_from
    # this process's counters start at 0; what the checkpoint had counted is restored beside them
    assert snap.counters == {"spikes": 1} and snap.processed == 1
    assert snap.restored_counters == {"spikes": 2} and snap.restored_processed == 3


def test_the_default_detector_restores_a_checkpoint_written_before_the_description(tmp_path):
    # written by the code before the Description: the default detector (warm-up 2) over 0, 0, 0, 50
    shutil.copytree(BEFORE / "ewma", tmp_path, dirs_exist_ok=True)
    snap, ctl = run(tmp_path, default_processor(config(tmp_path, warmup=2)), [50.0], warmup=2)
    assert ctl.recovery.restored_from is not None
    # as one run over all five: a fresh state would not be warm at 50 (one anomaly, not two)
    whole, _ = run(tmp_path / "whole", default_processor(config(tmp_path, warmup=2)), [0.0] * 3 + [50.0] * 2,
                   warmup=2)
    assert (snap.restored_counters["anomalies"] + snap.anomalies, snap.restored_processed + snap.processed) == (
        whole.anomalies, whole.processed) == (2, 5)


def test_a_checkpoint_written_before_the_description_is_refused_by_another_version(tmp_path):
    shutil.copytree(BEFORE / "spikes", tmp_path, dirs_exist_ok=True)
    made = spike_counter(limit=5.0)
    other = made._replace(description=dataclasses.replace(made.description, version="2"))
    ctl = Controller(config(tmp_path), processor=other, runtime=Runtime(io_factory=FakeIO()))
    with pytest.raises(CheckpointMismatch, match="processor_version"):
        ctl.start()
