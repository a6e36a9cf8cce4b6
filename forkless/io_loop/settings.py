"""Settings, each declared once: a field of a settings group, with its variable, rule, default and meaning.

Rules:
- A setting is declared where the room that reads it lives, as one field of one settings group (``setting(...)`` in
  a ``@settings_group`` class): its ``FORKLESS_*`` variable, its ``Rule`` (parsing, values taken in code, bounds),
  its default and a one-line meaning. The environment's reader, ``Config``'s keywords (the variable's name in lower
  case), ``--help`` and docs/variables.md are derived from it.
- A group checks its values when it is made (``ConfigError`` naming the variable, the value, ``<hidden>`` for a
  secret, and what is allowed); ``validate()`` adds the rules between its fields. A number given in code may be any
  ``numbers.Real`` (``numbers.Integral`` for an integer), kept as a plain ``float`` (``int``); a ``bool`` never is.
- A group remembers the fields it was built with (``given_fields``), so its defaults never override what another
  argument or the environment gives.
- A field that moved to another group (``settings_group(moved=...)``) follows the deprecation policy
  (io_loop/renamed.py): taken and read with a ``DeprecationWarning`` for one release, refused the next.
- Pure: nothing reads the environment or opens anything; a rule that checks a file does so when the value is read,
  so a bad one is a configuration error (exit 2).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, dataclass_transform, get_args

from forkless.io_loop.errors import ConfigError, ValueProblem
from forkless.io_loop.renamed import RENAMED, deprecated

__all__ = ["DEFAULT_SOURCE_BUFFER", "MAX_JSON_DEPTH", "OVERFLOW_POLICIES", "PREFIX", "REPLY_POLICIES", "Limits",
           "OverflowPolicy", "ReconnectSettings", "ReplyPolicy", "Rule", "Setting", "Timeouts", "TlsSettings",
           "as_text", "boolean", "choice", "existing_file", "given_fields", "header_pairs", "holding_moved", "integer",
           "json_text", "json_value", "moved_fields", "number", "optional", "pem_file", "setting", "settings_group",
           "settings_of", "settled", "text", "word_or_count"]

PREFIX = "FORKLESS_"
# what a feed is sent back (FORKLESS_REPLIES, a feed's "replies"): "all" results and error
# replies; "results" no error frames; "none" nothing but the subscription (and the protocol's
# own ping/pong/close): results still reach the controller's sinks and the counters
ReplyPolicy = Literal["all", "results", "none"]
REPLY_POLICIES: tuple[ReplyPolicy, ...] = get_args(ReplyPolicy)
# what a source's emits do beyond its own buffer while inbound is full (FORKLESS_OVERFLOW, a feed's or a
# source's "overflow"; io_loop/spill.py): "block" waits for room, "drop_oldest" drops its oldest waiting item
OverflowPolicy = Literal["block", "drop_oldest"]
OVERFLOW_POLICIES: tuple[OverflowPolicy, ...] = get_args(OverflowPolicy)
# messages and events one source may hold while the inbound queue is full (FORKLESS_SOURCE_BUFFER,
# io_loop/spill.py): a 9 s stall of the main loop at 500 trades/s is 4,500 events, beyond the
# 1024 items the inbound queue holds; 20,000 rides out a 40 s stall at that rate
DEFAULT_SOURCE_BUFFER = 20_000
MAX_JSON_DEPTH = 64  # arrays and objects inside one another in a variable's JSON (FEEDS, SUBSCRIBE, HEADERS)

_SETTING = "forkless.setting"  # a group field's metadata: its Setting
_GIVEN = "_given"  # a group's record of the fields it was built with
_MOVED = "_moved"  # a group's record of the moved fields it was given (their values go where they live now)
_HELD = "_held"  # the values of its moved fields a Config's group holds for a deprecated read (``holding_moved``)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")

G = TypeVar("G")


# ---- rules ------------------------------------------------------------------------------------------


def _any(value: Any) -> None:
    """Bounds that every value of the right type keeps."""


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Rule:
    """A setting's rule: ``parse`` its variable's text; ``check`` a value given in code: of ``types`` (``kind``
    says them in words; a ``bool`` only where ``bool`` is one of them), turned into its kept form
    (``normal``), then within ``bounds`` (which raises ``ValueError`` when it is not). ``allowed`` says in
    words what the variable may hold; ``from_code`` turns another value a program may give (a JSON value
    for a JSON text) into one of ``types`` first."""

    parse: Callable[[str], Any]
    types: tuple[type, ...]
    kind: str
    allowed: str
    bounds: Callable[[Any], None] = _any
    normal: Callable[[Any], Any] = _same
    from_code: Callable[[Any], Any] | None = None

    def check(self, value: Any) -> Any:
        """``value`` (given in code) in its kept form; ``ValueProblem`` naming the types for a wrong type,
        ``ValueError`` (or the parser's ``OSError``) for a value out of bounds."""
        if self.from_code is not None:
            value = self.from_code(value)
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            name = type(value).__name__
            given = "None" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
            raise ValueProblem(f"in code {self.kind}, not {given}")
        value = self.normal(value)
        self.bounds(value)
        return value


def _shown_number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def integer(lo: int, hi: int | None = None) -> Rule:
    """An integer from ``lo`` (to ``hi``); in code any ``numbers.Integral`` (numpy's too), kept as an ``int``."""
    def bounds(value: int) -> None:
        if value < lo or (hi is not None and value > hi):
            raise ValueError

    def parse(text: str) -> int:
        value = int(text.strip())
        bounds(value)
        return value

    allowed = f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}"
    return Rule(parse, (numbers.Integral,), "an integer", allowed, bounds, int)


