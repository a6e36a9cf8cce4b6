"""The value rules of the ``FORKLESS_*`` variables: each ``Rule`` parses the raw text into a value
and checks a value given in code (``Config(features=8)``) by its type and bounds directly (pure
but for the file checks).

Rules:
- A parser refuses with ``ValueError`` (or ``TypeError``, ``OSError``); the variable's
  ``allowed`` text says what is right. ``ValueProblem`` is a refusal with a detail fit to show,
  appended to that text; a parser never puts a secret in it.
- A value given in code is checked as it is, never written as text and parsed back: a wrong
  type is a ``ValueProblem`` naming the types allowed and the one given (``bool`` is never an
  int or a number); a value of a text variable (``text_rule``) must be what its parser returns
  for it (no surrounding spaces, a ``@path`` not read).
- The parsers that check files do so when the configuration is read, not at the first use:
  ``pem_file`` has OpenSSL load the CA file (no socket is opened), ``checkpoint_dir`` asks
  whether the directory could be made and written, so either fails with exit status 2.
"""

from __future__ import annotations

import json
import math
import os
import re
import ssl
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from forkless.io_loop.net.netaddr import parse_host_port, unix_address, unix_socket_path, url_host_port

__all__ = ["BUCKET_NAME", "FEED_NAME", "MAX_JSON_DEPTH", "MAX_PARTITIONS", "STREAM_NAME", "SUBJECT_TOKEN", "Rule",
           "ValueProblem", "address", "boolean", "bucket", "checkpoint_dir", "choice", "device_count", "existing_file",
           "header_pairs", "in_flight", "integer", "is_subject", "json_text", "json_value", "listen_socket",
           "nats_urls", "number", "optional", "optional_text", "pem_file", "relay_subject", "text_rule", "unix_socket",
           "ws_url"]

BUCKET_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a JetStream object-store or KV bucket (nats-py's rule, capped)
SUBJECT_TOKEN = re.compile(r"[^\s.]+")
FEED_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a FORKLESS_FEEDS entry's "name"
STREAM_NAME = re.compile(r"[^\s.*>/\\]{1,255}")  # what nats-server accepts as a stream name
MAX_PARTITIONS = 65536  # a partitioned feed's "partition_count", and so FORKLESS_INSTANCES, at most
MAX_JSON_DEPTH = 64  # arrays and objects inside one another in a variable's JSON (FEEDS, SUBSCRIBE, HEADERS)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")


class ValueProblem(ValueError):
    """A parser's refusal with a detail fit to show (never a secret): appended to the
    variable's ``allowed`` text in the ``ConfigError``."""


def _none(value: Any) -> None:
    """Bounds that every value of the right type keeps."""


@dataclass(frozen=True)
class Rule:
    """A variable's rule: ``parse`` its text (``Config.from_env``), ``check`` a value given in
    code (``Config.validate``): of ``types`` (``kind`` says them in words), then within ``bounds``
    (which raises ``ValueError`` when it is not)."""

    parse: Callable[[str], Any]
    types: tuple[type, ...]
    kind: str
    bounds: Callable[[Any], None] = _none

    def __call__(self, text: str) -> Any:
        return self.parse(text)

    def check(self, value: Any) -> None:
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            name = type(value).__name__
            given = "None" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
            raise ValueProblem(f"in code {self.kind}, not {given}")
        self.bounds(value)


def integer(lo: int, hi: int | None = None) -> Rule:
    def bounds(value: int) -> None:
        if value < lo or (hi is not None and value > hi):
            raise ValueError

    def parse(text: str) -> int:
        value = int(text.strip())
        bounds(value)
        return value

    return Rule(parse, (int,), "an int", bounds)


def number(lo: float, hi: float | None = None, *, lo_open: bool = False) -> Rule:
    def bounds(value: float) -> None:
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int too large for a float
            finite = False
        if not finite or value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
            raise ValueError

    def parse(text: str) -> float:
        value = float(text.strip())
        bounds(value)
        return value

    return Rule(parse, (int, float), "an int or a float", bounds)


def optional(rule: Rule) -> Rule:
    """``rule``'s value, or ``None`` (the empty text)."""
    def bounds(value: Any) -> None:
        if value is not None:
            rule.bounds(value)

    def parse_optional(text: str) -> Any:
        return None if text.strip() == "" else rule.parse(text)

    kind = f"{rule.kind}, or None" if " or " in rule.kind else f"{rule.kind} or None"
    return Rule(parse_optional, (*rule.types, type(None)), kind, bounds)


def choice(*choices: str, upper: bool = False) -> Rule:
    def bounds(value: str) -> None:
        if value not in choices:
            raise ValueError

    def parse(text: str) -> str:
        value = text.strip().upper() if upper else text.strip().lower()
        bounds(value)
        return value

    return Rule(parse, (str,), "a str", bounds)


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


boolean = Rule(_boolean, (bool,), "True or False")


def text_rule(parse: Callable[[str], str]) -> Rule:
    """A text variable's rule: ``parse`` reads the text; a value given in code must be a ``str``
    that ``parse`` returns unchanged (so it is the value the variable would have)."""
    def bounds(value: str) -> None:
        if parse(value) != value:
            raise ValueError

    return Rule(parse, (str,), "a str", bounds)


def ws_url(text: str) -> str:
    text = text.strip()
    if text == "":
        return ""
    parts = urlsplit(text)  # raises ValueError for some malformed IPv6 literals itself
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError
    url_host_port(text)  # brackets only around an IPv6 address, then nothing or :port (1-65535)
    return text


def bucket(text: str) -> str:
    """A JetStream bucket name (object store, KV)."""
    text = text.strip()
    if not BUCKET_NAME.fullmatch(text):
        raise ValueError
    return text


def optional_text(parse: Callable[[str], str]) -> Callable[[str], str]:
    def parse_optional(text: str) -> str:
        return "" if text.strip() == "" else parse(text)

    return parse_optional


def address(text: str) -> str:
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


def unix_socket(text: str) -> str:
    """The path of a unix-domain socket to connect to (``netaddr.unix_socket_path``), or empty: its
    server may start later, so it need not exist yet."""
    text = text.strip()
    if text == "":
        return ""
    try:
        return unix_socket_path(text)
    except ValueError as exc:
        raise ValueProblem(str(exc)) from None


def listen_socket(text: str) -> str:
    """The path of a unix-domain socket this process will listen on, or empty: its directory must
    exist and be writable, and the path must not be something other than a socket."""
    path = unix_socket(text)
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


def json_value(text: str) -> Any:
    """``text`` decoded as JSON (``ValueError`` when it is not), its arrays and objects nested at most
    ``MAX_JSON_DEPTH`` deep: a deeper one is a ``ValueProblem`` before the decoder is asked, as Python's
    recurses into each level (about 1,000 of them raised ``RecursionError``, a crash, not a refusal)."""
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))  # strings may hold brackets: not counted
    depth = 0
    for bracket in brackets:
        depth += 1 if bracket in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            raise ValueProblem(f"nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects inside one another)")
    return json.loads(text)


