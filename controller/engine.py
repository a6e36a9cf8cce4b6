"""Engine: the one owner of the device state.

Rules:
- ``compile_step`` builds an ``Engine``: it puts the processor's initial state on the device(s)
  and compiles the step for every bucket ahead of time (state DONATED), plus the slot reset.
  After it nothing compiles again (``compilations()`` stays flat; tests pin it).
- Only the engine holds and assigns the state. The loop asks it to ``step`` a batch, ``reset``
  recycled slots, ``begin_snapshot`` a checkpoint and ``restore`` one; nothing else reads or
  writes the state (tests/test_architecture.py holds every assignment of it to this module).
- Whatever must happen before the state is written happens here: a checkpoint being copied
  between steps keeps the rows a step or reset is about to write (copy-on-write,
  controller/snapshot.py ``PendingSnapshot``) — called by the engine, so no caller can forget it.
- One device or several (``FORKLESS_DEVICES``) is the engine's business, behind one interface:
  a *layout* (``_OneDevice``, ``_Sharded``) says how the state is placed, how a batch is laid
  out for the compiled step and how its results come back; the compile path, the step, the
  reset, snapshots and restores are written once over it. One device: no mesh, a padded
  ``Batch`` in and ``(state, outputs, bad)`` out. Several: a 1-D mesh ``"d"``, per-stream
  leaves sharded by stream (controller/placement.py), the step ``shard_map``-ped, one packed
  array each way per device.
- The processor contract is checked while compiling (controller/compiled.py): outputs
  ``[B, ...]``, a state of unchanged structure, shapes and dtypes, a step that writes only its
  batch's rows of a per-stream leaf (``check_row_writes``), and, on several devices, shared
  leaves returned unchanged and ``per_stream=True``.
- A step that fails at run time after being given the state (donated) leaves no state: the
  engine puts a fresh one in its place and says so (``StepFailed.state_lost``); a checkpoint
  being copied from the lost state is abandoned (``PendingSnapshot``'s ``intact``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from controller.batching import Batch, bucket_for, pad_batch
from controller.compiled import (
    XLA_CPU_TASK_BYTES,
    as_bytes,
    check_contract,
    check_input_dtype,
    check_replicated_unchanged,
    check_row_writes,
    example_batch,
    guarded,
    input_dtype,
    one_call,
    output_layout,
    per_stream_leaf,
    release_freed_memory,
    unsplit_cpu_ops,
    use_devices,
)
from controller.declared import check_counters, declared
from controller.errors import ProcessorContractError
from controller.placement import OutputField, Placement, Route, unpack_outputs
from controller.processor import reset_rows, row_template
from controller.slots import TableCopy
from controller.snapshot import PendingSnapshot, canonical_rows

__all__ = ["AXIS", "Engine", "StepFailed", "Stepped", "compile_step", "state_shapes"]

AXIS = "d"  # the mesh's one axis: the devices, along which the stream table is sharded


class Stepped(NamedTuple):
    """One batch's results on the host, in arrival order, cut to its ``m`` messages:
    ``outputs`` (name -> [m, ...]) and ``bad`` (bool [m]: a non-finite output)."""

    outputs: dict[str, np.ndarray]
    bad: np.ndarray


class StepFailed(Exception):
    """The compiled step raised (``__cause__``); ``state_lost``: it had been given the state
    (donated), which is gone, and every stream starts again from a fresh state."""

    def __init__(self, cause: BaseException, state_lost: bool) -> None:
        super().__init__(str(cause))
        self.state_lost = state_lost


# ---- layouts: how the state and a batch are placed on one device or several ------------------


class _OneDevice:
    """One device: the state as ``init`` builds it, a padded ``Batch``, ``(state, outputs, bad)``."""

    placement = None
    per_stream = None
    copies_rows = True  # a checkpoint may copy the state a chunk of rows at a time between steps

    def __init__(self, processor: Any, config: Any, device: Any) -> None:
        self.processor, self.config = processor, config
        self.spare_key = config.max_streams
        self.dtype = input_dtype(processor)  # batch.x's
        self.shardings: Any = None

    def fresh(self) -> Any:
        state = jax.device_put(self.processor.init(self.config))
        self.shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
        return state

    def compile_reset(self, state: Any) -> tuple[Any, Any]:
        template = one_call(lambda s: row_template(s, self.config.max_streams + 1), state)
        reset = jax.jit(reset_rows, donate_argnums=0).lower(
            state, template, np.zeros(self.config.max_batch, np.int32)).compile()
        return template, reset

    def jit(self, step: Callable[..., Any]) -> Any:
        # the state is donated: XLA updates the table in place, so a step costs O(B), not O(S)
        return jax.jit(guarded(step), donate_argnums=0)

    def check(self, step: Callable[..., Any], state: Any, bucket: int) -> None:
        out_info = jax.eval_shape(step, state, self.example(bucket))
        check_contract(state, out_info, bucket)
        check_counters(declared(self.processor).counters, out_info[1])

    def lower(self, jitted: Any, state: Any, bucket: int) -> Any:
        """The step lowered for ``bucket``, its contract checked on the lowering's own trace (the
        guard adds ``bad``): one trace a bucket, not two (0.06 s each with the default step)."""
        lowered = jitted.lower(state, self.example(bucket))
        new_state, outputs, _bad = lowered.out_info
        check_contract(state, (new_state, outputs), bucket)
        return lowered

    def example(self, bucket: int) -> Batch:
        return example_batch(self.config.features, bucket, self.spare_key, self.dtype)

    def lay_out(self, x: np.ndarray, key: np.ndarray) -> tuple[int, Batch, None, np.ndarray]:
        """The bucket, the batch for its step, the route back (none here) and the rows it writes."""
        bucket = bucket_for(len(key), self.config.buckets)
        batch = pad_batch(x, key, bucket, self.spare_key, self.dtype)
        return bucket, batch, None, batch.key

    def results(self, ran: tuple[Any, ...], m: int, route: None, fetch: Callable[[Any], Any]) -> Stepped:
        outputs, bad = fetch(ran)  # one transfer (also surfaces the step's runtime errors)
        return Stepped({name: np.asarray(value)[:m] for name, value in outputs.items()}, np.asarray(bad)[:m])

    def reset_index(self, slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The reset's index and the rows it writes."""
        idx = np.full(self.config.max_batch, self.spare_key, np.int32)  # padded with the spare
        idx[:len(slots)] = slots
        return idx, idx

    def to_device(self, host: Any) -> Any:
        return jax.device_put(host, self.shardings)

    def host_copy(self, state: Any) -> Any:
        return jax.device_get(state)

    def device_rows(self, bucket: int) -> int:
        return bucket

    def counts(self, m: int, route: None) -> int:
        return m


