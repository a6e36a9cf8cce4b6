"""What a source may declare beyond ``name`` and ``run``: its capabilities, small protocols and typed values.

Rules:
- A source is duck-typed and subclasses nothing. What it may declare is listed once, here: methods, each a
  one-method ``runtime_checkable`` protocol (``SupportsAwaiting`` …: a module asks ``isinstance`` and then calls it;
  None declares none, anything else that is no method is refused by ``check_methods``); and values, typed class
  attributes with their defaults on ``SourceCapabilities`` (a base a source may subclass, and need not), read by
  ``declarations(source, name)`` into a frozen ``Declarations``, each checked (``ValueError``/``TypeError`` naming
  the source, the attribute and what is allowed).
- No module reads a capability by its name as a string (tests/io_loop/test_capabilities.py holds it), so a
  misspelt capability in forkless's own code fails at once.
- A misspelt capability in a user's source would silently be no declaration: ``lookalikes`` names each public
  attribute close to one, and the controller warns of each (``CapabilityWarning``, ``warn_lookalikes``).
- Pure: no I/O, no loop, no clock.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from forkless.io_loop.counters import SourceStats
from forkless.io_loop.decoding import FrameDecoder
from forkless.io_loop.errors import ForklessError
from forkless.io_loop.seconds import seconds_or_none
from forkless.io_loop.settings import OVERFLOW_POLICIES, REPLY_POLICIES, OverflowPolicy, ReplyPolicy

__all__ = ["CAPABILITIES", "METHODS", "SENDS_WHILE_DISCONNECTED", "VALUES", "CapabilityWarning", "Declarations",
           "SendsWhileDisconnected", "SourceCapabilities", "SupportsAwaiting", "SupportsBeforeStop", "SupportsProbe",
           "SupportsSendAnswered", "SupportsSummary", "check_methods", "declarations", "lookalikes",
           "warn_lookalikes"]

SENDS_WHILE_DISCONNECTED = ("hold", "refuse")  # a source's sends while it is not connected: held, or given up at once
SendsWhileDisconnected = Literal["hold", "refuse"]

# the source's SourceContext (io_loop/source.py, which imports this module, so it is a parameter here)
Context = TypeVar("Context", contravariant=True)


# ---- the methods -------------------------------------------------------------------------------------------------


@runtime_checkable
class SupportsBeforeStop(Protocol[Context]):
    """``async before_stop(ctx)``: called when the orderly stop begins, before ``ctx.stopping``
    (docs/embedding/stop.md)."""

    async def before_stop(self, ctx: Context, /) -> None: ...


@runtime_checkable
class SupportsAwaiting(Protocol):
    """``awaiting()``: how many replies it still awaits, an ``int`` >= 0; the stop takes its replies until it is 0
    (io_loop/finishing.py)."""

    def awaiting(self) -> int: ...


@runtime_checkable
class SupportsSendAnswered(Protocol):
    """``send_answered(event)``: the id of the send (``Controller.send``'s) that an event it emits answers, or None.
    A send written on a connection that ends before its answer is reported (``SendFailed``, ``"connection
    lost"``), and the stop awaits the answers of what was written (io_loop/source.py)."""

    def send_answered(self, event: Any, /) -> Any: ...


@runtime_checkable
class SupportsSummary(Protocol):
    """``summary()``: one line on how the run went, read at its end (the demo feed's tally;
    ``Controller.summaries``)."""

    def summary(self) -> str: ...


@runtime_checkable
class SupportsProbe(Protocol):
    """``async probe(codec, say, *, dedupe_window_s)``: ``--check``'s try of it (io_loop/probe.py)."""

    async def probe(self, codec: FrameDecoder, say: Callable[[str], None], *, dedupe_window_s: float) -> None: ...


# each method capability's name and its protocol
METHODS: dict[str, type] = {"before_stop": SupportsBeforeStop, "awaiting": SupportsAwaiting,
                            "send_answered": SupportsSendAnswered, "summary": SupportsSummary, "probe": SupportsProbe}


# ---- the values --------------------------------------------------------------------------------------------------


class SourceCapabilities:
    """The values a source may declare, each at its default (docs/embedding/capabilities.md): a base a
    source may subclass, and need not (``declarations`` fills in the same defaults)."""

    replies: ReplyPolicy = "all"
    """What the main thread sends back to its messages: ``"all"``, ``"results"`` or ``"none"``."""

    required: bool = True
    """Readiness (``/readyz``) waits for it."""

    starts_connected: bool = True
    """Counted as connected while ``run`` runs; False: only once it says so (``ctx.connection_opened``)."""

    replayable: bool = False
    """It replays from ``ctx.resume_from``: never dropped from (``FORKLESS_OVERFLOW`` does not apply)."""

    overflow: OverflowPolicy | None = None
    """``"block"`` or ``"drop_oldest"`` beyond its own buffer; None: its feed entry's, else ``FORKLESS_OVERFLOW``."""

    buffer: int | None = None
    """Messages and events it may hold while inbound is full; None: ``FORKLESS_SOURCE_BUFFER``."""

    send_max_age_s: float | None = None
    """The deadline of what the main thread sends it (``Controller.send``) without a ``max_age_s`` of its own:
    written within this many seconds of the send or never (``SendFailed``, io_loop/sends.py); None: none."""

    sends_while_disconnected: SendsWhileDisconnected = "hold"
    """``"hold"``: what the main thread sends while it is not connected waits (until its deadline); ``"refuse"``:
    given up at once (cancel-on-disconnect), ``SendFailed`` with reason ``"disconnected"``."""

    figures: SourceStats | None = None
    """A ``SourceStats`` of the position figures it keeps, shown in its books; None: none."""


@dataclass(frozen=True)
class Declarations:
    """The values one source declares, its defaults filled in, checked (``declarations``): the
    fields of ``SourceCapabilities``, typed as there (tests/io_loop/test_capabilities.py holds them equal)."""

    replies: ReplyPolicy
    required: bool
    starts_connected: bool
    replayable: bool
    overflow: OverflowPolicy | None
    buffer: int | None
    send_max_age_s: float | None
    sends_while_disconnected: SendsWhileDisconnected
    figures: SourceStats | None


VALUES: tuple[str, ...] = tuple(value.name for value in fields(Declarations))
CAPABILITIES: tuple[str, ...] = (*VALUES, *METHODS)


def declarations(source: object, name: str) -> Declarations:
    """What ``source`` (the source named ``name``) declares of the values, each default where it
    declares nothing; ``ValueError`` or ``TypeError`` naming the source and the attribute for a
    value that is not allowed. Cheap (seven reads): read it where a value is needed."""
    # the one read of the values by name: each field of Declarations, the class's default where the source has none
    declared = Declarations(**{value: getattr(source, value, getattr(SourceCapabilities, value)) for value in VALUES})
    if declared.replies not in REPLY_POLICIES:
        raise ValueError(f"source {name!r} has replies={declared.replies!r}; expected one of "
                         f"{', '.join(REPLY_POLICIES)}")
    for flag, value in (("required", declared.required), ("starts_connected", declared.starts_connected),
                        ("replayable", declared.replayable)):
        if not isinstance(value, bool):
            raise TypeError(f"source {name!r} has {flag}={value!r}; expected True or False")
    if declared.overflow is not None and declared.overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"source {name!r} has overflow={declared.overflow!r}; expected one of "
                         f"{', '.join(OVERFLOW_POLICIES)}")
    if declared.overflow == "drop_oldest" and declared.replayable:
        raise ValueError(f"source {name!r} is replayable and has overflow='drop_oldest': a replayable source is "
                         f"never dropped from (a dropped message breaks the exactly-once state); use 'block'")
    if declared.buffer is not None and (type(declared.buffer) is not int or declared.buffer < 0):
        raise ValueError(f"source {name!r} has buffer={declared.buffer!r}; expected an int >= 0 (messages and "
                         f"events it may hold while the inbound queue is full)")
    max_age = declared.send_max_age_s
    try:
        seconds_or_none(max_age, "send_max_age_s", "no deadline")
    except TypeError:
        raise TypeError(f"source {name!r} has send_max_age_s={max_age!r}; expected a number of seconds (or None: "
                        f"no deadline)") from None
    except ValueError:
        raise ValueError(f"source {name!r} has send_max_age_s={max_age!r}; expected a finite number of seconds > 0 "
                         f"(or None: no deadline)") from None
    if declared.sends_while_disconnected not in SENDS_WHILE_DISCONNECTED:
        raise ValueError(f"source {name!r} has sends_while_disconnected={declared.sends_while_disconnected!r}; "
                         f"expected 'hold' (held until its deadline or a connection) or 'refuse' (given up at once "
                         f"while not connected)")
    if declared.figures is not None and not isinstance(declared.figures, SourceStats):
        raise TypeError(f"source {name!r} has figures={declared.figures!r}; expected a "
                        f"forkless.io_loop.counters.SourceStats (its position figures), or None")
    return declared


def check_methods(source: object, name: str) -> None:
    """``TypeError`` for a method capability ``source`` declares as something that is no method
    (``awaiting = 3``): ``isinstance`` with a protocol sees only that the name is there."""
    for method, protocol in METHODS.items():
        if isinstance(source, protocol):
            # the protocol said the attribute is there; whether it can be called is this check's
            declared = inspect.getattr_static(source, method)
            if not callable(declared) and not isinstance(declared, (staticmethod, classmethod)):
                raise TypeError(f"source {name!r} declares {method} = {declared!r}: a method, {method}(), is what "
                                f"is asked ({protocol.__name__}: docs/embedding/capabilities.md)")


class CapabilityWarning(ForklessError, UserWarning):
    """A source has an attribute that looks like a capability and is none: most likely a misspelling,
    which would otherwise be silently no declaration (``lookalikes``). A warning; a ``ForklessError``
    too, as every exception forkless raises is, where a program turns warnings into errors."""


def lookalikes(source: object) -> list[tuple[str, str]]:
    """``(attribute, capability)`` for each public attribute of ``source`` that is no capability but
    close to one (``difflib``'s ratio >= 0.75, case ignored): a method is compared with the method
    capabilities, any other attribute with the values, so a method ``replay()`` is not taken for
    ``replayable``. Attributes are looked up statically: no property is run."""
    found: list[tuple[str, str]] = []
    for attribute in dir(source):
        if attribute.startswith("_") or attribute in CAPABILITIES or attribute in ("name", "run"):
            continue
        try:
            declared = inspect.getattr_static(source, attribute)
        except AttributeError:
            continue
        method = callable(declared) or isinstance(declared, (staticmethod, classmethod))
        close = difflib.get_close_matches(attribute.lower(), tuple(METHODS) if method else VALUES, n=1, cutoff=0.75)
        if close:
            found.append((attribute, close[0]))
    return found


def warn_lookalikes(source: object, name: str) -> None:
    """A ``CapabilityWarning`` for each of ``lookalikes(source)``, naming the source, the attribute
    and the capability it looks like."""
    for attribute, meant in lookalikes(source):
        warnings.warn(CapabilityWarning(
            f"source {name!r} has {attribute!r}, which is no source capability: did you mean {meant!r}? As it is, "
            f"{attribute!r} declares nothing and {meant!r} keeps its default (the capabilities: "
            f"{', '.join(CAPABILITIES)}; docs/embedding/capabilities.md)"), stacklevel=3)