def _real(value: numbers.Real) -> float:
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError from None


def number(lo: float, hi: float | None = None, *, lo_open: bool = False, unit: str = "") -> Rule:
    """A finite number from ``lo`` (excluded with ``lo_open``) to ``hi``; in code any ``numbers.Real`` (an int,
    numpy's floats, a ``Fraction``), kept as a ``float``. ``unit`` (" of seconds") only words what is allowed."""
    def bounds(value: float) -> None:
        if not math.isfinite(value) or value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
            raise ValueError

    def parse(text: str) -> float:
        value = float(text.strip())
        bounds(value)
        return value

    what = f"a number{unit}"
    if hi is not None:
        allowed = f"{what} in ({_shown_number(lo)}, {_shown_number(hi)}]" if lo_open else \
            f"{what} from {_shown_number(lo)} to {_shown_number(hi)}"
    else:
        allowed = f"{what} {'>' if lo_open else '>='} {_shown_number(lo)}"
    return Rule(parse, (numbers.Real,), "a number", allowed, bounds, _real)


def optional(rule: Rule) -> Rule:
    """``rule``'s value, or ``None`` (the empty text)."""
    def bounds(value: Any) -> None:
        if value is not None:
            rule.bounds(value)

    def normal(value: Any) -> Any:
        return None if value is None else rule.normal(value)

    def parse_optional(text: str) -> Any:
        return None if text.strip() == "" else rule.parse(text)

    return Rule(parse_optional, (*rule.types, type(None)), f"{rule.kind} or None", f"{rule.allowed}, or empty",
                bounds, normal)


def choice(*choices: str, upper: bool = False) -> Rule:
    """One of ``choices``: the text read in any case (kept in upper case with ``upper``, else lower case)."""
    def bounds(value: str) -> None:
        if value not in choices:
            raise ValueError

    def parse(text: str) -> str:
        value = text.strip().upper() if upper else text.strip().lower()
        bounds(value)
        return value

    allowed = choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"
    return Rule(parse, (str,), "a str", allowed, bounds)


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


boolean = Rule(_boolean, (bool,), "True or False", "0 or 1")


def text(parse: Callable[[str], str], allowed: str, *, from_code: Callable[[Any], Any] | None = None) -> Rule:
    """A text setting's rule: ``parse`` reads the text; a value given in code must be a ``str`` that ``parse``
    returns unchanged (so it is the value the variable would have: no surrounding spaces, no ``@path`` read)."""
    def bounds(value: str) -> None:
        if parse(value) != value:
            raise ValueError

    return Rule(parse, (str,), "a str", allowed, bounds, from_code=from_code)


def word_or_count(word: str, hi: int) -> Rule:
    """``word`` or a count from 1 to ``hi``."""
    count = integer(1, hi)

    def bounds(value: int | str) -> None:
        if isinstance(value, str) and value != word:
            raise ValueError
        if not isinstance(value, str):
            count.bounds(value)

    def normal(value: Any) -> Any:
        return value if isinstance(value, str) else int(value)

    def parse(text: str) -> int | str:
        text = text.strip().lower()
        return word if text == word else count.parse(text)

    return Rule(parse, (numbers.Integral, str), f"{word!r} or an integer", f"{word}, or {count.allowed}", bounds,
                normal)


