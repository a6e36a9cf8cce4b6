"""What a source may declare beyond ``name`` and ``run``: every optional capability, its default, read in one place.

Rules:
- A source is duck-typed (io_loop/source.py's ``Source`` protocol): any object with a ``name`` and
  ``async run(ctx)``. Each optional attribute a source may declare is listed once, here, as a class
  attribute of ``SourceCapabilities`` with its default and meaning. A source may subclass it (the
  built-in WebSocket, JetStream and demo sources do) and inherits the defaults; one that subclasses
  nothing gets the very same defaults from ``capability``.
- Every module reads an optional attribute of a source through ``capability(source, name)``, never
  with a ``getattr``/``hasattr`` of its own (tests/test_capabilities.py holds that). A name not
  declared here is a ``KeyError`` naming the declared ones: a typo is found at once, never read as
  a default.
- Checking a declared value stays with the module that owns its meaning: ``replies`` and
  ``required`` controller/ioside.py, ``overflow`` and ``buffer`` io_loop/spill.py, ``awaiting``
  io_loop/finishing.py, ``send_max_age_s`` and ``sends_while_disconnected`` io_loop/sends.py. This
  module only says what may be declared and what is meant by nothing.
- Pure: no I/O, no loop, no clock.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CAPABILITIES", "DEFAULTS", "SourceCapabilities", "capability"]


class SourceCapabilities:
    """The optional attributes of a source, each with its default (docs/embedding/capabilities.md).
    Subclassing it is optional: a source that declares nothing reads the same."""

    replies: str = "all"
    """What the main thread sends back to its messages: ``"all"``, ``"results"`` or ``"none"``."""

    required: bool = True
    """Readiness (``/readyz``) waits for it."""

    starts_connected: bool = True
    """Counted as connected while ``run`` runs; False: only once it says so (``ctx.connection_opened``)."""

    replayable: bool = False
    """It replays from ``ctx.resume_from``: never dropped from (``FORKLESS_OVERFLOW`` does not apply)."""

    overflow: str | None = None
    """``"block"`` or ``"drop_oldest"`` beyond its own buffer; None: its feed entry's, else ``FORKLESS_OVERFLOW``."""

    buffer: int | None = None
    """Messages and events it may hold while inbound is full; None: ``FORKLESS_SOURCE_BUFFER``."""

    send_max_age_s: float | None = None
    """The deadline of what the main thread sends it (``Controller.send``) without a ``max_age_s`` of its own:
    written within this many seconds of the send or never (``SendFailed``, io_loop/sends.py); None: none."""

    sends_while_disconnected: str = "hold"
    """``"hold"``: what the main thread sends while it is not connected waits (until its deadline); ``"refuse"``:
    given up at once (cancel-on-disconnect), ``SendFailed`` with reason ``"disconnected"``."""

    figures: Any = None
    """A ``SourceStats`` of the position figures it keeps, shown in its books; None: none."""

    before_stop: Any = None
    """``async before_stop(ctx)``: called when the orderly stop begins, before ``ctx.stopping``; None: none."""

    awaiting: Any = None
    """``awaiting()``: replies it still awaits; the stop takes them until 0 (io_loop/finishing.py); None: none."""

    summary: Any = None
    """``summary()``: one line on how the run went, which the ``forkless`` program prints at its end (the demo
    feed's tally); None: none."""

    probe: Any = None
    """``async probe(codec, say, *, dedupe_window_s)``: ``--check``'s try of it (io_loop/probe.py); None: not
    tried."""


CAPABILITIES: tuple[str, ...] = tuple(name for name in vars(SourceCapabilities) if not name.startswith("_"))
DEFAULTS: dict[str, Any] = {name: vars(SourceCapabilities)[name] for name in CAPABILITIES}


def capability(source: Any, name: str) -> Any:
    """What ``source`` declares for the capability ``name``, or its default (see the module rules)."""
    try:
        default = DEFAULTS[name]
    except KeyError:
        raise KeyError(f"{name!r} is no source capability; the declared ones are {', '.join(CAPABILITIES)} "
                       f"(io_loop/capabilities.py)") from None
    return getattr(source, name, default)
