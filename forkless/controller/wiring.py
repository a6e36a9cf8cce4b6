"""What a ``Controller`` is built from: the typed groups of its arguments, and the old keywords translated.

Rules:
- ``Controller(config=None, *, processor, codec, sources, sinks, on_event, connect, runtime)``: eight arguments
  (tests/controller/test_wiring.py holds the count), each one thing: ``EVENTS_ONLY`` is a processor, ``OnResults``
  a sink, ``OnEvent`` the events' callback, ``ConnectHooks`` the WebSocket feeds' hooks, ``Runtime`` what the
  controller does in its host process.
- Each group is a frozen dataclass checked when made (``TypeError`` naming the field and what it takes); a group
  handed to the wrong argument is refused naming the right one.
- Results leave one way, ``sinks``, parted by ``split_sinks`` into the main thread's (``OnResults``) and the IO
  thread's (``ResultSink``). ``sources`` hand messages and events in; ``on_event`` takes the events.
- An old keyword is taken for one release under the deprecation policy (io_loop/renamed.py): a
  ``DeprecationWarning`` naming its new spelling (``grouped_keywords``). The attribute ``on_results`` is refused
  (``ReplacedAttribute``): set from outside, it would be read by nothing.
- Pure: no JAX, no threads, nothing of the IO side imported, so a group may be built before the configuration.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forkless.io_loop.renamed import deprecated

if TYPE_CHECKING:  # hints only: each would import the IO side or the checkpoint writer
    from forkless.controller.checkpoints.checkpointer import CheckpointStore
    from forkless.controller.ioside import IOFactory
    from forkless.io_loop.connectors.websocket.before_connect import BeforeConnect
    from forkless.io_loop.connectors.websocket.on_connect import OnConnect
    from forkless.io_loop.sinks.sink import ResultSink

__all__ = ["EVENTS_ONLY", "ConnectHooks", "EventsOnly", "OnEvent", "OnResults", "Runtime"]

log = logging.getLogger("forkless.controller")

ResultsCallback = Callable[[list[Any], list[str], dict[str, Any]], None]
"""``fn(seq, stream, outputs)``: a batch's results; ``outputs`` maps each output name to a numpy array whose
leading axis is the batch's messages (padding already cut off), in arrival order."""

EventCallback = Callable[[str, Any], None]
"""``fn(source, event)``: each object a user source handed over as it is (``SourceContext.emit_event``), in
order, in the main thread from ``process_pending``; with ``OnEvent(fn, connections=True)`` also each feed's
``ConnectionEvent``s, in order with them."""


class EventsOnly:
    """The type of ``forkless.EVENTS_ONLY``, the one value: ``Controller(processor=forkless.EVENTS_ONLY)`` runs no
    processor (controller/eventsonly.py): the sources hand over only events, and nothing is compiled."""

    __slots__ = ()
    _the: EventsOnly | None = None

    def __new__(cls) -> EventsOnly:
        if cls._the is None:
            cls._the = super().__new__(cls)
        return cls._the

    def __repr__(self) -> str:
        return "forkless.EVENTS_ONLY"

    def __reduce__(self) -> str:
        return "EVENTS_ONLY"  # a copy or an unpickled one is the same value


EVENTS_ONLY = EventsOnly()


def _callable(value: Any, what: str, takes: str) -> None:
    if not callable(value):
        raise TypeError(f"{what} takes a callable, {takes}; got {value!r}")


@dataclass(frozen=True)
class OnResults:
    """The main thread's sink of results (a ``ResultSink`` is the IO thread's): ``fn(seq, stream, outputs)`` after
    each step, before the batch's replies are handed to the IO thread (``Controller(sinks=[forkless.OnResults(fn)])``).
    What it raises is raised by ``process_pending()``, ``run()`` or ``stop()`` once that batch's replies are put."""

    fn: ResultsCallback

    def __post_init__(self) -> None:
        _callable(self.fn, "OnResults(fn)", "fn(seq, stream, outputs)")


@dataclass(frozen=True)
class OnEvent:
    """``Controller(on_event=...)`` with its options: ``fn(source, event)`` in the main thread for what the sources
    hand over with ``emit_event``; ``connections=True``: also each feed's ``ConnectionEvent`` as its connection
    comes up or goes down (docs/embedding/connection-events.md). A plain callable is ``OnEvent(fn)``."""

    fn: EventCallback
    connections: bool = False

    def __post_init__(self) -> None:
        _callable(self.fn, "OnEvent(fn)", "fn(source, event)")
        if not isinstance(self.connections, bool):
            raise TypeError(f"OnEvent(connections=...) takes True or False, not {self.connections!r}")


