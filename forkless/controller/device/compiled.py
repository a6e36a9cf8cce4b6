"""The device layer's building blocks: the processor-contract checks, the finiteness guard, the CPU compile setting,
the compilation counter. controller/engine.py compiles with them.

Rules:
- The processor contract is checked on the compiled shapes, so a violation stops the start with
  ``ProcessorContractError`` naming the output or leaf, its shape and the rule, not an IndexError at the first
  message: outputs ``[B, ...]`` and a state of unchanged structure, shapes and dtypes (``check_contract``); only the
  batch's rows of a per-stream leaf written (``check_row_writes``); on several devices replicated leaves unchanged
  (``check_replicated_unchanged``, on the jaxpr).
- Each compiled step is wrapped by ``guarded``: non-finite outputs are marked, and with steps in flight their
  streams' rows are reset inside the same step (a step dispatched before the host sees them reads fresh rows).
- On the CPU no op of the step is split across threads (``unsplit_cpu_ops``): XLA:CPU prices a table's gather or
  scatter by the table's bytes and splits ops that touch B rows into a task per thread, each paying a hand-off.
  It sizes the split by the compiling thread's CPUs, so every thread is held on one CPU while the steps compile,
  only where a state leaf is at least ``XLA_CPU_TASK_BYTES`` (bench/docs/levers.md).
- Every XLA compilation in this process is counted from JAX's own monitoring events.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from forkless.controller.batching import Batch, pad_batch
from forkless.controller.device.placement import OutputField
from forkless.controller.errors import ProcessorContractError
from forkless.controller.processor import Processor, StateShape, description_of
from forkless.controller.settings.groups import StepShape
from forkless.io_loop.errors import ConfigError

log = logging.getLogger("forkless.compile")

__all__ = ["as_bytes", "check_contract", "check_input_dtype", "check_platform_dtypes", "check_replicated_unchanged",
           "check_row_writes", "codec_dtype", "compilations", "example_batch", "guarded", "one_call",
           "output_layout", "per_stream_leaf", "release_freed_memory", "reset_bad_rows", "unpack_words",
           "unsplit_cpu_ops", "use_devices"]

_COMPILATIONS = [0]


def _on_event(event: str, duration_secs: float, **_: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILATIONS[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compilations() -> int:
    """XLA compilations so far in this process."""
    return _COMPILATIONS[0]


def example_batch(features: int, bucket: int, spare_slot: int, dtype: Any = np.float32) -> Batch:
    """An all-padding batch of ``bucket`` rows: the shapes and dtypes every real batch has
    (``x`` of ``dtype``, the processor's ``input_dtype``)."""
    return pad_batch(np.zeros((0, features), dtype), np.zeros(0, np.int32), bucket, spare_slot, dtype)


X64_FIX = ('jax.config.update("jax_enable_x64", True) at the top of the program, before any JAX array is made, '
           'or JAX_ENABLE_X64=1 in its environment')


def codec_dtype(processor: Processor) -> np.dtype:
    """The dtype the codec builds ``x`` in: the processor's declared input dtype (float32 or
    float64, checked when its ``Description`` was built)."""
    return description_of(processor).input_dtype


def check_input_dtype(processor: Processor) -> np.dtype:
    """The processor's input dtype, refused (``ProcessorContractError``) if it is float64 and
    JAX's 64-bit mode is off: JAX would silently make the input float32 again. The mode is
    process-wide, so it is the host program's to turn on, never this library's."""
    dtype = description_of(processor).input_dtype
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]  # set at run time
        raise ProcessorContractError(f"the processor declares input_dtype=float64, which needs JAX's 64-bit mode, "
                                     f"and it is off in this process (JAX would make the input float32 again): "
                                     f"turn it on before starting, with {X64_FIX}; forkless does not change "
                                     f"process-wide settings itself")
    return dtype


# what a TPU's float64 is: XLA emulates it with a pair of float32, so it has float32's range and about
# twice its precision (docs/embedding/contract.md, "input dtype")
TPU_FLOAT64 = ("on a TPU, float64 is not IEEE double: XLA emulates it with pairs of float32, with float32's "
               "range (1e300 became inf, 1e-310 became 0) and less precision (exp erred by ~3.9e-14 against "
               "~8.9e-16 on a CPU)")