def json_value(text: str) -> Any:
    """``text`` decoded as JSON (``ValueError`` when it is not), its arrays and objects nested at most
    ``MAX_JSON_DEPTH`` deep: a deeper one is a ``ValueProblem`` before the decoder is asked, as Python's
    recurses into each level (a deep one raises ``RecursionError``, a crash, not a refusal)."""
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


header_pairs = Rule(_header_pairs, (tuple,), "a tuple of (name, value) str pairs", "a JSON object of string values",
                    _pairs_bounds)


def pem_file(text: str) -> str:
    """An existing file holding at least one PEM certificate that OpenSSL accepts (no socket is opened)."""
    text = text.strip()
    if text:
        if not os.path.isfile(text):
            raise ValueError
        ssl.create_default_context().load_verify_locations(cafile=text)  # ssl.SSLError is an OSError
    return text


def existing_file(text: str) -> str:
    text = text.strip()
    if text and not os.path.isfile(text):
        raise ValueError
    return text


def as_text(value: Any) -> str:
    """A setting's value as its variable would be written (``None`` empty, a bool ``1``/``0``, header pairs a
    JSON object): what ``--help``, ``--check`` and a ``ConfigError`` show."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return json.dumps(dict(value))
    return str(value)


# ---- settings and their groups ----------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting as declared (``setting``), completed by its group (``settings_group``): its variable
    (``env``, ``FORKLESS_<name>``), its rule, what it means, its default, the group and field that hold it, and
    the keyword ``Config`` takes it by. ``shown`` writes a bad value as an error may show it (a URL without its
    credentials); a secret is never shown."""

    name: str  # the variable's name without the prefix
    rule: Rule
    help: str
    allowed: str
    secret: bool = False
    keyword: str = ""
    shown: Callable[[str], str] | None = None
    default: Any = None
    group: type | None = None
    field: str = ""

    @property
    def env(self) -> str:
        return PREFIX + self.name

    def parse(self, raw: str) -> Any:
        """The variable's text as the setting's value; ``ConfigError`` naming the variable if not allowed."""
        try:
            return self.rule.parse(raw)
        except (ValueError, TypeError, OSError) as exc:
            raise self.refusal(raw, exc) from None

    def check(self, value: Any) -> Any:
        """A value given in code in its kept form; ``ConfigError`` naming the variable if not allowed."""
        try:
            return self.rule.check(value)
        except (ValueError, TypeError, OSError) as exc:
            raise self.refusal(value, exc) from None

    def refusal(self, value: Any, exc: BaseException | None = None, allowed: str | None = None) -> ConfigError:
        """The ``ConfigError`` for ``value``: the variable, the value as it may be shown, what is allowed (plus
        the parser's detail, a ``ValueProblem``'s)."""
        allowed = self.allowed if allowed is None else allowed
        if isinstance(exc, ValueProblem):
            allowed = f"{allowed}: {exc}"
        return ConfigError(self.env, self.show(value), allowed)

    def show(self, value: Any) -> str:
        """``value`` as an error may show it: written as the variable would be (``as_text``), a secret hidden."""
        if self.secret:
            return "<hidden>"
        shown = as_text(value) if value is None or isinstance(value, (str, int, float)) else str(value)
        return self.shown(shown.strip()) if self.shown is not None else shown

    @property
    def spelling(self) -> str:
        """How a program gives it in its group: ``StepSettings(features=...)``."""
        return f"{self.group.__name__ if self.group else '?'}({self.field}=...)"


