"""What crosses the bridge between the threads, defined where they meet.

Rules:
- ``Chunk`` (IO -> main, on ``inbound``) and ``Outgoing`` (main -> IO, on ``outbound``) are the
  only things that cross (io_loop/bridge.py owns the queues); a ``Trace`` rides along on one
  message in ``SAMPLE_EVERY``, and a batch's ``Results`` on its ``Outgoing`` when the controller
  has sinks (io_loop/sinks/results.py): no third queue.
- Plain data, no behaviour that needs a thread, a loop or a clock: the main thread's core
  (controller/batching.py) builds batches from chunks and the IO side sends items, both
  importing these names from here. Nothing here imports a third-party library, so the
  controller's core can import it cheaply.
- A ``Trace``'s stamps are each written once, by the thread at that hop (``READ`` … ``WRITTEN``).
- ``ConnectionEvent`` is public (``forkless.ConnectionEvent``): a source's connection came up or went down,
  handed to ``on_event`` inside an ``Events`` like any object a source emits (io_loop/source.py says when),
  or put on an ``IOPortal``'s ``to_main`` (io_loop/portal.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar, final

__all__ = ["DECODED", "ENCODED", "FETCHED", "HOPS", "INBOUND", "OUTBOUND", "PICKED", "READ", "SAMPLE_EVERY",
           "STEP", "TAKEN", "WRITTEN", "Chunk", "ConnectionEvent", "Events", "Origin", "Outgoing", "PositionUnknown",
           "Results", "Resume", "Trace", "Unsent",
           "count_unsent"]


P = TypeVar("P", bound=int | str)  # a position: an int (a JetStream stream sequence) or a str (a source's own)


class Origin(NamedTuple, Generic[P]):
    """Where one message of a replayable source (a JetStream feed, io_loop/connectors/jetstream/source.py) came
    from: the stream sequence of its source message, its index there (a payload may hold a
    list: the good elements are 0, 1, … in order, the error replies of the bad ones follow),
    and whether it is the last good element of that source message. The last ``Origin`` a
    feed's messages reached the main thread with is that feed's position; a reply carries its
    message's ``Origin`` so that it is published with the id ``<stream>:<seq>:<index>``."""

    seq: P
    index: int  # type: ignore[assignment]  # the field hides tuple.index: to mypy, a bad override
    last: bool

    def resume(self: Origin[int]) -> tuple[int, int]:  # type: ignore[misc]  # mypy checks callers by it, not the def
        """Where consuming goes on after this element: (stream sequence, good elements of it to skip)."""
        return (self.seq + 1, 0) if self.last else (self.seq, self.index + 1)


class Resume(NamedTuple):
    """A restored position with the created time (ISO 8601) of the stream it was recorded in:
    a JetStream feed refuses a stream created at another time (deleted and made again). A
    partitioned feed's ``origin`` is its positions by partition (partition -> ``Origin``)."""

    origin: Origin | dict[int, Origin]
    stream_created: str


class PositionUnknown(NamedTuple):
    """Handed to a JetStream feed in place of its ``Origin`` when checkpoints existed but every
    one was damaged: the position they recorded is unknown. ``why`` names the files. The feed
    starts only where that loses nothing (io_loop/connectors/jetstream/consumer.py), else ``PositionLost``."""

    why: str

# ---- the latency budget: hop times of a sample of messages ---------------------------------

SAMPLE_EVERY = 64  # one message in this many carries a Trace (cheap enough to leave on)
# the stamps of a Trace, in the order a message passes them (time.monotonic_ns, every thread)
READ, DECODED, INBOUND, TAKEN, STEP, FETCHED, ENCODED, OUTBOUND, PICKED, WRITTEN = range(10)
HOPS = ("decode", "gather", "inbound", "batch", "step", "encode", "assemble", "outbound", "write")
"""The hops between consecutive stamps: ``decode`` frame read -> decoded (the frames of one
socket read handed over together share their first frame's read time); ``gather`` -> put on
the inbound queue (frames of one loop turn gathered into a chunk); ``inbound`` -> taken by the
main thread (queue wait and wake-up); ``batch`` -> the step starts (micro-batching, earlier
batches); ``step`` -> outputs on the host (pad, run, device-to-host); ``encode`` -> reply
frames made; ``assemble`` -> put on the outbound queue (error frames, results callback);
``outbound`` -> taken by the IO thread's writer (queue wait and wake-up); ``write`` -> its
batch of frames written to the socket. A stamp is taken just before a put, so time a put
waits for room counts in the next hop. A sampled message whose batch sends its feed no frame
(the reply policy, or the codec's None) ends at ``assemble``: no ``outbound`` or ``write``."""