@dataclass(frozen=True)
class ConnectHooks:
    """``Controller(connect=...)``: the WebSocket feeds' hooks, run on the IO thread's loop.
    ``on_connect(feed, connection)``: frames sent first on every new connection (a signed subscription);
    ``before_connect(feed, attempt)``: each attempt's URL and headers (a login, a token refresh);
    docs/embedding/subscriptions.md."""

    on_connect: OnConnect | None = None
    before_connect: BeforeConnect | None = None

    def __post_init__(self) -> None:
        if self.on_connect is not None:
            _callable(self.on_connect, "ConnectHooks(on_connect=...)", "on_connect(feed, connection)")
        if self.before_connect is not None:
            _callable(self.before_connect, "ConnectHooks(before_connect=...)", "before_connect(feed, attempt)")


@dataclass(frozen=True)
class Runtime:
    """``Controller(runtime=...)``: what the controller does in its host process, and where it keeps its
    checkpoints (docs/embedding/controller.md).

    ``out``: where ``run()``'s status lines go (None: a flushed ``print``); ``freeze_gc``: freeze the objects
    alive at ``start()`` for the run (``gc.freeze``, undone by the stop); ``notify_systemd``: tell systemd the
    run's phases and feed its watchdog (a ``Type=notify`` unit); ``checkpoint_store``: a ``CheckpointStore`` of
    the program's own instead of ``FORKLESS_CHECKPOINT_DIR``; ``io_factory``: the tests' seam, the IO side to
    run against (None: the real IO thread; tests/fake_io.py)."""

    out: Callable[[str], None] | None = None
    freeze_gc: bool = False
    notify_systemd: bool = False
    checkpoint_store: CheckpointStore | None = None
    io_factory: IOFactory | None = None

    def __post_init__(self) -> None:
        if self.out is not None:
            _callable(self.out, "Runtime(out=...)", "out(line)")
        for name in ("freeze_gc", "notify_systemd"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Runtime({name}=...) takes True or False, not {getattr(self, name)!r}")
        if self.io_factory is not None:
            _callable(self.io_factory, "Runtime(io_factory=...)", "io_factory(config, codec, stats, snapshot)")


# ---- the Controller's arguments checked ------------------------------------------------------------------


def checked_group(value: Any, kind: type, argument: str, spelled: str) -> Any:
    """``value`` (None: ``kind()``) when it is a ``kind``; else ``TypeError`` naming ``argument`` and ``spelled``."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise TypeError(f"Controller({argument}=...) takes {spelled}, not {value!r}")
    return value


def runs_no_processor(processor: Any) -> bool:
    """Whether ``processor`` is ``EVENTS_ONLY``; ``TypeError`` unless it is that, None (the default detector) or a
    processor (``init`` and ``step`` callables)."""
    if processor is EVENTS_ONLY:
        return True
    if processor is not None and not (callable(getattr(processor, "init", None))
                                      and callable(getattr(processor, "step", None))):
        raise TypeError(f"Controller(processor=...) takes a forkless.Processor (init, step), or forkless.EVENTS_ONLY "
                        f"to run none, not {processor!r}")
    return False


def event_callback(on_event: EventCallback | OnEvent | None) -> OnEvent | None:
    """``on_event`` as an ``OnEvent`` (a plain callable: ``OnEvent(fn)``), or None."""
    if on_event is None or isinstance(on_event, OnEvent):
        return on_event
    if isinstance(on_event, (OnResults, ConnectHooks, Runtime)):
        raise TypeError(f"Controller(on_event=...) takes fn(source, event) or forkless.OnEvent(fn, connections=...), "
                        f"not {on_event!r}")
    _callable(on_event, "Controller(on_event=...)", "fn(source, event), or forkless.OnEvent(fn, connections=True)")
    return OnEvent(on_event)


def split_sinks(sinks: Sequence[OnResults | ResultSink]) -> tuple[tuple[OnResults, ...], tuple[ResultSink, ...]]:
    """``Controller(sinks=...)`` parted into the main thread's (``OnResults``) and the IO thread's, each in order.
    A lone sink, or a function, is refused naming the fix; the IO thread's are checked further where the feeds
    are planned (controller/ioside.py ``checked_sinks``)."""
    if isinstance(sinks, (str, bytes, OnResults)) or hasattr(sinks, "run") or not hasattr(sinks, "__iter__"):
        raise TypeError(f"Controller(sinks=...) takes a list of sinks (sinks=[...]), not {sinks!r}")
    main: list[OnResults] = []
    io: list[Any] = []
    for sink in sinks:
        if isinstance(sink, OnResults):
            main.append(sink)
        elif callable(sink) and not hasattr(sink, "run"):
            raise TypeError(f"Controller(sinks=[...]) was given {sink!r}, a callable: wrap it as "
                            "forkless.OnResults(fn) to call it in the main thread with each batch's results")
        else:
            io.append(sink)
    return tuple(main), tuple(io)


def main_thread_results(sinks: Sequence[OnResults]) -> ResultsCallback:
    """One call that hands a batch's results to each ``OnResults`` in order (none: a call that does nothing, so the
    step never asks whether there is one). Each is called whatever an earlier one raised; the first exception is
    raised after the last call (a later one is logged)."""
    if not sinks:
        return _no_results
    if len(sinks) == 1:
        return sinks[0].fn
    fns = tuple(sink.fn for sink in sinks)

    def each(seq: list[Any], stream: list[str], outputs: dict[str, Any]) -> None:
        raised: BaseException | None = None
        for fn in fns:
            try:
                fn(seq, stream, outputs)
            except BaseException as exc:  # raised below, once every sink has had the batch
                if raised is None:
                    raised = exc
                else:
                    log.error("OnResults(%r) raised %r after an earlier OnResults raised (that one is raised)", fn,
                              exc)
        if raised is not None:
            raise raised

    return each


def _no_results(seq: list[Any], stream: list[str], outputs: dict[str, Any]) -> None:
    """No ``OnResults``: the results go to the IO thread's sinks and the replies only."""


