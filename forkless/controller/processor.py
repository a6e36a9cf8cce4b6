"""Processors: a pure ``(init, step)`` pair, JAX style, its ``Description``, and the default EWMA z-score detector.

The contract a processor keeps is docs/embedding/contract.md. The rules the controller relies on:
- ``init(shape) -> state``, ``shape`` a ``StateShape`` (sizes only: a processor's own settings are closed over
  when it is built). Per-stream leaves have ``max_streams + 1`` rows, the last the spare slot padding rows point
  at, all equal at the start: a recycled slot is reset to that row (``reset_rows``).
- ``step(state, batch) -> (state, outputs)`` is pure and jitted with the state donated: a caller keeps only the
  state it returns. Padding rows (``valid=False``) change nothing; outputs have leading axis B.
- A step costs O(B), not O(max_streams): gather the batch's rows once, compute on [B, ...], scatter once. Never
  carry the table through a ``while_loop``/``scan`` or build a new [S + 1, ...] array. Keep every read of the table
  ahead of the write: a gathered row used directly may be fused after the scatter, and XLA then copies the whole
  table (``compiled.as_text()`` shows the ``copy``).
- Write only the batch's rows of a per-stream leaf: a checkpoint copied between steps saves exactly those first.
- On several devices each device's step sees its shard: take the spare row from ``leaf.shape[0] - 1``, never from
  ``shape.max_streams``; shared leaves come back unchanged; a step that mixes streams says ``per_stream=False``.
- The modules read the ``Description`` as typed attributes through ``description_of``, never with ``getattr``.

``stream_processor`` batches a per-row ``row_step(params, row, x) -> (row, out)``: a stream repeated in a batch
runs in arrival order (round k runs every stream's k-th message at once, ``jax.vmap``), O(B · rounds); ``params``
(shared, never per-stream) are passed in unchanged. An output that follows from others alone (a score from z) is
cheaper computed once on the step's outputs, as the EWMA does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from forkless.controller.declared import Description
from forkless.controller.errors import ProcessorContractError
from forkless.io_loop.renamed import removed

__all__ = ["EWMAState", "Processor", "StateShape", "StreamState", "default_processor",
           "description_of", "ewma_processor", "reset_rows", "row_template", "stream_processor"]

EPS = 1e-6


@dataclass(frozen=True)
class StateShape:
    """What ``init`` (and a stream processor's ``init_row``/``init_params``) is handed: the sizes of
    the state, nothing else. ``max_streams`` (FORKLESS_MAX_STREAMS): a per-stream leaf has
    ``max_streams + 1`` rows; ``features`` (FORKLESS_FEATURES): a message's x is [features]. Any
    other setting a processor needs is given when it is built (module docstring)."""

    max_streams: int
    features: int

    @classmethod
    def of(cls, config: Any) -> StateShape:
        """The shape of a configuration's state (a ``Config``, or anything with the two fields)."""
        return cls(max_streams=config.max_streams, features=config.features)

    def __getattr__(self, name: str) -> Any:  # only for a name the two fields are not
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{name!r}: a processor's init is handed a StateShape(max_streams, features), not the whole Config; "
            f"pass any other setting when you build the processor (an argument of your builder, as "
            f"ewma_processor(alpha=..., threshold=..., warmup=...) takes the detector's, closed over by init, "
            f"or functools.partial(init, {name}=config.{name}))", name=name, obj=self)


class _Functions(NamedTuple):
    init: Callable[[StateShape], Any]  # the state from its shape (module docstring)
    step: Callable[[Any, Any], tuple[Any, dict[str, Any]]]
    description: Description = Description()  # frozen: one default shared by every processor


# the fields a Processor carried itself before its Description, in their positional order, each refused naming
# its Description spelling (io_loop/renamed.py)
BEFORE_DESCRIPTION = ("per_stream", "name", "version", "restore_shared", "input_dtype", "counters", "settings",
                      "recorded")


