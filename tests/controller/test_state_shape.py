"""What a processor's ``init`` is handed: a ``StateShape`` (max_streams, features), not the whole ``Config``.

A processor that reads ``features`` and ``max_streams`` runs unchanged; one that reads any other setting gets an
``AttributeError`` naming the fix (pass it when the processor is built), wherever the controller calls ``init``:
the compile (one device), the stream processor's ``init_row``/``init_params``."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from forkless.controller.config import Config
from forkless.controller.declared import Description
from forkless.controller.loop import Controller
from forkless.controller.processor import Processor, StateShape, ewma_processor, stream_processor

F = 3


def _counting(seen: list) -> Processor:
    """A processor whose init keeps what it was handed and builds its table from features and max_streams."""

    def init(shape):
        seen.append(shape)
        return {"total": jnp.zeros((shape.max_streams + 1, shape.features), jnp.float32)}

    def step(state, batch):
        key = jnp.where(batch.valid, batch.key, state["total"].shape[0] - 1)
        rows = state["total"][key] + batch.x
        return {"total": state["total"].at[key].set(rows)}, {"total": rows}

    return Processor(init, step, description=Description(name="counting"))


def test_init_is_handed_the_state_shape_and_a_processor_reading_features_and_max_streams_compiles():
    seen: list = []
    ctl = Controller(Config(features=F, max_streams=16, max_batch=4), processor=_counting(seen))
    ctl.compile()
    assert seen and all(isinstance(shape, StateShape) for shape in seen)
    assert StateShape(max_streams=16, features=F) in seen


def test_an_init_reading_another_setting_gets_an_attribute_error_that_names_the_fix():
    def init(config):
        return {"mean": jnp.zeros((config.max_streams + 1, config.features)) * config.alpha}

    proc = Processor(init, lambda state, batch: (state, {"x": batch.x}), description=Description(name="reads-alpha"))
    ctl = Controller(Config(features=F, max_batch=4), processor=proc)
    with pytest.raises(AttributeError, match=r"'alpha'.*StateShape\(max_streams, features\).*when you build the "
                                             r"processor.*functools\.partial"):
        ctl.compile()


def test_a_stream_processor_s_init_row_and_init_params_are_handed_the_state_shape_too():
    seen: list = []

    def init_row(shape):
        seen.append(shape)
        return jnp.zeros((shape.features,), jnp.float32)

    def init_params(shape):
        seen.append(shape)
        return {"scale": np.ones((shape.features,), np.float32)}

    proc = stream_processor(lambda params, row, x: (row + x * params["scale"], {"y": row}), init_row=init_row,
                            init_params=init_params, description=Description(name="scaled"))
    Controller(Config(features=F, max_streams=8, max_batch=4), processor=proc).compile()
    assert seen and all(shape == StateShape(8, F) for shape in seen if shape.max_streams == 8)
    assert all(isinstance(shape, StateShape) for shape in seen)


def test_a_setting_passed_when_the_processor_is_built_is_the_fix_the_message_names():
    def build(shape, *, alpha):  # the setting bound at build time, the shape at init
        return {"mean": jnp.full((shape.max_streams + 1, shape.features), alpha, jnp.float32)}

    cfg = Config(features=F, max_batch=4, alpha=0.25)
    proc = Processor(functools.partial(build, alpha=cfg.alpha), lambda state, batch: (state, {"x": batch.x}),
                     description=Description(name="bound"))
    Controller(cfg, processor=proc).compile()


def test_the_state_shape_is_small_frozen_and_names_other_attributes_in_its_error():
    shape = StateShape.of(Config(features=F, max_streams=32))
    assert (shape.max_streams, shape.features) == (32, F)
    with pytest.raises(AttributeError, match=r"threshold"):
        shape.threshold  # noqa: B018
    with pytest.raises(AttributeError):
        shape.features = 2  # frozen
    assert ewma_processor().init(shape).mean.shape == (33, F)