# ---- the old keywords ---------------------------------------------------------------------------------------

# each keyword the controller took before its arguments were grouped: the spelling io_loop/renamed.py knows it by
OLD_KEYWORDS = {
    "on_results": "Controller(on_results=f)",
    "events_only": "Controller(events_only=True)",
    "on_connect": "Controller(on_connect=h)",
    "before_connect": "Controller(before_connect=h)",
    "connection_events": "Controller(on_event=f, connection_events=True)",
    "out": "Controller(out=f)",
    "freeze_gc": "Controller(freeze_gc=True)",
    "notify_systemd": "Controller(notify_systemd=True)",
    "checkpoint_store": "Controller(checkpoint_store=s)",
    "io_factory": "Controller(io_factory=f)",
}
RUNTIME_KEYWORDS = ("out", "freeze_gc", "notify_systemd", "checkpoint_store", "io_factory")


class ReplacedAttribute:
    """An attribute the controller had, read or assigned: ``AttributeError`` naming what took its place (assigning
    ``ctl.on_results`` would otherwise set an attribute nothing reads, and the results would be lost silently)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        raise AttributeError(self.message)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(self.message)


def grouped_keywords(kwargs: dict[str, Any], *, stacklevel: int = 2) -> dict[str, Any]:
    """``Controller``'s keyword arguments with each old keyword put where it is written now, each warned of with a
    ``DeprecationWarning`` naming its new spelling (``TypeError`` once the release that removes them has come:
    io_loop/renamed.py). An old keyword beside the argument that replaced it is a ``TypeError`` naming both.
    ``stacklevel``: the warnings', counted from the caller (the program's own line)."""
    old = [name for name in OLD_KEYWORDS if name in kwargs]
    for name in old:
        deprecated(OLD_KEYWORDS[name], stacklevel=stacklevel)
    if not old:
        return kwargs
    new = {name: value for name, value in kwargs.items() if name not in OLD_KEYWORDS}

    def put(argument: str, value: Any, *keywords: str) -> None:
        if argument in new:
            raise TypeError(f"Controller({keywords[0]}=...) and Controller({argument}=...) both given: put "
                            f"{' and '.join(keywords)} in {_WHERE[argument]}")
        new[argument] = value

    if kwargs.get("on_results") is not None:
        new["sinks"] = [OnResults(kwargs["on_results"]), *new.get("sinks", ())]  # called first, as it was
    if kwargs.get("events_only"):
        put("processor", EVENTS_ONLY, "events_only")
    hooks = {name: kwargs[name] for name in ("on_connect", "before_connect") if kwargs.get(name) is not None}
    if hooks:
        put("connect", ConnectHooks(**hooks), *hooks)
    if kwargs.get("connection_events"):
        if new.get("on_event") is None or isinstance(new["on_event"], OnEvent):
            raise TypeError("Controller(connection_events=True) hands each feed's ConnectionEvents to on_event: "
                            "write Controller(on_event=forkless.OnEvent(f, connections=True))")
        new["on_event"] = OnEvent(new["on_event"], connections=True)
    runtime = {name: kwargs[name] for name in RUNTIME_KEYWORDS if name in kwargs}
    if runtime:
        put("runtime", Runtime(**runtime), *runtime)
    return new


_WHERE = {"processor": "processor=forkless.EVENTS_ONLY", "connect": "forkless.ConnectHooks(...)",
          "runtime": "forkless.Runtime(...)"}


def taking_old_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """``Controller.__init__`` that takes each old keyword for the release the deprecation policy gives it
    (``grouped_keywords``), before anything is built; every other argument goes to ``init`` as it is (its own
    signature refuses the rest), and ``inspect.signature`` shows ``init``'s."""

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **grouped_keywords(kwargs, stacklevel=3))

    return checked
