"""The WebSocket room's settings: the one-feed shorthand (``FORKLESS_WS_URL`` and what goes with it), what every
handshake carries (``Credentials``) and the embedded demo feed's (``DemoSettings``); each setting declared once
(io_loop/settings.py's rules).

Rules:
- ``WebSocketSettings`` is the one feed a program may give without ``FORKLESS_FEEDS``: ``feed`` makes its
  ``FeedSpec``, as a ``FORKLESS_FEEDS`` entry's is made (entry.py); its unix-domain socket needs its URL, whose
  path and host the handshake still sends (``Config.validate``, beside the rule against ``FORKLESS_FEEDS``).
- ``Credentials`` stay out of ``repr`` and errors; one source of credentials per handshake is the feed's check
  (``check_credentials``: a URL's user:password, ``FORKLESS_AUTH_TOKEN``, or an Authorization header).
- Pure: nothing here opens a socket.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from forkless.io_loop.errors import ConfigError, ValueProblem
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.net.netaddr import listen_socket, redact_url, socket_path, url_host_port
from forkless.io_loop.settings import (
    PREFIX,
    REPLY_POLICIES,
    ReplyPolicy,
    header_pairs,
    integer,
    json_text,
    number,
    setting,
    settings_group,
    text,
)

__all__ = ["WEBSOCKET", "Credentials", "DemoSettings", "WebSocketSettings", "check_credentials", "subscribe_text",
           "ws_url"]

WEBSOCKET = "websocket"  # a FeedSpec's kind for this room's feeds (io_loop/kinds.py finds its connector by it)


def ws_url(text: str) -> str:
    """A ws:// or wss:// URL with a host (port 1-65535), or empty."""
    text = text.strip()
    if text == "":
        return ""
    parts = urlsplit(text)  # raises ValueError for some malformed IPv6 literals itself
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError
    url_host_port(text)  # brackets only around an IPv6 address, then nothing or :port (1-65535)
    return text


def subscribe_text(value: Any) -> Any:
    """``subscribe`` given in code as a JSON value (a dict or list, say): its compact JSON text, the form it is
    kept and sent in, as a ``FORKLESS_FEEDS`` entry's; ``None`` means none. A text is taken as it is."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise ValueProblem(f"in code a JSON-serialisable value (a dict or list of str, numbers, bool, None), not "
                           f"this {type(value).__name__}, which json cannot write (it is or holds a set, bytes, NaN, "
                           "another object …)") from None


@settings_group
class WebSocketSettings:
    """One WebSocket feed given by variables (``FORKLESS_WS_URL``; empty: the embedded demo feed, unless
    ``FORKLESS_FEEDS`` or a program's own sources are given)."""

    url: str = setting("WS_URL", text(ws_url, "a ws:// or wss:// URL (port 1-65535), or empty"),
                       "WebSocket feed to connect to; empty starts the embedded demo feed", default="",
                       shown=redact_url)
    unix_socket: str = setting(
        "WS_UNIX_SOCKET", text(socket_path, "an absolute path of at most 107 bytes, or empty"),
        "connect to WS_URL's feed through this unix-domain socket instead of TCP: the handshake's path and Host "
        "(and, for wss://, TLS's server name) still come from WS_URL, e.g. ws://localhost/feed; needs WS_URL (a "
        'FORKLESS_FEEDS entry takes "unix_socket")', default="")
    # a JSON text; in code also a JSON value (dict, list …), kept as its compact JSON text
    subscribe: str = setting("SUBSCRIBE", text(json_text, "a JSON text or @path to a file holding one",
                                               from_code=subscribe_text),
                             "message sent first on every new connection (empty: none); never logged, as it often "
                             "holds credentials", default="", secret=True)

    def feed(self, replies: ReplyPolicy = REPLY_POLICIES[0]) -> FeedSpec:
        """The one feed these settings give, named ``0``, its replies by ``replies`` (``FORKLESS_REPLIES``); its
        url is empty where the demo feed runs in its place."""
        return FeedSpec("0", self.url, self.subscribe, replies=replies, unix_socket=self.unix_socket, kind=WEBSOCKET)


@settings_group
class Credentials:
    """What every WebSocket handshake carries (connect.py's ``handshake_headers``), kept out of ``repr``: a
    feed's own headers are its ``FeedSpec``'s."""

    headers: tuple[tuple[str, str], ...] = setting("HEADERS", header_pairs, "extra handshake headers; never logged",
                                                   default=(), secret=True)
    auth_token: str = setting("AUTH_TOKEN", text(str.strip, "any text"), "sent as 'Authorization: Bearer <token>'; "
                              "never logged", default="", secret=True)


def check_credentials(feed: FeedSpec, credentials: Credentials, variable: str) -> None:
    """One source of handshake credentials for ``feed``: its URL's user:password, ``FORKLESS_AUTH_TOKEN``, or an
    Authorization header (``FORKLESS_HEADERS`` or the feed's own), as aiohttp refuses two at once, and mid-run;
    ``ConfigError`` naming ``variable`` (the token's where it is one of them), the values hidden."""
    sources = []
    where = f"in {feed.label}" if variable.endswith("FEEDS") else "in FORKLESS_WS_URL"
    if feed.url and (urlsplit(feed.url).username or urlsplit(feed.url).password):
        sources.append(f"credentials {where} (user:password@)")
    if credentials.auth_token:
        sources.append("FORKLESS_AUTH_TOKEN")
    if any(name.lower() == "authorization" for name, _ in credentials.headers):
        sources.append("an Authorization header in FORKLESS_HEADERS")
    if any(name.lower() == "authorization" for name, _ in feed.headers):
        sources.append(f"an Authorization header in the headers of {feed.label}")
    if len(sources) > 1:
        raise ConfigError(PREFIX + "AUTH_TOKEN" if credentials.auth_token else variable, "<hidden>",
                          f"one source of credentials, not {' and '.join(sources)}")


@settings_group(moved={"features": "features", "warmup": "warmup"})
class DemoSettings:
    """The embedded demo feed's (demo_source.py): how fast it sends, over how many streams, and where it serves."""

    rate: float = setting("DEMO_RATE", number(0.0, 100_000.0, lo_open=True), "demo feed messages per second (all "
                          "streams together)", default=200.0)
    streams: int = setting("DEMO_STREAMS", integer(1, 100_000), "number of demo feed streams", default=8)
    # the demo feed serves on this unix-domain socket, and is read through it ("": loopback TCP)
    unix_socket: str = setting(
        "DEMO_UNIX_SOCKET", text(listen_socket, "an absolute path of at most 107 bytes in an existing writable "
                                 "directory, or empty"),
        "the embedded demo feed serves on this unix-domain socket (made at the start, removed at the stop) and is "
        "read through it, instead of a loopback TCP port: no TCP socket is opened; only with the demo feed (WS_URL "
        "and FEEDS unset)", default="")