class _Sharded:
    """Several devices: per-stream leaves sharded by stream over a 1-D mesh, the step
    ``shard_map``-ped; one packed array in, one packed byte array out (controller/placement.py)."""

    copies_rows = False  # a sharded state's checkpoint is copied at once, put in order by the writer

    def __init__(self, processor: Any, config: Any, devices: list[Any]) -> None:
        if not getattr(processor, "per_stream", True):
            raise ProcessorContractError(
                f"this processor declares per_stream=False (its step mixes streams), so it cannot be sharded over "
                f"{len(devices)} devices: run it on one device with FORKLESS_DEVICES=1")
        self.processor, self.config = processor, config
        self.dtype = input_dtype(processor)  # batch.x's, and the packed batch's
        n = len(devices)
        self.placement = place = Placement(n, config.max_streams)
        self.spare_key = place.spare_row
        self.mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
        canonical = jax.eval_shape(lambda: processor.init(config))
        self.per_stream = jax.tree.map(lambda leaf: per_stream_leaf(leaf, config.max_streams + 1), canonical)
        self.specs = jax.tree.map(lambda sharded: P(AXIS) if sharded else P(), self.per_stream)
        self.shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.specs,
                                      is_leaf=lambda v: isinstance(v, P))
        self.rows = NamedSharding(self.mesh, P(AXIS))  # a batch, its outputs, a reset's index: [N * Bd]
        self.local_state = jax.tree.map(
            lambda leaf, sharded: jax.ShapeDtypeStruct(
                (place.rows_per_device, *leaf.shape[1:]) if sharded else leaf.shape, leaf.dtype),
            canonical, self.per_stream)
        self.layout: tuple[OutputField, ...] = ()

        def fresh_state() -> Any:
            # the contract makes every per-stream row of init equal: row 0, repeated over the
            # sharded table (XLA drops the rest of init, so no device holds the whole table)
            state = processor.init(config)
            return jax.tree.map(lambda leaf, sharded: jnp.broadcast_to(leaf[0], (place.table_rows, *leaf.shape[1:]))
                                if sharded else leaf, state, self.per_stream)

        self.fresh = jax.jit(fresh_state, out_shardings=self.shardings).lower().compile()

    def compile_reset(self, state: Any) -> tuple[Any, Any]:
        replicated = NamedSharding(self.mesh, P())
        template = jax.device_put(one_call(lambda s: jax.tree.map(lambda leaf, sharded: leaf[0] if sharded else None,
                                                                  s, self.per_stream), state), replicated)
        template_specs = jax.tree.map(lambda _: P(), template)
        reset = jax.jit(jax.shard_map(reset_rows, mesh=self.mesh, in_specs=(self.specs, template_specs, P(AXIS)),
                                      out_specs=self.specs, check_vma=False),
                        in_shardings=(self.shardings, jax.tree.map(lambda _: replicated, template), self.rows),
                        out_shardings=self.shardings, donate_argnums=0,
                        ).lower(state, template, np.zeros(self.placement.devices * self.config.max_batch, np.int32)
                                ).compile()
        return template, reset

    def jit(self, step: Callable[..., Any]) -> Any:
        features = self.config.features
        guarded_step = guarded(step)

        def per_device(state: Any, packed: jax.Array) -> tuple[Any, jax.Array]:
            # the key's bits sit in an int as wide as x's dtype (controller/placement.py, pack)
            bits = jnp.int32 if packed.dtype.itemsize == 4 else jnp.int64
            key = jax.lax.bitcast_convert_type(packed[:, features], bits)
            if key.dtype != jnp.int32:
                key = key.astype(jnp.int32)
            batch = Batch(packed[:, :features], key, packed[:, features + 1] > 0)
            new_state, outputs, bad = guarded_step(state, batch)
            return new_state, as_bytes([outputs[field.name] for field in self.layout[:-1]] + [bad])

        # check_vma off: the processor's own code need not mark device-varying values (pcast);
        # what it must not do (change a replicated leaf) is checked on its jaxpr instead
        mapped = jax.shard_map(per_device, mesh=self.mesh, in_specs=(self.specs, P(AXIS)),
                               out_specs=(self.specs, P(AXIS)), check_vma=False)
        return jax.jit(mapped, in_shardings=(self.shardings, self.rows), out_shardings=(self.shardings, self.rows),
                       donate_argnums=0)

    def check(self, step: Callable[..., Any], state: Any, bucket: int) -> None:
        local = example_batch(self.config.features, bucket, self.spare_key, self.dtype)
        out_info = jax.eval_shape(step, self.local_state, local)
        check_contract(self.local_state, out_info, bucket)
        check_counters(declared(self.processor).counters, out_info[1])
        check_replicated_unchanged(step, self.local_state, local, self.per_stream)
        if not self.layout:
            self.layout = output_layout(out_info[1])

    def lower(self, jitted: Any, state: Any, bucket: int) -> Any:
        """The step lowered for ``bucket`` after its contract is checked (on the per-device step:
        the lowering's is the packed one); the first bucket's was checked before (``check``)."""
        if bucket != self.config.buckets[0]:
            self.check(self.processor.step, state, bucket)
        return jitted.lower(state, self.example(bucket))

    def example(self, bucket: int) -> np.ndarray:
        place = self.placement
        return place.pack(np.zeros((0, self.config.features), self.dtype), np.zeros(0, np.int32),
                          Route(bucket, np.zeros(0, np.int64), np.zeros(place.devices, np.int64)), self.dtype)

    def lay_out(self, x: np.ndarray, key: np.ndarray) -> tuple[int, np.ndarray, Route, None]:
        # grouped by owning device: [N, Bd], Bd the bucket of the busiest device; one array: one
        # transfer per device. A sharded state's checkpoint is copied at once (no rows to keep).
        route = self.placement.route(key, self.config.buckets)
        return route.bucket, self.placement.pack(x, key, route, self.dtype), route, None

    def results(self, ran: tuple[Any, ...], m: int, route: Route, fetch: Callable[[Any], Any]) -> Stepped:
        (packed,) = ran  # the outputs and flags packed in one byte array, as the batch was
        arrays = unpack_outputs(np.asarray(fetch(packed)), self.layout, route.positions)  # back in arrival order
        return Stepped({field.name: a for field, a in zip(self.layout[:-1], arrays)}, arrays[-1])

    def reset_index(self, slots: list[int]) -> tuple[np.ndarray, None]:
        return self.placement.reset_index(slots, self.config.max_batch), None  # [N, max_batch] local rows

    def host_copy(self, state: Any) -> Any:
        """The state on the host in canonical order: each per-stream leaf taken shard by shard,
        put in order by the checkpoint writer's thread as it writes (``CanonicalRows``)."""
        return jax.tree.map(lambda leaf, sharded: canonical_rows(leaf, self.placement) if sharded
                            else np.asarray(jax.device_get(leaf)), state, self.per_stream)

    def to_device(self, host: Any) -> Any:
        place = self.placement
        return jax.device_put(jax.tree.map(lambda leaf, sharded: place.to_sharded(leaf) if sharded else leaf,
                                           host, self.per_stream), self.shardings)

    def device_rows(self, bucket: int) -> int:
        return self.placement.devices * bucket

    def counts(self, m: int, route: Route) -> np.ndarray:
        return route.counts


