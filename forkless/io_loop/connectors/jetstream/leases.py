"""Leases: the partition leases of a checkpoint store, one KV key per partition in a lease bucket, taken, renewed,
fenced and released on the store's loop (storethread.py); store.py's blocking methods call them.

Rules:
- Everything runs on the store's loop, but ``holds``, ``lost`` (a ``threading.Event``) and ``lost_keys``, which any
  thread reads.
- The lease bucket is a KV bucket of history 1 and TTL ``lease_s``, made when missing (an existing one's TTL is
  used, with a warning). "A lease" below is ``min(lease_s, TTL)``.
- Taking (``acquire``): a key is created where it holds no value; one holding our own holder name is taken over
  at its revision (a restart). Another holder's key is read every lease/6 for ``max(lease_s, TTL)`` and a margin:
  its revision changing means it is alive (``LeaseHeld``, after releasing what this call took); its value gone, it
  is free; unchanged at the deadline, it is taken at that revision (``update(last=)``). A holder is alive only once
  ``ALIVE_RENEWALS`` of its renewals are seen (one may be its last, stored late).
- A wait for a silent holder looks at the caller's stop every ``STOP_POLL_S``: ``StopRequested``, its keys released.
- A holder name names one live instance: a second process under the same name takes its leases over at once, and
  the first finds out at its next renewal.
- Renewing: every lease/3 each key is written again at its revision, with the round's other parts (``RoundPart``).
  A renewal counts from when it was sent, so we hold a lease expired no later than the server or a claimant does.
  A conflict, or no renewal for a lease: the key is lost (``lost`` set, logged, never raised).
- Fencing: ``fence`` raises ``LeaseLost`` once a lease is lost or ran out; objects.py calls it just before an
  object's commit, so an instance that lost its partitions never writes their checkpoints. ``holds()`` (any thread,
  no I/O) is False once the last acknowledged renewal is a lease old, noticed or not (a SIGSTOP'd process wakes
  with every thread at once); replies.py drops what it may not publish. Each window is one publish long.
- ``release`` deletes each key still ours at our revision only; one that cannot be deleted expires.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import threading
import time
from typing import Protocol

from forkless.io_loop.connectors.jetstream.storethread import (
    NAME_IN_USE,
    TAKE_ATTEMPTS,
    StoreThread,
    each,
    sleep_or_stop,
)
from forkless.io_loop.connectors.jetstream.transport import (
    KeyValue,
    NatsError,
    NatsNotFound,
    NatsWrongLast,
    Transport,
)
from forkless.io_loop.connectors.jetstream.transport import NatsConnectFailed as _Failed
from forkless.io_loop.connectors.jetstream.transport import describe_error as _describe
from forkless.io_loop.errors import LeaseHeld, LeaseLost, StoreError

__all__ = ["Leases", "RoundPart"]

log = logging.getLogger("forkless.store")

RENEWS_PER_LEASE = 3
POLLS_PER_LEASE = 6  # a waiting claimant reads the held keys this often per lease
# a waited-for holder is alive once this many of its renewals are seen during the wait: one alone
# may be the last it sent before it stopped (SIGSTOP, a frozen VM), stored late by a busy server
# (seen in the suite: a paused instance's renewal stored after the claimant's first read)
ALIVE_RENEWALS = 2
MARGIN_FRACTION, MARGIN_S = 0.1, 0.5  # a claimant waits for a silent holder a lease plus this


def _holders(held: dict[str, list]) -> str:
    """``'a'`` for one holder, ``'a' (K.1, K.2), 'b' (K.7)`` for several."""
    by: dict[str, list[str]] = collections.defaultdict(list)
    for key, (holder, _) in sorted(held.items()):
        by[holder].append(key)
    if len(by) == 1:
        return repr(next(iter(by)))
    return ", ".join(f"{holder!r} ({', '.join(keys)})" for holder, keys in sorted(by.items()))


class RoundPart(Protocol):
    """More work of every renewal round, and of the release (the deployment record)."""

    async def keep(self) -> None: ...
    async def end(self) -> None: ...


class Leases:
    """The leases of ``holder`` in the KV bucket ``bucket``, each ``lease_s`` long, over the
    connection of ``thread`` (see the module rules)."""

    def __init__(self, thread: StoreThread, *, bucket: str, lease_s: float, holder: str) -> None:
        self._thread = thread
        self.bucket = bucket
        self.lease_s = float(lease_s)
        self.holder = holder
        self.lost = threading.Event()  # set once any lease is lost; never cleared
        self.lost_keys: list[str] = []  # which (written on the store's loop, read anywhere)
        self._holder_bytes = holder.encode()
        # ---- the store's loop only ----
        self._kv_direct = False
        self._ttl_s = self.lease_s  # the lease bucket's TTL in force
        self._held: dict[str, int] = {}  # key -> our revision
        self._valid_until: dict[str, float] = {}  # key -> monotonic time its lease runs out for us
        # the earliest of ``_valid_until`` (-inf: nothing held): one float, written on the store's
        # loop and read by any thread (``holds``) without a lock
        self._held_until = -math.inf
        self._renewer: asyncio.Task | None = None
        self._stop_renewing: asyncio.Event | None = None
        self._renew_error = ""
        self._taken_over: list[str] = []  # keys of our own holder name taken over by the acquire running
        self.part: RoundPart | None = None  # the deployment record, once claimed

    def keep_with_renewals(self, part: RoundPart) -> None:
        """``part`` (the claimed deployment record) is kept in every renewal round from now on,
        and ended with the release. The store's loop only."""
        self.part = part

    # ---- the lease's length, from lease_s and the bucket's TTL ---------------------------------------

    @property
    def lease(self) -> float:
        """How long a renewal is trusted: the shorter of ours and the bucket's."""
        return min(self.lease_s, self._ttl_s)

    @property
    def wait_s(self) -> float:
        """How long a claimant waits for a silent holder before taking its key."""
        longest = max(self.lease_s, self._ttl_s)
        return longest + longest * MARGIN_FRACTION + MARGIN_S

    @property
    def kv(self) -> KeyValue:
        """The lease bucket over the connection now."""
        return self._thread.transport.key_value(self.bucket, direct=self._kv_direct)

    def holds(self) -> bool:
        """Whether every lease of ours is still held by time: none lost, and the earliest renewal
        not older than a lease (``now < sent + lease`` for each key's last acknowledged renewal).
        Any thread; no I/O. The IO side asks before publishing each batch of replies, so an
        instance that was paused (SIGSTOP, a VM frozen) past its lease never publishes what it
        held, whether or not its renewer has noticed yet (see the module rules, "Fencing")."""
        return not self.lost.is_set() and time.monotonic() < self._held_until

    def _update_held_until(self) -> None:
        self._held_until = min(self._valid_until.values(), default=-math.inf)

    # ---- the bucket ------------------------------------------------------------------------------------

    async def open_bucket(self, transport: Transport) -> str:
        """Make the lease bucket where missing; read its TTL. Returns what it opened, for the log."""
        try:
            info = await transport.stream_info(f"KV_{self.bucket}")
        except NatsNotFound:
            try:
                await transport.create_key_value(self.bucket, history=1, ttl_s=self.lease_s,
                                                 description="forkless partition leases (the JetStream connector)")
            except NatsError as exc:
                if exc.code != 400 or exc.err_code != NAME_IN_USE:  # made by another instance at the same moment
                    raise
            info = await transport.stream_info(f"KV_{self.bucket}")
        if not info.config.max_msgs_per_subject or info.config.max_msgs_per_subject < 1:
            raise _Failed(f"stream KV_{self.bucket} is not a KV bucket: choose another lease bucket", fatal=True)
        ttl = info.config.max_age or 0.0
        if abs(ttl - self.lease_s) > 1e-3:
            log.warning("the lease bucket %r exists with a TTL of %s, not the lease of %g s asked for: using it "
                        "(renewing every %g s; a silent holder's lease is taken after %g s)", self.bucket,
                        f"{ttl:g} s" if ttl else "none (values never expire)", self.lease_s,
                        min(self.lease_s, ttl or self.lease_s) / RENEWS_PER_LEASE,
                        max(self.lease_s, ttl) * (1 + MARGIN_FRACTION) + MARGIN_S)
        self._ttl_s = ttl if ttl > 0 else self.lease_s
        self._kv_direct = bool(info.config.allow_direct)
        return f"lease bucket {self.bucket!r} (TTL {self._ttl_s:g} s)"

    # ---- taking ------------------------------------------------------------------------------------------

    async def acquire(self, keys: list[str], stop: threading.Event | None = None) -> None:
        """Take the lease of every key (see the module rules); renewed from now on until ``release``."""
        await self._thread.connection()
        todo = [key for key in keys if key not in self._held]
        took: list[str] = []
        self._taken_over = []
        try:
            results = await each(lambda key: self._try_take(key, took), todo)
            if took:
                self._ensure_renewer()
            held = {key: list(found) for key, found in zip(todo, results) if found is not None}
            if held:
                await self._wait_for(held, took, stop)
        except BaseException:
            await self._release_keys(took)
            raise
        if self._taken_over:
            log.info("the leases of %s held our own holder name %r (an earlier run of this instance): taken over",
                     ", ".join(sorted(self._taken_over)), self.holder)
        self._ensure_renewer()

    def _took(self, key: str, revision: int, sent: float, took: list[str]) -> None:
        self._held[key] = revision
        self._valid_until[key] = sent + self.lease
        self._update_held_until()
        took.append(key)

    async def _try_take(self, key: str, took: list[str]) -> tuple[str, int] | None:
        """Create ``key`` (or take it over from our own holder name): None once taken, else
        (its holder, its revision)."""
        kv = self.kv
        for _ in range(TAKE_ATTEMPTS):
            sent = time.monotonic()
            try:
                revision = await kv.create(key, self._holder_bytes)
                self._took(key, revision, sent, took)
                return None
            except NatsNotFound:
                continue  # it held a value that went away during the create: try again
            except NatsWrongLast:
                pass
            try:
                entry = await kv.get(key)
            except NatsNotFound:
                continue  # expired or deleted meanwhile
            holder = (entry.value or b"").decode(errors="replace")
            if holder != self.holder:
                return holder, entry.revision
            sent = time.monotonic()
            try:
                revision = await kv.update(key, self._holder_bytes, last=entry.revision)
            except NatsWrongLast:
                continue
            self._took(key, revision, sent, took)
            self._taken_over.append(key)
            return None
        raise StoreError(f"the lease of {key} changed hands {TAKE_ATTEMPTS} times while this instance tried to "
                         f"take it (bucket {self.bucket!r})")

    async def _wait_for(self, held: dict[str, list], took: list[str], stop: threading.Event | None = None) -> None:
        """Wait for the holders of ``held`` ({key: [holder, revision]}) to let their leases expire;
        take each key then. ``LeaseHeld`` as soon as one holder shows it is alive: a second renewal
        seen (``ALIVE_RENEWALS``), or another holder's write."""
        t0 = time.monotonic()
        deadline = t0 + self.wait_s
        log.warning("waiting for the lease of %s held by %s to expire (up to %.1f s)", ", ".join(sorted(held)),
                    _holders(held), self.wait_s)
        poll_s = self.lease / POLLS_PER_LEASE
        renewals: dict[str, int] = {}
        while held:
            now = time.monotonic()
            await sleep_or_stop(max(0.0, min(poll_s, deadline - now)), stop)
            if self.lost.is_set():
                raise LeaseLost(self.lost_message())
            await self._thread.connection()
            kv = self.kv  # over the connection of the moment: the server may have restarted during the wait
            holders = {key: held[key][0] for key in held}
            states = dict(zip(list(held), await each(functools.partial(self._look, kv, held=held), list(held))))
            once = []
            for key, state in states.items():
                if state != "alive":
                    continue
                renewals[key] = renewals.get(key, 0) + 1
                if held[key][0] != holders[key] or renewals[key] >= ALIVE_RENEWALS:
                    raise self._alive(held, held[key][0])
                once.append(key)
            if once:  # the holder may have sent it just before it stopped: the wait starts again from it
                deadline = max(deadline, time.monotonic() + self.wait_s)
                log.info("%s renewed the lease of %s during the wait: waiting for a second renewal, or for this "
                         "one to expire (up to %.1f s)", _holders({k: held[k] for k in once}), ", ".join(sorted(once)),
                         self.wait_s)
            free = [key for key, state in states.items() if state == "free"]
            for key, found in zip(free, await each(lambda key: self._try_take(key, took), free)):
                if found is not None:  # someone else took it first: alive
                    held[key] = list(found)
                    raise self._alive(held, found[0])
                del held[key]
            if held and time.monotonic() >= deadline:
                silent = sorted(held)
                taken = await each(functools.partial(self._take_silent, kv, held=held, took=took), silent)
                for key, ok in zip(silent, taken):
                    if not ok:
                        raise self._alive(held, held[key][0])
                    del held[key]
                log.warning("took the leases of %s: not renewed for %.1f s (expired; the server had not removed them "
                            "yet)", ", ".join(silent), time.monotonic() - t0)
            self._ensure_renewer()  # what was taken so far is renewed while the rest is waited for
        log.info("took the waited-for leases after %.1f s", time.monotonic() - t0)

    def _alive(self, held: dict[str, list], holder: str) -> LeaseHeld:
        keys = sorted(held)
        holders = sorted({h for h, _ in held.values()})
        return LeaseHeld(keys, ", ".join(holders), (
            f"the leases of {', '.join(keys)} (bucket {self.bucket!r}) are held by {_holders(held)}; "
            f"{holder!r} renewed its lease while this instance waited: it is alive and owns these partitions "
            f"(give this instance other partitions, or stop {holder!r} first)"))

    async def _look(self, kv: KeyValue, key: str, held: dict[str, list]) -> str:
        """A waited-for key: "free" (no value), "alive" (written since: ``held`` updated) or "same"."""
        try:
            entry = await kv.get(key)
        except NatsNotFound:
            return "free"
        if entry.revision != held[key][1]:
            held[key] = [(entry.value or b"").decode(errors="replace"), entry.revision]
            return "alive"
        return "same"

    async def _take_silent(self, kv: KeyValue, key: str, held: dict[str, list], took: list[str]) -> bool:
        """Take a key at the revision seen at the start: False if someone wrote it since."""
        sent = time.monotonic()
        try:
            new = await kv.update(key, self._holder_bytes, last=held[key][1])
        except NatsWrongLast:
            return False
        self._took(key, new, sent, took)
        return True

    # ---- renewing ----------------------------------------------------------------------------------------

    def _ensure_renewer(self) -> None:
        if self._held and (self._renewer is None or self._renewer.done()):
            self._stop_renewing = asyncio.Event()
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop(self._stop_renewing),
                                                                   name="forkless-store-renew")

    async def _renew_loop(self, stop: asyncio.Event) -> None:
        """Every lease/3 renew every key; never raises (what fails is logged and counted)."""
        while self._held and not stop.is_set():
            started = time.monotonic()
            earliest = min(self._valid_until.values())
            try:
                async with asyncio.timeout(max(0.0, earliest - started)):
                    await self._thread.connection()
                    await each(self._renew, list(self._held))
                    if self.part is not None:
                        await self.part.keep()
            except (TimeoutError, StoreError, NatsError) as exc:
                self._renew_error = _describe(exc)
            except Exception as exc:  # a renewal must never end the loop silently
                self._renew_error = _describe(exc)
                log.exception("renewing the leases failed unexpectedly")
            self._expire(time.monotonic())
            if not self._held:
                return
            wake = min(started + self.lease / RENEWS_PER_LEASE, min(self._valid_until.values()))
            try:
                async with asyncio.timeout(max(0.0, wake - time.monotonic())):
                    await stop.wait()
            except TimeoutError:
                pass

    async def _renew(self, key: str) -> None:
        revision = self._held.get(key)
        if revision is None:
            return
        sent = time.monotonic()
        try:
            new = await self.kv.update(key, self._holder_bytes, last=revision)
        except NatsWrongLast:
            try:
                entry = await self.kv.get(key)
                now = f"now held by {(entry.value or b'').decode(errors='replace')!r}"
            except NatsError:
                now = "now deleted or expired"
            if self._held.get(key) == revision:
                self._lose([key], f"someone else wrote it ({now})")
            return
        except NatsError as exc:
            self._renew_error = _describe(exc)
            return
        if self._held.get(key) == revision:
            self._held[key] = new
            self._valid_until[key] = sent + self.lease
            self._update_held_until()
            self._renew_error = ""

    # ---- losing and fencing ------------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        expired = [key for key, until in self._valid_until.items() if now >= until]
        if expired:
            why = f": {self._renew_error}" if self._renew_error else ""
            self._lose(expired, f"not renewed for {self.lease:g} s{why}")

    def _lose(self, keys: list[str], why: str) -> None:
        self._held_until = -math.inf  # first: ``holds`` is False from here on (``lost`` is never cleared)
        for key in keys:
            self._held.pop(key, None)
            self._valid_until.pop(key, None)
        self.lost_keys = sorted({*self.lost_keys, *keys})
        # logged before ``lost`` is set: whoever wakes on it finds the reason already logged
        log.error("lost the lease of %s (bucket %r, holder %r): %s; no checkpoint is written from now on",
                  ", ".join(sorted(keys)), self.bucket, self.holder, why)
        self.lost.set()

    def lost_message(self) -> str:
        return (f"the lease of {', '.join(self.lost_keys) or 'a partition'} was lost (bucket {self.bucket!r}, "
                f"holder {self.holder!r}): another instance may own it now")

    def fence(self) -> None:
        """``LeaseLost`` once a lease is lost or has run out (checked on the store's loop)."""
        self._expire(time.monotonic())
        if self.lost.is_set():
            raise LeaseLost(self.lost_message())

    # ---- releasing ---------------------------------------------------------------------------------------

    async def release(self) -> None:
        """Stop renewing, delete our keys (each only if still ours), end the round's other parts."""
        task, stop = self._renewer, self._stop_renewing
        if task is not None:
            if stop is not None:
                stop.set()
            await asyncio.wait([task])  # a round under way ends within a lease: its revisions are kept
            self._renewer = None
        keys = list(self._held)
        if keys:
            await self._release_keys(keys)
            log.info("released the leases of %s", ", ".join(sorted(keys)))
        if self.part is not None:
            part, self.part = self.part, None
            await part.end()

    async def _release_keys(self, keys: list[str]) -> None:
        """Delete each key at our revision (not one someone else wrote since); what fails expires."""
        failed: list[str] = []
        revisions = {key: self._held.pop(key) for key in keys if key in self._held}
        for key in keys:
            self._valid_until.pop(key, None)
        self._update_held_until()

        async def delete(key: str) -> None:
            try:
                await self.kv.delete(key, last=revisions[key])
            except NatsWrongLast:
                pass  # someone else wrote it since: not ours to delete
            except NatsError:
                failed.append(key)

        if not revisions:
            return
        try:
            await self._thread.connection()
            await each(delete, list(revisions))
        except StoreError:
            failed = list(revisions)
        if failed:
            log.warning("could not release the lease of %s: it expires by itself within %g s",
                        ", ".join(sorted(failed)), self._ttl_s)
