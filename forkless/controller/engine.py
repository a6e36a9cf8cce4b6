"""Engine: the one owner of the device state.

Rules:
- ``compile_step`` builds an ``Engine``: the initial state on the device(s), the step compiled for every bucket
  (state donated) and the slot reset. After it nothing compiles again (``compilations()`` stays flat).
- Only the engine holds and assigns the state (tests/docs/test_architecture.py holds every assignment to this
  module); the loop asks it to ``step``, ``reset`` recycled slots, ``begin_snapshot`` and ``restore``.
- A step is ``dispatch`` then ``finish``; several may be in flight, always finished in dispatch order (the device
  orders them: each is given the state the one before returned). A step that fails when finished had passed its
  lost state on: what was dispatched after it (the journal) runs again on the kept or a fresh state, so the
  results are those of one step at a time. ``begin_snapshot`` refuses while steps are in flight; with steps in
  flight the compiled steps reset a non-finite stream's rows themselves (``resets_in_step``).
- What must happen before the state is written happens here, so no caller can forget it: a checkpoint being
  copied between steps keeps the rows a step or reset is about to write (``PendingSnapshot``).
- One device or several is a *layout* (controller/device/layouts.py); the compile, step, reset, snapshots and
  restores are written once over it. The processor contract is checked while compiling (device/compiled.py).
- A step that fails after being given the state leaves none: a fresh one takes its place
  (``StepFailed.state_lost``) and a checkpoint being copied from the lost one is abandoned.
- Live weights offered from any thread (``offer_weights``) are put in place at the start of the next ``step``;
  the compiled steps run on unchanged.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from forkless.controller.checkpoints.snapshot import PendingSnapshot
from forkless.controller.device.compiled import (
    XLA_CPU_TASK_BYTES,
    check_input_dtype,
    check_platform_dtypes,
    check_row_writes,
    per_stream_leaf,
    release_freed_memory,
    unsplit_cpu_ops,
    use_devices,
)
from forkless.controller.device.layouts import OneDevice, Sharded, Stepped
from forkless.controller.device.placement import Route
from forkless.controller.device.programs import keep, kept, program_key
from forkless.controller.device.weights import LiveWeights, Weights
from forkless.controller.processor import Processor, StateShape, StreamState
from forkless.controller.settings.groups import StepSettings, StepShape
from forkless.controller.slots import TableCopy

__all__ = ["Engine", "Pending", "StepFailed", "compile_step", "state_shapes"]

class StepFailed(Exception):
    """The compiled step raised (``__cause__``); ``state_lost``: it had been given the state
    (donated), which is gone, and every stream starts again from a fresh state."""

    def __init__(self, cause: BaseException, state_lost: bool) -> None:
        super().__init__(str(cause))
        self.state_lost = state_lost


# ---- the engine ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Compiled:
    steps: dict[int, Any]  # bucket -> compiled (state, batch, template) -> (state, *results)
    template: Any
    reset: Any
    clone: Any = None  # the state copied on its device(s), for a checkpoint (layouts.compile_clone)


class _WithTemplate:
    """A compiled step as ``(state, batch) -> (state, *results)``, the engine's template passed
    (``Engine.steps``: for callers that drive the steps themselves); else the compiled object."""

    def __init__(self, compiled: Any, template: Any) -> None:
        self._compiled, self._template = compiled, template

    def __call__(self, state: Any, batch: Any) -> Any:
        return self._compiled(state, batch, self._template)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)


class Pending:
    """One step dispatched and not yet finished (``Engine.dispatch``, ``Engine.finish``): its
    laid-out batch (kept, to run it again after an earlier step in flight failed), the
    results being copied to the host, or the exception its dispatch raised."""

    __slots__ = ("batch", "bucket", "failed", "lost", "m", "ran", "route", "state_in")

    def __init__(self, bucket: int, batch: Any, route: Any, m: int) -> None:
        self.bucket, self.batch, self.route, self.m = bucket, batch, route, m
        self.ran: tuple[Any, ...] = ()
        self.state_in: Any = None  # the state it was given (donated: deleted once it runs)
        self.failed: BaseException | None = None
        self.lost = False


class Engine:
    """Holds the device state and runs every compiled computation on it; built by ``compile_step``.

    The loop calls ``step`` per batch, ``reset`` for recycled slots, ``begin_snapshot`` for a
    checkpoint and ``restore`` once at start. ``devices``, ``device_rows`` and
    ``device_messages`` are counters the stats read (written by the main thread only). ``settings``:
    the step's settings as compiled (``StepSettings.on_platform``: ``steps_in_flight`` is the depth
    the loop keeps in flight)."""

    def __init__(self, layout: OneDevice | Sharded, state: Any, compiled: _Compiled,
                 devices: tuple[str, ...], canonical: Any, processor: Processor, settings: StepSettings) -> None:
        self._layout = layout
        self._state = state
        self._compiled = compiled
        self._canonical = canonical
        self._processor = processor
        self.settings = settings
        self.devices = devices
        # read-only, as (state, batch) -> (state, *results); for the preflight and the benchmark
        self.steps: Mapping[int, Any] = {b: _WithTemplate(c, compiled.template) for b, c in compiled.steps.items()}
        # outputs of a CPU step are host memory already: np.asarray reads them in place, cheaper than
        # jax.device_get's one asynchronous copy per array; on an accelerator those overlapped copies win
        self.platform = jax.devices()[0].platform  # "cpu", "tpu", "gpu" …
        # the compiled steps reset a non-finite stream's rows themselves (compiled.guarded); else the caller does
        self.resets_in_step = int(settings.steps_in_flight) > 1  # resolved (on_platform): an int
        on_cpu = self.platform == "cpu"
        self._fetch: Callable[[Any], Any] = _read_in_place if on_cpu else jax.device_get
        # a step's results start their way to the host as it is dispatched (steps in flight);
        # on the CPU they are host memory already
        self._copy_async = not on_cpu
        # what was dispatched since the oldest unfinished step: steps (``Pending``) and the
        # resets and weight swaps between them (state -> state), to run again if one fails
        self._journal: deque[Pending | Callable[[Any], Any]] = deque()
        self._copying: PendingSnapshot | None = None  # a checkpoint being copied between steps
        self.generation = 0  # bumped whenever the state is replaced (a restore, a lost state)
        self.device_rows = 0  # rows the devices stepped, padding included
        self.device_messages = np.zeros(len(devices), np.int64)
        self.steps_run = 0  # steps that ran (batches stepped) by this engine
        # False: a checkpoint not copied in rows is taken to the host on the main thread at T0
        # (jax.device_get), not cloned on the device; for bench/checkpoint_stall.py's "before"
        self.clone_checkpoints = True
        # a StreamState's params can be swapped while it runs (controller/device/weights.py); None: no params
        self.live_weights = LiveWeights(canonical.params, jax.device_get(state.params)) \
            if isinstance(canonical, StreamState) else None

    # ---- what the loop calls --------------------------------------------------------------------

    def step(self, x: np.ndarray, key: np.ndarray) -> Stepped:
        """Run the compiled step on one batch (``x`` [m, F], ``key`` int32 slots [m]); its
        results on the host. Raises ``StepFailed`` (the state kept, or replaced if it was lost)."""
        return self.finish(self.dispatch(x, key))

    def dispatch(self, x: np.ndarray, key: np.ndarray) -> Pending:
        """Start the compiled step on one batch and the copy of its results to the host, without
        waiting for either; ``finish`` it (in dispatch order) for the results. A failure is
        raised by ``finish`` (the state kept, or replaced if it was lost)."""
        layout = self._layout
        if self.live_weights is not None and self.live_weights.pending:
            self._swap_weights()
        m = len(key)
        bucket, batch, route, written = layout.lay_out(x, key)
        self._before_write(written)
        pending = Pending(bucket, batch, route, m)
        self._run(pending)
        self._journal.append(pending)
        self.steps_run += 1
        self.device_rows += layout.device_rows(bucket)
        self.device_messages += layout.counts(m, route)  # type: ignore[arg-type]  # None: one device's, no placement
        return pending

    def ready(self, pending: Pending) -> bool:
        """Whether ``finish(pending)`` would return without waiting for the device."""
        return pending.failed is not None or all(leaf.is_ready() for leaf in jax.tree.leaves(pending.ran))

    @property
    def unfinished(self) -> int:
        """Steps dispatched and not yet finished."""
        return sum(1 for op in self._journal if isinstance(op, Pending))

    def finish(self, pending: Pending) -> Stepped:
        """The results of the oldest unfinished step on the host (waiting for them). Raises
        ``StepFailed``: then the steps dispatched after it, which were given its state, run
        again in order on the state kept or a fresh one, as they would have one at a time."""
        journal = self._journal
        if pending not in journal:
            raise RuntimeError("Engine.finish: this step is not in flight (finished already, or abandoned)")
        while journal[0] is not pending:
            if isinstance(journal[0], Pending):
                raise RuntimeError("Engine.finish: steps are finished in the order they were dispatched")
            journal.popleft()
        journal.popleft()
        failure: BaseException | None = pending.failed
        if failure is None:
            try:
                return self._layout.results(pending.ran, pending.m, pending.route, self._fetch)
            except Exception as exc:  # it failed at run time, after being given the state
                failure = exc
                pending.lost = any(leaf.is_deleted() for leaf in jax.tree.leaves(pending.state_in))
                self._replace(self._layout.fresh() if pending.lost else pending.state_in)
        pending.state_in = None
        if pending.failed is None:  # what was dispatched after it was given its lost or kept state
            self._again()
        raise StepFailed(failure, pending.lost) from failure

    def abandon(self) -> int:
        """Forget the steps in flight (their results are never fetched); how many there were."""
        count = self.unfinished
        self._journal.clear()
        return count

    def reset(self, slots: list[int]) -> None:
        """Give these slots a fresh stream's state (before the step that uses them)."""
        idx, written = self._layout.reset_index(slots)
        self._before_write(written)
        self._apply(lambda state: self._compiled.reset(state, self._compiled.template, idx))

    def begin_snapshot(self, table: TableCopy, counts: Mapping[str, int], settings: Mapping[str, Any],
                       wall_time: float, *, seen_shift: float, incremental: bool,
                       positions: Mapping[str, Any] | None = None) -> PendingSnapshot:
        """A checkpoint of the state as of now (between two steps), copied a chunk at a time by
        its ``advance`` between the next steps, or at once (``incremental=False``, several
        devices, an accelerator); the engine keeps it exact until it is copied."""
        if self.unfinished:
            raise RuntimeError("Engine.begin_snapshot: steps are in flight; a checkpoint holds finished steps only "
                               "(finish them first)")
        layout, generation = self._layout, self.generation
        pending = PendingSnapshot(
            self._state, table, counts, settings, wall_time, rows=self.settings.max_streams + 1,
            get_state=lambda: self._state, seen_shift=seen_shift, incremental=incremental and layout.copies_rows,
            intact=lambda: self.generation == generation, host_copy=layout.host_copy, positions=positions,
            clone=self._compiled.clone if self.clone_checkpoints else None)
        self._copying = pending
        return pending

    def offer_weights(self, params: Any, version: str | None = None) -> str:
        """New values for ``state.params``, applied at the start of the next ``step`` (any thread;
        controller/device/weights.py); their version. ``ValueError`` for a state without params."""
        if self.live_weights is None:
            raise ValueError("set_weights: this processor's state is not a StreamState(params, rows), so it has no "
                             "weights to swap: build it with stream_processor(..., init_params=...) or make init "
                             "return controller.processor.StreamState(params, rows) and read params in step")
        return self.live_weights.offer(params, version)

    @property
    def weights(self) -> Weights | None:
        """The weights in force (None: the state has no params)."""
        return self.live_weights.current if self.live_weights is not None else None

    @property
    def layout(self) -> OneDevice | Sharded:
        """How a batch is laid out for ``steps`` and its results read back (``lay_out``,
        ``results``), for a caller that drives ``steps`` itself (the benchmark's spawn design):
        on an accelerator a step takes and gives packed arrays."""
        return self._layout

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
            slots = self.settings.max_streams + 1
            host = jax.tree.map(lambda saved, now, like: saved if per_stream_leaf(like, slots) else jax.device_get(now),
                                host, self._state, self._canonical)
        self._replace(self._layout.to_device(host))

    def shared_leaves(self) -> list[str]:
        """The paths of the state's leaves that are not per-stream (shared by every stream)."""
        slots = self.settings.max_streams + 1
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
            new_state, *ran = self.steps[bucket](self._state, self._layout.example(bucket))
            self._state = new_state
            route = None if self._layout.placement is None else Route(bucket, np.zeros(0, np.int64), np.zeros(0))
            names = sorted(self._layout.results(tuple(ran), 0, route, self._fetch).outputs)  # type: ignore[arg-type]  # as above
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

    def _run(self, pending: Pending) -> None:
        """Dispatch ``pending``'s step on the state, and start its results' copy to the host; a
        failure is kept in it (the state replaced by a fresh one if the step had been given it)."""
        state = self._state
        pending.failed, pending.lost = None, False
        try:
            new_state, *ran = self._compiled.steps[pending.bucket](state, pending.batch, self._compiled.template)
        except Exception as exc:
            pending.failed = exc
            pending.lost = any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
            if pending.lost:  # donated to the step that failed: gone
                self._replace(self._layout.fresh())
            return
        pending.ran, pending.state_in = tuple(ran), state
        self._state = new_state
        if self._copy_async:
            for leaf in jax.tree.leaves(pending.ran):
                leaf.copy_to_host_async()

    def _apply(self, change: Callable[[Any], Any]) -> None:
        """The state changed by ``change`` (a reset, a weight swap), kept in the journal while steps are in flight."""
        self._state = change(self._state)
        if self._journal:
            self._journal.append(change)

    def _again(self) -> None:
        """Everything dispatched after a step that failed at run time, again, in order, on the
        state now in place: it had been given the failed step's state."""
        for op in self._journal:
            if isinstance(op, Pending):
                self._run(op)
            else:
                self._state = op(self._state)

    def _swap_weights(self) -> None:
        """The offered weights in place of ``state.params``, each leaf put where the old one was
        (its device or devices); the per-stream rows are untouched, so a checkpoint being
        copied stays exact (it took the shared leaves whole when it began)."""
        assert self.live_weights is not None  # called when weights are pending
        leaves = self.live_weights.take(self.steps_run, int(self.device_messages.sum()))
        if leaves is None:
            return
        old, treedef = jax.tree.flatten(self._state.params)
        params = jax.tree.unflatten(treedef, [jax.device_put(new, leaf.sharding) for new, leaf in zip(leaves, old)])
        self._apply(lambda state: state._replace(params=params))