# ---- the engine ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Compiled:
    steps: dict[int, Any]
    template: Any
    reset: Any


class Engine:
    """Holds the device state and runs every compiled computation on it; built by ``compile_step``.

    The loop calls ``step`` per batch, ``reset`` for recycled slots, ``begin_snapshot`` for a
    checkpoint and ``restore`` once at start. ``devices``, ``device_rows`` and
    ``device_messages`` are counters the stats read (written by the main thread only)."""

    def __init__(self, layout: _OneDevice | _Sharded, state: Any, compiled: _Compiled,
                 devices: tuple[str, ...], canonical: Any, processor: Any, config: Any) -> None:
        self._layout = layout
        self._state = state
        self._compiled = compiled
        self._canonical = canonical
        self._processor = processor
        self._config = config
        self.devices = devices
        self.steps: Mapping[int, Any] = compiled.steps  # read-only; for the preflight and the benchmark
        # outputs of a CPU step are host memory already: np.asarray reads them in place (about
        # 13 µs for the default outputs, against 85 µs for jax.device_get, which starts one
        # asynchronous copy per array); on an accelerator device_get's overlapped copies win
        self._fetch: Callable[[Any], Any] = _read_in_place if jax.devices()[0].platform == "cpu" else jax.device_get
        self._copying: PendingSnapshot | None = None  # a checkpoint being copied between steps
        self.generation = 0  # bumped whenever the state is replaced (a restore, a lost state)
        self.device_rows = 0  # rows the devices stepped, padding included
        self.device_messages = np.zeros(len(devices), np.int64)

    # ---- what the loop calls --------------------------------------------------------------------

    def step(self, x: np.ndarray, key: np.ndarray) -> Stepped:
        """Run the compiled step on one batch (``x`` [m, F], ``key`` int32 slots [m]); its
        results on the host. Raises ``StepFailed`` (the state kept, or replaced if it was lost)."""
        layout = self._layout
        m = len(key)
        bucket, batch, route, written = layout.lay_out(x, key)
        self._before_write(written)
        try:
            new_state, *ran = self._compiled.steps[bucket](self._state, batch)
            stepped = layout.results(tuple(ran), m, route, self._fetch)
        except Exception as exc:
            lost = any(leaf.is_deleted() for leaf in jax.tree.leaves(self._state))
            if lost:  # donated to the step that failed at run time: gone
                self._replace(layout.fresh())
            raise StepFailed(exc, lost) from exc
        self._state = new_state
        self.device_rows += layout.device_rows(bucket)
        self.device_messages += layout.counts(m, route)
        return stepped

    def reset(self, slots: list[int]) -> None:
        """Give these slots a fresh stream's state (before the step that uses them)."""
        idx, written = self._layout.reset_index(slots)
        self._before_write(written)
        self._state = self._compiled.reset(self._state, self._compiled.template, idx)

    def begin_snapshot(self, table: TableCopy, counts: Mapping[str, int], settings: Mapping[str, Any],
                       wall_time: float, *, seen_shift: float, incremental: bool,
                       positions: Mapping[str, Any] | None = None) -> PendingSnapshot:
        """A checkpoint of the state as of now (between two steps), copied a chunk at a time by
        its ``advance`` between the next steps, or at once (``incremental=False``, several
        devices, an accelerator); the engine keeps it exact until it is copied."""
        layout, generation = self._layout, self.generation
        pending = PendingSnapshot(
            self._state, table, counts, settings, wall_time, rows=self._config.max_streams + 1,
            get_state=lambda: self._state, seen_shift=seen_shift, incremental=incremental and layout.copies_rows,
            intact=lambda: self.generation == generation, host_copy=layout.host_copy, positions=positions)
        self._copying = pending
        return pending

    @property
    def state(self) -> Any:
        """The state as it is now, to look at (tests, inspection); the next step is given it
        donated, so keep no reference to it across a step."""
        return self._state

    @property
    def checkpoint_shapes(self) -> Any:
        """The state's shapes and dtypes in a checkpoint's canonical layout (row s = slot s)."""
        return self._canonical

    def restore(self, host: Any, *, shared: bool = True) -> None:
        """Put a checkpoint's state (canonical host arrays, ``checkpoint_shapes``) on the device(s).
        ``shared=False``: leaves that are not per-stream (weights) keep their ``init`` values."""
        if not shared:
            slots = self._config.max_streams + 1
            host = jax.tree.map(lambda saved, now, like: saved if per_stream_leaf(like, slots) else jax.device_get(now),
                                host, self._state, self._canonical)
        self._replace(self._layout.to_device(host))

    def shared_leaves(self) -> list[str]:
        """The paths of the state's leaves that are not per-stream (shared by every stream)."""
        slots = self._config.max_streams + 1
        return [jax.tree_util.keystr(path) or "(the state)"
                for path, leaf in jax.tree_util.tree_flatten_with_path(self._canonical)[0]
                if not per_stream_leaf(leaf, slots)]

    def describe(self) -> str:
        """The devices, and how the table is spread over them, for the start-up log."""
        place = self._layout.placement
        sharded = "" if place is None else (f", the stream table sharded over them ({place.rows_per_device} rows "
                                            f"each, slot s on device s % {place.devices})")
        return f"{len(self.devices)} device(s): {', '.join(self.devices)}{sharded}"

    def output_names(self) -> list[str]:
        """Run every bucket once on padding (the preflight); the outputs' names."""
        names: list[str] = []
        for bucket in self._compiled.steps:
            new_state, *ran = self._compiled.steps[bucket](self._state, self._layout.example(bucket))
            self._state = new_state
            route = None if self._layout.placement is None else Route(bucket, np.zeros(0, np.int64), np.zeros(0))
            names = sorted(self._layout.results(tuple(ran), 0, route, self._fetch).outputs)
        return names

    def take_state(self) -> Any:
        """Hand the state to a caller that drives ``steps`` itself (the benchmark's spawn design):
        the engine holds none afterwards."""
        state, self._state = self._state, None
        return state

    # ---- inside --------------------------------------------------------------------------------

    def _before_write(self, rows: np.ndarray | None) -> None:
        """A checkpoint being copied keeps the present values of the rows about to be written."""
        pending = self._copying
        if pending is not None and rows is not None:
            if pending.wants_writes:
                pending.before_state_write(self._state, rows)
            else:
                self._copying = None  # copied, written or dropped: nothing more to keep

    def _replace(self, state: Any) -> None:
        self._state = state
        self.generation += 1