def check_platform_dtypes(processor: Processor, shapes: Any, platform: str) -> None:
    """Refuse (``ProcessorContractError``) a float64 input on a TPU (``platform``, a device's
    ``platform`` string), and warn (logged) about float64 state leaves there: its float64 is
    not IEEE double (``TPU_FLOAT64``), so the values would not be what the processor computes on
    a CPU or a GPU. With JAX's 64-bit mode on (process-wide), ``jnp.zeros(rows)`` without a
    dtype is float64: the warning names such leaves."""
    if platform != "tpu":
        return
    dtype = description_of(processor).input_dtype
    if dtype.itemsize == 8:
        raise ProcessorContractError(
            f"the processor declares input_dtype=float64, and this process runs on a TPU: {TPU_FLOAT64}. "
            f"Declare input_dtype=float32 to run on the TPU, or run on a CPU (JAX_PLATFORMS=cpu) or a GPU, "
            f"where float64 is IEEE double")
    wide = [jax.tree_util.keystr(path) or "(the state)"
            for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]
            if np.dtype(leaf.dtype) in (np.dtype(np.float64), np.dtype(np.complex128))]
    if wide:
        log.warning("state leaves %s are float64 on a TPU: %s. With JAX's 64-bit mode on, jnp.zeros(...) without a "
                    "dtype is float64: give init's arrays dtype=jnp.float32", ", ".join(wide), TPU_FLOAT64)


def use_devices(setting: int | str) -> list[Any]:
    """The local devices ``FORKLESS_DEVICES`` asks for: all of them, or the first N;
    ``ConfigError`` when more are asked for than there are."""
    available = jax.local_devices()
    if setting == "all":
        return available
    if int(setting) > len(available):
        raise ConfigError("FORKLESS_DEVICES", str(setting),
                          f"all, or at most {len(available)} (this process has {len(available)} local device(s): "
                          f"{', '.join(map(str, available))})")
    return available[:int(setting)]


XLA_CPU_TASK_BYTES = 256 << 10  # XLA:CPU's least cost (bytes accessed) per task when it splits an op


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []


@contextlib.contextmanager
def unsplit_cpu_ops(devices: list[Any]) -> Iterator[None]:
    """Compile inside this for no op split across threads on CPU devices (module docstring).

    Every thread of the process runs on one of its CPUs meanwhile; each is given back its own
    CPU set after, and a thread started meanwhile (LLVM's workers) the one the calling thread
    had. No effect off Linux, on accelerators, or with one CPU already."""
    if not hasattr(os, "sched_setaffinity") or any(d.platform != "cpu" for d in devices):
        yield
        return
    mine = os.sched_getaffinity(0)
    threads = _threads()
    if len(mine) <= 1 or not threads:
        yield
        return
    saved: dict[int, set[int]] = {}
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            saved[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {min(mine)})
    try:
        yield
    finally:
        for tid in _threads():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, saved.get(tid, mine))


def release_freed_memory() -> None:
    """Give the heap the XLA compiler freed back to the OS (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def one_call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` as one XLA computation that is not kept: run eagerly, each op would leave
    its own compiled executable resident in JAX's cache for the life of the process."""
    return jax.jit(fn)(*args)


def output_layout(outputs: dict[str, Any]) -> tuple[OutputField, ...]:
    """Where each output, then the finiteness flags (bool, named ""), sit in a packed row."""
    fields, offset = [], 0
    for name, leaf in [*sorted(outputs.items()), ("", jax.ShapeDtypeStruct((1,), jnp.bool_))]:
        tail = tuple(leaf.shape[1:])
        dtype = np.dtype(leaf.dtype)
        nbytes = int(np.prod(tail, dtype=np.int64)) * dtype.itemsize
        fields.append(OutputField(name, dtype, tail, offset, nbytes))
        offset += nbytes
    return tuple(fields)


def as_bytes(leaves: list[jax.Array]) -> jax.Array:
    """Leaves with a common leading axis B side by side as uint8 [B, T] (bool as 0/1 bytes)."""
    b = leaves[0].shape[0]
    parts = []
    for leaf in leaves:
        flat = leaf.reshape(b, -1)
        if flat.dtype == jnp.bool_:
            flat = flat.astype(jnp.uint8)
        parts.append(jax.lax.bitcast_convert_type(flat, jnp.uint8).reshape(b, -1))
    return jnp.concatenate(parts, axis=1)


def unpack_words(words: jax.Array, features: int, dtype: Any) -> Batch:
    """The ``Batch`` in a packed batch of uint32 words (``placement.pack_words``), on the device:
    ``x`` from its bits as ``dtype``, the key as int32, ``valid``; bitcasts only."""
    dtype = np.dtype(dtype)
    width = features * dtype.itemsize // 4
    bits = words[:, :width]
    if dtype.itemsize == 8:  # two words a value, in the host's (little-endian) order, made one
        # uint64 of the same width first: XLA:CPU's simplifier broke a u32 pair -> f64 -> u8
        # chain of bitcasts (the byte outputs) into a wrongly shaped one (an HLO verifier error)
        pairs = bits.reshape(words.shape[0], features, 2).astype(jnp.uint64)
        bits = pairs[..., 0] | (pairs[..., 1] << 32)
    x = jax.lax.bitcast_convert_type(bits, dtype)
    key = jax.lax.bitcast_convert_type(words[:, width], jnp.int32)
    return Batch(x, key, words[:, width + 1] != 0)


