"""Opening a WebSocket to the feed: headers, TLS, and what a refused handshake means.

Rules:
- One implementation, for the client's reconnect loop and for ``--check``'s probe.
- aiohttp's exceptions are translated here, at one edge (as httpx's ``map_httpcore_exceptions``): ``open_feed``
  returns an open WebSocket or raises ``HandshakeRefused`` (``fatal`` for a 4xx but 408/429) or ``ConnectFailed``;
  on an open one, ``mapped_aiohttp_errors()`` makes aiohttp's errors ``ConnectionLost``. No other module names an
  aiohttp exception in an ``except``.
- Secrets (token, headers) never go into messages; URLs are shown without query or credentials (``redact_url``).
- Redirects are never followed: the handshake carries the credentials, and aiohttp would send them on to wherever a
  3xx points. ``new_session()``'s trace hook stops the redirect before the second request; a 3xx raises
  ``HandshakeRefused`` (fatal) naming the target without query or credentials.
- A feed with a unix-domain socket gets a session that connects every request through it (``UnixConnector``, TLS
  over it for wss://): no TCP socket, no name resolved; messages name ``ws://host/path via unix:/path``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import ssl
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import aiohttp
from aiohttp.client_exceptions import UnixClientConnectorError

from forkless.io_loop.connectors.websocket.settings import Credentials
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.net.aiohttp_compat import UnixConnector
from forkless.io_loop.net.netaddr import redact_url, unix_label
from forkless.io_loop.settings import Timeouts

__all__ = ["ConnectFailed", "ConnectionLost", "HandshakeRefused", "handshake_headers",
           "mapped_aiohttp_errors", "merge_headers", "new_session", "open_feed", "shown_target"]

RETRYABLE_4XX = (408, 429)
_HINTS = {401: "unauthorised: check FORKLESS_AUTH_TOKEN",
          403: "forbidden: check FORKLESS_AUTH_TOKEN / FORKLESS_HEADERS",
          404: "not found: check the path in FORKLESS_WS_URL"}


class _RedirectRefused(Exception):
    """Raised inside aiohttp's redirect trace hook, before it sends the next request."""

    def __init__(self, status: int, location: str) -> None:
        super().__init__(status, location)
        self.status = status
        self.location = location


class ConnectFailed(Exception):
    """No connection this time (refused, reset, timeout, TLS, 5xx …); ``str`` says why."""


class ConnectionLost(Exception):
    """An open WebSocket failed while sending or receiving (``mapped_aiohttp_errors``): the text is
    the original's type and first line, the original its ``__cause__``."""


@contextmanager
def mapped_aiohttp_errors() -> Iterator[None]:
    """aiohttp's ``ClientError`` and a ``ConnectionError`` raised in the block become
    ``ConnectionLost``; anything else passes through."""
    try:
        yield
    except (ConnectionError, aiohttp.ClientError) as exc:
        raise ConnectionLost(f"{exc.__class__.__name__}: {short(exc)}") from exc


class HandshakeRefused(Exception):
    """The server answered the opening handshake with an HTTP status other than 101."""

    def __init__(self, shown_url: str, status: int, hint: str = "") -> None:
        self.status = status
        self.fatal = 300 <= status < 500 and status not in RETRYABLE_4XX
        hint = hint or _HINTS.get(status, "client error: check FORKLESS_WS_URL" if self.fatal else "")
        super().__init__(f"{shown_url} refused the WebSocket handshake with HTTP {status}"
                         + (f" ({hint})" if hint else ""))


def handshake_headers(credentials: Credentials, feed: FeedSpec | None = None) -> dict[str, str]:
    """``FORKLESS_HEADERS``, then the feed's own headers (which win, by name in any case),
    plus ``Authorization: Bearer`` from ``FORKLESS_AUTH_TOKEN``."""
    headers = merge_headers(credentials.headers, feed.headers if feed is not None else ())
    if credentials.auth_token:
        headers["Authorization"] = f"Bearer {credentials.auth_token}"
    return headers


def merge_headers(headers: Iterable[tuple[str, str]] | Mapping[str, str],
                  extra: Iterable[tuple[str, str]]) -> dict[str, str]:
    """``headers`` with ``extra`` added, each replacing any of the same name in any case."""
    merged = dict(headers)
    for name, value in extra:
        for same in [known for known in merged if known.lower() == name.lower()]:
            del merged[same]
        merged[name] = value
    return merged


def shown_target(url: str, unix_socket: str = "") -> str:
    """How messages name where a feed connects: the URL without credentials or query, and
    ``via unix:/path`` when it goes through a unix-domain socket."""
    return redact_url(url) + (f" via {unix_label(unix_socket)}" if unix_socket else "")