def setting(name: str, rule: Rule, help: str, *, default: Any, allowed: str | None = None, secret: bool = False,
            keyword: str | None = None, shown: Callable[[str], str] | None = None) -> Any:
    """A field of a settings group that is the setting ``FORKLESS_<name>``: its rule, its meaning (``help``,
    one line), its default, what is allowed in words (the rule's unless given), whether it is a secret (kept
    out of ``repr`` and errors), the keyword ``Config`` takes it by (the variable's name in lower case unless
    given) and how an error shows a bad value (``shown``)."""
    declared = Setting(name, rule, help, rule.allowed if allowed is None else allowed, secret,
                       keyword or name.lower(), shown, default)
    return field(default=default, repr=not secret, metadata={_SETTING: declared})


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(setting, field))
def settings_group(cls: type[G] | None = None, *, moved: Mapping[str, str] | None = None) -> Any:
    """Make ``cls`` a settings group: a frozen, keyword-only dataclass whose fields are settings (``setting``),
    each checked when the group is made, then the group's own ``validate()`` if it has one; it remembers the
    fields it was built with (``given_fields``). ``moved``: a field that lived here and lives in another group
    now, by its old name: the keyword of the setting it is; its entry in io_loop/renamed.py is
    ``Group(name=...)`` (see the module rules)."""
    def make(cls: type[G]) -> type[G]:
        cls = dataclass(frozen=True, kw_only=True)(cls)
        declared = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            found = f.metadata.get(_SETTING)
            if found is None:
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting(...)")
            declared.append(dataclasses.replace(found, group=cls, field=f.name))
        cls.__settings__ = tuple(declared)  # type: ignore[attr-defined]
        cls.__moved__ = dict(moved or {})  # type: ignore[attr-defined]
        for old in cls.__moved__:  # type: ignore[attr-defined]
            if f"{cls.__name__}({old}=...)" not in RENAMED:
                raise TypeError(f"{cls.__name__}.{old} moved, but io_loop/renamed.py does not list it")
        build = cls.__init__
        own_validate = getattr(cls, "validate", None)

        @functools.wraps(build)
        def __init__(self: Any, **values: Any) -> None:
            old = {name: values.pop(name) for name in list(values) if name in cls.__moved__}  # type: ignore[attr-defined]
            for name in old:
                deprecated(f"{cls.__name__}({name}=...)")
            build(self, **values)
            for declared_setting in cls.__settings__:  # type: ignore[attr-defined]
                value = getattr(self, declared_setting.field)
                object.__setattr__(self, declared_setting.field, declared_setting.check(value))
            object.__setattr__(self, _GIVEN, frozenset(values))
            object.__setattr__(self, _MOVED, {cls.__moved__[name]: value  # type: ignore[attr-defined]
                                              for name, value in old.items()})
            if own_validate is not None:
                own_validate(self)

        cls.__init__ = __init__  # type: ignore[method-assign]
        for old_name in cls.__moved__:  # type: ignore[attr-defined]
            setattr(cls, old_name, _moved_property(cls, old_name))
        return cls

    return make(cls) if cls is not None else make


def _moved_property(cls: type, old: str) -> property:
    keyword = cls.__moved__[old]  # type: ignore[attr-defined]
    key = f"{cls.__name__}({old}=...)"
    now = RENAMED[key].new
    group, _, rest = now.partition("(")

    def read(self: Any) -> Any:
        deprecated(key, old=f"{cls.__name__}.{old}", new=f"{group}.{rest.partition('=')[0]}", error=AttributeError)
        return {**getattr(self, _MOVED, {}), **getattr(self, _HELD, {})}.get(keyword)

    return property(read, doc=f"Deprecated: the setting moved to {now}.")


def settings_of(group: type) -> tuple[Setting, ...]:
    """The settings a group declares, in its fields' order."""
    return getattr(group, "__settings__", ())


def given_fields(group: Any) -> frozenset[str]:
    """The fields ``group`` was built with: all of them where one was built by ``dataclasses.replace``."""
    return getattr(group, _GIVEN, frozenset(f.name for f in dataclasses.fields(group)))


def moved_fields(group: Any) -> dict[str, Any]:
    """The moved fields ``group`` holds (``settings_group(moved=...)``), by the keyword of their setting."""
    return dict(getattr(group, _MOVED, {}))


def settled(group: type[G], **values: Any) -> G:
    """A ``group`` of values already checked where they were given, derived from them (the compile's step settings,
    ``StepSettings.on_platform``): made without checking them again, as built with every field."""
    made = object.__new__(group)
    for declared in settings_of(group):
        object.__setattr__(made, declared.field, values.pop(declared.field, declared.default))
    if values:
        raise TypeError(f"{group.__name__} has no field {sorted(values)[0]!r}")
    return made


