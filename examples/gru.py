"""A per-symbol GRU: one recurrent hidden state per stream, weights from a ``.npz`` file.

Each stream (a symbol, say) keeps its own hidden state ``h`` [hidden]; each message ``x``
[features] updates it with one GRU cell (the weights are shared by every stream), and the
step answers with the new hidden state, a prediction of the stream's next message (a linear
read-out of ``h``) and how far this message was from the prediction made before it:

    z = sigmoid(x W_xz + b_xz + h W_hz + b_hz)          update gate
    r = sigmoid(x W_xr + b_xr + h W_hr + b_hr)          reset gate
    n = tanh(x W_xn + b_xn + r * (h W_hn + b_hn))       candidate
    h' = (1 - z) * n + z * h
    outputs: h = h', prediction = h' W_out + b_out, surprise = max |x - (h W_out + b_out)|

The weights are plain numpy arrays in a ``.npz`` file (no model library needed):
``w_x`` [F, 3H] and ``b_x`` [3H] (gates z, r, n side by side), ``w_h`` [H, 3H], ``b_h`` [3H],
``w_out`` [H, F], ``b_out`` [F]. Train them anywhere and ``np.savez`` them; or make a file
of random ones to try it: ``save_random_weights("gru.npz", features=2, hidden=16)``.

Embed it (the default JSON codec sends every output back; an ``OnResults`` sink sees them first)::

    from forkless import Config, Controller, OnResults
    from examples.gru import gru_processor

    def on_results(seq, stream, outputs):
        for s, name, surprise in zip(seq, stream, outputs["surprise"]):
            if surprise > 3.0:
                print("surprising", name, s)

    config = Config.from_env(features=2)
    Controller(config, processor=gru_processor("gru.npz", features=2, hidden=16),
               sinks=[OnResults(on_results)]).run()

The processor is built with ``controller.processor.stream_processor``: ``gru_row_step``
handles one message of one stream, the helper runs a batch of them (a stream repeated in a
batch in arrival order) at O(batch) cost. The weights are the state's shared leaves (state:
``StreamState(params=weights, rows=h [max_streams + 1, hidden])``), passed to the step as
arguments, never baked into the compiled code; with ``restore_shared=False`` a restart
takes them from the file again, the hidden states from the checkpoint.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from forkless.controller.declared import Description
from forkless.controller.processor import Processor, StateShape, stream_processor

__all__ = ["gru_processor", "gru_row_step", "load_weights", "save_random_weights"]


def weight_shapes(features: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The arrays a weights file holds and their shapes."""
    return {"w_x": (features, 3 * hidden), "b_x": (3 * hidden,), "w_h": (hidden, 3 * hidden),
            "b_h": (3 * hidden,), "w_out": (hidden, features), "b_out": (features,)}


def save_random_weights(path: str | os.PathLike[str], *, features: int, hidden: int, seed: int = 0,
                        scale: float = 0.5) -> None:
    """Write a weights file of random float32 arrays (uniform in ±scale/sqrt(fan-in), biases 0)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(features, hidden).items():
        if name.startswith("b_"):
            weights[name] = np.zeros(shape, np.float32)
        else:
            bound = scale / np.sqrt(shape[0])
            weights[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    np.savez(path, **weights)


def load_weights(path: str | os.PathLike[str], *, features: int, hidden: int) -> dict[str, np.ndarray]:
    """The weights in ``path`` as float32 numpy arrays; ``ValueError`` naming the array whose
    shape does not fit ``features`` and ``hidden``, or that is missing."""
    with np.load(path) as data:
        found = {name: data[name] for name in data.files}
    weights = {}
    for name, shape in weight_shapes(features, hidden).items():
        if name not in found:
            raise ValueError(f"{path}: no array {name!r} (a GRU weights file holds "
                             f"{', '.join(weight_shapes(features, hidden))})")
        if found[name].shape != shape:
            raise ValueError(f"{path}: {name} has shape {list(found[name].shape)}, expected {list(shape)} "
                             f"for features={features}, hidden={hidden}")
        weights[name] = np.asarray(found[name], np.float32)
    return weights


def gru_row_step(params: dict[str, jax.Array], h: jax.Array, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One message ``x`` [F] of one stream: its hidden state ``h`` [H] after, and the outputs."""
    x = x.astype(jnp.float32)
    hidden = h.shape[0]
    gx = x @ params["w_x"] + params["b_x"]
    gh = h @ params["w_h"] + params["b_h"]
    z = jax.nn.sigmoid(gx[:hidden] + gh[:hidden])
    r = jax.nn.sigmoid(gx[hidden:2 * hidden] + gh[hidden:2 * hidden])
    n = jnp.tanh(gx[2 * hidden:] + r * gh[2 * hidden:])
    new_h = (1.0 - z) * n + z * h
    expected = h @ params["w_out"] + params["b_out"]  # what the stream's last message predicted
    return new_h, {"h": new_h, "prediction": new_h @ params["w_out"] + params["b_out"],
                   "surprise": jnp.max(jnp.abs(x - expected))}


def gru_processor(weights_path: str | os.PathLike[str], *, features: int, hidden: int) -> Processor:
    """The per-stream GRU with the weights in ``weights_path`` (read now, so a bad file fails
    here); the configuration's features (``shape.features``) must equal ``features``. Named "gru"."""
    weights = load_weights(weights_path, features=features, hidden=hidden)

    def init_params(shape: StateShape) -> dict[str, np.ndarray]:
        if shape.features != features:
            raise ValueError(f"gru_processor: the weights in {weights_path} take {features} features, "
                             f"the configuration has FORKLESS_FEATURES={shape.features}")
        return weights

    def init_row(shape: StateShape) -> jax.Array:
        return jnp.zeros((hidden,), jnp.float32)

    return stream_processor(gru_row_step, init_row=init_row, init_params=init_params,
                            description=Description(name="gru"))


if __name__ == "__main__":  # python examples/gru.py [PATH]: write a file of random weights to try it
    import sys

    target = sys.argv[1] if len(sys.argv) > 1 else "gru.npz"
    save_random_weights(target, features=2, hidden=16)
    print(f"wrote random GRU weights (features=2, hidden=16) to {target}")
