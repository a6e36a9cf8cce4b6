"""The NATS client behind one transport: every call forkless makes to a NATS server, and the one place nats-py's
exceptions become ours (httpx's transport and its ``map_httpcore_exceptions`` are the model). The feed, its
replies, ``--check``, the relay's publisher and the checkpoint store all talk to NATS through a ``Transport``.
Imported only where one of them is (nats-py is an optional extra).

Rules:
- Options (``connect_options``): the servers of a feed's URL, its token, creds file and TLS (io_loop/net/tls.py);
  one attempt per server, nats-py's own reconnecting off (the caller's ``Backoff`` decides).
- One attempt (``Transport.connect``) is bounded by ``connect_timeout_s`` x 2 per server + 1 s; its failure is one
  ``NatsConnectFailed``, ``fatal`` when the server refused the credentials.
- Every coroutine method of a ``Transport``, its ``KeyValue`` and ``PendingAck.wait`` raises ours, never nats-py's
  (``_mapped``, the one mapper): ``NatsError`` and its kinds, each with nats-py's as its ``__cause__``, and an
  error the server answered keeps its codes (``api``). A publish ack read by a raw subscription is ours the same
  way (``error_ack``). No other module of the room names a nats-py exception (tests/docs/test_architecture.py).
- Errors are shown as their type and first line (``describe_error``): never a URL's user:password, a token or a
  creds file.
- What a call returns is nats-py's data as it is, read by its fields.
- A publish ack says "duplicate" (``duplicate_ack``) in either spelling the servers write.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.kv import KeyValue as _NatsKeyValue
from nats.js.object_store import ObjectStore

from forkless.io_loop.connectors.jetstream.nats_compat import RawClient, RawHandler, publish_commands
from forkless.io_loop.connectors.jetstream.settings import spec_of
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.net.tls import make_ssl_context
from forkless.io_loop.settings import Timeouts, TlsSettings

__all__ = ["KeyValue", "NatsApiError", "NatsConnectFailed", "NatsError", "NatsNoStreamResponse", "NatsNotFound",
           "NatsUnavailable", "NatsWrongLast", "PendingAck", "Subscription", "Transport", "connect_options",
           "describe_error", "duplicate_ack", "error_ack"]

_NATS_ERRORS = (nats.errors.Error, OSError, TimeoutError)
DUPLICATE_ACK = re.compile(rb'"duplicate"\s*:\s*true')  # nats-server 2.15 writes '"duplicate": true'
WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream's error codes for an expected-last-sequence mismatch
SUBJECTS_PAGES = 100  # pages of a stream's subjects read at most (the server's page: up to 100,000 subjects)


class NatsConnectFailed(Exception):
    """A connection attempt failed; ``fatal`` when retrying cannot help (credentials refused).
    The feed's, the relay's and the store's (io_loop/connectors/jetstream/storethread.py)."""

    def __init__(self, reason: str, *, fatal: bool = False) -> None:
        super().__init__(reason)
        self.fatal = fatal


class NatsError(Exception):
    """Talking to NATS failed (a ``Transport`` call): the text is ``describe_error``'s of nats-py's
    exception (the ``__cause__``). ``api``: the server answered a JetStream API error, whose
    ``code``, ``err_code`` and ``description`` are kept (None otherwise)."""

    api = False
    code: int | None = None
    err_code: int | None = None
    description: str | None = None

    @classmethod
    def answered(cls, text: str, code: int | None, err_code: int | None, description: str | None) -> NatsError:
        """Ours for an error the server answered (``code``, ``err_code``, ``description``), of the class those say."""
        kind: type[NatsError] = NatsApiError
        if err_code in WRONG_LAST_SEQUENCE:
            kind = NatsWrongLast
        elif code == 404:
            kind = NatsNotFound
        elif code == 503:
            kind = NatsUnavailable
        mapped = kind(text)
        mapped.api, mapped.code, mapped.err_code, mapped.description = True, code, err_code, description
        return mapped


class NatsNotFound(NatsError):
    """The server answered that the stream, consumer, key, message or object does not exist."""