def per_stream_leaf(leaf: Any, slots: int) -> bool:
    """The contract's default: a leaf whose leading axis is ``max_streams + 1`` is per-stream."""
    shape: tuple[int, ...] = getattr(leaf, "shape", ())
    return len(shape) >= 1 and shape[0] == slots


def check_replicated_unchanged(step: Callable[..., Any], state: Any, batch: Batch, per_stream: Any) -> None:
    """Raise ``ProcessorContractError`` unless ``step`` returns every leaf that is not
    per-stream (so replicated on every device) exactly as it was given: each device runs
    its own copy, and a changed copy would differ between devices."""
    closed = jax.make_jaxpr(step)(state, batch)
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    flags = jax.tree.leaves(per_stream)
    ins, outs = closed.jaxpr.invars[:len(paths)], closed.jaxpr.outvars[:len(paths)]
    for (path, leaf), sharded, given, returned in zip(paths, flags, ins, outs):
        if not sharded and returned is not given:
            raise ProcessorContractError(
                f"state leaf {jax.tree_util.keystr(path) or '(the state)'} ({leaf.dtype}{list(leaf.shape)}) is not "
                f"per-stream (its leading axis is not max_streams + 1), so on several devices it is replicated and "
                f"step must return it unchanged; it returns a new value: run this processor with FORKLESS_DEVICES=1")


def guarded(step: Callable[[Any, Batch], tuple[Any, dict[str, Any]]], reset: bool = True
            ) -> Callable[[Any, Batch, Any], tuple[Any, dict[str, Any], Any]]:
    """``step`` plus the finiteness guard: ``(state, batch, template) -> (state, outputs, bad)``.

    ``bad`` (bool [B]) marks the messages with a NaN or an infinity in any float output; with
    ``reset`` their streams' rows of every per-stream leaf are set to ``template``
    (``row_template``: a fresh stream's) in the same computation (``reset_bad_rows``), so a
    stream whose state went non-finite starts again instead of staying poisoned, and the next
    step, dispatched before this one's outputs reach the host (steps in flight), already reads
    the fresh rows. Its scatters cost every step (docs/performance.md, "Steps in flight"), so it
    is compiled in only with steps in flight; one step at a time, the caller resets those streams
    before the next step (``template`` is then unused). It checks the outputs only, as reading the
    table's rows back after the in-place write costs several times more: a processor whose state
    could go non-finite without its outputs showing it keeps its arithmetic within range
    (docs/reliability.md, "numbers out of range")."""

    def guarded_step(state: Any, batch: Batch, template: Any) -> tuple[Any, dict[str, Any], Any]:
        new_state, outputs = step(state, batch)
        n = batch.key.shape[0]
        finite = jnp.ones(n, bool)
        for value in outputs.values():
            # an output not [B, ...] breaks the contract, which the compile checks on this trace
            if jnp.issubdtype(value.dtype, jnp.inexact) and value.shape[:1] == (n,):
                finite &= jnp.isfinite(value.reshape(n, -1)).all(axis=1)
        bad = ~finite & batch.valid
        return (reset_bad_rows(new_state, template, batch.key, bad) if reset else new_state), outputs, bad

    return guarded_step


def reset_bad_rows(state: Any, template: Any, key: Any, bad: Any) -> Any:
    """``state`` with the rows ``key[bad]`` of every per-stream leaf (``template``'s leaves that
    are not None) set to their fresh row; nothing else written."""

    def reset(row: Any, leaf: Any) -> Any:
        if row is None:
            return leaf
        idx = jnp.where(bad, key, leaf.shape[0])  # out of the table: dropped
        return leaf.at[idx].set(jnp.broadcast_to(row, (key.shape[0], *row.shape)), mode="drop")

    return jax.tree.map(reset, template, state, is_leaf=lambda row: row is None)


def check_contract(state: Any, out_info: Any, bucket: int) -> None:
    """Raise ``ProcessorContractError`` unless ``out_info`` (the compiled step's output shapes
    for a batch of ``bucket`` rows) is ``(state of the same shapes, {name: [B, ...]})``."""
    rule = f"outputs must have shape [B, ...] (B = {bucket}, the rows of the padded batch)"
    if not (isinstance(out_info, tuple) and len(out_info) == 2):
        raise ProcessorContractError("step must return (state, outputs)")
    new_state, outputs = out_info
    before = jax.tree.structure(state)
    if jax.tree.structure(new_state) != before:  # type: ignore[operator]  # jaxlib has no stub for PyTreeDef
        raise ProcessorContractError(f"step must return a state of the same structure as it was given: "
                                     f"got {jax.tree.structure(new_state)}, expected {before}")
    for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
        if (old.shape, old.dtype) != (new.shape, new.dtype):
            raise ProcessorContractError(f"step must return state leaves of unchanged shape and dtype: "
                                         f"{old.dtype}{list(old.shape)} came back as {new.dtype}{list(new.shape)}")
    if not isinstance(outputs, dict) or not all(isinstance(k, str) for k in outputs):
        raise ProcessorContractError(f"step must return outputs as a dict of arrays keyed by name, "
                                     f"got {type(outputs).__name__}")
    for name, leaf in outputs.items():
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape or shape[0] != bucket:
            raise ProcessorContractError(f"output {name!r} has shape {list(shape)}: {rule}")


