"""Layouts: how the device state, a batch and its results are placed on one device or several.

Rules:
- A layout is the engine's one switch between one device and several (``FORKLESS_DEVICES``): ``OneDevice`` (no
  mesh; on the CPU a padded ``Batch`` in and the outputs read in place; on an accelerator one packed array each
  way) or ``Sharded`` (a 1-D mesh ``"d"``, per-stream leaves sharded by stream, the step ``shard_map``-ped, one
  packed array each way per device).
- A packed batch is uint32 words (``placement.pack_words``): a key never travels in a float array, whose copy to
  an accelerator need not keep its bits. Each array is one transfer, so a step's arrays travel packed (results as
  bytes, ``unpack_outputs``); on the CPU unpacked arrays are read in place, cheaper (bench/packed_io.py).
- A checkpoint of a state not copied in rows between steps is cloned on the device(s) on the main thread
  (``compile_clone``), its copy to the host started there and waited for by the writer thread.
- Both layouts have one interface (``fresh``, ``compile_template``, ``compile_reset``, ``jit``, ``check``, ``lower``,
  ``example``, ``lay_out``, ``results``, ``reset_index``, ``to_device``, ``compile_clone``, ``host_copy``,
  ``device_rows``, ``counts``), and hold no state: handed the state, they give back what to put in its place;
  only the engine assigns it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from forkless.controller.batching import Batch, bucket_for, pad_batch
from forkless.controller.declared import check_counters
from forkless.controller.device.compiled import (
    as_bytes,
    check_contract,
    check_replicated_unchanged,
    example_batch,
    guarded,
    one_call,
    output_layout,
    per_stream_leaf,
    unpack_words,
)
from forkless.controller.device.placement import (
    CanonicalRows,
    OutputField,
    Placement,
    Route,
    pack_words,
    unpack_outputs,
)
from forkless.controller.errors import ProcessorContractError
from forkless.controller.processor import Processor, StateShape, description_of, reset_rows, row_template
from forkless.controller.settings.groups import StepShape

__all__ = ["AXIS", "OneDevice", "Sharded", "Stepped", "accelerated", "canonical_rows", "device_copy"]

AXIS = "d"  # the mesh's one axis: the devices, along which the stream table is sharded


def canonical_rows(leaf: Any, placement: Placement) -> CanonicalRows:
    """A sharded leaf's device shards, in mesh order, as a lazily canonical host leaf (what a checkpoint takes of a
    state spread over several devices: controller/checkpoints/snapshot.py)."""
    shards = sorted(leaf.addressable_shards, key=lambda shard: shard.index[0].start or 0)
    return CanonicalRows([np.asarray(shard.data) for shard in shards], placement)


class Stepped(NamedTuple):
    """One batch's results on the host, in arrival order, cut to its ``m`` messages:
    ``outputs`` (name -> [m, ...]) and ``bad`` (bool [m]: a non-finite output)."""

    outputs: dict[str, np.ndarray]
    bad: np.ndarray



def accelerated(platform: str) -> bool:
    """Whether one device of ``platform`` (a device's ``platform`` string) takes the accelerator's
    path: a packed array each way per step, a checkpoint cloned on the device. Not the CPU: its
    arrays are read in place, so three of them cost less than packing them (bench/packed_io.py),
    and its checkpoints are copied in rows between steps."""
    return platform != "cpu"


# ---- layouts: how the state and a batch are placed on one device or several ------------------


class OneDevice:
    """One device: the state as ``init`` builds it, on ``device``. ``packed`` (default: on an
    accelerator) steps one uint32 array in and one byte array out; otherwise a padded ``Batch``
    in, ``(state, outputs, bad)`` out."""

    placement = None
    per_stream = None
    copies_rows = True  # a checkpoint may copy the state a chunk of rows at a time between steps

    def __init__(self, processor: Processor, settings: StepShape, device: Any, packed: bool | None = None) -> None:
        self.processor, self.settings, self.device = processor, settings, device
        self.spare_key = settings.max_streams
        self.dtype = description_of(processor).input_dtype  # batch.x's
        self.shardings: Any = None
        self.packed = accelerated(device.platform) if packed is None else packed
        self.fields: tuple[OutputField, ...] = ()  # where each output sits in a packed result row

    def fresh(self) -> Any:
        with jax.default_device(self.device):
            state = jax.device_put(self.processor.init(StateShape.of(self.settings)), self.device)
        self.shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
        return state

    def compile_template(self, state: Any) -> Callable[[Any], Any]:
        """state -> the fresh row of each per-stream leaf, for the reset (``row_template``),
        compiled (one computation, kept with the program: controller/device/programs.py)."""
        slots = self.settings.max_streams + 1
        return jax.jit(lambda s: row_template(s, slots)).lower(state).compile()

    def compile_reset(self, state: Any, template: Any) -> Any:
        return jax.jit(reset_rows, donate_argnums=0).lower(
            state, template, np.zeros(self.settings.max_batch, np.int32)).compile()

    def compile_clone(self, state: Any) -> Any:
        """The state copied on its device, for a checkpoint; None on the CPU (copied in rows)."""
        return device_copy(state, self.shardings) if accelerated(self.device.platform) else None

    def jit(self, step: Callable[..., Any], reset: bool) -> Any:
        # the state is donated: XLA updates the table in place, so a step costs O(B), not O(S);
        # the template (fresh rows, for the guard's reset: ``reset``) is not
        guarded_step = guarded(step, reset)
        if not self.packed:
            return jax.jit(guarded_step, donate_argnums=0)
        features, dtype = self.settings.features, self.dtype

        def packed_step(state: Any, words: jax.Array, template: Any) -> tuple[Any, jax.Array]:
            new_state, outputs, bad = guarded_step(state, unpack_words(words, features, dtype), template)
            return new_state, as_bytes([outputs[field.name] for field in self.fields[:-1]] + [bad])

        return jax.jit(packed_step, donate_argnums=0)

    def use_outputs(self, fields: tuple[OutputField, ...]) -> None:
        """Where a kept program's packed step puts each output (controller/device/programs.py): its
        steps are not traced again, so ``check`` does not learn it."""
        self.fields = fields

    def check(self, step: Callable[..., Any], state: Any, bucket: int) -> None:
        out_info = jax.eval_shape(step, state, self._batch(bucket))
        check_contract(state, out_info, bucket)
        check_counters(self.processor.description.counters, out_info[1])
        if not self.fields:
            self.fields = output_layout(out_info[1])

    def lower(self, jitted: Any, state: Any, template: Any, bucket: int) -> Any:
        """The step lowered for ``bucket``, its contract checked on the lowering's own trace (the
        guard adds ``bad``): one trace a bucket, not two (0.06 s each with the default step).
        Packed, the lowering's outputs are bytes: checked on the step's shapes (``check``)."""
        if self.packed:
            if bucket != self.settings.buckets[0]:
                self.check(self.processor.step, state, bucket)
            return jitted.lower(state, self.example(bucket), template)
        lowered = jitted.lower(state, self.example(bucket), template)
        new_state, outputs, _bad = lowered.out_info
        check_contract(state, (new_state, outputs), bucket)
        return lowered

    def _batch(self, bucket: int) -> Batch:
        return example_batch(self.settings.features, bucket, self.spare_key, self.dtype)

    def example(self, bucket: int) -> Batch | np.ndarray:
        """An all-padding batch as the compiled step takes it."""
        if self.packed:
            return pack_words(np.zeros((0, self.settings.features), self.dtype), np.zeros(0, np.int32), bucket,
                              self.spare_key, self.dtype)
        return self._batch(bucket)

    def lay_out(self, x: np.ndarray, key: np.ndarray) -> tuple[int, Batch | np.ndarray, None, np.ndarray]:
        """The bucket, the batch for its step, the route back (none here) and the rows it writes."""
        bucket = bucket_for(len(key), self.settings.buckets)
        if self.packed:
            written = np.full(bucket, self.spare_key, np.int32)
            written[:len(key)] = key
            return bucket, pack_words(x, key, bucket, self.spare_key, self.dtype), None, written
        batch = pad_batch(x, key, bucket, self.spare_key, self.dtype)
        return bucket, batch, None, batch.key

    def results(self, ran: tuple[Any, ...], m: int, route: None, fetch: Callable[[Any], Any]) -> Stepped:
        if self.packed:
            (packed,) = ran  # the outputs and flags in one byte array: one transfer
            arrays = unpack_outputs(np.asarray(fetch(packed)), self.fields, slice(0, m))
            return Stepped({field.name: a for field, a in zip(self.fields[:-1], arrays)}, arrays[-1])
        outputs, bad = fetch(ran)  # one transfer (also surfaces the step's runtime errors)
        return Stepped({name: np.asarray(value)[:m] for name, value in outputs.items()}, np.asarray(bad)[:m])

    def reset_index(self, slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The reset's index and the rows it writes."""
        idx = np.full(self.settings.max_batch, self.spare_key, np.int32)  # padded with the spare
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