class Trace:
    """The stamps of one sampled message (``READ`` … ``WRITTEN``), each written once, by the
    thread at that hop; the IO thread reads them all after ``WRITTEN`` (see ``HOPS``)."""

    __slots__ = ("feed", "ns")

    def __init__(self, feed: int, read_ns: int, decoded_ns: int) -> None:
        self.feed = feed
        self.ns = [read_ns, decoded_ns, 0, 0, 0, 0, 0, 0, 0, 0]

    def hops_s(self, end: int = WRITTEN) -> list[float]:
        """Seconds spent in each hop up to stamp ``end``, then the whole way (read to ``end``).
        ``WRITTEN`` (the IO thread, once its reply frames are written): every one of ``HOPS``;
        ``OUTBOUND`` (the main thread, when its batch sent it no frame, e.g. ``"replies":
        "none"``): ``decode`` … ``assemble``, the trace ending where its results were handed over."""
        ns = self.ns
        return [(ns[i + 1] - ns[i]) * 1e-9 for i in range(end)] + [(ns[end] - ns[READ]) * 1e-9]


@dataclass
class Chunk:
    """Messages from one inbound frame, column-wise, with the time the frame arrived."""

    seq: list[Any]
    stream: list[str]
    # numpy [n, F] of the processor's input dtype (float32 by default; no numpy import here: see the
    # rules), or, gathered from several frames, a list of their own arrays whose rows in order are the
    # chunk's: they are copied once, on the main thread, into the padded batch (``x_parts``)
    x: Any
    received_ns: int
    feed: int = 0  # index of the feed (``IOSettings.feed_specs``) whose connection it came from
    trace: Trace | None = None  # one in SAMPLE_EVERY messages: its first message's hop times
    origin: list[Origin] | None = None  # per message, from a source that gives positions; None otherwise
    connection: int = 0  # the source's connection (1, 2, …) its frames were read on (0: it counts none)

    def __len__(self) -> int:
        return len(self.seq)

    def x_parts(self) -> list[Any]:
        """The arrays that hold ``x``'s rows, in order (one, or the frames' own)."""
        return self.x if isinstance(self.x, list) else [self.x]


@final  # (``type(item) is Events`` tells the two apart)
@dataclass
class Events:
    """Objects a source hands to the main thread as they are (``SourceContext.emit_event``: a
    fill, a book), on ``inbound`` beside the chunks, in order with them; not messages of the
    books (no processor sees them), counted on their own."""

    feed: int
    items: list[Any]
    received_ns: int

    def __len__(self) -> int:
        return 0  # no messages: the books count chunks' messages only


@dataclass(frozen=True)
class ConnectionEvent:
    """A source's connection came up (``connected``) or went down, as ``on_event(source, event)`` gets it
    with ``Controller(on_event=OnEvent(fn, connections=True))``, in order with the source's other events and after the
    messages it emitted before; an ``IOPortal(connection_events=True)`` puts one on ``to_main`` each
    time its worker starts and ends. ``source``: the source's (feed's, portal's) name; ``reason``:
    why it went down ("" when it came up); ``code``: the WebSocket close code where one was received
    (the peer's close frame, 1006 when the connection was lost without one), else None;
    ``connection``: the connection's id (1, 2, …; a portal's: the worker's run), 0 for a source that
    counts none; ``at_s``: when it changed, Unix seconds (``time.time()``, as ``state_since``)."""

    source: str
    connected: bool
    reason: str = ""
    code: int | None = None
    connection: int = 0
    at_s: float = 0.0