class Processor(_Functions):
    """A model the controller can run: two pure functions, like an optax transform, and its ``Description``
    (controller/declared.py), read as typed attributes: ``processor.description.name``. The fields it carried
    itself before the Description each raise naming their ``Description`` spelling."""

    __slots__ = ()

    def __new__(cls, init: Callable[[StateShape], Any], step: Callable[[Any, Any], tuple[Any, dict[str, Any]]],
                description: Description | None = None, *before: Any, **before_keywords: Any) -> Processor:
        if not callable(init) or not callable(step):
            raise TypeError(f"Processor(init, step, description=Description(...)): init and step are functions, "
                            f"got init={init!r}, step={step!r}")
        if description is not None and not isinstance(description, Description):
            before = (description, *before)  # the old third positional field, per_stream
            description = None
        if before or before_keywords:
            spelt = _spelt(_named(before, before_keywords))
            raise removed("Processor(init, step, name=..., ...)", old=f"Processor(init, step, {spelt})",
                          new=f"Processor(init, step, description=Description({spelt}))")
        return super().__new__(cls, init, step, Description() if description is None else description)

    def _replace(self, **changes: Any) -> Processor:
        """A copy with ``changes`` (``init``, ``step``, ``description``)."""
        before = {name: changes[name] for name in BEFORE_DESCRIPTION if name in changes}
        if before:
            spelt = _spelt(before)
            raise removed("processor._replace(name=...)", old=f"processor._replace({spelt})",
                          new=f"processor._replace(description=dataclasses.replace(processor.description, {spelt}))")
        if not isinstance(changes.get("description", self.description), Description):
            raise TypeError(f"processor._replace(description={changes['description']!r}): a Description")
        return super()._replace(**changes)

    def __getattr__(self, name: str) -> Any:  # only for a name the three fields are not
        if name not in BEFORE_DESCRIPTION:
            raise AttributeError(f"'Processor' object has no attribute {name!r}", name=name, obj=self)
        raise removed("processor.name", old=f"processor.{name}", new=f"processor.description.{name}",
                      error=AttributeError)


def description_of(processor: Processor) -> Description:
    """``processor.description``, the one way the modules read what a processor declares;
    ``TypeError`` naming ``Processor`` for any other object, however it looks: refused, not guessed at."""
    if not isinstance(processor, Processor):
        raise TypeError(f"a processor is a forkless.Processor(init, step, description=Description(...)); got "
                        f"{type(processor).__name__} {processor!r}: build one with Processor(its init, its step, "
                        f"description=Description(name=..., ...)) (docs/embedding/contract.md)")
    return processor.description


def _named(before: tuple[Any, ...], keywords: dict[str, Any]) -> dict[str, Any]:
    """The old positional and keyword fields as one mapping; ``TypeError`` for a name that was never one."""
    if len(before) > len(BEFORE_DESCRIPTION):
        raise TypeError(f"Processor takes init, step and description=Description(...); got {len(before) + 2} "
                        f"positional arguments")
    named = dict(zip(BEFORE_DESCRIPTION, before))
    for name, value in keywords.items():
        if name not in BEFORE_DESCRIPTION:
            raise TypeError(f"Processor got an unexpected keyword {name!r}: it takes init, step and "
                            f"description=Description(...) (whose fields are {', '.join(BEFORE_DESCRIPTION)})")
        if name in named:
            raise TypeError(f"Processor got {name!r} twice, by position and by keyword")
        named[name] = value
    return named


def _spelt(fields: dict[str, Any]) -> str:
    """``name='x', version='2'``: the fields as a program wrote them."""
    return ", ".join(f"{name}={value!r}" for name, value in fields.items())


class StreamState(NamedTuple):
    """The state of a ``stream_processor`` with shared parameters."""

    params: Any  # shared leaves (weights): never per-stream, returned unchanged by the step
    rows: Any  # per-stream leaves: ``init_row``'s row stacked to [max_streams + 1, ...]


class EWMAState(NamedTuple):
    """Per-stream state; row ``max_streams`` is the spare slot used by padding."""

    count: jax.Array  # type: ignore[assignment]  # int32 [S + 1] messages seen per stream (hides tuple.count)
    mean: jax.Array  # float32 [S + 1, F]
    var: jax.Array  # float32 [S + 1, F]


