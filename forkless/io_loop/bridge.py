"""The one place where the two threads meet: two bounded janus queues.

Rules:
- Both queues are created inside the IO thread's running loop (janus needs a loop).
- ``inbound`` carries ``Chunk``s IO -> main; ``outbound`` carries ``Outgoing`` items
  main -> IO. The IO thread only touches the async sides, the main thread only the sync
  sides (``MainSide``); nobody else holds both.
- The IO thread's reader of ``outbound`` is woken by one event per put (``OutboundSender``,
  ``OutboundReceiver``) instead of janus's notification: one turn of the loop instead of
  three (measured in the latency budget's ``outbound`` hop, bench/README.md). Under the ``spin``
  hand-off (io_loop/waiting.py) the main thread tells the IO thread how many steps are in flight
  (``OutboundSender.expect``); while any is, the IO loop's selector looks at *outbound* itself
  (``OutboundReceiver.poll``) and a put does not wake it.
- A send of the main thread's (``Outgoing.sent``) crosses with the same one wake-up, which also
  hands it to ``on_sent`` on the IO loop (its feed's ``SendWatch``, io_loop/sends.py: its deadline
  is watched from then, whether or not the feed's writer is taking).
- With a sink on the IO loop instead of the main thread (the relay, io_loop/thread.py), the IO
  thread takes from ``inbound``'s async side too, and ends ``outbound`` itself (``end_outbound``):
  the main thread then touches neither queue.
- Orderly stop, in this order: the IO thread stops reading and shuts ``inbound`` down
  (the main thread drains what is left, then gets ``SyncQueueShutDown``); the main thread
  sends its last results and shuts ``outbound`` down (the IO thread sends what is left,
  then gets ``AsyncQueueShutDown``); finally the IO thread closes both (``aclose``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import janus

from forkless.io_loop.crossing import Chunk, Outgoing
from forkless.io_loop.waiting import Expecting

__all__ = ["Bridge", "MainSide"]


def _expect_nothing(steps: int) -> None:
    """A main side whose IO loop parks: steps in flight are nobody's business."""


@dataclass(frozen=True)
class MainSide:
    """What the main thread gets: the sync sides only, and ``expect(steps)``: how many steps are in
    flight (their results will be put on outbound), for an IO loop that spins (io_loop/waiting.py)."""

    inbound: janus.SyncQueue[Chunk]
    outbound: OutboundSender
    expect: Callable[[int], None] = _expect_nothing


class OutboundSender:
    """The main thread's side of ``outbound``: janus's sync side, plus one wake-up of the IO
    thread's reader per put (``loop.call_soon_threadsafe(ready.set)``). janus's own wake-up
    of an awaiting ``get`` takes three turns of the loop (a callback makes a task, the task
    takes the async mutex and notifies, the getter takes the mutex back); an event set by
    the callback takes one. Nothing awaits janus's async ``get``, so janus sends none of its own."""

    def __init__(self, queue: janus.Queue[Outgoing], loop: asyncio.AbstractEventLoop, ready: asyncio.Event,
                 expecting: Expecting | None = None, on_sent: Callable[[Outgoing], None] | None = None) -> None:
        self._queue = queue.sync_q
        self._shutdown = queue.shutdown
        self._loop = loop
        self._ready = ready
        self._expecting = expecting  # None: the IO loop parks (no spinning selector watches outbound)
        self._on_sent = on_sent

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

    def put(self, item: Outgoing, timeout: float | None = None) -> None:
        self._queue.put(item, timeout=timeout)
        if item.sent and self._on_sent is not None:
            self._wake_sent(item)
        else:
            self._wake()

    def put_nowait(self, item: Outgoing) -> None:
        self._queue.put_nowait(item)
        if item.sent and self._on_sent is not None:
            self._wake_sent(item)
        else:
            self._wake()

    def qsize(self) -> int:
        return self._queue.qsize()

    def shutdown(self) -> None:
        """No more items: the IO thread sends what is queued, then sees ``AsyncQueueShutDown`` (woken
        whether or not its loop spins: a spinning selector looks at what is queued, not at the shutdown)."""
        self._shutdown()
        self._wake(always=True)

    def _wake(self, always: bool = False) -> None:
        expecting = self._expecting
        if not always and expecting is not None and expecting.spinning_now():  # after the put: io_loop/waiting.py
            return
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop has closed: nobody is left to wake
            pass

    def _wake_sent(self, item: Outgoing) -> None:
        try:
            self._loop.call_soon_threadsafe(self._sent_crossed, item)
        except RuntimeError:  # the loop has closed: the stop counts what is left
            pass

    def _sent_crossed(self, item: Outgoing) -> None:
        """On the IO loop: the reader woken, and the send handed to ``on_sent``."""
        self._ready.set()
        self._on_sent(item)


class OutboundReceiver:
    """The IO thread's side of ``outbound`` (see ``OutboundSender``): ``get`` waits on the
    event, ``get_nowait``/``put``/``put_nowait`` are janus's async side's (a put from this
    side sets the event too)."""

    def __init__(self, queue: janus.Queue[Outgoing], ready: asyncio.Event) -> None:
        self._queue = queue.async_q
        self._ready = ready

    async def get(self) -> Outgoing:
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

    def get_nowait(self) -> Outgoing:
        return self._queue.get_nowait()

    def poll(self) -> bool:
        """On the loop, from its spinning selector: wake the reader if an item waits and it was not
        woken yet; whether it was woken now."""
        if self._queue.qsize() and not self._ready.is_set():
            self._ready.set()
            return True
        return False

    async def put(self, item: Outgoing) -> None:
        await self._queue.put(item)
        self._ready.set()

    def put_nowait(self, item: Outgoing) -> None:
        self._queue.put_nowait(item)
        self._ready.set()

    def qsize(self) -> int:
        return self._queue.qsize()


class Bridge:
    """Owns both queues. Construct it in the IO thread's running loop; ``expecting``: what the main
    thread tells a spinning IO loop (io_loop/waiting.py; None: the loop parks)."""

    def __init__(self, queue_size: int, expecting: Expecting | None = None,
                 on_sent: Callable[[Outgoing], None] | None = None) -> None:
        self._inbound: janus.Queue[Chunk] = janus.Queue(queue_size)
        self._outbound: janus.Queue[Outgoing] = janus.Queue(queue_size)
        ready = asyncio.Event()
        self._outbound_receiver = OutboundReceiver(self._outbound, ready)
        self._outbound_sender = OutboundSender(self._outbound, asyncio.get_running_loop(), ready, expecting, on_sent)

    @property
    def inbound(self) -> janus.AsyncQueue[Chunk]:
        return self._inbound.async_q

    @property
    def outbound(self) -> OutboundReceiver:
        return self._outbound_receiver

    def main_side(self) -> MainSide:
        sender = self._outbound_sender
        return MainSide(self._inbound.sync_q, sender, sender.expect)

    def stop_inbound(self) -> None:
        """No more chunks will come; the main thread drains what is queued, then sees ShutDown."""
        self._inbound.shutdown()

    def end_outbound(self) -> None:
        """No replies will come (a sink took the chunks, io_loop/thread.py): the feeds' writers end."""
        self._outbound_sender.shutdown()

    def depths(self) -> tuple[int, int]:
        return self._inbound.async_q.qsize(), self._outbound.async_q.qsize()

    async def aclose(self) -> None:
        """Close both queues; call last, from the IO loop, after both sides have stopped."""
        for q in (self._inbound, self._outbound):
            q.shutdown(immediate=True)
            await q.aclose()


def _nothing() -> None:
    """A callback that only wakes the loop (``OutboundSender.expect``)."""