def _read_in_place(tree: Any) -> Any:
    """The step's outputs as numpy arrays, read in place (CPU only)."""
    return jax.tree.map(np.asarray, tree)


def state_shapes(processor: Processor, shape: StateShape | StepShape) -> Any:
    """The shapes and dtypes of ``processor.init`` of ``shape``'s ``StateShape`` (a tree of
    ``ShapeDtypeStruct``), computing nothing."""
    return jax.eval_shape(lambda: processor.init(StateShape.of(shape)))


def compile_step(processor: Processor, settings: StepShape,
                 on_compiled: Callable[[int, float], None] | None = None) -> Engine:
    """Initialise the state on the device(s) and compile ``processor.step`` for ``settings.buckets``;
    ``on_compiled(bucket, seconds)`` is called after each (the preflight prints it). ``settings`` is the
    configuration's ``step_settings()``, or a ``Config`` itself (controller/settings/groups.py ``StepShape``)."""
    with _cache_every_compile():
        return _compile_step(processor, settings, on_compiled)


JAX_MIN_COMPILE_TIME_S = 1.0  # JAX's default for jax_persistent_cache_min_compile_time_secs


@contextlib.contextmanager
def _cache_every_compile() -> Any:
    """With a persistent compilation cache (``jax_compilation_cache_dir``, set in ``jax.config``
    or by JAX_COMPILATION_CACHE_DIR), cache every bucket: they compile in well under JAX's
    default 1 s threshold. Not where the host set the threshold itself (in ``jax.config`` or
    its variable). A JAX setting of the whole process, so it is given back as it was once the
    steps are compiled."""
    name = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, name)
    if (not jax.config.jax_compilation_cache_dir or "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" in os.environ  # type: ignore[attr-defined]  # set at run time
            or before != JAX_MIN_COMPILE_TIME_S):
        yield
        return
    jax.config.update(name, 0.0)
    try:
        yield
    finally:
        jax.config.update(name, before)


