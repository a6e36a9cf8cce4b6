"""Addresses: ``host:port`` parsing and the loopback check, one implementation each.

Rules:
- Pure: no sockets, no name resolution. A host name is taken as written; only literal
  addresses (and ``localhost``) count as loopback.
- Errors are ``ValueError`` with a sentence saying what was expected, for the caller to put
  beside the variable's name.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit, urlunsplit

__all__ = ["is_loopback", "parse_host_port", "parse_port", "redact_url"]


def parse_port(text: str, *, allow_zero: bool = True) -> int:
    """A TCP port written in decimal digits, 0 (any free port, if allowed) to 65535."""
    text = text.strip()
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"the port {text!r} is not a number")
    port = int(text)
    if port > 65535 or (port == 0 and not allow_zero):
        raise ValueError(f"the port {port} is out of range ({0 if allow_zero else 1}-65535)")
    return port


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> ``(host, port)`` (brackets removed)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise ValueError("expected host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError("expected host:port")
    return host, parse_port(port)


def is_loopback(host: str, *, literal: bool = False) -> bool:
    """True for literal loopback addresses (127.0.0.0/8, ::1), and ``localhost`` unless
    ``literal`` (a listener that must never be reachable from elsewhere takes only literals)."""
    if host == "localhost":
        return not literal
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redact_url(url: str) -> str:
    """``scheme://host:port/path`` — no credentials, no query (tokens often live there)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