def ewma_processor(alpha: float = 0.05, threshold: float = 4.0, warmup: int = 20,
                   eps: float = EPS) -> Processor:
    """The per-stream EWMA z-score anomaly detector, a ``stream_processor`` named "ewma".

    Per stream, in arrival order, with n = how many earlier messages that stream had:
    n == 0: z = 0, mean = x, var = 0; otherwise d = x - mean, z = d / sqrt(var + eps),
    mean += alpha * d, var = (1 - alpha) * (var + alpha * d**2).
    score = max |z|; anomaly = n >= warmup and score > threshold.

    A stream may appear several times in one batch; the result equals processing the
    messages one at a time, bit for bit (tests/reference_ewma.py). Its state is
    ``EWMAState(count, mean, var)``, each leaf [max_streams + 1, ...] (no shared parameters).
    """

    def init_row(shape: StateShape) -> EWMAState:
        return EWMAState(count=jnp.zeros((), jnp.int32), mean=jnp.zeros((shape.features,), jnp.float32),
                         var=jnp.zeros((shape.features,), jnp.float32))

    def row_step(params: None, row: EWMAState, x: jax.Array) -> tuple[EWMAState, dict[str, jax.Array]]:
        x = x.astype(jnp.float32)
        first = row.count == 0
        d = x - row.mean
        z = jnp.where(first, 0.0, d / jnp.sqrt(row.var + eps))
        mean = jnp.where(first, x, row.mean + alpha * d)
        var = jnp.where(first, 0.0, (1.0 - alpha) * (row.var + alpha * d * d))
        return EWMAState(row.count + 1, mean, var), {"z": z, "n": row.count}

    per_row = stream_processor(row_step, init_row=init_row, description=Description(name="ewma"))

    def step(state: EWMAState, batch: Any) -> tuple[EWMAState, dict[str, jax.Array]]:
        # score and anomaly follow from z and n alone: computed once here, not in every round
        state, out = per_row.step(state, batch)
        score = jnp.max(jnp.abs(out["z"]), axis=1)
        anomaly = (out["n"] >= warmup) & (score > threshold) & batch.valid
        return state, {"z": out["z"], "score": score, "anomaly": anomaly}

    # the detector's own counter and the settings its checkpoints record (only: tuning them keeps the state)
    return Processor(per_row.init, step, description=Description(
        name="ewma", counters={"anomalies": "anomaly"}, recorded={"alpha": alpha, "threshold": threshold,
                                                                   "warmup": warmup}))


def _stream_init(init_row: Callable[[Any], Any], init_params: Callable[[Any], Any] | None,
                 name: str) -> Callable[[Any], Any]:
    """``stream_processor``'s ``init``: the stream table from ``init_row`` (every slot a fresh
    row), and the shared leaves from ``init_params`` beside it, checked not to look per-stream."""

    def init(shape: StateShape) -> Any:
        slots = shape.max_streams + 1

        def table() -> Any:
            row = init_row(shape)
            if not jax.tree.leaves(row):
                raise ProcessorContractError(f"processor {name!r}: init_row returned {row!r}, a row with no arrays; "
                                             f"a stream's row must hold at least one array")
            return jax.tree.map(lambda leaf: jnp.broadcast_to(_strong(leaf), (slots, *jnp.shape(leaf))), row)

        # one XLA computation, not kept: run eagerly, each broadcast would leave a compiled op
        # resident in JAX's cache for the life of the process
        rows = jax.jit(table)()
        if init_params is None:
            return rows
        params = jax.tree.map(_strong, init_params(shape))
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            if _per_stream(leaf, slots):
                raise ProcessorContractError(
                    f"processor {name!r}: params leaf {jax.tree_util.keystr(path) or '(params)'} "
                    f"({leaf.dtype}{list(leaf.shape)}) has leading axis {slots} = max_streams + 1, which marks a "
                    f"per-stream leaf (it would be reset with a stream's slot and split over devices): store it "
                    f"transposed or with a leading axis of 1, or choose another max_streams")
        return StreamState(params, rows)

    return init


