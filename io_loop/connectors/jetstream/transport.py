"""NATS as every part of forkless that talks to it connects and reads it: the JetStream feed
(io_loop/connectors/jetstream/source.py) and its publisher (io_loop/connectors/jetstream/replies.py), the relay
(io_loop/connectors/jetstream/publisher.py),
the checkpoint store (io_loop/connectors/jetstream/store.py) and ``--check`` (io_loop/connectors/jetstream/probe.py).
Imported only where
one of them is (nats-py is an optional extra).

Rules:
- Options (``connect_options``): the servers of a feed's comma-separated URL, its token, creds
  file and TLS (``tls://``: the same context as a ``wss://`` feed, io_loop/sources/connect.py); one
  attempt per server, nats-py's own reconnecting off (the caller's ``Backoff`` decides), the
  heartbeat as nats-py's ping.
- One attempt (``connect_once``) is bounded by ``connect_timeout_s`` x 2 per server + 1 s; its
  failure is one ``NatsConnectFailed``, ``fatal`` when the server refused the credentials
  (retrying cannot help).
- Errors are shown as their type and first line (``describe_error``): never a URL's user:password,
  a token or a creds file's content, which nats-py's messages do not carry either.
- nats-py's exceptions become ours at one edge (``mapped_nats_errors()``, as httpx's
  ``map_httpcore_exceptions``): ``NatsError`` (the connection, a timeout, any other failure),
  ``NatsNotFound`` (the stream, consumer, key or object does not exist), ``NatsUnavailable`` (no
  responders, or a 503: JetStream not enabled), ``NatsWrongLast`` (a write at a revision or
  sequence that is no longer the last), ``NatsNoStreamResponse`` (no stream stores a published
  subject), ``NatsApiError`` (another error the server answered); each one's text is
  ``describe_error``'s of nats-py's, which is its ``__cause__``, and an error the server answered
  keeps its ``code``, ``err_code`` and ``description`` (``api`` is True). No module but this one
  names a nats-py exception in an ``except``: the JetStream feed (io_loop/connectors/jetstream/source.py) and
  its publisher (io_loop/connectors/jetstream/replies.py), ``--check`` (io_loop/connectors/jetstream/probe.py), the
  relay
  (io_loop/connectors/jetstream/publisher.py) and the checkpoint store (io_loop/nats/: whatever runs on its loop
  through ``StoreThread.call`` is mapped there too) catch ours.
- A JetStream publish acknowledgement says "duplicate" (``duplicate_ack``) in either spelling the
  servers write: nats-server 2.15 writes ``"duplicate": true``, with a space.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import nats
import nats.errors
import nats.js.errors
from forkless.io_loop.settings import FeedSpec, Timeouts, TlsSettings
from forkless.io_loop.sources.connect import make_ssl_context

__all__ = ["NATS_ERRORS", "NatsApiError", "NatsConnectFailed", "NatsError", "NatsNoStreamResponse", "NatsNotFound",
           "NatsUnavailable", "NatsWrongLast", "close_quietly", "connect_once", "connect_options",
           "credentials_refused", "describe_error", "duplicate_ack", "mapped_nats_errors", "unsubscribe_quietly"]

NATS_ERRORS = (nats.errors.Error, OSError, TimeoutError)
DUPLICATE_ACK = re.compile(rb'"duplicate"\s*:\s*true')  # nats-server 2.15 writes '"duplicate": true'
WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream's error codes for an expected-last-sequence mismatch


class NatsConnectFailed(Exception):
    """A connection attempt failed; ``fatal`` when retrying cannot help (credentials refused).
    The feed's, the relay's and the store's (io_loop/connectors/jetstream/storethread.py)."""

    def __init__(self, reason: str, *, fatal: bool = False) -> None:
        super().__init__(reason)
        self.fatal = fatal


class NatsError(Exception):
    """Talking to NATS failed (``mapped_nats_errors``): the text is ``describe_error``'s of nats-py's
    exception (the ``__cause__``). ``api``: the server answered a JetStream API error, whose
    ``code``, ``err_code`` and ``description`` are kept (None otherwise)."""

    api = False
    code: int | None = None
    err_code: int | None = None
    description: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> NatsError:
        """Ours for nats-py's ``exc`` (raise it ``from exc``)."""
        mapped = cls(describe_error(exc))
        if isinstance(exc, nats.js.errors.APIError):  # some of its subclasses set only some of these
            mapped.api = True
            mapped.code, mapped.err_code, mapped.description = (getattr(exc, name, None) for name in (
                "code", "err_code", "description"))
        return mapped


class NatsNotFound(NatsError):
    """The server answered that the stream, consumer, key or object does not exist."""


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


@contextmanager
def mapped_nats_errors() -> Iterator[None]:
    """nats-py's exceptions (and ``OSError``, ``TimeoutError``: ``NATS_ERRORS``) raised in the block
    become ours (see the module rules); anything else passes through."""
    try:
        yield
    except NATS_ERRORS as exc:
        raise _mapped_type(exc).of(exc) from exc


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


def credentials_refused(exc: BaseException) -> bool:
    """The server refused the credentials. nats-py 2.16 raises ``AuthorizationError`` only on a
    reconnect; at the first connect (with our reconnect policy every connect is a first one) it
    is a plain ``Error`` carrying the server's ``-ERR 'Authorization Violation'``."""
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower()


def connect_options(feed: FeedSpec, timeouts: Timeouts, tls: TlsSettings, **callbacks: Any) -> dict[str, Any]:
    """``nats.connect``'s options for a feed: its servers, credentials and TLS, one attempt per
    server (the reconnect policy is ours: ``Backoff``), the heartbeat as nats-py's ping."""
    spec = feed.jetstream
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


async def connect_once(timeouts: Timeouts, options: dict[str, Any], client: Any = None) -> Any:
    """One connection attempt with ``options`` (``connect_options``'): ``client`` connected (a
    nats_compat.RawClient), else nats-py's own. Raises ``NatsConnectFailed``: ``fatal`` when the
    server refused the credentials, its reason the failure (``describe_error``)."""
    try:
        async with asyncio.timeout(timeouts.connect_timeout_s * 2 * len(options["servers"]) + 1):
            if client is None:
                return await nats.connect(**options)
            await client.connect(**options)
            return client
    except (*NATS_ERRORS, nats.errors.NoServersError) as exc:
        raise NatsConnectFailed(describe_error(exc), fatal=credentials_refused(exc)) from None


async def close_quietly(nc: Any, timeout_s: float) -> None:
    """Close a connection, waiting at most ``timeout_s``; whatever fails is of no use to report."""
    try:
        async with asyncio.timeout(timeout_s):
            await nc.close()
    except (*NATS_ERRORS, asyncio.CancelledError):
        pass


async def unsubscribe_quietly(sub: Any) -> None:
    """End a subscription of a connection that may be lost already."""
    try:
        await sub.unsubscribe()
    except NATS_ERRORS:
        pass


def duplicate_ack(data: bytes) -> bool:
    """A JetStream publish acknowledgement (its JSON body) says the stream dropped the message as a
    duplicate of one it stored (the same ``Nats-Msg-Id`` within its duplicate window)."""
    return b'"duplicate"' in data and DUPLICATE_ACK.search(data) is not None
