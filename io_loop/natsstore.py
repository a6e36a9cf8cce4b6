"""NatsStore: checkpoint objects and partition leases on a JetStream server (issue 24), behind a
blocking API for ordinary threads (the main thread at start, the checkpoint writer, the stop).

Rules:
- One NATS connection, on a daemon thread of its own ("forkless-store") running its own asyncio
  loop, apart from the IO thread: a checkpoint of many MB never delays the feeds, and a busy IO
  loop never delays a renewal. Every public method blocks until its work on that loop is done
  and may be called from any thread but the store's own (there it raises RuntimeError: it would
  wait for itself). Everything of the store's state (held leases, the connection) is touched on
  its loop only; ``lost`` (a ``threading.Event``) and ``lost_keys`` are all other threads read.
- Connecting: the feed's servers, credentials and TLS (``natsconn.connect_options``). ``start``
  retries with ``Backoff`` per ``FORKLESS_RECONNECT_*``; tries used up, or the credentials
  refused: ``FeedFatal``. A connection lost later is made again on demand, one attempt by the
  operation that needs it (a renewal comes every lease/3): that operation fails with
  ``StoreError`` if the attempt does. No secret is logged: the URL is shown without credentials
  and nats-py's own error callback (which logs) is replaced.
- Buckets: the lease bucket is a KV bucket (history 1, TTL = ``lease_s``: a value not written
  again within the TTL is removed by the server); the object bucket an object store. Both are
  made when missing; an existing lease bucket with another TTL is used as it is, with a warning.
- Leases (one KV key per partition, its value the holder's name): ``acquire`` creates each key
  (``create``: only where it holds no value; over a delete marker, nats-py creates on the
  marker's revision). A key whose value is our own holder name is ours from before (a restart
  of the same instance) and taken over at its revision. For a key held by someone else, one
  warning is logged, then the key is read every lease/6 for at most ``max(lease_s, TTL)`` + a
  margin: its revision changing means its holder is alive (``LeaseHeld``, after releasing what
  this call took); its value gone (expired, deleted) means it is free, and it is created; still
  unchanged at the deadline (the server removes expired values a little late), it is taken at
  that revision (``update(last=)``: only if nobody wrote it meanwhile).
- A wait is never deaf to a stop: ``start`` and ``acquire`` take the caller's stop (a
  ``threading.Event``, set by its signal handler) and look at it every ``STOP_POLL_S`` while
  they wait (between connection attempts; for a silent holder); once it is set they raise
  ``StopRequested``, having released every key that call took.
- The deployment record (``claim_deployment``, after ``acquire``): one more KV key beside the
  leases holding the partition count and instances the stream's live instances run with, written
  again by each at every renewal round. Another layout written again within a lease is another
  live deployment (``DeploymentMismatch``, after releasing what was taken); one left unchanged
  for a lease belongs to dead instances and is replaced. Once a lease, each instance reads every
  partition's lease key: partitions without a value for longer than a lease are ``unowned``
  (logged when the set changes; the controller's ``forkless_partitions_unowned``). At an orderly
  release the record is deleted when no partition's lease key holds a value any more (the last
  instance stopped), so another layout may start at once.
- A holder name names one live instance: a second process started under the same name takes
  its leases over at once (meant for a restart after a kill), and the first finds out at its
  next renewal, within lease/3.
- Renewing: every ``lease/3`` each key is written again at its revision (``update(last=)``).
  A renewal counts from the moment it was sent, so we consider a lease expired no later than the
  server does (its TTL runs from when it stored the value), and no later than a claimant's
  deadline. A revision conflict (someone else wrote the key) or no successful renewal for a
  lease: the key is lost — ``lost`` is set, an error logged, never an exception to anyone.
  (Here "a lease" is ``min(lease_s, TTL)``.)
- Fencing: ``put`` and ``delete`` raise ``LeaseLost`` once a lease is lost or has run out
  unrenewed (checked on the caller's side and again on the loop just before the object is
  committed), so an instance that lost its partitions never writes or prunes their checkpoints.
  The last check and the meta's publication are not one atomic step: a meta sent in the instant
  the lease runs out is stored. That window is one publish long, and a new owner takes a key only
  once the server has let it expire (or later).
- Fencing the replies: ``holds()`` (any thread, no I/O) is False once a lease is lost or its
  last acknowledged renewal is a lease old, whether or not the renewer has noticed yet (a
  process paused by SIGSTOP wakes with every thread at once). The IO side asks it before it
  publishes each item of replies (io_loop/jspublish.py) and drops what it may not publish, so a
  zombie never publishes what it held: the partitions' new owner answers those from its
  checkpoint. The window between the check and the publication is one item long, as above.
- ``release`` deletes each key still ours, only at our revision (``delete(last=)``), so a key
  someone else took meanwhile is left alone; a key that cannot be deleted expires by itself.
- Objects are stored in nats-py's object-store layout (``$O.<bucket>.C.<nuid>`` chunks of
  128 KiB, then the meta on ``$O.<bucket>.M.<base64(name)>``, published with a roll-up header,
  so the newest meta replaces the last): nats-py's ``ObjectStore`` reads ours and we read its
  (a test holds both). Written and read here all the same: the lease check must sit just before
  the meta is published, and nats-py's ``get`` appends chunk by chunk to ``bytes`` (quadratic in
  the size: 4.6 s for 32 MiB, against 0.2 s here).
- Atomicity relied on: a put's chunks go to a subject of their own (a new nuid) and the meta,
  the commit point, is published only after every chunk is acknowledged (stored) by the server;
  a reader reads the meta first, then exactly the chunks it names. So a reader sees the whole old
  object or the whole new one, never a mix; a put that fails before the meta leaves no object
  (its chunks are purged); a writer killed mid-put leaves unreferenced chunks (space, not a
  wrong object). The old chunks of an overwritten name are purged after the new meta; a reader
  that finds chunks missing reads the meta again (an overwrite in between) and otherwise
  reports the object damaged.
- Integrity relied on: the meta records the size and the SHA-256 of the content; ``get``
  checks both and raises ``ObjectDamaged`` (a ``StoreError``) on any difference, a missing chunk
  or an unreadable meta. Durability is the server's: what it acknowledged outlives this process;
  what outlives a crash of the server (process or host) depends on its storage settings (its
  sync interval) and the bucket's replicas. The caller's bytes carry their own checksum too, so
  a damage here is caught above as well.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from nats.nuid import NUID

from io_loop.backoff import Backoff
from io_loop.errors import DeploymentMismatch, FeedFatal, ForklessError, LeaseHeld, LeaseLost, StopRequested
from io_loop.natsconn import NATS_ERRORS, close_quietly, connect_once, connect_options
from io_loop.natsconn import NatsConnectFailed as _Failed
from io_loop.natsconn import describe_error as _describe
from io_loop.partitions import format_partitions
from io_loop.settings import FeedSpec, IOSettings

__all__ = ["NatsStore", "ObjectDamaged", "StoreError"]

log = logging.getLogger("forkless.store")

T = TypeVar("T")

CHUNK_BYTES = 128 * 1024  # nats-py's object-store chunk (a server's max_payload is 1 MiB by default)
PUBLISH_WINDOW = 16  # chunks published ahead of their acknowledgements
IN_FLIGHT = 64  # lease requests (create, get, update, delete) in flight at once, over many keys
RENEWS_PER_LEASE = 3
POLLS_PER_LEASE = 6  # a waiting claimant reads the held keys this often per lease
MARGIN_FRACTION, MARGIN_S = 0.1, 0.5  # a claimant waits for a silent holder a lease plus this
TAKE_ATTEMPTS = 5  # a key changing hands under a claimant this often: StoreError
CLOSE_S = 1.0
STOP_POLL_S = 0.05  # a wait (connection retries, a dead holder's lease) looks at the caller's stop this often
BUCKET_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")  # nats-py's rule for KV and object-store buckets
KEY_NAME = re.compile(r"^[-/_=.a-zA-Z0-9]+$")  # a KV key (nats-py's rule), not starting or ending with "."
WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream's error codes for an expected-last-sequence mismatch
NAME_IN_USE = 10058  # "stream name already in use with a different configuration"


class StoreError(ForklessError):
    """An operation on the store failed (server unreachable, an answer refused or late); the
    store stays usable and the next call tries again."""


class ObjectDamaged(StoreError):
    """An object's content does not match its meta (size, SHA-256, a chunk missing, the meta
    unreadable): use an older one."""



def _wrong_last(exc: BaseException) -> bool:
    return isinstance(exc, nats.js.errors.KeyWrongLastSequenceError) or (
        isinstance(exc, nats.js.errors.APIError) and exc.err_code in WRONG_LAST_SEQUENCE)


async def _sleep(seconds: float, stop: threading.Event | None) -> None:
    """``asyncio.sleep(seconds)``, looking at ``stop`` every ``STOP_POLL_S``: ``StopRequested``
    once it is set (a ``threading.Event``: the caller's stop request, set by a signal handler)."""
    end = time.monotonic() + seconds
    while True:
        if stop is not None and stop.is_set():
            raise StopRequested("a stop was requested while the checkpoint store waited")
        left = end - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(left, STOP_POLL_S) if stop is not None else left)


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