def stream_processor(row_step: Callable[[Any, Any, jax.Array], tuple[Any, dict[str, jax.Array]]], *,
                     init_row: Callable[[Any], Any], init_params: Callable[[Any], Any] | None = None,
                     description: Description | None = None, **before: Any) -> Processor:
    """A batched, O(B) ``Processor`` from ``row_step(params, row, x) -> (row, out)``, the update
    of one stream's row by one message (module docstring).

    ``init_row(shape)`` builds a fresh stream's row (a pytree of arrays; run under
    ``jax.jit``, so jnp or numpy values); ``init_params(shape)``, if given, the shared
    leaves (weights: numpy arrays, say, loaded from a file), put on the device as they are.
    ``out`` is a dict of arrays, each stacked over the batch into the step's outputs.
    ``description`` goes into the ``Processor`` as it is (its name in the helper's errors); its
    ``per_stream`` is True, as the helper keeps streams apart. The description's fields as keywords
    (``name=``, ``version=``, …) raise naming the ``description=`` spelling.
    """
    if before:
        unknown = [key for key in before if key not in BEFORE_DESCRIPTION or key == "per_stream"]
        if unknown:
            raise TypeError(f"stream_processor got an unexpected keyword {unknown[0]!r}: it takes row_step, "
                            f"init_row, init_params and description=Description(...)")
        spelt = _spelt(before)
        raise removed("stream_processor(..., name=...)", old=f"stream_processor(..., {spelt})",
                      new=f"stream_processor(..., description=Description({spelt}))")
    description = Description() if description is None else description
    if not isinstance(description, Description):
        raise TypeError(f"stream_processor(description={description!r}): a Description (from forkless import "
                        f"Description)")
    if not description.per_stream:
        raise ProcessorContractError("stream_processor(description=Description(per_stream=False)): the helper "
                                     "keeps streams apart (row_step sees one stream's row), so its processor is "
                                     "per-stream; write Processor(init, step, ...) for a step that mixes streams")
    name = description.name or "(unnamed)"
    init = _stream_init(init_row, init_params, name)

    def step(state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        params, table = (None, state) if init_params is None else state
        slots = jax.tree.leaves(table)[0].shape[0]  # this device's rows; the last is its spare
        key = jnp.where(batch.valid, batch.key, slots - 1)
        rank, prev, last = _occurrences(key)
        rank = jnp.where(batch.valid, rank, -1)
        rounds = jnp.max(rank) + 1
        run = jax.vmap(row_step, in_axes=(None, 0, 0))
        # the only reads of the table: one gather of the batch's rows
        gathered = jax.tree.map(lambda leaf: leaf[key], table)
        _checked_shapes(name, run, params, gathered, batch.x)

        def pick(active: jax.Array, new: Any, old: Any) -> Any:
            return jax.tree.map(lambda n, o: jnp.where(active.reshape(-1, *(1,) * (o.ndim - 1)), n, o), new, old)

        # Round 0, every stream's first message in the batch, reads the gathered rows. Its new
        # rows stand for every row (a later occurrence's is replaced in its round, a padding
        # row's is never written); padding rows' outputs are zeros.
        post, out = run(params, gathered, batch.x)
        out = pick(rank == 0, out, jax.tree.map(jnp.zeros_like, out))

        def cond(carry: tuple) -> jax.Array:
            return carry[0] < rounds

        def body(carry: tuple) -> tuple:
            # Round r: each stream's r-th repeat reads the row its previous occurrence left
            # (post [B, ...]: each row's stream row after that row's message).
            r, post, out = carry
            active = rank == r
            new_rows, new_out = run(params, jax.tree.map(lambda leaf: leaf[prev], post), batch.x)
            return r + 1, pick(active, new_rows, post), pick(active, new_out, out)

        # Round 0 runs outside the loop, the loop (rounds 1 …) only for repeats: zeros starting the
        # outputs' carry let XLA's CPU executor run ops on another thread, a slower step at B = 1.
        # Everything used after the loop comes out of it: a gathered row used there directly could
        # be fused after the scatter, and XLA would copy the whole table to keep the old row.
        _, post, out = jax.lax.while_loop(cond, body, (jnp.int32(1), post, out))
        # the only write: one scatter of each stream's last occurrence; padding rows and
        # earlier occurrences get an out-of-range index and are dropped
        idx = jnp.where(last & batch.valid, key, slots)
        table = jax.tree.map(lambda leaf, rows: leaf.at[idx].set(rows, mode="drop"), table, post)
        return (table if init_params is None else StreamState(params, table)), out

    return Processor(init, step, description=description)


def _strong(value: Any) -> jax.Array:
    """``value`` as an array of its own dtype, not weakly typed (a Python 0 becomes int32, not
    an int that the next operand's dtype decides), so the state's types never change."""
    array = jnp.asarray(value)
    return jnp.asarray(array, dtype=array.dtype)


def _checked_shapes(name: str, run: Callable[..., Any], params: Any, rows: Any, x: jax.Array) -> Any:
    """The batched ``row_step``'s output shapes, after checking it returns ``(row, dict)`` with
    the row's structure, shapes and dtypes unchanged; ``ProcessorContractError`` otherwise."""
    info = jax.eval_shape(run, params, rows, x)
    if not (isinstance(info, tuple) and len(info) == 2 and isinstance(info[1], dict)):
        raise ProcessorContractError(f"processor {name!r}: row_step must return (row, outputs), outputs a dict "
                                     f"of arrays keyed by name")
    new_rows, out = info
    if jax.tree.structure(new_rows) != jax.tree.structure(rows):  # type: ignore[operator]  # jaxlib has no stub for PyTreeDef
        raise ProcessorContractError(f"processor {name!r}: row_step must return a row of the structure it was "
                                     f"given: got {jax.tree.structure(new_rows)}, expected {jax.tree.structure(rows)}")
    for (path, old), new in zip(jax.tree_util.tree_flatten_with_path(rows)[0], jax.tree.leaves(new_rows)):
        if (old.shape, old.dtype) != (new.shape, new.dtype):
            raise ProcessorContractError(
                f"processor {name!r}: row_step must return row leaves of unchanged shape and dtype: "
                f"row{jax.tree_util.keystr(path)} {old.dtype}{list(old.shape[1:])} came back as "
                f"{new.dtype}{list(new.shape[1:])}")
    return out


def _occurrences(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row of a batch: its occurrence rank, its previous occurrence, and whether it is last.

    ``rank[i]``: how many earlier rows have the same key; ``prev[i]``: the row of the
    previous occurrence of the same key (``i`` itself for a first occurrence);
    ``last[i]``: no later row has the same key. One stable sort, O(B log B).
    """
    b = key.shape[0]
    pos = jnp.arange(b, dtype=jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sorted_key = key[order]
    run_start = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
    run_end = jnp.concatenate([sorted_key[1:] != sorted_key[:-1], jnp.ones((1,), bool)])
    first_of_run = jax.lax.cummax(jnp.where(run_start, pos, 0))
    before = jnp.concatenate([order[:1], order[:-1]])  # the row sorted just before
    prev_sorted = jnp.where(run_start, order, before)
    rank = jnp.zeros(b, jnp.int32).at[order].set(pos - first_of_run)
    prev = jnp.zeros(b, jnp.int32).at[order].set(prev_sorted)
    last = jnp.zeros(b, bool).at[order].set(run_end)
    return rank, prev, last


def _occurrence_rank(key: jax.Array) -> jax.Array:
    """For each row, how many earlier rows of the batch have the same key (O(B log B))."""
    return _occurrences(key)[0]


def row_template(state: Any, slots: int) -> Any:
    """One fresh row per per-stream leaf of ``state``, for ``reset_rows``.

    ``state`` is a fresh ``init(shape)`` state and ``slots`` the length of its per-stream
    leading axis, ``max_streams + 1``. A leaf whose leading axis is ``slots`` becomes its
    row 0; any other leaf (weights shared by all streams, say) becomes ``None``, which
    ``reset_rows`` leaves alone. Build it once, at start-up, and keep it on the device.
    """
    return jax.tree.map(lambda leaf: leaf[0] if _per_stream(leaf, slots) else None, state)


def reset_rows(state: Any, template: Any, idx: jax.Array) -> Any:
    """``state`` with the rows ``idx`` (int32 [K]) of every per-stream leaf set to ``template``.

    Call it, jitted with ``donate_argnums=0``, on the slots a ``StreamSlots.lookup`` reported
    as recycled, before the step that runs their new streams' messages, so a new stream
    never inherits its slot's previous owner. Pad ``idx`` to a fixed K with the spare slot
    ``max_streams`` (resetting it is harmless). Costs O(K) with the state donated.
    """
    return jax.tree.map(lambda row, leaf: leaf if row is None else leaf.at[idx].set(row),
                        template, state, is_leaf=lambda row: row is None)


def _per_stream(leaf: Any, slots: int) -> bool:
    shape: tuple[int, ...] = getattr(leaf, "shape", ())
    return len(shape) >= 1 and shape[0] == slots


def default_processor(config: Any) -> Processor:
    """The EWMA detector (named "ewma") with the configuration's alpha, threshold and warm-up
    (FORKLESS_ALPHA, FORKLESS_THRESHOLD, FORKLESS_WARMUP: read here only). One processor per
    setting of the three: every controller of the same settings in a process compiles it once
    (controller/device/programs.py)."""
    return _ewma_of(config.detector.alpha, config.detector.threshold, config.detector.warmup)


@functools.lru_cache(maxsize=8)
def _ewma_of(alpha: float, threshold: float, warmup: int) -> Processor:
    return ewma_processor(alpha=alpha, threshold=threshold, warmup=warmup)