@dataclass
class Results:
    """One stepped batch's results for the controller's sinks, as ``OnResults`` got them: each
    message's feed (its index), ``seq``, ``stream``, and ``outputs`` (output name -> numpy array
    whose leading axis is the messages, in arrival order). Read-only once it crosses."""

    feed: list[int]
    seq: list[Any]
    stream: list[str]
    outputs: dict[str, Any]

    def __len__(self) -> int:
        return len(self.seq)


@dataclass
class Outgoing:
    """Frames for the IO thread to send, in order.

    ``answers``: True when every frame answers one received message (results, and error
    replies such as "too many streams"), False for the error replies to bad input the
    reader makes itself (not messages: outside the message books). ``error_at`` holds the
    positions of the error frames among the answers (sorted), so a writer that is stopped
    part-way through an item still counts exactly how many results it wrote.
    ``received_ns`` holds, for each frame that answers a message, when its frame arrived
    (monotonic ns), for the received-to-written latency (``write_latency``). ``feed`` is the
    index of the feed whose connection the frames go back on (their messages came from it).

    A batch that mixed several feeds crosses as one bundle (one queue hand-over, one wake-up
    of the IO thread): ``parts`` holds one ``Outgoing`` per feed and ``frames`` is empty; the
    IO side's router hands each part to its feed (``unbundled``).
    """

    frames: list[str | bytes]
    received_ns: list[int] = field(default_factory=list)
    error_at: tuple[int, ...] = ()
    answers: bool = True
    feed: int = 0
    parts: tuple[Outgoing, ...] = ()
    traces: list[Trace] = field(default_factory=list)  # sampled messages among those answered here
    origin: list[Origin] | None = None  # per frame, its message's (a source that gives positions); else None
    sent: bool = False  # frames the main thread sent on its own (``Controller.send``): no answers, no errors
    for_sinks: Results | None = None  # the batch's results for the controller's sinks (a bundle's, not its parts')
    # a send's (``sent``; io_loop/sends.py has the rules): its id, when it was sent and its deadline
    # (``time.monotonic()`` seconds; None: none); ``taken`` once its feed's writer side took it from the
    # queue, ``handed`` while a writer has it in hand, ``failed`` the reason it was given up (never
    # written, counted once: in ``sent_failed``, not in what the stop counts)
    send_id: Any = None
    sent_at: float = 0.0
    deadline: float | None = None
    taken: bool = False
    handed: bool = False
    failed: str = ""

    def take_up(self) -> None:
        """A send was taken from the queue by its feed's writer side."""
        self.taken = True

    def hand_out(self, handed: bool) -> None:
        """A send is in a writer's hands (True) or waits again (False: given back half written)."""
        self.handed = handed

    def give_up(self, reason: str) -> None:
        """A send is given up for ``reason``: never written (io_loop/sends.py counts it)."""
        self.failed = reason

    def unbundled(self) -> tuple[Outgoing, ...]:
        """The items to send: the parts of a bundle, else this item itself."""
        return self.parts or (self,)

    @property
    def frame_count(self) -> int:
        """Frames to send, a bundle's parts included."""
        return sum(len(part.frames) for part in self.parts) if self.parts else len(self.frames)

    @property
    def results(self) -> int:
        """How many of the frames are results."""
        return len(self.frames) - len(self.error_at) if self.answers else 0

    def errors_between(self, start: int, stop: int) -> int:
        """How many of ``frames[start:stop]`` are error frames."""
        if self.sent:
            return 0
        if not self.answers:
            return stop - start
        return bisect.bisect_left(self.error_at, stop) - bisect.bisect_left(self.error_at, start)


class Unsent(NamedTuple):
    answers: int  # frames answering received messages
    errors: int  # error replies to bad input
    sent: int  # frames the main thread sent on its own


def count_unsent(items: list[tuple[Outgoing | None, int]]) -> Unsent:
    """For ``(item, frames already written)`` pairs that will never be sent further: how many
    unsent frames answer received messages, how many are error replies to bad input, and how
    many the main thread sent on its own."""
    answers = errors = sent = 0
    for item, written in items:
        for part in item.unbundled() if item is not None else ():
            if part.failed:  # a send given up: counted in sent_failed already
                continue
            if part.sent:
                sent += len(part.frames) - written
            elif part.answers:
                answers += len(part.frames) - written
            else:
                errors += len(part.frames) - written
    return Unsent(answers, errors, sent)
