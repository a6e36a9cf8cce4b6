"""Addresses: ``host:port`` parsing, URL authorities, the loopback check, one implementation each.

Rules:
- Pure: no sockets, no name resolution. A host name is taken as written; only literal
  addresses (and ``localhost``) count as loopback.
- An IPv6 literal is written in brackets (``[::1]:9000``, ``ws://[fe80::1%eth0]/x``): a
  bracket that is not closed, stray, or around something that is not an IPv6 address is an
  error, never passed on to the socket or the client's URL parser.
- Errors are ``ValueError`` with a sentence saying what was expected, for the caller to put
  beside the variable's name. ``redact_url`` never raises: it also shows malformed URLs.
- The parsers of settings' text (``socket_path``, ``listen_socket``, ``listen_address``, ``nats_urls``) raise
  ``ValueProblem`` with the detail, for the setting's ``ConfigError``; ``is_subject`` says whether a text is a
  NATS subject (a message's address there).
- A unix-domain socket is named by an absolute path (``unix_socket_path``): a relative one would
  mean another socket whenever the process starts in another directory. At most
  ``UNIX_PATH_MAX_BYTES`` bytes (Linux's ``sun_path``, with its terminating NUL), so a path the
  kernel would refuse is refused with the configuration, not at the first connect. An address
  for a listener may be ``unix:/path`` (``unix_address``); shown as such (``unix_label``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from urllib.parse import urlsplit, urlunsplit

from forkless.io_loop.errors import ValueProblem

__all__ = ["UNIX_PATH_MAX_BYTES", "UNIX_PREFIX", "is_loopback", "is_subject", "listen_address", "listen_socket",
           "nats_urls", "parse_host_port", "parse_port", "redact_url", "redact_urls", "socket_path", "unix_address",
           "unix_label", "unix_socket_path", "url_host_port"]

SUBJECT_TOKEN = re.compile(r"[^\s.]+")

UNIX_PREFIX = "unix:"  # a listener's address on a unix-domain socket: unix:/run/forkless/metrics.sock
UNIX_PATH_MAX_BYTES = 107  # sizeof(sockaddr_un.sun_path) on Linux, less the terminating NUL


def parse_port(text: str, *, allow_zero: bool = True) -> int:
    """A TCP port written in decimal digits, 0 (any free port, if allowed) to 65535."""
    text = text.strip()
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"the port {text!r} is not a number")
    port = int(text)
    if port > 65535 or (port == 0 and not allow_zero):
        raise ValueError(f"the port {port} is out of range ({0 if allow_zero else 1}-65535)")
    return port


def _ipv6(text: str) -> str:
    """``text`` if it is an IPv6 address (a zone such as ``%eth0`` allowed), else ValueError."""
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        raise ValueError(f"{text!r} in brackets is not an IPv6 address") from None
    return text


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> ``(host, port)`` (brackets removed)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise ValueError("expected host:port")
    if host.startswith("[") and host.endswith("]"):
        host = _ipv6(host[1:-1])
    elif "[" in host or "]" in host:
        raise ValueError("expected host:port, an IPv6 address in brackets: [::1]:9000")
    elif ":" in host:  # an IPv6 address without brackets: the port is what follows its last colon
        _ipv6(host)
    return host, parse_port(port)


def url_host_port(url: str) -> tuple[str, int | None]:
    """The host (brackets removed) and the port (None when not written) of
    ``scheme://[user[:password]@]host[:port][/path][?query][#fragment]``. Raises ValueError for
    a URL without a host, a malformed bracketed host, anything between ``]`` and ``:port``, or
    a port that is not 1-65535 in digits."""
    _, sep, rest = url.partition("://")
    if not sep:
        raise ValueError("expected scheme://host")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    userinfo, _, hostport = authority.rpartition("@")
    if "[" in userinfo or "]" in userinfo:
        raise ValueError("a bracket in the user name or password (percent-encode it)")
    if hostport.startswith("["):
        inside, closed, after = hostport[1:].partition("]")
        if not closed:
            raise ValueError("an IPv6 address opened with '[' is not closed with ']'")
        host = _ipv6(inside)
        if after and not after.startswith(":"):
            raise ValueError(f"{after!r} after the bracketed host: expected :port or nothing")
        port_text = after[1:] if after else None
    else:
        if "[" in hostport or "]" in hostport:
            raise ValueError("a bracket outside an IPv6 address in brackets")
        host, colon, port_text = hostport.partition(":")
        port_text = port_text if colon else None
    if not host:
        raise ValueError("expected a host")
    return host, None if port_text is None else parse_port(port_text, allow_zero=False)


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
    """``scheme://host:port/path`` — no credentials, no query (tokens often live there).
    Never raises: a URL ``urlsplit`` refuses (a malformed IPv6 literal) is cut by hand."""
    try:
        parts = urlsplit(url)
    except ValueError:
        scheme, sep, rest = url.partition("://")
        rest = re.split(r"[?#]", rest, maxsplit=1)[0]
        authority, slash, path = rest.partition("/")
        return f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{path}"
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def redact_urls(text: str) -> str:
    """A comma-separated list of URLs (a NATS cluster's servers), each as ``redact_url`` shows it."""
    return ",".join(redact_url(part.strip()) for part in text.split(","))


def unix_socket_path(text: str) -> str:
    """A unix-domain socket's path (see the module rules): absolute, no NUL, at most
    ``UNIX_PATH_MAX_BYTES`` bytes, not a directory's (ending in ``/``). Returns it stripped."""
    path = text.strip()
    if not path:
        raise ValueError("expected the path of a unix-domain socket, not an empty text")
    if "\x00" in path:
        raise ValueError("a NUL character in the socket's path")
    if not path.startswith("/"):
        raise ValueError(f"an absolute path (starting with /), not {path!r}: a relative one names another socket "
                         "in every working directory")
    if path.endswith("/"):
        raise ValueError(f"the path of the socket itself, not of a directory: {path!r}")
    size = len(path.encode("utf-8", "surrogateescape"))
    if size > UNIX_PATH_MAX_BYTES:
        raise ValueError(f"at most {UNIX_PATH_MAX_BYTES} bytes (the kernel's limit for a socket's path), "
                         f"not {size}: choose a shorter directory")
    return path


def unix_address(addr: str) -> str | None:
    """The socket's path when ``addr`` is ``unix:/path`` (checked: ``unix_socket_path``), else None."""
    addr = addr.strip()
    if not addr.startswith(UNIX_PREFIX):
        return None
    return unix_socket_path(addr[len(UNIX_PREFIX):])


def unix_label(path: str) -> str:
    """How logs and messages show a unix-domain socket: ``unix:/path``."""
    return UNIX_PREFIX + path


# ---- settings' text (io_loop/settings.py rules): ValueProblem with the detail -----------------------------


def socket_path(text: str) -> str:
    """The path of a unix-domain socket to connect to (``unix_socket_path``), or empty: its server may start
    later, so it need not exist yet."""
    text = text.strip()
    if text == "":
        return ""
    try:
        return unix_socket_path(text)
    except ValueError as exc:
        raise ValueProblem(str(exc)) from None


def listen_socket(text: str) -> str:
    """The path of a unix-domain socket this process will listen on, or empty: its directory must exist and be
    writable, and the path must not be something other than a socket."""
    path = socket_path(text)
    if not path:
        return ""
    directory = os.path.dirname(path) or "/"
    if not os.path.isdir(directory):
        raise ValueProblem(f"the directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueProblem(f"the directory {directory} is not writable by this process")
    if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ValueProblem(f"{path} exists and is not a socket")
    return path


def listen_address(text: str) -> str:
    """``host:port``, ``unix:/path`` (a socket this process will listen on: ``listen_socket``), or empty."""
    text = text.strip()
    if not text:
        return text
    try:
        path = unix_address(text)
    except ValueError as exc:
        raise ValueProblem(str(exc)) from None
    if path is not None:
        listen_socket(path)
    else:
        parse_host_port(text)
    return text


def nats_urls(text: str) -> str:
    """One nats:// or tls:// URL, or several comma-separated (each with a host, port 1-65535); "" stays ""."""
    text = text.strip()
    for url in text.split(",") if text else ():
        scheme, sep, _ = url.strip().partition("://")
        if scheme not in ("nats", "tls") or not sep:
            raise ValueError
        url_host_port(url.strip())
    return text


def is_subject(text: object, *, wildcards: bool) -> bool:
    """A NATS subject: dot-separated tokens without spaces; with ``wildcards``, a token may be ``*``, and the
    last one ``>``."""
    if not isinstance(text, str) or not 0 < len(text) <= 1024:
        return False
    tokens = text.split(".")
    for i, token in enumerate(tokens):
        if not SUBJECT_TOKEN.fullmatch(token):
            return False
        wildcard = token == "*" or (token == ">" and i == len(tokens) - 1)
        if ("*" in token or ">" in token) and not (wildcards and wildcard):
            return False
    return True
