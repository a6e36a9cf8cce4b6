"""Objects: the checkpoint objects of a store, in nats-py's object-store layout, written and read on the store's
loop (storethread.py); store.py's blocking methods call them.

Rules:
- The bucket is a JetStream object store, made when missing, in nats-py's layout (``$O.<bucket>.C.<nuid>`` chunks,
  then the meta on ``$O.<bucket>.M.<base64(name)>`` with a roll-up header): nats-py's ``ObjectStore`` reads ours and
  we read its (a test holds both). Every call goes through the store's ``Transport``.
- Written and read here, not by nats-py's ``put``/``get``: the lease check (``fence``) must sit just before the meta
  is published, chunks go ``PUBLISH_WINDOW`` ahead of their acks, and nats-py's ``get`` is quadratic in the size.
- Atomicity relied on: a put's chunks go to a subject of their own and the meta, the commit point, is published
  only after every chunk is acknowledged; a reader reads the meta, then exactly its chunks. A reader sees the whole
  old object or the whole new one; a failed put leaves no object; a killed writer leaves unreferenced chunks. Old
  chunks are purged after the new meta; a reader missing chunks reads the meta again, else reports damage.
- Integrity relied on: the meta records the size and SHA-256; ``get`` checks both (``ObjectDamaged``). Durability
  is the server's (its sync interval, the bucket's replicas); the caller's bytes carry their own checksum too.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from nats.js import api
from nats.nuid import NUID

from forkless.io_loop.connectors.jetstream.storethread import NAME_IN_USE, TAKE_ATTEMPTS, StoreThread
from forkless.io_loop.connectors.jetstream.transport import NatsError, NatsNotFound, PendingAck, Transport
from forkless.io_loop.connectors.jetstream.transport import describe_error as _describe
from forkless.io_loop.errors import ObjectDamaged, StoreError

__all__ = ["Objects"]

log = logging.getLogger("forkless.store")

CHUNK_BYTES = 128 * 1024  # nats-py's object-store chunk (a server's max_payload is 1 MiB by default)
PUBLISH_WINDOW = 16  # chunks published ahead of their acknowledgements


def _digest(sha: Any) -> str:
    return "SHA-256=" + base64.urlsafe_b64encode(sha.digest()).decode()


class Objects:
    """The objects of the object-store bucket ``bucket`` over the connection of ``thread``;
    ``fence()`` raises ``LeaseLost`` once the leases may no longer be trusted (see the module
    rules)."""

    def __init__(self, thread: StoreThread, bucket: str, fence: Callable[[], None]) -> None:
        self._thread = thread
        self.bucket = bucket
        self._stream = f"OBJ_{bucket}"
        self._fence = fence
        self._direct = False  # the stream allows direct gets
        self._nuid = NUID()

    async def open_bucket(self, transport: Transport) -> str:
        """Make the bucket where missing. Returns what it opened, for the log."""
        try:
            info = await transport.stream_info(self._stream)
        except NatsNotFound:
            try:
                await transport.create_object_store(self.bucket, description="forkless checkpoints (the JetStream "
                                                                             "connector)")
            except NatsError as exc:
                if exc.code != 400 or exc.err_code != NAME_IN_USE:  # made by another instance at the same moment
                    raise
            info = await transport.stream_info(self._stream)
        self._direct = bool(info.config.allow_direct)
        return f"object bucket {self.bucket!r}"

    def _meta_subject(self, name: str) -> str:
        return f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    async def _info(self, name: str) -> api.ObjectInfo | None:
        """The object's meta; None when there is none or it is deleted."""
        try:
            msg = await self._thread.transport.get_msg(self._stream, subject=self._meta_subject(name),
                                                       direct=self._direct)
        except NatsNotFound:
            return None
        try:
            info = api.ObjectInfo.from_response(json.loads(msg.data or b"{}"))
        except (ValueError, TypeError, KeyError) as exc:
            raise ObjectDamaged(f"object {name!r} in bucket {self.bucket!r}: its meta cannot be read "
                                f"({_describe(exc)})") from None
        return None if info.deleted else info

    # ---- writing -----------------------------------------------------------------------------------------

    async def put(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` as the object ``name``: its chunks, then (the leases still held) its meta."""
        self._fence()
        await self._thread.connection()
        js = self._thread.transport
        old = await self._info(name)
        nuid = self._nuid.next().decode()
        view = memoryview(data).cast("B")
        count, digest = await self._put_chunks(js, nuid, view)
        info = api.ObjectInfo(
            name=name, bucket=self.bucket, nuid=nuid, size=len(view), chunks=count, digest=_digest(digest),
            mtime=datetime.now(UTC).isoformat(), options=api.ObjectMetaOptions(max_chunk_size=CHUNK_BYTES))
        try:
            await js.publish_acked(self._meta_subject(name), json.dumps(info.as_dict()).encode(),
                                   headers={api.Header.ROLLUP: "sub"})
        except NatsError as exc:
            if exc.api:  # the server answered: not stored, so the chunks are nobody's
                try:
                    await js.purge_stream(self._stream, subject=f"$O.{self.bucket}.C.{nuid}")
                except NatsError:
                    pass
            raise
        # any other failure (no answer) leaves the chunks: the server may have stored the meta
        if old is not None and old.nuid and old.nuid != nuid:
            try:
                await js.purge_stream(self._stream, subject=f"$O.{self.bucket}.C.{old.nuid}")
            except NatsError as exc:
                log.warning("object %r: the chunks of the version it replaced were not removed (%s)", name,
                            _describe(exc))

    async def _put_chunks(self, js: Transport, nuid: str, view: memoryview) -> tuple[int, Any]:
        """Publish ``view`` as the chunks of ``nuid``, each acknowledged, then ``fence()``: their
        count and SHA-256. On any failure the chunks are purged and it is raised."""
        chunks = f"$O.{self.bucket}.C.{nuid}"
        digest = hashlib.sha256()
        pending: collections.deque[PendingAck] = collections.deque()
        count = 0
        try:
            for offset in range(0, len(view), CHUNK_BYTES):
                chunk = bytes(view[offset:offset + CHUNK_BYTES])
                digest.update(chunk)
                pending.append(await js.publish_later(chunks, chunk))
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
                async with asyncio.timeout(self._thread.api_s):
                    await js.purge_stream(self._stream, subject=chunks)
            except (NatsError, asyncio.CancelledError):
                pass  # unreferenced chunks: space, not a wrong object
            raise
        return count, digest

    async def _stored(self, pending: PendingAck) -> None:
        async with asyncio.timeout(self._thread.api_s):
            await pending.wait()

    # ---- reading -----------------------------------------------------------------------------------------

    async def get(self, name: str) -> bytes | None:
        """The object's content, checked against its meta; None if there is none of that name."""
        await self._thread.connection()
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
            digest = _digest(sha)
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
                msg = await self._thread.transport.get_msg(self._stream, seq=seq, subject=subject,
                                                           direct=self._direct, next=True)
            except NatsNotFound:
                return None
            parts.append(msg.data or b"")
            sha.update(parts[-1])
            seq = msg.seq + 1
        return parts, sha

    # ---- listing and deleting (nats-py's own) ------------------------------------------------------------

    async def names(self, prefix: str) -> list[str]:
        """The names of the objects (not deleted) starting with ``prefix``, sorted."""
        await self._thread.connection()
        try:
            async with asyncio.timeout(self._thread.api_s * 2):
                infos = await self._thread.transport.object_infos(self.bucket)
        except NatsNotFound:
            return []
        return sorted({info.name for info in infos if not info.deleted and info.name.startswith(prefix)})

    async def delete(self, name: str) -> None:
        """Delete the object (nothing if there is none), the leases still held."""
        self._fence()
        await self._thread.connection()
        try:
            await self._thread.transport.delete_object(self.bucket, name)
        except NatsNotFound:
            pass