def _read_in_place(tree: Any) -> Any:
    """The step's outputs as numpy arrays, read in place (CPU only)."""
    return jax.tree.map(np.asarray, tree)


def state_shapes(processor: Any, config: Any) -> Any:
    """The shapes and dtypes of ``processor.init(config)`` (a tree of ``ShapeDtypeStruct``), computing nothing."""
    return jax.eval_shape(lambda: processor.init(config))


def compile_step(processor: Any, config: Any,
                 on_compiled: Callable[[int, float], None] | None = None) -> Engine:
    """Initialise the state on the device(s) and compile ``processor.step`` for ``config.buckets``;
    ``on_compiled(bucket, seconds)`` is called after each (the preflight prints it)."""
    with _cache_every_compile():
        return _compile_step(processor, config, on_compiled)


@contextlib.contextmanager
def _cache_every_compile() -> Any:
    """With a persistent compilation cache (JAX_COMPILATION_CACHE_DIR), cache every bucket: they
    compile in well under JAX's default 1 s threshold. A JAX setting of the whole process, so
    it is given back as it was once the steps are compiled."""
    name = "jax_persistent_cache_min_compile_time_secs"
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR") or "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" in os.environ:
        yield
        return
    before = getattr(jax.config, name)
    jax.config.update(name, 0.0)
    try:
        yield
    finally:
        jax.config.update(name, before)


