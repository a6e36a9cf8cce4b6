"""The one place where two threads meet: two bounded janus queues, one each way, for the IO thread and the IO portal
alike.

Rules:
- Both queues are created inside the loop thread's running loop (janus needs a loop).
- ``inbound`` carries items loop -> main, ``outbound`` main -> loop. The loop touches inbound's async side and
  ``OutboundReceiver``, the main thread the sync sides (``MainSide``); nobody else holds both (a portal's worker in
  an executor thread uses the sync sides, ``OutboundSender``, so each put still wakes the loop).
- The loop's reader of ``outbound`` is woken by one event per put: one turn of the loop, not janus's three
  (bench/README.md, the ``outbound`` hop). Under ``spin``, while the main thread says steps are in flight
  (``OutboundSender.expect``), the loop's selector looks at *outbound* itself and a put does not wake it.
- An item ``sent(item)`` picks out (a send with a deadline) is handed to ``on_sent`` on the loop with the same one
  wake-up: its deadline is watched from then, whether or not the reader is taking.
- With a sink on the IO loop instead of the main thread, the IO thread takes from ``inbound``'s async side too and
  ends ``outbound`` itself (``end_outbound``).
- Orderly stop, in this order: the loop shuts ``inbound`` down (the main thread drains it, then
  ``SyncQueueShutDown``); the main thread sends its last items and shuts ``outbound`` down (the loop drains it,
  then ``AsyncQueueShutDown``); the loop closes both (``aclose``), ``inbound`` keeping what it holds for the main
  thread. A failure ends both at once, dropping what they hold (``immediate``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import janus

from forkless.io_loop.waiting import Expecting, SpinningSelector

__all__ = ["Bridge", "MainSide", "OutboundReceiver", "OutboundSender"]

In = TypeVar("In")
Out = TypeVar("Out")


def _expect_nothing(steps: int) -> None:
    """A main side whose loop parks: steps in flight are nobody's business."""


def _never(item: Any) -> bool:
    """No item is handed to ``on_sent``."""
    return False


@dataclass(frozen=True)
class MainSide(Generic[In, Out]):
    """What the main thread gets: the sync sides only, and ``expect(steps)``: how many steps are in
    flight (their results will be put on outbound), for a loop that spins (io_loop/waiting.py)."""

    inbound: janus.SyncQueue[In]
    outbound: OutboundSender[Out]
    expect: Callable[[int], None] = _expect_nothing


class OutboundSender(Generic[Out]):
    """The sync side of ``outbound``: janus's, whose puts each wake the loop's reader once
    (``loop.call_soon_threadsafe(ready.set)``). janus's own wake-up of an awaiting ``get`` takes
    three turns of the loop (a callback makes a task, the task takes the async mutex and notifies,
    the getter takes the mutex back); an event set by the callback takes one. Nothing awaits
    janus's async ``get``, so janus sends none of its own."""

    def __init__(self, queue: janus.Queue[Out], loop: asyncio.AbstractEventLoop, ready: asyncio.Event,
                 expecting: Expecting | None = None, on_sent: Callable[[Out], None] | None = None,
                 sent: Callable[[Out], bool] = _never) -> None:
        self._queue = queue.sync_q
        self._shutdown = queue.shutdown
        self._loop = loop
        self._ready = ready
        self._expecting = expecting  # None: the loop parks (no spinning selector watches outbound)
        self._on_sent, self._sent = on_sent, sent

    def expect(self, steps: int) -> None:
        """``steps`` steps are in flight (their results will be put here). Under ``spin``, the IO loop
        is woken when the first begins, so that it spins, looking at *outbound* itself, until the
        last one's results are put (io_loop/waiting.py); otherwise nothing."""
        expecting = self._expecting
        if expecting is None:
            return
        before = expecting.expect(steps)
        if steps and not before and not expecting.spinning_now():
            try:
                self._loop.call_soon_threadsafe(_nothing)  # its select returns, and spins from then on
            except RuntimeError:  # the loop has closed
                pass

    def put(self, item: Out, block: bool = True, timeout: float | None = None) -> None:
        self._queue.put(item, block, timeout)
        if self._sent(item):
            self._wake_sent(item)
        else:
            self._wake()

    def put_nowait(self, item: Out) -> None:
        self.put(item, False)

    def get(self, block: bool = True, timeout: float | None = None) -> Out:
        return self._queue.get(block, timeout)

    def get_nowait(self) -> Out:
        return self._queue.get_nowait()

    def qsize(self) -> int:
        return self._queue.qsize()

    def full(self) -> bool:
        return self._queue.full()

    @property
    def maxsize(self) -> int:
        return self._queue.maxsize

    def shutdown(self, immediate: bool = False) -> None:
        """No more items: the loop takes what is queued (none, ``immediate``), then sees ``AsyncQueueShutDown``
        (woken whether or not it spins: a spinning selector looks at what is queued, not at the shutdown)."""
        self._shutdown(immediate)
        self._wake(always=True)

    def _wake(self, always: bool = False) -> None:
        expecting = self._expecting
        if not always and expecting is not None and expecting.spinning_now():  # after the put: io_loop/waiting.py
            return
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop has closed: nobody is left to wake
            pass

    def _wake_sent(self, item: Out) -> None:
        try:
            self._loop.call_soon_threadsafe(self._sent_crossed, item)
        except RuntimeError:  # the loop has closed: the stop counts what is left
            pass

    def _sent_crossed(self, item: Out) -> None:
        """On the loop: the reader woken, and the item handed to ``on_sent``."""
        self._ready.set()
        assert self._on_sent is not None  # sent() picks items out only with one
        self._on_sent(item)


