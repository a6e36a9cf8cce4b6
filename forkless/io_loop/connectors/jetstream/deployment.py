"""DeploymentRecord: the layout a partitioned stream's live instances run with, one more KV key beside their leases,
claimed after the leases and kept with every renewal round, on the store's loop.

Rules:
- The record holds the partition count and instances, written again by each live instance every round. Another
  layout written within a lease is a live deployment (``DeploymentMismatch``, after releasing what was taken); one
  unchanged for a lease is dead instances' and is replaced. A wait for it looks at the caller's stop.
- Once a lease, each instance reads every partition's lease key: partitions without a value for longer than a lease
  are ``unowned`` (logged on change), a tuple replaced whole, read by any thread.
- At an orderly release the record is deleted when no lease key holds a value (the last instance stopped); one
  that cannot be deleted expires with the bucket's TTL.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from forkless.io_loop.connectors.jetstream.leases import POLLS_PER_LEASE, RENEWS_PER_LEASE, Leases
from forkless.io_loop.connectors.jetstream.partitions import format_partitions
from forkless.io_loop.connectors.jetstream.storethread import StoreThread, each, sleep_or_stop
from forkless.io_loop.connectors.jetstream.transport import NatsError, NatsNotFound
from forkless.io_loop.errors import DeploymentMismatch, StoreError

__all__ = ["DeploymentRecord"]

log = logging.getLogger("forkless.store")


def _same_layout(recorded: dict[str, Any], ours: dict[str, Any]) -> bool:
    """The same partition count, and the same number of instances where both have one (an
    instance given its "partitions" explicitly records none)."""
    if recorded.get("partition_count") != ours.get("partition_count"):
        return False
    a, b = recorded.get("instances"), ours.get("instances")
    return a is None or b is None or a == b


def _layout(layout: dict[str, Any]) -> str:
    if "partition_count" not in layout:
        return repr(layout)
    n = layout.get("instances")
    return f"partition_count {layout['partition_count']}, " + (f"FORKLESS_INSTANCES={n}" if n is not None
                                                               else "partitions named in the feed entry")


class DeploymentRecord:
    """The record ``key`` in the lease bucket of ``leases``: ``layout`` (the partition count and
    instances) against what the live instances wrote; ``peers``: every partition's lease key ->
    its partition (see the module rules)."""

    def __init__(self, thread: StoreThread, leases: Leases, key: str, layout: dict[str, Any],
                 peers: dict[str, int]) -> None:
        self._thread = thread
        self._leases = leases
        self.key = key
        self.layout = layout
        self.peers = peers
        self._ours = json.dumps(layout, sort_keys=True).encode()
        self._unowned_since: dict[str, float] = {}  # a peer key seen without a value: since when
        self._rounds = 0
        # the partitions whose lease key has held no value for longer than a lease (written on the
        # store's loop, read anywhere: a tuple, replaced whole)
        self.unowned: tuple[int, ...] = ()

    async def claim(self, stop: threading.Event | None) -> None:
        """Wait while another live layout keeps the record (``DeploymentMismatch`` once it shows
        it is alive), then write ours."""
        leases, key, layout = self._leases, self.key, self.layout
        seen: int | None = None
        t0 = time.monotonic()
        while True:
            await self._thread.connection()
            kv = leases.kv  # over the connection of the moment: the server may have restarted during the wait
            try:
                entry = await kv.get(key)
            except NatsNotFound:
                entry = None
            if entry is None or entry.value is None:
                break
            try:
                recorded = json.loads(entry.value)
            except ValueError:
                recorded = {"unreadable": entry.value.decode(errors="replace")}
            if _same_layout(recorded, layout):
                break
            if seen is None:
                seen = entry.revision
                log.warning("the deployment record %r (bucket %r) says %s, this instance runs with %s: waiting up to "
                            "%.1f s to see whether an instance that keeps it is alive", key, leases.bucket,
                            _layout(recorded), _layout(layout), leases.wait_s)
            elif entry.revision != seen:
                raise DeploymentMismatch(recorded, layout, (
                    f"the live instances sharing this stream run with {_layout(recorded)} (deployment record {key!r} "
                    f"in bucket {leases.bucket!r}), this one with {_layout(layout)}: start every instance with "
                    "the same FORKLESS_INSTANCES and partition_count (stop them all first to change either)"))
            elif time.monotonic() - t0 >= leases.wait_s:
                log.warning("the deployment record %r was not written for %.1f s (its instances are gone): replaced",
                            key, time.monotonic() - t0)
                break
            await sleep_or_stop(leases.lease / POLLS_PER_LEASE, stop)
        await kv.put(key, self._ours)

    async def keep(self) -> None:
        """One renewal round's part: write the record again; once a lease, read every partition's
        lease key and log the partitions that have had no holder for longer than a lease."""
        leases, peers = self._leases, self.peers
        await leases.kv.put(self.key, self._ours)
        self._rounds += 1
        if self._rounds % RENEWS_PER_LEASE:
            return

        async def free(peer: str) -> bool:
            try:
                entry = await leases.kv.get(peer)
            except NatsNotFound:
                return True
            return entry.value is None or not entry.value

        now = time.monotonic()
        names = list(peers)
        for peer, empty in zip(names, await each(free, names)):
            if not empty:
                self._unowned_since.pop(peer, None)
            else:
                self._unowned_since.setdefault(peer, now)
        unowned = tuple(sorted(peers[k] for k, since in self._unowned_since.items() if now - since > leases.lease))
        before, self.unowned = self.unowned, unowned  # set before the line is logged: whoever reads it sees both
        if unowned != before:
            if unowned:
                log.warning("partitions %s (of %d) have had no live lease for more than %g s: no instance owns "
                            "them, so their messages go unanswered (start the instances that own them)",
                            format_partitions(unowned), len(peers), leases.lease)
            elif before:
                log.info("every partition has an owner again")

    async def end(self) -> None:
        """At release: delete the record when no partition's lease key holds a value (the last
        instance of the deployment stopped), so another layout may start at once."""
        self.unowned = ()
        leases = self._leases

        async def held(peer: str) -> bool:
            try:
                entry = await leases.kv.get(peer)
            except NatsNotFound:
                return False
            return bool(entry.value)

        try:
            await self._thread.connection()
            if not any(await each(held, list(self.peers))):
                await leases.kv.delete(self.key)
        except (StoreError, NatsError):
            pass  # it expires by itself within the TTL