class NatsUnavailable(NatsError):
    """No one answered the request (no responders), or the server answered 503: JetStream is not
    enabled (or not ready)."""


class NatsApiError(NatsError):
    """The server answered another JetStream API error (a bad request, a limit)."""


class NatsWrongLast(NatsApiError):
    """The server refused a write at a revision (a KV key's) or a sequence that is no longer the
    last: someone else wrote it meanwhile."""


class NatsNoStreamResponse(NatsError):
    """No stream stores the subject a message was published to (no acknowledgement came)."""


# ---- the one mapper ----------------------------------------------------------------------------------


@contextmanager
def _mapped() -> Iterator[None]:
    """nats-py's exceptions (and ``OSError``, ``TimeoutError``) raised in the block become ours (see the
    module rules); anything else passes through."""
    try:
        yield
    except _NATS_ERRORS as exc:
        raise _of(exc) from exc


def _of(exc: BaseException) -> NatsError:
    """Ours for nats-py's ``exc`` (raise it ``from exc``)."""
    mapped = _mapped_type(exc)(describe_error(exc))
    if isinstance(exc, nats.js.errors.APIError):  # some of its subclasses set only some of these
        mapped.api = True
        mapped.code, mapped.err_code, mapped.description = (getattr(exc, name, None) for name in (
            "code", "err_code", "description"))
    return mapped


def _mapped_type(exc: BaseException) -> type[NatsError]:
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError) or (
            isinstance(exc, nats.js.errors.APIError) and getattr(exc, "err_code", None) in WRONG_LAST_SEQUENCE):
        return NatsWrongLast
    if isinstance(exc, nats.js.errors.NotFoundError):
        return NatsNotFound
    if isinstance(exc, (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError)):
        return NatsUnavailable
    if isinstance(exc, nats.js.errors.APIError):
        return NatsApiError
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return NatsNoStreamResponse
    return NatsError


def describe_error(exc: BaseException) -> str:
    """One line for a NATS error: its type and its first line (a timeout without text said so); a
    mapped one (``NatsError``) already is that line."""
    if isinstance(exc, NatsError):
        return str(exc)
    text = str(exc).strip().splitlines()
    if text and text[0]:
        return f"{type(exc).__name__}: {text[0][:200]}"
    return "no answer in time (TimeoutError)" if isinstance(exc, TimeoutError) else type(exc).__name__


def _credentials_refused(exc: BaseException) -> bool:
    """The server refused the credentials. nats-py 2.16 raises ``AuthorizationError`` only on a
    reconnect; at the first connect (with our reconnect policy every connect is a first one) it
    is a plain ``Error`` carrying the server's ``-ERR 'Authorization Violation'``."""
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower()


def duplicate_ack(data: bytes) -> bool:
    """A JetStream publish acknowledgement (its JSON body) says the stream dropped the message as a
    duplicate of one it stored (the same ``Nats-Msg-Id`` within its duplicate window)."""
    return b'"duplicate"' in data and DUPLICATE_ACK.search(data) is not None


_API_NAMES = {400: "BadRequestError", 404: "NotFoundError", 500: "ServerError", 503: "ServiceUnavailableError"}


def error_ack(data: bytes) -> NatsError | None:
    """The error a publish acknowledgement's body carries, or None when it says the message is
    stored. ``{"error": {"code": 400, "err_code": 10054, "description": "message size exceeds
    maximum allowed"}, …}`` is ours as ``Transport.publish_acked`` would raise it (``NatsError.answered``).
    Never raises: a body that is not a JSON object, or whose "error" is not one, is a ``NatsError``
    naming it (the frame is not known stored)."""
    try:
        resp = json.loads(data)
    except Exception:  # not JSON (ValueError, UnicodeDecodeError), or nested past the parser's depth
        return NatsError(f"an acknowledgement that is not JSON: {data[:200]!r}")
    if not isinstance(resp, dict):
        return NatsError(f"an acknowledgement that is not a JSON object: {data[:200]!r}")
    if "error" not in resp:
        return None
    error = resp["error"]
    if not isinstance(error, dict):
        return NatsError.answered(f"APIError: nats: APIError: description={error!r:.200}", None, None,
                                  f"{error!r:.200}")
    code, err_code, description = error.get("code"), error.get("err_code"), error.get("description")
    code = code if type(code) is int else None
    err_code = err_code if type(err_code) is int else None
    description = None if description is None else str(description)[:200]
    name = _API_NAMES.get(code, "APIError") if code is not None else "APIError"
    return NatsError.answered(f"{name}: nats: {name}: code={code} err_code={err_code} description={description!r}",
                              code, err_code, description)