class Sharded:
    """Several devices: per-stream leaves sharded by stream over a 1-D mesh, the step
    ``shard_map``-ped; one packed array in, one packed byte array out (controller/device/placement.py)."""

    copies_rows = False  # a sharded state's checkpoint is copied at once, put in order by the writer
    packed = True  # one packed array each way per device

    def __init__(self, processor: Processor, settings: StepShape, devices: list[Any]) -> None:
        if not description_of(processor).per_stream:
            raise ProcessorContractError(
                f"this processor declares per_stream=False (its step mixes streams), so it cannot be sharded over "
                f"{len(devices)} devices: run it on one device with FORKLESS_DEVICES=1")
        self.processor, self.settings = processor, settings
        self.dtype = processor.description.input_dtype  # batch.x's, and the packed batch's
        n = len(devices)
        self.placement = place = Placement(n, settings.max_streams)
        self.spare_key = place.spare_row
        self.mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
        shape = StateShape.of(settings)  # what init is handed
        canonical = jax.eval_shape(lambda: processor.init(shape))
        self.per_stream = jax.tree.map(lambda leaf: per_stream_leaf(leaf, settings.max_streams + 1), canonical)
        self.specs = jax.tree.map(lambda sharded: P(AXIS) if sharded else P(), self.per_stream)
        self.shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.specs,
                                      is_leaf=lambda v: isinstance(v, P))
        self.rows = NamedSharding(self.mesh, P(AXIS))  # a batch, its outputs, a reset's index: [N * Bd]
        self.local_state = jax.tree.map(
            lambda leaf, sharded: jax.ShapeDtypeStruct(
                (place.rows_per_device, *leaf.shape[1:]) if sharded else leaf.shape, leaf.dtype),
            canonical, self.per_stream)
        self.fields: tuple[OutputField, ...] = ()

        def fresh_state() -> Any:
            # the contract makes every per-stream row of init equal: row 0, repeated over the
            # sharded table (XLA drops the rest of init, so no device holds the whole table)
            state = processor.init(shape)
            return jax.tree.map(lambda leaf, sharded: jnp.broadcast_to(leaf[0], (place.table_rows, *leaf.shape[1:]))
                                if sharded else leaf, state, self.per_stream)

        self.fresh = jax.jit(fresh_state, out_shardings=self.shardings).lower().compile()

    def compile_template(self, state: Any) -> Callable[[Any], Any]:
        """state -> the fresh row of each per-stream leaf, for the reset, on every device."""
        replicated = NamedSharding(self.mesh, P())
        return lambda s: jax.device_put(one_call(lambda t: jax.tree.map(
            lambda leaf, sharded: leaf[0] if sharded else None, t, self.per_stream), s), replicated)

    def compile_reset(self, state: Any, template: Any) -> Any:
        replicated = NamedSharding(self.mesh, P())
        template_specs = jax.tree.map(lambda _: P(), template)
        reset = jax.jit(jax.shard_map(reset_rows, mesh=self.mesh, in_specs=(self.specs, template_specs, P(AXIS)),
                                      out_specs=self.specs, check_vma=False),
                        in_shardings=(self.shardings, jax.tree.map(lambda _: replicated, template), self.rows),
                        out_shardings=self.shardings, donate_argnums=0,
                        ).lower(state, template, np.zeros(self.placement.devices * self.settings.max_batch, np.int32)
                                ).compile()
        return reset

    def jit(self, step: Callable[..., Any], reset: bool) -> Any:
        features, dtype = self.settings.features, self.dtype
        guarded_step = guarded(step, reset)

        def per_device(state: Any, packed: jax.Array, template: Any) -> tuple[Any, jax.Array]:
            new_state, outputs, bad = guarded_step(state, unpack_words(packed, features, dtype), template)
            return new_state, as_bytes([outputs[field.name] for field in self.fields[:-1]] + [bad])

        # check_vma off: the processor's own code need not mark device-varying values (pcast);
        # what it must not do (change a replicated leaf) is checked on its jaxpr instead
        # the template (compile_template's: a fresh row of each per-stream leaf) on every device
        template_specs = jax.tree.map(lambda sharded: P() if sharded else None, self.per_stream)
        replicated = jax.tree.map(lambda sharded: NamedSharding(self.mesh, P()) if sharded else None,
                                  self.per_stream)
        mapped = jax.shard_map(per_device, mesh=self.mesh, in_specs=(self.specs, P(AXIS), template_specs),
                               out_specs=(self.specs, P(AXIS)), check_vma=False)
        return jax.jit(mapped, in_shardings=(self.shardings, self.rows, replicated),
                       out_shardings=(self.shardings, self.rows), donate_argnums=0)

    def check(self, step: Callable[..., Any], state: Any, bucket: int) -> None:
        local = example_batch(self.settings.features, bucket, self.spare_key, self.dtype)
        out_info = jax.eval_shape(step, self.local_state, local)
        check_contract(self.local_state, out_info, bucket)
        check_counters(self.processor.description.counters, out_info[1])
        check_replicated_unchanged(step, self.local_state, local, self.per_stream)
        if not self.fields:
            self.fields = output_layout(out_info[1])

    def lower(self, jitted: Any, state: Any, template: Any, bucket: int) -> Any:
        """The step lowered for ``bucket`` after its contract is checked (on the per-device step:
        the lowering's is the packed one); the first bucket's was checked before (``check``)."""
        if bucket != self.settings.buckets[0]:
            self.check(self.processor.step, state, bucket)
        return jitted.lower(state, self.example(bucket), template)

    def example(self, bucket: int) -> np.ndarray:
        place = self.placement
        return place.pack(np.zeros((0, self.settings.features), self.dtype), np.zeros(0, np.int32),
                          Route(bucket, np.zeros(0, np.int64), np.zeros(place.devices, np.int64)), self.dtype)

    def lay_out(self, x: np.ndarray, key: np.ndarray) -> tuple[int, np.ndarray, Route, None]:
        # grouped by owning device: [N, Bd], Bd the bucket of the busiest device; one array: one
        # transfer per device. A sharded state's checkpoint is copied at once (no rows to keep).
        route = self.placement.route(key, self.settings.buckets)
        return route.bucket, self.placement.pack(x, key, route, self.dtype), route, None

    def results(self, ran: tuple[Any, ...], m: int, route: Route, fetch: Callable[[Any], Any]) -> Stepped:
        (packed,) = ran  # the outputs and flags packed in one byte array, as the batch was
        arrays = unpack_outputs(np.asarray(fetch(packed)), self.fields, route.positions)  # back in arrival order
        return Stepped({field.name: a for field, a in zip(self.fields[:-1], arrays)}, arrays[-1])

    def reset_index(self, slots: list[int]) -> tuple[np.ndarray, None]:
        return self.placement.reset_index(slots, self.settings.max_batch), None  # [N, max_batch] local rows

    def compile_clone(self, state: Any) -> Any:
        """The state copied on its devices, each shard where it is, for a checkpoint."""
        return device_copy(state, self.shardings)

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


def device_copy(state: Any, shardings: Any) -> Any:
    """A compiled copy of ``state`` on the device(s) it is on (new buffers, never the given
    ones: a later step may be donated the state while the copy is read)."""
    copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s),  # a copy op: XLA gives it a buffer of its own
                   in_shardings=(shardings,), out_shardings=shardings)
    return copy.lower(state).compile()
