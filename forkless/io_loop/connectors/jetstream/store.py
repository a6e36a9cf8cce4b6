"""NatsStore: checkpoint objects and partition leases on a JetStream server, behind a blocking API for ordinary
threads (the main thread at start, the checkpoint writer, the stop).

Rules:
- Three parts composed here, each stating its own rules: the store's thread, loop and connection
  (storethread.py), the leases and their renewal (leases.py, with deployment.py) and the objects (objects.py).
- Every public method blocks until its work on the store's loop is done, from any thread but the store's own
  (there RuntimeError: it would wait for itself). The store's state is touched on its loop only; ``lost``,
  ``lost_keys``, ``unowned`` and ``holds()`` are what other threads read.
- A wait is never deaf to a stop: ``start``, ``acquire`` and ``claim_deployment`` look at the caller's stop every
  ``STOP_POLL_S``, then raise ``StopRequested`` having released every key that call took.
- Fencing: ``put`` and ``delete`` raise ``LeaseLost`` once a lease is lost or ran out (checked here and again on the
  loop just before the commit), so an instance that lost its partitions never writes their checkpoints.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

from forkless.io_loop.connectors.jetstream.deployment import DeploymentRecord
from forkless.io_loop.connectors.jetstream.leases import Leases
from forkless.io_loop.connectors.jetstream.objects import Objects
from forkless.io_loop.connectors.jetstream.settings import BUCKET_NAME, spec_of
from forkless.io_loop.connectors.jetstream.storethread import StoreThread
from forkless.io_loop.connectors.jetstream.transport import Transport
from forkless.io_loop.errors import LeaseLost
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.settings import ReconnectSettings, Timeouts, TlsSettings

__all__ = ["NatsStore"]

KEY_NAME = re.compile(r"^[-/_=.a-zA-Z0-9]+$")  # a KV key (nats-py's rule), not starting or ending with "."


class NatsStore:
    """Checkpoint objects in the object-store bucket ``bucket`` (None: no objects) and partition
    leases in the KV bucket ``lease_bucket`` on the server of the JetStream feed ``feed``, as
    ``holder``, each lease ``lease_s`` long (see the module rules); its connection is made with
    ``timeouts``, ``reconnect`` and ``tls`` (io_loop/settings.py's groups). ``start`` first, ``close``
    last."""

    def __init__(self, feed: FeedSpec, *, timeouts: Timeouts, reconnect: ReconnectSettings, tls: TlsSettings,
                 bucket: str | None, lease_bucket: str, lease_s: float, holder: str) -> None:
        spec_of(feed)  # a JetStream feed's: the store connects to its NATS server
        for what, name in (("bucket", bucket), ("lease_bucket", lease_bucket)):
            if name is not None and not BUCKET_NAME.fullmatch(name):
                raise ValueError(f"{what} {name!r} is not a JetStream bucket name (letters, digits, '_' and '-')")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, not {lease_s!r}")
        if not holder:
            raise ValueError("holder must name this instance")
        self.feed = feed
        self.bucket = bucket
        self.lease_bucket = lease_bucket
        self.lease_s = float(lease_s)
        self.holder = holder
        self._thread = StoreThread(feed, timeouts=timeouts, reconnect=reconnect, tls=tls)
        self._leases = Leases(self._thread, bucket=lease_bucket, lease_s=lease_s, holder=holder)
        self._objects = Objects(self._thread, bucket, self._leases.fence) if bucket else None
        self._deployment: DeploymentRecord | None = None
        self.lost = self._leases.lost  # set once any lease is lost; never cleared

    @property
    def lost_keys(self) -> list[str]:
        """The keys whose lease was lost."""
        return self._leases.lost_keys

    @property
    def unowned(self) -> tuple[int, ...]:
        """The partitions whose lease key has held no value for longer than a lease (after
        ``claim_deployment``; empty again once released)."""
        record = self._deployment
        return record.unowned if record is not None else ()

    def holds(self) -> bool:
        """Whether every lease of ours is still held by time (any thread, no I/O): see
        ``Leases.holds``."""
        return self._leases.holds()

    # ---- the thread ------------------------------------------------------------------------------------

    def start(self, stop: threading.Event | None = None) -> None:
        """Start the thread, connect (retrying), make the buckets if missing. Raises ``FeedFatal``
        when the server cannot be used, ``StopRequested`` once ``stop`` is set between two
        attempts; then the store is closed."""
        self._thread.start(stop, self._open_buckets)

    async def _open_buckets(self, transport: Transport) -> str:
        opened = await self._leases.open_bucket(transport)
        if self._objects is not None:
            opened += ", " + await self._objects.open_bucket(transport)
        return opened

    def close(self) -> None:
        """``release``, then close the connection and end the thread, within
        ``FORKLESS_SHUTDOWN_TIMEOUT_S`` (a lease not released then expires by itself). Idempotent."""
        self._thread.close(self._leases.release)

    # ---- leases ------------------------------------------------------------------------------------------

    def acquire(self, keys: Sequence[str], stop: threading.Event | None = None) -> None:
        """Take the lease of every key (io_loop/connectors/jetstream/leases.py's rules); renewed from now on until
        ``release``. Raises ``LeaseHeld`` (a live instance holds some: none of this call's keys
        kept), ``LeaseLost`` (a lease of ours was lost before), ``StoreError``, and
        ``StopRequested`` once ``stop`` is set while it waits for a holder (none of this call's
        keys kept: released at once, within ``STOP_POLL_S`` and one round trip)."""
        keys = list(dict.fromkeys(keys))
        for key in keys:
            if not KEY_NAME.match(key) or key.startswith(".") or key.endswith("."):
                raise ValueError(f"{key!r} is not a lease key (letters, digits and -/_=. not at either end)")
        if self.lost.is_set():
            raise LeaseLost(self._leases.lost_message())
        self._thread.call(self._leases.acquire(keys, stop))

    def release(self) -> None:
        """Delete our keys (each only if still ours) and stop renewing. Idempotent."""
        if not self._thread.running:
            return
        self._thread.call(self._leases.release())

    def claim_deployment(self, key: str, layout: dict[str, Any], peers: dict[str, int],
                         stop: threading.Event | None = None) -> None:
        """Check the deployment record ``key`` (a KV key in the lease bucket: the partition count
        and instances every live instance of this stream runs with) against ``layout``, then keep
        it written with each renewal. ``peers``: every partition's lease key -> its partition
        (the store watches them: ``unowned``). Call after ``acquire``. A record with another
        layout, written again within a lease (a live instance keeps it): ``DeploymentMismatch``;
        one left unchanged for a lease (its writers are dead) is replaced. ``StopRequested`` as
        for ``acquire``."""
        if not KEY_NAME.match(key):
            raise ValueError(f"{key!r} is not a KV key")
        self._thread.call(self._claim_deployment(DeploymentRecord(
            self._thread, self._leases, key, dict(layout), dict(peers)), stop))

    async def _claim_deployment(self, record: DeploymentRecord, stop: threading.Event | None) -> None:
        await record.claim(stop)
        self._leases.keep_with_renewals(record)
        self._deployment = record

    # ---- objects -----------------------------------------------------------------------------------------

    def put(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` as the object ``name`` (replacing an older one of that name). Raises
        ``LeaseLost`` once a lease is lost (nothing written), ``StoreError``."""
        objects = self._need_bucket(name)
        if self.lost.is_set():
            raise LeaseLost(self._leases.lost_message())
        self._thread.call(objects.put(name, data))

    def get(self, name: str) -> bytes | None:
        """The object's content; None if there is none of that name. Raises ``ObjectDamaged``
        (content and meta disagree), ``StoreError``."""
        return self._thread.call(self._need_bucket(name).get(name))

    def names(self, prefix: str = "") -> list[str]:
        """The names of the objects (not deleted) starting with ``prefix``, sorted."""
        return self._thread.call(self._need_bucket().names(prefix))

    def delete(self, name: str) -> None:
        """Delete the object ``name`` (nothing if there is none). Raises ``LeaseLost`` once a lease
        is lost (pruning then could remove what the partitions' new owner needs), ``StoreError``."""
        objects = self._need_bucket(name)
        if self.lost.is_set():
            raise LeaseLost(self._leases.lost_message())
        self._thread.call(objects.delete(name))

    def _need_bucket(self, name: str | None = None) -> Objects:
        if self._objects is None:
            raise RuntimeError("this NatsStore was made without an object bucket (bucket=None)")
        if name is not None and not name:
            raise ValueError("an object needs a name")
        return self._objects