def _compile_buckets(layout: Any, processor: Processor, settings: StepSettings, state: Any, template: Any,
                     on_compiled: Callable[[int, float], None] | None) -> dict[int, Any]:
    """The step compiled for each bucket, the processor's contract checked on the way."""
    jitted = layout.jit(processor.step, int(settings.steps_in_flight) > 1)
    # the contract on the shapes first (cheap, and clear errors), then at each bucket as it
    # is lowered
    layout.check(processor.step, state, settings.buckets[0])
    check_row_writes(processor, settings)
    steps = {}
    for bucket in settings.buckets:
        t0 = time.perf_counter()
        steps[bucket] = layout.lower(jitted, state, template, bucket).compile()
        # drop what jit keeps of it (its trace and lowering; the executable is ours) and
        # give the freed heap back: the start's peak is one bucket's work, not all of them
        jitted.clear_cache()
        release_freed_memory()
        if on_compiled is not None:
            on_compiled(bucket, time.perf_counter() - t0)
    return steps


def _compile_step(processor: Processor, settings: StepShape,
                  on_compiled: Callable[[int, float], None] | None) -> Engine:
    check_input_dtype(processor)  # float32, or float64 with JAX's x64 mode on: before anything is built
    devices = use_devices(settings.devices)
    settings = StepSettings.on_platform(settings, devices[0].platform)  # steps_in_flight resolved, once
    canonical = state_shapes(processor, settings)
    check_platform_dtypes(processor, canonical, devices[0].platform)  # a TPU's float64 is not IEEE double
    largest = max((leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(canonical)), default=0) // len(devices)
    # below XLA's 256 KB a task it splits nothing, and compiling on one CPU is slower (LLVM's
    # workers share it): +1.1 s at the default settings on 2 cores, so only where it pays
    unsplit = unsplit_cpu_ops(devices) if largest >= XLA_CPU_TASK_BYTES else contextlib.nullcontext()
    # the same program compiled before in this process: its executables, nothing traced again
    # (controller/device/programs.py says when that is sure)
    key = program_key(processor, settings, devices, canonical)
    if key is not None:  # the guard's reset is compiled in with steps in flight only
        key = (*key, int(settings.steps_in_flight) > 1)
    with unsplit:
        several = len(devices) > 1
        layout = Sharded(processor, settings, devices) if several else OneDevice(processor, settings, devices[0])
        state = layout.fresh()
        key = key and (*key, layout.packed)  # a packed step takes and gives other arrays
        again = kept(key)
        if again is not None:
            template, reset, steps = again.template(state), again.reset, dict(again.steps)
            assert isinstance(layout, OneDevice)  # program_key keeps one device's programs only
            layout.use_outputs(again.outputs)
            for bucket in settings.buckets:
                if on_compiled is not None:
                    on_compiled(bucket, 0.0)
        else:
            make_template = layout.compile_template(state)
            template = make_template(state)
            reset = layout.compile_reset(state, template)
            steps = _compile_buckets(layout, processor, settings, state, template, on_compiled)
            keep(key, steps, reset, make_template, layout.fields)
        clone = layout.compile_clone(state)
    if layout.placement is None:
        held = sorted({str(d) for leaf in jax.tree.leaves(state) for d in leaf.devices()}) or [str(devices[0])]
    else:
        held = [str(d) for d in devices]
    return Engine(layout, state, _Compiled(steps, template, reset, clone), tuple(held), canonical, processor, settings)