def new_session(unix_socket: str = "") -> aiohttp.ClientSession:
    """A client session that refuses to follow redirects (see the module rules); with
    ``unix_socket``, one that connects every request through that unix-domain socket."""

    async def on_redirect(session: aiohttp.ClientSession, ctx: object,
                          params: aiohttp.TraceRequestRedirectParams) -> None:
        location = params.response.headers.get("Location", "")
        try:
            target = redact_url(str(params.url.join(type(params.url)(location))))
        except ValueError:  # the server's Location is not a URL (e.g. "ws://[::1/x"): shown as sent, redacted
            target = redact_url(location)
        raise _RedirectRefused(params.response.status, target)

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(on_redirect)
    connector = UnixConnector(path=unix_socket) if unix_socket else None
    return aiohttp.ClientSession(trace_configs=[trace], connector=connector)


async def open_feed(session: aiohttp.ClientSession, url: str, ssl_context: ssl.SSLContext | None, *,
                    headers: Mapping[str, str], timeouts: Timeouts, max_msg_bytes: int,
                    heartbeat: bool = True, autoping: bool = True) -> aiohttp.ClientWebSocketResponse:
    """Connect and complete the opening handshake within ``timeouts.connect_timeout_s``, sending
    ``headers`` (the configured ones with the feed's added, ``handshake_headers``, or this attempt's
    from the before-connect hook: io_loop/connectors/websocket/before_connect.py); a frame over ``max_msg_bytes``
    ends the connection (1009). ``autoping=False``: the server's pings and pongs reach ``receive()``,
    and the caller answers the pings."""
    shown = redact_url(url)
    try:
        async with asyncio.timeout(timeouts.connect_timeout_s):
            return await session.ws_connect(
                url,
                headers=headers,
                heartbeat=(timeouts.heartbeat_s or None) if heartbeat else None,
                ssl=ssl_context if ssl_context is not None else True,
                max_msg_size=max_msg_bytes + 1,  # aiohttp refuses a frame of exactly its limit
                autoping=autoping,
            )
    except aiohttp.WSServerHandshakeError as exc:
        raise HandshakeRefused(shown, exc.status) from None
    except _RedirectRefused as exc:
        raise HandshakeRefused(shown, exc.status, f"a redirect to {exc.location}, not followed: the handshake "
                                                  "carries credentials; set FORKLESS_WS_URL to that URL if "
                                                  "you trust it") from None
    except aiohttp.ClientConnectorCertificateError as exc:
        cert = exc.certificate_error
        raise ConnectFailed(f"TLS certificate verification failed: {cert.__class__.__name__}: "
                            f"{getattr(cert, 'verify_message', cert)} (FORKLESS_CA_FILE adds a CA bundle)") from None
    except TimeoutError:
        raise ConnectFailed(f"no connection and handshake within FORKLESS_CONNECT_TIMEOUT_S="
                            f"{timeouts.connect_timeout_s}s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise ConnectFailed(describe_error(exc)) from None


def describe_error(exc: BaseException) -> str:
    """'Connection refused (errno 111)' rather than aiohttp's wrapper text; for a unix-domain
    socket, what its path lacks."""
    os_error = getattr(exc, "os_error", None)
    if isinstance(exc, UnixClientConnectorError):
        return _unix_failure(exc.path, os_error)
    if isinstance(os_error, socket.gaierror):
        return f"cannot resolve the host name: {os_error.strerror}"
    code = getattr(os_error, "errno", None)
    if isinstance(os_error, OSError) and code:
        return f"{os.strerror(code)} (errno {code})"
    return f"{exc.__class__.__name__}: {short(exc)}"


def short(exc: BaseException) -> str:
    """The first line of an exception's text, at most 200 characters."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else exc.__class__.__name__
    return text if len(text) <= 200 else text[:200] + "…"


_UNIX_HINTS = {errno.ENOENT: "no such socket: is the feed's server running, and is the path right?",
               errno.ECONNREFUSED: "nothing is listening on the socket (its server has stopped)",
               errno.EACCES: "permission denied: this user may not write to the socket",
               errno.ENOTDIR: "a part of the path is not a directory",
               errno.ENOTSOCK: "the path is not a socket"}


def _unix_failure(path: str, os_error: object) -> str:
    """Why connecting to the unix-domain socket ``path`` failed, in words an operator can act on."""
    code = getattr(os_error, "errno", None)
    what = _UNIX_HINTS.get(code) if code else None
    if what is None:
        what = f"{os.strerror(code)} (errno {code})" if code else f"{os_error.__class__.__name__}: {os_error}"
    return f"{what} ({path})"