# ---- connecting -----------------------------------------------------------------------------------------


def connect_options(feed: FeedSpec, timeouts: Timeouts, tls: TlsSettings, **callbacks: Any) -> dict[str, Any]:
    """``nats.connect``'s options for a feed: its servers, credentials and TLS, one attempt per
    server (the reconnect policy is ours: ``Backoff``), the heartbeat as nats-py's ping. ``callbacks``:
    ``error_cb`` (handed nats-py's exception: ``describe_error`` shows it), ``disconnected_cb``, ``closed_cb``."""
    spec = spec_of(feed)
    servers = [url.strip() for url in feed.url.split(",")]
    options: dict[str, Any] = {
        "servers": servers, "name": f"forkless-{feed.name}", "allow_reconnect": False,
        "max_reconnect_attempts": 1, "reconnect_time_wait": 0, "connect_timeout": timeouts.connect_timeout_s,
        "ping_interval": timeouts.heartbeat_s if timeouts.heartbeat_s > 0 else 120, "max_outstanding_pings": 2,
        **callbacks}
    if spec.token:
        options["token"] = spec.token
    if spec.creds:
        options["user_credentials"] = spec.creds
    if any(url.startswith("tls://") for url in servers):
        options["tls"] = make_ssl_context(tls)
    return options