def json_text(text: str) -> str:
    """A JSON document, or ``@path`` naming a file holding one; returns the JSON text."""
    text = text.strip()
    if text == "":
        return ""
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as f:
            text = f.read()
    json_value(text)
    return text


def _header_pairs(text: str) -> tuple[tuple[str, str], ...]:
    if text.strip() == "":
        return ()
    value = json_value(text)
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError
    return tuple((str(k), v) for k, v in value.items())


def _pairs_bounds(value: tuple[Any, ...]) -> None:
    """(name, value) pairs of ``str``, each name once (as a JSON object holds them)."""
    if not all(isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(part, str) for part in pair)
               for pair in value) or len({name for name, _ in value}) != len(value):
        raise ValueError


header_pairs = Rule(_header_pairs, (tuple,), "a tuple of (name, value) str pairs", _pairs_bounds)


def pem_file(text: str) -> str:
    """An existing file holding at least one PEM certificate that OpenSSL accepts."""
    text = text.strip()
    if text:
        if not os.path.isfile(text):
            raise ValueError
        ssl.create_default_context().load_verify_locations(cafile=text)  # ssl.SSLError is an OSError
    return text


def checkpoint_dir(text: str) -> str:
    """A directory to keep checkpoints in, created if missing: not an existing non-directory,
    and under the nearest existing ancestor, a directory this process may write to."""
    text = text.strip()
    if text == "":
        return ""
    if "\x00" in text or any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in text.split("/")):
        raise ValueError
    probe = os.path.abspath(text)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError
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


def relay_subject(text: str) -> str:
    """The relay's subject prefix: a NATS subject without wildcards ("" stays "")."""
    text = text.strip()
    if text and not is_subject(text, wildcards=False):
        raise ValueError
    return text


def existing_file(text: str) -> str:
    text = text.strip()
    if text and not os.path.isfile(text):
        raise ValueError
    return text


def is_subject(text: Any, *, wildcards: bool) -> bool:
    """A NATS subject: dot-separated tokens without spaces; with ``wildcards``, a token may be
    ``*``, and the last one ``>``."""
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


def _word_or_count(word: str, hi: int) -> Rule:
    """``word`` or a count from 1 to ``hi``."""
    count = integer(1, hi)

    def bounds(value: int | str) -> None:
        if isinstance(value, str) and value != word:
            raise ValueError
        if isinstance(value, int):
            count.bounds(value)

    def parse(text: str) -> int | str:
        text = text.strip().lower()
        return word if text == word else count(text)

    return Rule(parse, (int, str), f"{word!r} or an int", bounds)


# whether the process has that many devices is known only once JAX starts (controller/device/compiled.py
# ``use_devices`` checks it, with the same variable named)
device_count = _word_or_count("all", 4096)
# ``auto``: the measured default of the platform, controller/inflight.py
in_flight = _word_or_count("auto", 64)