# check_row_writes' small step: a table of this many streams, a batch writing two of them
SMALL_STREAMS = 12  # 13 rows: a shared leaf is rarely that long by chance
SMALL_KEYS = (1, 4, 1)


def check_row_writes(processor: Processor, settings: StepShape) -> None:
    """Raise ``ProcessorContractError`` if ``processor.step`` writes rows of a per-stream leaf
    other than its batch's (``batch.key``, the spare row of padding included).

    One step at a small size, run once before compiling: the processor's state for a table of
    ``SMALL_STREAMS`` streams, every per-stream row filled with distinct values, one step of a
    batch holding streams 1 and 4 (1 twice) and padding; every other row must come back bit
    for bit. Why it matters: a checkpoint copied between steps keeps exactly the rows each step
    is about to write (controller/checkpoints/checkpoint.py), so a step that writes others (or all rows:
    a decay of every stream, a ``jnp.where`` over the table) would make it inexact, and would
    cost O(max_streams) a step. A processor whose ``init`` or ``step`` cannot run at that size
    is not checked so (logged)."""
    small = StateShape(max_streams=SMALL_STREAMS, features=settings.features)
    slots = SMALL_STREAMS + 1
    rng = np.random.default_rng(0)
    bucket = min(4, settings.max_batch)
    keys = np.asarray(SMALL_KEYS[:bucket], np.int32)
    try:
        state = jax.device_get(one_call(lambda: processor.init(small)))
        paths = jax.tree_util.tree_flatten_with_path(state)[0]
        treedef = jax.tree.structure(state)
        filled = [_distinct_rows(np.asarray(leaf), rng) if per_stream_leaf(leaf, slots) else leaf
                  for _, leaf in paths]
        batch = pad_batch(rng.standard_normal((len(keys), settings.features)), keys, bucket, SMALL_STREAMS,
                          description_of(processor).input_dtype)
        stepped = jax.jit(processor.step)
        new_state, _ = jax.device_get(stepped(jax.tree.unflatten(treedef, filled), batch))
        stepped.clear_cache()  # type: ignore[attr-defined]  # jax's stub of jit's result lacks it
    except Exception as exc:  # any failure at the small size only skips the check
        log.warning("the processor's row writes were not checked (its init or step does not run with a table of %d "
                    "streams: %s: %s); the contract still holds: a step writes only its batch's rows of a "
                    "per-stream leaf", SMALL_STREAMS, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return
    allowed = np.zeros(slots, bool)
    allowed[keys] = True
    allowed[SMALL_STREAMS] = True  # padding's spare row
    for (path, _), before, after in zip(paths, filled, jax.tree.leaves(new_state)):
        if not per_stream_leaf(before, slots):
            continue
        b = np.ascontiguousarray(before).reshape(slots, -1).view(np.uint8)
        a = np.ascontiguousarray(np.asarray(after, dtype=before.dtype)).reshape(slots, -1).view(np.uint8)
        changed = np.flatnonzero((a != b).any(axis=1) & ~allowed)
        if changed.size:
            raise ProcessorContractError(
                f"state leaf {jax.tree_util.keystr(path) or '(the state)'} is per-stream (leading axis "
                f"max_streams + 1) and step wrote rows other than its batch's: checked with a table of "
                f"{SMALL_STREAMS} streams and a batch of streams {sorted(set(keys.tolist()))} (padding at the "
                f"spare row {SMALL_STREAMS}), rows "
                f"{changed.tolist()} changed. A step must write only batch.key's rows of a per-stream leaf "
                f"(state.leaf.at[key].set(rows)); checkpoints copied between steps rely on it, and a step over "
                f"every row costs O(max_streams) (controller/processor.py)")


def _distinct_rows(leaf: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``leaf`` with every row filled with values that differ from row to row."""
    if leaf.dtype == np.bool_:
        return rng.random(leaf.shape) < 0.5
    if np.issubdtype(leaf.dtype, np.integer):
        return rng.integers(0, 5, leaf.shape).astype(leaf.dtype)
    if np.issubdtype(leaf.dtype, np.floating) or np.issubdtype(leaf.dtype, np.complexfloating):
        return rng.standard_normal(leaf.shape).astype(leaf.dtype)
    return leaf