class OutboundReceiver(Generic[Out]):
    """The loop's side of ``outbound`` (see ``OutboundSender``): ``get`` waits on the
    event, ``get_nowait``/``put``/``put_nowait`` are janus's async side's (a put from this
    side sets the event too). Several tasks may await ``get``: each put wakes them all, one takes it."""

    def __init__(self, queue: janus.Queue[Out], ready: asyncio.Event) -> None:
        self._queue = queue.async_q
        self._ready = ready

    async def get(self) -> Out:
        """The next item; raises ``janus.AsyncQueueShutDown`` once shut down and empty."""
        queue, ready = self._queue, self._ready
        while True:
            try:
                return queue.get_nowait()
            except asyncio.QueueEmpty:
                pass
            ready.clear()
            try:  # an item put before the clear has already set the event: look once more
                return queue.get_nowait()
            except asyncio.QueueEmpty:
                pass
            await ready.wait()

    def get_nowait(self) -> Out:
        return self._queue.get_nowait()

    def take_all(self) -> list[Out]:
        """What is queued, taken: at the end, when the reader has stopped, to count it or report it."""
        left = []
        while True:
            try:
                left.append(self._queue.get_nowait())
            except (asyncio.QueueEmpty, janus.AsyncQueueShutDown):
                return left

    def poll(self) -> bool:
        """On the loop, from its spinning selector: wake the reader if an item waits and it was not
        woken yet; whether it was woken now."""
        if self._queue.qsize() and not self._ready.is_set():
            self._ready.set()
            return True
        return False

    async def put(self, item: Out) -> None:
        await self._queue.put(item)
        self._ready.set()

    def put_nowait(self, item: Out) -> None:
        self._queue.put_nowait(item)
        self._ready.set()

    def qsize(self) -> int:
        return self._queue.qsize()


class Bridge(Generic[In, Out]):
    """Owns both queues. Construct it in the loop thread's running loop; ``selector``: the loop's
    ``SpinningSelector`` when it spins (``LoopThread.selector``; None: it parks), which then looks at
    *outbound* while the main thread expects work; ``on_sent``/``sent`` as the module rules say;
    ``queue``: the janus queue class of both (a portal's gives an item back at the front)."""

    def __init__(self, queue_size: int, selector: SpinningSelector | None = None,
                 on_sent: Callable[[Out], None] | None = None, sent: Callable[[Out], bool] = _never, *,
                 queue: Callable[[int], janus.Queue[Any]] = janus.Queue) -> None:
        self._inbound: janus.Queue[In] = queue(queue_size)
        self._outbound: janus.Queue[Out] = queue(queue_size)
        ready = asyncio.Event()
        self._outbound_receiver = OutboundReceiver(self._outbound, ready)
        expecting = None
        if selector is not None:
            expecting = selector.expecting
            selector.attach(self._outbound_receiver.poll)
        self._outbound_sender = OutboundSender(self._outbound, asyncio.get_running_loop(), ready, expecting,
                                               on_sent, sent)

    @property
    def inbound(self) -> janus.AsyncQueue[In]:
        return self._inbound.async_q

    @property
    def outbound(self) -> OutboundReceiver[Out]:
        return self._outbound_receiver

    def main_side(self) -> MainSide[In, Out]:
        sender = self._outbound_sender
        return MainSide(self._inbound.sync_q, sender, sender.expect)

    def stop_inbound(self, immediate: bool = False) -> None:
        """No more items will come; the main thread drains what is queued (dropped, ``immediate``), then
        sees ShutDown. Any thread."""
        self._inbound.shutdown(immediate)

    def end_outbound(self, immediate: bool = False) -> None:
        """No more items will be taken (or replies come: a sink took the chunks, io_loop/thread.py): the
        reader ends once it has taken what is queued (dropped, ``immediate``). Any thread."""
        self._outbound_sender.shutdown(immediate)

    def depths(self) -> tuple[int, int]:
        return self._inbound.async_q.qsize(), self._outbound.async_q.qsize()

    async def aclose(self) -> None:
        """Close both queues; call last, from the loop, after both sides have stopped (the module rules)."""
        self.end_outbound(immediate=True)
        self.stop_inbound()
        for q in (self._outbound, self._inbound):
            await q.wait_closed()


def _nothing() -> None:
    """A callback that only wakes the loop (``OutboundSender.expect``)."""