def _holders(held: dict[str, list]) -> str:
    """``'a'`` for one holder, ``'a' (K.1, K.2), 'b' (K.7)`` for several."""
    by: dict[str, list[str]] = collections.defaultdict(list)
    for key, (holder, _) in sorted(held.items()):
        by[holder].append(key)
    if len(by) == 1:
        return repr(next(iter(by)))
    return ", ".join(f"{holder!r} ({', '.join(keys)})" for holder, keys in sorted(by.items()))


class NatsStore:
    """Checkpoint objects in the object-store bucket ``bucket`` (None: no objects) and partition
    leases in the KV bucket ``lease_bucket`` on the server of the JetStream feed ``feed``, as
    ``holder``, each lease ``lease_s`` long (see the module rules). ``start`` first, ``close``
    last."""

    def __init__(self, settings: IOSettings, feed: FeedSpec, *, bucket: str | None, lease_bucket: str,
                 lease_s: float, holder: str) -> None:
        if feed.jetstream is None:
            raise ValueError(f"{feed.label} is not a JetStream feed: the store needs its NATS server")
        for what, name in (("bucket", bucket), ("lease_bucket", lease_bucket)):
            if name is not None and not BUCKET_NAME.match(name):
                raise ValueError(f"{what} {name!r} is not a JetStream bucket name (letters, digits, '_' and '-')")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, not {lease_s!r}")
        if not holder:
            raise ValueError("holder must name this instance")
        self.settings = settings
        self.feed = feed
        self.bucket = bucket
        self.lease_bucket = lease_bucket
        self.lease_s = float(lease_s)
        self.holder = holder
        self.lost = threading.Event()  # set once any lease is lost; never cleared
        self.lost_keys: list[str] = []  # which (written on the store's loop, read anywhere)
        self._holder_bytes = holder.encode()
        self._shown = feed.shown_url
        self._api_s = settings.connect_timeout_s
        self._guard = threading.Lock()  # start and close
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # ---- the store's loop only ----
        self._nc: Any = None
        self._js: Any = None
        self._kv: KeyValue | None = None
        self._kv_direct = False
        self._obj_direct = False
        self._connecting: asyncio.Lock | None = None
        self._nats_error = ""
        self._nuid = NUID()
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
        # the deployment record (``claim_deployment``): its key, our value, every partition's lease key
        self._deployment: tuple[str, bytes, dict[str, int]] | None = None
        self._unowned_since: dict[str, float] = {}  # a peer key seen without a value: since when
        self._rounds = 0
        # the partitions whose lease key has held no value for longer than a lease (written on the
        # store's loop, read anywhere: a tuple, replaced whole)
        self.unowned: tuple[int, ...] = ()

    # ---- the lease's length, from lease_s and the bucket's TTL ---------------------------------------

    @property
    def _lease(self) -> float:
        """How long a renewal is trusted: the shorter of ours and the bucket's."""
        return min(self.lease_s, self._ttl_s)

    @property
    def _wait_s(self) -> float:
        """How long a claimant waits for a silent holder before taking its key."""
        longest = max(self.lease_s, self._ttl_s)
        return longest + longest * MARGIN_FRACTION + MARGIN_S

    def holds(self) -> bool:
        """Whether every lease of ours is still held by time: none lost, and the earliest renewal
        not older than a lease (``now < sent + lease`` for each key's last acknowledged renewal).
        Any thread; no I/O. The IO side asks before publishing each batch of replies, so an
        instance that was paused (SIGSTOP, a VM frozen) past its lease never publishes what it
        held, whether or not its renewer has noticed yet (see the module rules, "Fencing")."""
        return not self.lost.is_set() and time.monotonic() < self._held_until

    def _update_held_until(self) -> None:
        self._held_until = min(self._valid_until.values(), default=-math.inf)

    # ---- the thread and the calls onto it --------------------------------------------------------------

    def start(self, stop: threading.Event | None = None) -> None:
        """Start the thread, connect (retrying), make the buckets if missing. Raises ``FeedFatal``
        when the server cannot be used, ``StopRequested`` once ``stop`` is set between two
        attempts; then the store is closed."""
        with self._guard:
            if self._loop is not None or self._closed:
                raise RuntimeError("NatsStore.start: started already (a store is started once)")
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._thread = threading.Thread(target=self._run_loop, args=(loop,), name="forkless-store", daemon=True)
            self._thread.start()
        try:
            self._call(self._start(stop))
        except BaseException:
            self._end_thread()
            raise

    def close(self) -> None:
        """``release``, then close the connection and end the thread, within
        ``FORKLESS_SHUTDOWN_TIMEOUT_S`` (a lease not released then expires by itself). Idempotent."""
        with self._guard:
            if self._closed:
                return
            if self._loop is None:
                self._closed = True
                return
        try:  # bounded: with the server gone, the release's one connection attempt must not hold a stop
            self._call(self._close(), timeout=self.settings.shutdown_timeout_s)
        except Exception as exc:  # the connection is closed below in any case
            log.warning("closing the checkpoint store on %s: %s", self._shown, _describe(exc))
        finally:
            self._end_thread()

    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    def _end_thread(self) -> None:
        with self._guard:
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # closed meanwhile
                pass
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_S * 5)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        loop = self._loop
        if loop is None or self._closed:
            coro.close()
            raise RuntimeError("the checkpoint store is not started (call start()) or is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a NatsStore method was called on the store's own thread: it would wait for itself")
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout)
        except concurrent.futures.CancelledError:
            raise StoreError(f"the checkpoint store on {self._shown} was closed during the call") from None
        except NATS_ERRORS as exc:  # TimeoutError among them: ours (the wait above) or the work's own
            if not future.done():
                future.cancel()
                raise StoreError(f"the checkpoint store on {self._shown} did not finish within {timeout:g} s") from None
            raise StoreError(f"the checkpoint store on {self._shown}: {_describe(exc)}") from None

    async def _each(self, fn: Callable[[str], Awaitable[T]], items: Iterable[str]) -> list[T]:
        """``fn`` on every item, at most ``IN_FLIGHT`` at once; the first error cancels the rest and
        is raised as it is (not in an ExceptionGroup)."""
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def one(item: str) -> T:
            async with gate:
                return await fn(item)

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(item)) for item in items]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        return [task.result() for task in tasks]

    # ---- connecting ------------------------------------------------------------------------------------

    async def _start(self, stop: threading.Event | None) -> None:
        cfg = self.settings
        self._connecting = asyncio.Lock()
        backoff = Backoff.from_settings(cfg)
        while True:
            try:
                await self._connect()
                await self._open_buckets()
                log.info("checkpoint store on %s: lease bucket %r (TTL %g s)%s", self._shown, self.lease_bucket,
                         self._ttl_s, f", object bucket {self.bucket!r}" if self.bucket else "")
                return
            except _Failed as exc:
                await self._drop_connection()
                if exc.fatal:
                    raise FeedFatal(f"checkpoint store on {self._shown}: {exc}") from None
                delay = backoff.failed()
                if delay is None:
                    raise FeedFatal(f"giving up on the checkpoint store on {self._shown} after {backoff.failures} "
                                    f"failed attempts in a row: {exc}") from None
                log.warning("checkpoint store on %s: %s; retrying in %.2fs", self._shown, exc, delay)
                await _sleep(delay, stop)

    async def _connect(self) -> None:
        """One attempt; raises ``_Failed``."""
        cfg = self.settings

        async def on_error(exc: Exception) -> None:  # nats-py's default logs the exception
            self._nats_error = _describe(exc)

        async def on_event() -> None:
            pass

        options = connect_options(cfg, self.feed, error_cb=on_error, disconnected_cb=on_event, closed_cb=on_event)
        options["name"] = f"forkless-store-{self.feed.name}"
        self._nats_error = ""
        try:
            nc = await connect_once(cfg, options)
        except _Failed as exc:
            if exc.fatal:
                raise _Failed(f"the server refused the credentials (check the user:password in \"nats\", \"token\" "
                              f"or \"creds\" of {self.feed.label})", fatal=True) from None
            raise _Failed(f"cannot connect: {self._nats_error or exc}") from None
        self._nc = nc
        self._js = nc.jetstream(timeout=self._api_s)
        self._kv = KeyValue(name=self.lease_bucket, stream=f"KV_{self.lease_bucket}",
                            pre=f"$KV.{self.lease_bucket}.", js=self._js, direct=self._kv_direct)

    async def _drop_connection(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None:
            await close_quietly(nc, CLOSE_S)

    async def _connection(self) -> None:
        """Connected, or one attempt to connect again; ``StoreError`` if it fails."""
        if self._nc is not None and self._nc.is_connected:
            return
        assert self._connecting is not None
        async with self._connecting:
            if self._nc is not None and self._nc.is_connected:
                return
            await self._drop_connection()
            try:
                await self._connect()
            except _Failed as exc:
                raise StoreError(f"the checkpoint store on {self._shown}: {exc}") from None
            log.info("checkpoint store: connected again to %s", self._shown)

    async def _open_buckets(self) -> None:
        """Make the buckets where missing; read the lease bucket's TTL. Raises ``_Failed``."""
        js = self._js
        try:
            try:
                info = await js.stream_info(f"KV_{self.lease_bucket}")
            except nats.js.errors.NotFoundError:
                try:
                    await js.create_key_value(api.KeyValueConfig(
                        bucket=self.lease_bucket, history=1, ttl=self.lease_s,
                        description="forkless partition leases (io_loop/natsstore.py)"))
                except nats.js.errors.BadRequestError as exc:
                    if exc.err_code != NAME_IN_USE:  # made by another instance at the same moment
                        raise
                info = await js.stream_info(f"KV_{self.lease_bucket}")
            if not info.config.max_msgs_per_subject or info.config.max_msgs_per_subject < 1:
                raise _Failed(f"stream KV_{self.lease_bucket} is not a KV bucket: choose another lease bucket",
                              fatal=True)
            ttl = info.config.max_age or 0.0
            if abs(ttl - self.lease_s) > 1e-3:
                log.warning("the lease bucket %r exists with a TTL of %s, not the lease of %g s asked for: using it "
                            "(renewing every %g s; a silent holder's lease is taken after %g s)", self.lease_bucket,
                            f"{ttl:g} s" if ttl else "none (values never expire)", self.lease_s,
                            min(self.lease_s, ttl or self.lease_s) / RENEWS_PER_LEASE,
                            max(self.lease_s, ttl) * (1 + MARGIN_FRACTION) + MARGIN_S)
            self._ttl_s = ttl if ttl > 0 else self.lease_s
            self._kv_direct = bool(info.config.allow_direct)
            self._kv = KeyValue(name=self.lease_bucket, stream=f"KV_{self.lease_bucket}",
                                pre=f"$KV.{self.lease_bucket}.", js=js, direct=self._kv_direct)
            if self.bucket:
                stream = f"OBJ_{self.bucket}"
                try:
                    info = await js.stream_info(stream)
                except nats.js.errors.NotFoundError:
                    try:
                        await js.create_object_store(
                            self.bucket, description="forkless checkpoints (io_loop/natsstore.py)")
                    except nats.js.errors.BadRequestError as exc:
                        if exc.err_code != NAME_IN_USE:
                            raise
                    info = await js.stream_info(stream)
                self._obj_direct = bool(info.config.allow_direct)
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
            raise _Failed("JetStream does not answer (not enabled: nats-server -js; or starting)") from None
        except nats.js.errors.APIError as exc:
            raise _Failed(f"making the buckets failed: {_describe(exc)}", fatal=exc.code in (400, 403)) from None
        except NATS_ERRORS as exc:
            raise _Failed(f"reading the buckets failed: {self._nats_error or _describe(exc)}") from None

    async def _close(self) -> None:
        try:
            await self._release()
        finally:
            await self._drop_connection()

    # ---- leases ------------------------------------------------------------------------------------------

    def acquire(self, keys: Sequence[str], stop: threading.Event | None = None) -> None:
        """Take the lease of every key (see the module rules); renewed from now on until
        ``release``. Raises ``LeaseHeld`` (a live instance holds some: none of this call's keys
        kept), ``LeaseLost`` (a lease of ours was lost before), ``StoreError``, and
        ``StopRequested`` once ``stop`` is set while it waits for a holder (none of this call's
        keys kept: released at once, within ``STOP_POLL_S`` and one round trip)."""
        keys = list(dict.fromkeys(keys))
        for key in keys:
            if not KEY_NAME.match(key) or key.startswith(".") or key.endswith("."):
                raise ValueError(f"{key!r} is not a lease key (letters, digits and -/_=. not at either end)")
        if self.lost.is_set():
            raise LeaseLost(self._lost_message())
        self._call(self._acquire(keys, stop))

    def release(self) -> None:
        """Delete our keys (each only if still ours) and stop renewing. Idempotent."""
        if self._loop is None or self._closed:
            return
        self._call(self._release())

    async def _acquire(self, keys: list[str], stop: threading.Event | None = None) -> None:
        await self._connection()
        todo = [key for key in keys if key not in self._held]
        took: list[str] = []
        self._taken_over = []
        try:
            results = await self._each(lambda key: self._try_take(key, took), todo)
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
        self._valid_until[key] = sent + self._lease
        self._update_held_until()
        took.append(key)

    async def _try_take(self, key: str, took: list[str]) -> tuple[str, int] | None:
        """Create ``key`` (or take it over from our own holder name): None once taken, else
        (its holder, its revision)."""
        kv = self._kv
        for _ in range(TAKE_ATTEMPTS):
            sent = time.monotonic()
            try:
                revision = await kv.create(key, self._holder_bytes)
                self._took(key, revision, sent, took)
                return None
            except nats.js.errors.KeyNotFoundError:
                continue  # it held a value that went away during the create: try again
            except nats.js.errors.APIError as exc:
                if not _wrong_last(exc):
                    raise
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                continue  # expired or deleted meanwhile
            holder = (entry.value or b"").decode(errors="replace")
            if holder != self.holder:
                return holder, entry.revision
            sent = time.monotonic()
            try:
                revision = await kv.update(key, self._holder_bytes, last=entry.revision)
            except nats.js.errors.APIError as exc:
                if _wrong_last(exc):
                    continue
                raise
            self._took(key, revision, sent, took)
            self._taken_over.append(key)
            return None
        raise StoreError(f"the lease of {key} changed hands {TAKE_ATTEMPTS} times while this instance tried to "
                         f"take it (bucket {self.lease_bucket!r})")

    async def _wait_for(self, held: dict[str, list], took: list[str], stop: threading.Event | None = None) -> None:
        """Wait for the holders of ``held`` ({key: [holder, revision]}) to let their leases expire;
        take each key then. ``LeaseHeld`` as soon as one holder shows it is alive."""
        t0 = time.monotonic()
        deadline = t0 + self._wait_s
        log.warning("waiting for the lease of %s held by %s to expire (up to %.1f s)", ", ".join(sorted(held)),
                    _holders(held), self._wait_s)
        poll_s = self._lease / POLLS_PER_LEASE
        kv = self._kv

        def alive(holder: str) -> LeaseHeld:
            keys = sorted(held)
            holders = sorted({h for h, _ in held.values()})
            return LeaseHeld(keys, ", ".join(holders), (
                f"the leases of {', '.join(keys)} (bucket {self.lease_bucket!r}) are held by {_holders(held)}; "
                f"{holder!r} renewed its lease while this instance waited: it is alive and owns these partitions "
                f"(give this instance other partitions, or stop {holder!r} first)"))

        async def look(key: str) -> str:
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return "free"
            if entry.revision != held[key][1]:
                held[key] = [(entry.value or b"").decode(errors="replace"), entry.revision]
                return "alive"
            return "same"

        async def take_silent(key: str, took: list[str]) -> bool:
            """Take a key at the revision seen at the start: False if someone wrote it since."""
            sent = time.monotonic()
            try:
                new = await kv.update(key, self._holder_bytes, last=held[key][1])
            except nats.js.errors.APIError as exc:
                if _wrong_last(exc):
                    return False
                raise
            self._took(key, new, sent, took)
            return True

        while held:
            now = time.monotonic()
            await _sleep(max(0.0, min(poll_s, deadline - now)), stop)
            if self.lost.is_set():
                raise LeaseLost(self._lost_message())
            await self._connection()
            states = dict(zip(list(held), await self._each(look, list(held))))
            for key, state in states.items():
                if state == "alive":
                    raise alive(held[key][0])
            free = [key for key, state in states.items() if state == "free"]
            for key, found in zip(free, await self._each(lambda key: self._try_take(key, took), free)):
                if found is not None:  # someone else took it first: alive
                    held[key] = list(found)
                    raise alive(found[0])
                del held[key]
            if held and time.monotonic() >= deadline:
                silent = sorted(held)
                for key, ok in zip(silent, await self._each(lambda key: take_silent(key, took), silent)):
                    if not ok:
                        raise alive(held[key][0])
                    del held[key]
                log.warning("took the leases of %s: not renewed for %.1f s (expired; the server had not removed them "
                            "yet)", ", ".join(silent), time.monotonic() - t0)
            self._ensure_renewer()  # what was taken so far is renewed while the rest is waited for
        log.info("took the waited-for leases after %.1f s", time.monotonic() - t0)

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
                    await self._connection()
                    await self._each(self._renew, list(self._held))
                    if self._deployment is not None:
                        await self._keep_deployment()
            except (TimeoutError, StoreError, *NATS_ERRORS) as exc:
                self._renew_error = _describe(exc)
            except Exception as exc:  # a renewal must never end the loop silently
                self._renew_error = _describe(exc)
                log.exception("renewing the leases failed unexpectedly")
            self._expire(time.monotonic())
            if not self._held:
                return
            wake = min(started + self._lease / RENEWS_PER_LEASE, min(self._valid_until.values()))
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
            new = await self._kv.update(key, self._holder_bytes, last=revision)
        except nats.js.errors.APIError as exc:
            if not _wrong_last(exc):
                self._renew_error = _describe(exc)
                return
            try:
                entry = await self._kv.get(key)
                now = f"now held by {(entry.value or b'').decode(errors='replace')!r}"
            except (*NATS_ERRORS, nats.js.errors.KeyNotFoundError):
                now = "now deleted or expired"
            if self._held.get(key) == revision:
                self._lose([key], f"someone else wrote it ({now})")
            return
        except (*NATS_ERRORS, TimeoutError) as exc:
            self._renew_error = _describe(exc)
            return
        if self._held.get(key) == revision:
            self._held[key] = new
            self._valid_until[key] = sent + self._lease
            self._update_held_until()
            self._renew_error = ""

    def _expire(self, now: float) -> None:
        expired = [key for key, until in self._valid_until.items() if now >= until]
        if expired:
            why = f": {self._renew_error}" if self._renew_error else ""
            self._lose(expired, f"not renewed for {self._lease:g} s{why}")

    def _lose(self, keys: list[str], why: str) -> None:
        self._held_until = -math.inf  # first: ``holds`` is False from here on (``lost`` is never cleared)
        for key in keys:
            self._held.pop(key, None)
            self._valid_until.pop(key, None)
        self.lost_keys = sorted({*self.lost_keys, *keys})
        # logged before ``lost`` is set: whoever wakes on it finds the reason already logged
        log.error("lost the lease of %s (bucket %r, holder %r): %s; no checkpoint is written from now on",
                  ", ".join(sorted(keys)), self.lease_bucket, self.holder, why)
        self.lost.set()

    def _lost_message(self) -> str:
        return (f"the lease of {', '.join(self.lost_keys) or 'a partition'} was lost (bucket {self.lease_bucket!r}, "
                f"holder {self.holder!r}): another instance may own it now")

    def _fence(self) -> None:
        """``LeaseLost`` once a lease is lost or has run out (checked on the store's loop)."""
        self._expire(time.monotonic())
        if self.lost.is_set():
            raise LeaseLost(self._lost_message())

    async def _release(self) -> None:
        task, stop = self._renewer, self._stop_renewing
        if task is not None:
            if stop is not None:
                stop.set()
            await asyncio.wait([task])  # a round in flight ends within a lease: its revisions are kept
            self._renewer = None
        keys = list(self._held)
        if keys:
            await self._release_keys(keys)
            log.info("released the leases of %s", ", ".join(sorted(keys)))
        if self._deployment is not None:
            await self._end_deployment()

    # ---- the deployment record -------------------------------------------------------------------------

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
        self._call(self._claim_deployment(key, dict(layout), dict(peers), stop))

    async def _claim_deployment(self, key: str, layout: dict[str, Any], peers: dict[str, int],
                                stop: threading.Event | None) -> None:
        await self._connection()
        kv, ours = self._kv, json.dumps(layout, sort_keys=True).encode()
        seen: int | None = None
        t0 = time.monotonic()
        while True:
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
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
                            "%.1f s to see whether an instance that keeps it is alive", key, self.lease_bucket,
                            _layout(recorded), _layout(layout), self._wait_s)
            elif entry.revision != seen:
                raise DeploymentMismatch(recorded, layout, (
                    f"the live instances sharing this stream run with {_layout(recorded)} (deployment record {key!r} "
                    f"in bucket {self.lease_bucket!r}), this one with {_layout(layout)}: start every instance with "
                    "the same FORKLESS_INSTANCES and partition_count (stop them all first to change either)"))
            elif time.monotonic() - t0 >= self._wait_s:
                log.warning("the deployment record %r was not written for %.1f s (its instances are gone): replaced",
                            key, time.monotonic() - t0)
                break
            await _sleep(self._lease / POLLS_PER_LEASE, stop)
        await kv.put(key, ours)
        self._deployment = (key, ours, peers)

    async def _keep_deployment(self) -> None:
        """One renewal round's part: write the record again; once a lease, read every partition's
        lease key and log the partitions that have had no holder for longer than a lease."""
        key, ours, peers = self._deployment
        await self._kv.put(key, ours)
        self._rounds += 1
        if self._rounds % RENEWS_PER_LEASE:
            return

        async def free(peer: str) -> bool:
            try:
                entry = await self._kv.get(peer)
            except nats.js.errors.KeyNotFoundError:
                return True
            return entry.value is None or not entry.value

        now = time.monotonic()
        names = list(peers)
        for peer, empty in zip(names, await self._each(free, names)):
            if not empty:
                self._unowned_since.pop(peer, None)
            else:
                self._unowned_since.setdefault(peer, now)
        unowned = tuple(sorted(peers[k] for k, since in self._unowned_since.items() if now - since > self._lease))
        before, self.unowned = self.unowned, unowned  # set before the line is logged: whoever reads it sees both
        if unowned != before:
            if unowned:
                log.warning("partitions %s (of %d) have had no live lease for more than %g s: no instance owns "
                            "them, so their messages go unanswered (start the instances that own them)",
                            format_partitions(unowned), len(peers), self._lease)
            elif before:
                log.info("every partition has an owner again")

    async def _end_deployment(self) -> None:
        """At release: delete the record when no partition's lease key holds a value (the last
        instance of the deployment stopped), so another layout may start at once."""
        key, _, peers = self._deployment
        self._deployment = None
        self.unowned = ()

        async def held(peer: str) -> bool:
            try:
                entry = await self._kv.get(peer)
            except nats.js.errors.KeyNotFoundError:
                return False
            return bool(entry.value)

        try:
            await self._connection()
            if not any(await self._each(held, list(peers))):
                await self._kv.delete(key)
        except (StoreError, *NATS_ERRORS, nats.js.errors.Error):
            pass  # it expires by itself within the TTL

    async def _release_keys(self, keys: list[str]) -> None:
        """Delete each key at our revision (not one someone else wrote since); what fails expires."""
        failed: list[str] = []
        revisions = {key: self._held.pop(key) for key in keys if key in self._held}
        for key in keys:
            self._valid_until.pop(key, None)
        self._update_held_until()

        async def delete(key: str) -> None:
            try:
                await self._kv.delete(key, last=revisions[key])
            except nats.js.errors.APIError as exc:
                if not _wrong_last(exc):
                    failed.append(key)
            except (*NATS_ERRORS, TimeoutError):
                failed.append(key)

        if not revisions:
            return
        try:
            await self._connection()
            await self._each(delete, list(revisions))
        except StoreError:
            failed = list(revisions)
        if failed:
            log.warning("could not release the lease of %s: it expires by itself within %g s",
                        ", ".join(sorted(failed)), self._ttl_s)

    # ---- objects -----------------------------------------------------------------------------------------

    def put(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` as the object ``name`` (replacing an older one of that name). Raises
        ``LeaseLost`` once a lease is lost (nothing written), ``StoreError``."""
        self._need_bucket(name)
        if self.lost.is_set():
            raise LeaseLost(self._lost_message())
        self._call(self._put(name, data))

    def get(self, name: str) -> bytes | None:
        """The object's content; None if there is none of that name. Raises ``ObjectDamaged``
        (content and meta disagree), ``StoreError``."""
        self._need_bucket(name)
        return self._call(self._get(name))

    def names(self, prefix: str = "") -> list[str]:
        """The names of the objects (not deleted) starting with ``prefix``, sorted."""
        self._need_bucket()
        return self._call(self._names(prefix))

    def delete(self, name: str) -> None:
        """Delete the object ``name`` (nothing if there is none). Raises ``LeaseLost`` once a lease
        is lost (pruning then could remove what the partitions' new owner needs), ``StoreError``."""
        self._need_bucket(name)
        if self.lost.is_set():
            raise LeaseLost(self._lost_message())
        self._call(self._delete(name))

    def _need_bucket(self, name: str | None = None) -> None:
        if not self.bucket:
            raise RuntimeError("this NatsStore was made without an object bucket (bucket=None)")
        if name is not None and not name:
            raise ValueError("an object needs a name")

    def _meta_subject(self, name: str) -> str:
        return f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    async def _info(self, name: str) -> api.ObjectInfo | None:
        """The object's meta; None when there is none or it is deleted."""
        try:
            msg = await self._js.get_msg(f"OBJ_{self.bucket}", subject=self._meta_subject(name),
                                         direct=self._obj_direct)
        except nats.js.errors.NotFoundError:
            return None
        try:
            info = api.ObjectInfo.from_response(json.loads(msg.data or b"{}"))
        except (ValueError, TypeError, KeyError) as exc:
            raise ObjectDamaged(f"object {name!r} in bucket {self.bucket!r}: its meta cannot be read "
                                f"({_describe(exc)})") from None
        return None if info.deleted else info

    async def _put(self, name: str, data: bytes | bytearray | memoryview) -> None:
        self._fence()
        await self._connection()
        js, stream = self._js, f"OBJ_{self.bucket}"
        old = await self._info(name)
        nuid = self._nuid.next().decode()
        chunks = f"$O.{self.bucket}.C.{nuid}"
        view = memoryview(data).cast("B")
        digest = hashlib.sha256()
        pending: collections.deque[asyncio.Future] = collections.deque()
        count = 0
        try:
            for offset in range(0, len(view), CHUNK_BYTES):
                chunk = bytes(view[offset:offset + CHUNK_BYTES])
                digest.update(chunk)
                pending.append(await js.publish_async(chunks, chunk))
                count += 1
                if len(pending) >= PUBLISH_WINDOW:
                    await self._stored(pending.popleft())
            while pending:
                await self._stored(pending.popleft())
            self._fence()  # the meta is the commit point: never published after a lease is lost
        except BaseException:
            for future in pending:
                future.cancel()
            try:
                async with asyncio.timeout(self._api_s):
                    await js.purge_stream(stream, subject=chunks)
            except (*NATS_ERRORS, asyncio.CancelledError):
                pass  # unreferenced chunks: space, not a wrong object
            raise
        info = api.ObjectInfo(
            name=name, bucket=self.bucket, nuid=nuid, size=len(view), chunks=count,
            digest="SHA-256=" + base64.urlsafe_b64encode(digest.digest()).decode(),
            mtime=datetime.now(UTC).isoformat(), options=api.ObjectMetaOptions(max_chunk_size=CHUNK_BYTES))
        try:
            await js.publish(self._meta_subject(name), json.dumps(info.as_dict()).encode(),
                             headers={api.Header.ROLLUP: "sub"})
        except nats.js.errors.APIError:  # the server answered: not stored, so the chunks are nobody's
            try:
                await js.purge_stream(stream, subject=chunks)
            except NATS_ERRORS:
                pass
            raise
        # any other failure (no answer) leaves the chunks: the server may have stored the meta
        if old is not None and old.nuid and old.nuid != nuid:
            try:
                await js.purge_stream(stream, subject=f"$O.{self.bucket}.C.{old.nuid}")
            except NATS_ERRORS as exc:
                log.warning("object %r: the chunks of the version it replaced were not removed (%s)", name,
                            _describe(exc))

    async def _stored(self, future: asyncio.Future) -> None:
        async with asyncio.timeout(self._api_s):
            await future

    async def _get(self, name: str) -> bytes | None:
        await self._connection()
        for _ in range(TAKE_ATTEMPTS):
            info = await self._info(name)
            if info is None:
                return None
            if info.is_link():
                raise StoreError(f"object {name!r} in bucket {self.bucket!r} is a link; links are not read")
            read = await self._chunks(info)
            if read is None:
                again = await self._info(name)
                if again is not None and again.nuid != info.nuid:
                    continue  # overwritten while we read: read the new one
                raise ObjectDamaged(f"object {name!r} in bucket {self.bucket!r} is damaged: chunks missing "
                                    f"(its meta names {info.chunks} chunks of {info.nuid})")
            parts, sha = read
            data = b"".join(parts)
            digest = "SHA-256=" + base64.urlsafe_b64encode(sha.digest()).decode()
            if len(data) != (info.size or 0) or (info.digest or "").upper() != digest.upper():
                raise ObjectDamaged(f"object {name!r} in bucket {self.bucket!r} is damaged: {len(data)} bytes with "
                                    f"{digest}, its meta says {info.size} bytes with {info.digest}")
            return data
        raise StoreError(f"object {name!r} in bucket {self.bucket!r} was overwritten {TAKE_ATTEMPTS} times while read")

    async def _chunks(self, info: api.ObjectInfo) -> tuple[list[bytes], Any] | None:
        """The chunks the meta names, in order, and their SHA-256 (hashed as they come, so a large
        object does not hold the loop, and the renewals, for one long hash); None when one is
        missing."""
        subject = f"$O.{self.bucket}.C.{info.nuid}"
        parts: list[bytes] = []
        sha = hashlib.sha256()
        seq = 1
        for _ in range(info.chunks or 0):
            try:
                msg = await self._js.get_msg(f"OBJ_{self.bucket}", seq=seq, subject=subject, direct=self._obj_direct,
                                             next=True)
            except nats.js.errors.NotFoundError:
                return None
            parts.append(msg.data or b"")
            sha.update(parts[-1])
            seq = msg.seq + 1
        return parts, sha

    async def _names(self, prefix: str) -> list[str]:
        await self._connection()
        store = ObjectStore(name=self.bucket, stream=f"OBJ_{self.bucket}", js=self._js)
        try:
            async with asyncio.timeout(self._api_s * 2):
                infos = await store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        return sorted({info.name for info in infos if not info.deleted and info.name.startswith(prefix)})

    async def _delete(self, name: str) -> None:
        self._fence()
        await self._connection()
        try:
            await ObjectStore(name=self.bucket, stream=f"OBJ_{self.bucket}", js=self._js).delete(name)
        except nats.js.errors.ObjectNotFoundError:
            pass