def holding_moved(group: G, values: Mapping[str, Any]) -> G:
    """``group`` (made by the caller, not shared) holding the values of its moved fields, by keyword, for a
    deprecated read of one (``config.limits.features``)."""
    object.__setattr__(group, _HELD, dict(values))
    return group


# ---- the IO side's own groups ----------------------------------------------------------------------


@settings_group
class ReconnectSettings:
    """How a connection is retried (io_loop/backoff.py's ``Backoff.of``); read by every connection's loop
    (WebSocket, JetStream, the store, the relay)."""

    min_s: float = setting("RECONNECT_MIN_S", number(0.0, lo_open=True), "smallest delay between connection "
                           "attempts", default=0.5)
    max_s: float = setting("RECONNECT_MAX_S", number(0.0), "largest delay between connection attempts",
                           default=30.0, allowed="a number >= RECONNECT_MIN_S")
    reset_s: float = setting("RECONNECT_RESET_S", number(0.0), "a connection must stay up this long before the "
                             "backoff starts again from the minimum", default=5.0)
    tries: int = setting("RECONNECT_TRIES", integer(0), "failed attempts in a row before giving up with exit "
                         "status 3 (0 = forever)", default=0)

    def validate(self) -> None:
        if self.max_s < self.min_s:
            raise ConfigError(PREFIX + "RECONNECT_MAX_S", as_text(self.max_s),
                              f"a number >= FORKLESS_RECONNECT_MIN_S ({self.min_s})")


@settings_group
class Timeouts:
    """How long a connection's steps may take (io_loop/connectors/websocket/connect.py,
    io_loop/connectors/jetstream/transport.py) and the orderly stop."""

    connect_timeout_s: float = setting("CONNECT_TIMEOUT_S", number(0.0, lo_open=True), "limit on connecting plus "
                                       "the opening handshake (a JetStream API call's too)", default=10.0)
    heartbeat_s: float = setting("HEARTBEAT_S", number(0.0), "ping interval; no pong within half of it drops and "
                                 "reconnects (0: off)", default=15.0)
    stale_s: float = setting("STALE_S", number(0.0), "reconnect when no frame has arrived for this long (0: off)",
                             default=0.0)
    shutdown_timeout_s: float = setting("SHUTDOWN_TIMEOUT_S", number(0.0, lo_open=True), "longest an orderly stop "
                                        "may take before giving up on unsent results", default=10.0)


@settings_group
class TlsSettings:
    """How a TLS connection is verified (io_loop/net/tls.py's ``make_ssl_context``)."""

    ca_file: str = setting("CA_FILE", text(pem_file, "the path of an existing PEM file of CA certificates"),
                           "extra CA bundle for wss:// and tls:// (the system store is always used)", default="")
    insecure: bool = setting("TLS_INSECURE", boolean, "1 turns certificate verification off (logs a warning at "
                             "every connect)", default=False)


@settings_group(moved={"features": "features", "max_batch": "max_batch"})
class Limits:
    """The sizes of what a source reads and hands over (io_loop/source.py, io_loop/spill.py, the bridge)."""

    queue_size: int = setting("QUEUE_SIZE", integer(1, 1_000_000), "bound of each queue: inbound chunks (frames "
                              "read together, at most MAX_BATCH messages or one frame), outbound batches",
                              default=1024)
    overflow: str = setting("OVERFLOW", choice(*OVERFLOW_POLICIES), "a source's own buffer full (SOURCE_BUFFER): "
                            "block stops reading the socket; drop_oldest drops the source's own oldest messages and "
                            "events, counted under its name (never a replayable source's)", default="block")
    source_buffer: int = setting("SOURCE_BUFFER", integer(0, 10_000_000), "messages and events each source may "
                                 "hold while the inbound queue is full (a stalled main loop), its reader not "
                                 "waiting; then OVERFLOW applies. 0: the queue's bound alone",
                                 default=DEFAULT_SOURCE_BUFFER)
    max_msg_bytes: int = setting("MAX_MSG_BYTES", integer(64, 1 << 30), "largest frame accepted; a larger one "
                                 "closes the connection with 1009 and reconnects. A JetStream feed's payload over it "
                                 "is not decoded: one error reply (message too large), counted, acknowledged",
                                 default=1 << 20)
    max_frame_items: int = setting("MAX_FRAME_ITEMS", integer(1, 1_000_000), "most messages in one JSON-array "
                                   "frame", default=10_000)