class Subscription:
    """A subscription of a ``Transport``: ``unsubscribe()`` ends it, quietly (its connection may be lost already)."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def unsubscribe(self) -> None:
        try:
            await self._sub.unsubscribe()
        except _NATS_ERRORS:
            pass


class PendingAck:
    """A publication whose JetStream acknowledgement is awaited later (``Transport.publish_later``)."""

    def __init__(self, future: asyncio.Future) -> None:
        self._future = future

    async def wait(self) -> Any:
        """The acknowledgement (nats-py's ``PubAck``); ours raised for a refusal or a lost connection."""
        with _mapped():
            return await self._future

    def cancel(self) -> None:
        self._future.cancel()


class KeyValue:
    """One KV bucket over a ``Transport``'s connection: nats-py's calls, ours raised."""

    def __init__(self, kv: _NatsKeyValue) -> None:
        self._kv = kv

    async def get(self, key: str) -> Any:
        with _mapped():
            return await self._kv.get(key)

    async def create(self, key: str, value: bytes) -> int:
        with _mapped():
            return await self._kv.create(key, value)

    async def update(self, key: str, value: bytes, *, last: int) -> int:
        with _mapped():
            return await self._kv.update(key, value, last=last)

    async def put(self, key: str, value: bytes) -> int:
        with _mapped():
            return await self._kv.put(key, value)

    async def delete(self, key: str, *, last: int | None = None) -> None:
        with _mapped():
            await self._kv.delete(key, last=last)


class Transport:
    """One NATS connection and every call forkless makes on it (see the module rules). ``connect`` makes one;
    ``api_s`` bounds each JetStream API request."""

    def __init__(self, nc: Any, api_s: float) -> None:
        self._nc = nc
        self.api_s = api_s
        # one JetStream context per connection: its publish_async keeps one subscription for every acknowledgement
        self._js = nc.jetstream(timeout=api_s)

    @classmethod
    async def connect(cls, timeouts: Timeouts, options: dict[str, Any], *, raw: bool = False,
                      api_s: float | None = None) -> Transport:
        """One connection attempt with ``options`` (``connect_options``'); ``raw``: a client whose
        ``subscribe`` hands messages straight from the protocol parser (nats_compat.RawClient). Raises
        ``NatsConnectFailed``: ``fatal`` when the server refused the credentials, its reason the failure."""
        try:
            async with asyncio.timeout(timeouts.connect_timeout_s * 2 * len(options["servers"]) + 1):
                nc: nats.NATS
                if raw:
                    nc = RawClient()
                    await nc.connect(**options)
                else:
                    nc = await nats.connect(**options)
        except (*_NATS_ERRORS, nats.errors.NoServersError) as exc:
            raise NatsConnectFailed(describe_error(exc), fatal=_credentials_refused(exc)) from None
        return cls(nc, timeouts.connect_timeout_s if api_s is None else api_s)

    # ---- the connection ---------------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        return self._nc.is_connected

    @property
    def max_payload(self) -> int:
        return self._nc.max_payload

    @property
    def server_version(self) -> str:
        return str(self._nc.connected_server_version)

    @property
    def client(self) -> Any:
        """nats-py's client itself, for the test of its private parts (nats_compat.nats_missing)."""
        return self._nc

    def new_inbox(self) -> str:
        return self._nc.new_inbox()

    async def close(self, timeout_s: float) -> None:
        """Close the connection, waiting at most ``timeout_s``; whatever fails is of no use to report."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._nc.close()
        except (*_NATS_ERRORS, asyncio.CancelledError):
            pass

    async def publish(self, subject: str, data: bytes = b"", *, reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        """A core NATS publication (a pull request, an ack, a relayed message with its JetStream ack to ``reply``)."""
        try:  # the mapping written out (no context manager): the relay's one call per message
            await self._nc.publish(subject, data, reply=reply, headers=headers)
        except _NATS_ERRORS as exc:
            raise _of(exc) from exc

    async def publish_commands(self, data: bytes) -> None:
        """Publications already written as protocol commands, as one piece (nats_compat.publish_commands)."""
        try:  # as publish: the replies' one call per batch
            await publish_commands(self._nc, data)
        except _NATS_ERRORS as exc:
            raise _of(exc) from exc

    async def subscribe(self, subject: str, handler: RawHandler) -> Subscription:
        """``handler(subject, reply, data, headers)`` for each message, straight from the protocol parser (a
        ``raw`` transport's: nats_compat.RawClient)."""
        with _mapped():
            return Subscription(await self._nc.raw_subscribe(subject, handler))

    async def subscribe_messages(self, subject: str, callback: Callable[[Any], Awaitable[None]]) -> Subscription:
        """nats-py's subscription with ``callback(msg)`` (its ``Msg``: ``subject``, ``data``, ``headers``)."""
        with _mapped():
            return Subscription(await self._nc.subscribe(subject, cb=callback))

    # ---- the JetStream API ------------------------------------------------------------------------

    def _jsm(self, timeout_s: float | None = None) -> Any:
        return self._js if timeout_s is None else self._nc.jsm(timeout=timeout_s)

    async def stream_info(self, stream: str, *, timeout_s: float | None = None) -> Any:
        with _mapped():
            return await self._jsm(timeout_s).stream_info(stream)

    async def subject_counts(self, stream: str, subject: str) -> dict[str, int] | None:
        """How many messages the stream holds of each subject matching ``subject`` (a filter, wildcards
        allowed), every page of the server's answer read; None when there are more subjects than
        ``SUBJECTS_PAGES`` pages hold (not known)."""
        counts: dict[str, int] = {}
        for _ in range(SUBJECTS_PAGES):
            request = json.dumps({"subjects_filter": subject, "offset": len(counts)}).encode()
            with _mapped():
                msg = await self._nc.request(f"$JS.API.STREAM.INFO.{stream}", request, timeout=self.api_s)
            try:
                resp = json.loads(msg.data)
            except ValueError:
                raise NatsError(f"stream {stream!r}: an answer that is not JSON: {msg.data[:200]!r}") from None
            error = resp.get("error") if isinstance(resp, dict) else None
            if isinstance(error, dict):
                raise NatsError.answered(f"APIError: {error.get('description')}", error.get("code"),
                                         error.get("err_code"), error.get("description"))
            page = ((resp.get("state") or {}).get("subjects") or {}) if isinstance(resp, dict) else {}
            counts.update(page)
            total = resp.get("total") if isinstance(resp, dict) else None
            if not page or not isinstance(total, int) or len(counts) >= total:
                return counts
        return None

    async def consumer_info(self, stream: str, name: str) -> Any:
        with _mapped():
            return await self._jsm().consumer_info(stream, name)

    async def add_pull_consumer(self, stream: str, *, name: str, start_seq: int, subjects: tuple[str, ...],
                                ack_wait_s: float, max_ack_pending: int, inactive_s: float) -> None:
        """An ephemeral pull consumer (named, in memory, removed by the server after ``inactive_s``
        unused) delivering ``subjects`` (none: the whole stream) from ``start_seq``, ack policy "all"."""
        config = api.ConsumerConfig(
            name=name, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq,
            ack_policy=api.AckPolicy.ALL, ack_wait=ack_wait_s, max_ack_pending=max_ack_pending,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            filter_subjects=list(subjects) if len(subjects) > 1 else None,
            inactive_threshold=inactive_s, mem_storage=True)
        with _mapped():
            await self._jsm().add_consumer(stream, config)

    async def find_stream_name_by_subject(self, subject: str) -> str:
        with _mapped():
            return await self._jsm().find_stream_name_by_subject(subject)

    async def get_msg(self, stream: str, *, seq: int | None = None, subject: str | None = None,
                      direct: bool = False, next: bool = False) -> Any:
        """A stored message (nats-py's ``RawStreamMsg``): at ``seq``; the last of ``subject``; or with ``next``
        the first of ``subject`` at or after ``seq``."""
        with _mapped():
            return await self._jsm().get_msg(stream, seq=seq, subject=subject, direct=direct, next=next)

    async def get_last_msg(self, stream: str, subject: str) -> Any:
        with _mapped():
            return await self._jsm().get_last_msg(stream, subject)

    async def publish_acked(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> Any:
        """A JetStream publication, its acknowledgement awaited (nats-py's ``PubAck``)."""
        with _mapped():
            return await self._js.publish(subject, data, headers=headers)

    async def publish_later(self, subject: str, data: bytes) -> PendingAck:
        """A JetStream publication whose acknowledgement is awaited later (``PendingAck.wait``)."""
        with _mapped():
            return PendingAck(await self._js.publish_async(subject, data))

    async def purge_stream(self, stream: str, subject: str) -> None:
        with _mapped():
            await self._jsm().purge_stream(stream, subject=subject)

    # ---- buckets ----------------------------------------------------------------------------------

    async def create_key_value(self, bucket: str, *, history: int, ttl_s: float, description: str) -> None:
        with _mapped():
            await self._js.create_key_value(api.KeyValueConfig(
                bucket=bucket, history=history, ttl=ttl_s, description=description))

    def key_value(self, bucket: str, *, direct: bool) -> KeyValue:
        """The KV bucket ``bucket`` over this connection (``direct``: its stream allows direct gets)."""
        return KeyValue(_NatsKeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.",
                                      js=self._js, direct=direct))

    async def create_object_store(self, bucket: str, *, description: str) -> None:
        with _mapped():
            await self._js.create_object_store(bucket, description=description)

    def _objects(self, bucket: str) -> ObjectStore:
        return ObjectStore(name=bucket, stream=f"OBJ_{bucket}", js=self._js)

    async def object_infos(self, bucket: str) -> list[Any]:
        """The metas of the bucket's objects, deleted ones left out by the server (nats-py's ``ObjectInfo``)."""
        with _mapped():
            return await self._objects(bucket).list(ignore_deletes=True)

    async def delete_object(self, bucket: str, name: str) -> None:
        with _mapped():
            await self._objects(bucket).delete(name)
