"""The before-connect hook: credentials an embedder computes for each connection attempt of a feed (its contract:
docs/embedding/subscriptions.md, "Credentials per connection").

Rules:
- The hook is the embedder's callable (``ConnectHooks(before_connect=hook)``), handed to the IO side as a
  constructor argument; the IO side never imports the controller.
- ``hook(feed, attempt)`` runs on the IO loop before every opening handshake of every WebSocket feed (the demo
  feed's too); ``attempt > 1`` says the last attempt failed, so log in again rather than reuse a token.
- It returns a ``Handshake`` (or an awaitable of one, within ``FORKLESS_CONNECT_TIMEOUT_S``), or None for the
  configured URL and headers. Its headers replace configured ones of the same name in any case; a URL with
  ``user:password@`` and an ``Authorization`` header together are refused (one source of credentials).
- A hook that raises, returns something else or times out fails that attempt like a failed connect
  (``HookFailed``: counted, retried with the backoff, logged once per distinct error); the IO thread never dies of
  it. With a hook, a handshake refused with 401 or 403 is not fatal: the next attempt asks the hook again.
- Secrets: a ``Handshake``'s ``repr`` shows the URL without query or credentials and no header values; errors name
  headers, never their values.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from forkless.io_loop.connectors.websocket.connect import merge_headers
from forkless.io_loop.hooks import guarded_call
from forkless.io_loop.net.netaddr import redact_url, url_host_port

__all__ = ["BeforeConnect", "Handshake", "call_before_connect", "resolve"]

BeforeConnect = Callable[[str, int], Any]
"""``before_connect(feed, attempt) -> Handshake | None`` (or an awaitable of one)."""

HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP token (RFC 9110, 5.6.2)
BAD_IN_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # control characters but tab: no header injection


@dataclass(frozen=True, repr=False)
class Handshake:
    """One attempt's opening handshake: ``url`` (``None``: the configured one) and the headers
    added to the configured ones for it (see the module rules)."""

    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        url = None if self.url is None else redact_url(str(self.url))
        return f"Handshake(url={url!r}, headers=<{len(self.headers)} hidden>)"


def resolve(result: Any, url: str, headers: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The URL and headers of an attempt, from what the hook returned and the configured
    ``url`` and ``headers``; ``TypeError``/``ValueError`` saying what is wrong (no secret in it)."""
    if result is None:
        return url, dict(headers)
    if not isinstance(result, Handshake):
        raise TypeError(f"before_connect returned a {type(result).__name__}; return a Handshake(url=..., "
                        "headers={...}) or None")
    if result.url is not None:
        url = _ws_url(result.url)
    extra = result.headers
    if not isinstance(extra, Mapping):
        raise TypeError(f"before_connect returned headers that are a {type(extra).__name__}, not a mapping of "
                        "header names to values")
    for name, value in extra.items():
        if not isinstance(name, str) or not HEADER_NAME.fullmatch(name):
            raise ValueError(f"before_connect returned the header name {name!r}, which is not an HTTP token")
        if not isinstance(value, str) or BAD_IN_VALUE.search(value):
            raise ValueError(f"before_connect returned a value for the header {name!r} that is not a str "
                             "without control characters (value hidden)")
    merged = merge_headers(headers, extra.items())
    parts = urlsplit(url)
    if (parts.username or parts.password) and any(name.lower() == "authorization" for name in merged):
        raise ValueError("before_connect's handshake has two sources of credentials: user:password in the URL "
                         "and an Authorization header; use one")
    return url, merged


def _ws_url(url: Any) -> str:
    if not isinstance(url, str):
        raise TypeError(f"before_connect returned a URL that is a {type(url).__name__}, not a str")
    try:
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError
        url_host_port(url)
    except ValueError:
        raise ValueError(f"before_connect returned the URL {redact_url(url)!r}: expected a ws:// or wss:// URL "
                         "with a host (and a port 1-65535, if any)") from None
    return url


async def call_before_connect(hook: BeforeConnect, feed: str, attempt: int, timeout_s: float, url: str,
                              headers: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """Call ``hook(feed, attempt)`` (awaiting what it returns, if awaitable, within ``timeout_s``)
    and return the attempt's URL and headers (``resolve``); ``HookFailed`` for anything else."""
    return await guarded_call("before_connect", hook, feed, attempt, timeout_s,
                              lambda result: resolve(result, url, headers))
