"""Live weights: a processor's parameters swapped while it runs, between two batches, no recompile.

Rules:
- The weights are ``state.params`` of a ``StreamState(params, rows)``: shared leaves passed to the compiled step
  as arguments, never baked into it. A swap gives them new values of the same structure, shapes and dtypes, so
  the executables compiled at start run on: nothing is traced or compiled again.
- ``offer`` is callable from any thread: it checks the new weights against the compiled shapes (``ValueError``
  naming the first leaf that differs) and copies them to host memory; it touches no device. The newest offer
  waits in one slot (a later one replaces it, logged) until the engine's next step puts it on the device(s) where
  the old leaves were, on the main thread, the per-stream rows and connections untouched.
- Which weights a result came from is recorded: ``Weights`` (version, digest, the step and message count they
  applied from, the swaps) is in ``stats().weights``, logged at each swap, and written into every checkpoint's
  settings (recorded, never matched).
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["LiveWeights", "Weights", "checked_weights", "weights_digest"]

log = logging.getLogger("forkless.controller")

INIT = "init"  # the version of the weights the processor's init built


class Weights(NamedTuple):
    """The weights in force: ``version`` (the caller's name for them, else their digest; "init":
    the processor's ``init``), ``digest`` (sha256 of their dtypes, shapes and bytes, 16 hex
    digits), ``since_step`` and ``since_messages`` (this run's steps and messages stepped before
    they applied: 0 for weights in force from the start) and ``swaps`` (applied this run)."""

    version: str
    digest: str
    since_step: int = 0
    since_messages: int = 0
    swaps: int = 0

    def record(self) -> dict[str, Any]:
        """What a checkpoint's metadata says of them."""
        return {"version": self.version, "digest": self.digest, "since_step": self.since_step,
                "since_messages": self.since_messages, "swaps": self.swaps}


def weights_digest(leaves: list[np.ndarray]) -> str:
    """sha256 of the leaves' dtypes, shapes and bytes, in order: 16 hex digits."""
    digest = hashlib.sha256()
    for leaf in leaves:
        digest.update(f"{leaf.dtype.str}{leaf.shape}".encode())
        digest.update(np.ascontiguousarray(leaf).tobytes())
    return digest.hexdigest()[:16]


def checked_weights(params: Any, like: Any) -> list[np.ndarray]:
    """``params``' leaves as host arrays (copies), in ``like``'s order, after checking that they
    have its tree structure, shapes and dtypes (``like``: the compiled weights' shapes);
    ``ValueError`` naming the first difference."""
    try:
        leaves = jax.tree.flatten(params)[0]
        given = jax.tree.structure(params)
    except Exception as exc:  # an object jax cannot flatten
        raise ValueError(f"set_weights: the new weights are not a pytree ({type(exc).__name__}: {exc})") from None
    expected = jax.tree.structure(like)
    if given != expected:  # type: ignore[operator]  # jaxlib has no stub for PyTreeDef
        raise ValueError(f"set_weights: the new weights have the tree structure {given}, and the processor's are "
                         f"{expected}: give the same containers and keys (only the values change)")
    out = []
    for (path, want), leaf in zip(jax.tree_util.tree_flatten_with_path(like)[0], leaves):
        name = "params" + jax.tree_util.keystr(path)
        dtype = getattr(leaf, "dtype", None)
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        if dtype is None or np.dtype(dtype) != np.dtype(want.dtype) or shape != tuple(want.shape):
            shown = f"{np.dtype(dtype) if dtype is not None else type(leaf).__name__}{list(shape)}"
            raise ValueError(f"set_weights: {name} is {shown}, and the compiled step takes "
                             f"{np.dtype(want.dtype)}{list(want.shape)}: give an array of that shape and dtype "
                             f"(a swap never changes them: that would need a new compile)")
        out.append(np.array(leaf, copy=True))
    return out


class LiveWeights:
    """An engine's weights: the ones in force (``current``) and the newest offer not yet applied.

    ``like`` is the compiled params' shapes (a tree of ``ShapeDtypeStruct``), ``initial`` their
    values at start (host arrays, for the digest)."""

    def __init__(self, like: Any, initial: Any) -> None:
        self._like = like
        # the newest offer: a one-slot deque, whose append (replacing what it held) and popleft are each
        # atomic, so an offering thread and the main thread need no lock (and this layer no threading)
        self._pending: deque[tuple[Weights, list[np.ndarray]]] = deque(maxlen=1)
        leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(initial)]
        self.current = Weights(INIT, weights_digest(leaves))

    def offer(self, params: Any, version: str | None = None) -> str:
        """Check ``params`` and hold them for the next step (module rules); their version."""
        if version is not None and (not isinstance(version, str) or not version):
            raise ValueError(f"set_weights: version must be a non-empty str, not {version!r}")
        leaves = checked_weights(params, self._like)
        digest = weights_digest(leaves)
        offered = Weights(version if version is not None else digest, digest)
        if self._pending:  # for the log only: what the append below replaces
            log.warning("weights offered before are replaced by %r before they were applied (no step ran between "
                        "the two swaps)", offered.version)
        self._pending.append((offered, leaves))
        return offered.version

    def restored(self, record: Any) -> None:
        """A checkpoint's weights put back in force (``restore_shared=True``), from its record."""
        if isinstance(record, dict) and isinstance(record.get("version"), str):
            self.current = Weights(record["version"], str(record.get("digest", "")))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def offered(self) -> str | None:
        """The version of the weights offered and not yet applied (None: none)."""
        try:
            return self._pending[0][0].version
        except IndexError:
            return None

    def take(self, steps: int, messages: int) -> list[np.ndarray] | None:
        """The offered leaves to apply now, before step ``steps + 1`` (None: none offered); they
        become ``current``, logged. Main thread."""
        try:
            offered, leaves = self._pending.popleft()
        except IndexError:
            return None
        previous, self.current = self.current, offered._replace(since_step=steps, since_messages=messages,
                                                                swaps=self.current.swaps + 1)
        log.info("weights %r (digest %s) applied before step %d of this run, after %d messages stepped (they "
                 "replace %r)", offered.version, offered.digest, steps + 1, messages, previous.version)
        return leaves