def _compile_step(processor: Any, config: Any, on_compiled: Callable[[int, float], None] | None) -> Engine:
    check_input_dtype(processor)  # float32, or float64 with JAX's x64 mode on: before anything is built
    devices = use_devices(getattr(config, "devices", "all"))
    canonical = state_shapes(processor, config)
    largest = max((leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(canonical)), default=0) // len(devices)
    # below XLA's 256 KB a task it splits nothing, and compiling on one CPU is slower (LLVM's
    # workers share it): +1.1 s at the default settings on 2 cores, so only where it pays
    unsplit = unsplit_cpu_ops(devices) if largest >= XLA_CPU_TASK_BYTES else contextlib.nullcontext()
    with unsplit:
        layout = _Sharded(processor, config, devices) if len(devices) > 1 else _OneDevice(processor, config, devices[0])
        state = layout.fresh()
        template, reset = layout.compile_reset(state)
        jitted = layout.jit(processor.step)
        # the contract on the shapes first (cheap, and clear errors), then at each bucket as it
        # is lowered
        layout.check(processor.step, state, config.buckets[0])
        check_row_writes(processor, config)
        steps = {}
        for bucket in config.buckets:
            t0 = time.perf_counter()
            steps[bucket] = layout.lower(jitted, state, bucket).compile()
            # drop what jit keeps of it (its trace and lowering; the executable is ours) and
            # give the freed heap back: the start's peak is one bucket's work, not all of them
            jitted.clear_cache()
            release_freed_memory()
            if on_compiled is not None:
                on_compiled(bucket, time.perf_counter() - t0)
    if layout.placement is None:
        held = sorted({str(d) for leaf in jax.tree.leaves(state) for d in leaf.devices()}) or [str(devices[0])]
    else:
        held = [str(d) for d in devices]
    return Engine(layout, state, _Compiled(steps, template, reset), tuple(held), canonical, processor, config)

