"""How the main thread waits for the IO thread (controller/queues.py's ``Intake``, io_loop/waiting.py): without
a GIL it spins for ``spin_s`` after its last work, so that a put is seen by a look, not a wake-up; then it
blocks as it does under the GIL.

*inbound* here is a real janus queue made on a real loop thread, which plays the IO thread: its async side's
``put_nowait`` is what the IO thread's hand-over calls. Nothing is timed: the spin is made long enough to
cover each test (``spin_s``) and each assertion is on which way the item was taken.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import janus
import numpy as np
import pytest

from forkless.controller.batching import MicroBatcher
from forkless.controller.inflight import StepsInFlight
from forkless.controller.queues import Intake
from forkless.controller.stats import MainStats
from forkless.io_loop.crossing import Chunk
from forkless.io_loop.loopthread import LoopThread
from forkless.io_loop.waiting import PARK, WaitSettings
from tests.harness import UNIT_S

pytestmark = pytest.mark.threads

NO_GIL = WaitSettings("spin", spin_s=60.0, both=True, apart=True)  # a spin longer than any test
UNDER_GIL = WaitSettings("spin", spin_s=60.0)


def chunk(seq: int) -> Chunk:
    return Chunk([seq], [f"s{seq}"], np.full((1, 2), float(seq), np.float32), 0)


class Inbound:
    """*inbound*'s sync side as the main thread sees it, recording which way it was read: by a look
    (``qsize``, then ``get_nowait``) or by a blocking ``get``, which the IO thread's put must wake."""

    def __init__(self, queue: janus.Queue[Any]) -> None:
        self._q = queue.sync_q
        self.blocking_gets = 0
        self.looked = threading.Event()  # the main thread looked at an empty queue
        self.blocked = threading.Event()  # the main thread is in a blocking get

    def qsize(self) -> int:
        n = self._q.qsize()
        if not n:
            self.looked.set()
        return n

    def get(self, timeout: float | None = None) -> Any:
        self.blocking_gets += 1
        self.blocked.set()
        return self._q.get(timeout=timeout)

    def get_nowait(self) -> Any:
        return self._q.get_nowait()


class IOSide:
    """A loop thread holding *inbound*; ``put`` hands an item over from it, as the IO thread's hand-over does."""

    def __init__(self) -> None:
        self.runner = LoopThread("test-io", cleanup_s=1.0)
        self.queue: janus.Queue[Any] | None = None

    async def _main(self) -> None:
        self.queue = janus.Queue(16)
        self.runner.ready()
        await self.runner.loop.create_future()  # runs until cancelled

    def put(self, item: Any) -> None:
        assert self.queue is not None
        queue = self.queue
        assert self.runner.call_soon(queue.async_q.put_nowait, item)


@pytest.fixture
def io() -> Iterator[IOSide]:
    side = IOSide()
    assert side.runner.start(side._main, timeout=10 * UNIT_S)
    yield side
    side.runner.cancel()
    side.runner.join(10 * UNIT_S)


def intake(inbound: Inbound, wait: WaitSettings, step: Any = None) -> Intake:
    stepped: list[Any] = []
    return Intake(inbound, MicroBatcher(4, 0.0), MainStats(), step if step is not None else
                  (lambda taken, deadline: stepped.append(taken)), names=["f"], on_event=lambda: None, wait=wait)


def put_once(io: IOSide, happened: threading.Event, item: Any) -> threading.Thread:
    """Put ``item`` from the IO side once the main thread has done what ``happened`` records: looked at
    the empty queue, or entered a blocking get (so the put cannot come before the wait it is meant for)."""
    def put() -> None:
        assert happened.wait(10 * UNIT_S), "the main thread never waited on inbound"
        io.put(item)

    thread = threading.Thread(target=put)
    thread.start()
    return thread


def test_without_a_gil_the_main_thread_takes_a_put_by_looking_not_by_being_woken(io: IOSide) -> None:
    inbound = Inbound(io.queue)
    taker = intake(inbound, NO_GIL)
    taker._worked()  # it has just finished some work: the next message is likely near
    putter = put_once(io, inbound.looked, chunk(7))
    taken = taker.collect(10 * UNIT_S)
    putter.join()
    assert taken is not None and taken.seq == [7]
    assert inbound.blocking_gets == 0  # seen by a look: the put woke no one


def test_under_the_gil_the_main_thread_blocks_on_inbound_and_the_put_wakes_it(io: IOSide) -> None:
    for wait in (UNDER_GIL, PARK):
        inbound = Inbound(io.queue)
        taker = intake(inbound, wait)
        taker._worked()
        putter = put_once(io, inbound.blocked, chunk(8))
        taken = taker.collect(10 * UNIT_S)
        putter.join()
        assert taken is not None and taken.seq == [8]
        assert inbound.blocking_gets == 1


def test_without_a_gil_it_spins_only_for_spin_s_after_its_last_work_then_blocks(io: IOSide) -> None:
    inbound = Inbound(io.queue)
    taker = intake(inbound, WaitSettings("spin", spin_s=0.0, both=True, apart=True))
    taker._worked()  # spin_s 0: its spin is over at once, as it is long after a feed went quiet
    putter = put_once(io, inbound.blocked, chunk(9))
    taken = taker.collect(10 * UNIT_S)
    putter.join()
    assert taken is not None and taken.seq == [9]
    assert inbound.blocking_gets == 1


class Step:
    """A step in flight whose device the test finishes (``done``); ``BatchStep``'s interface as
    ``StepsInFlight`` uses it. ``waited``: finished while not done yet, i.e. blocked on the device."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.begun: list[Any] = []
        self.ended: list[Any] = []
        self.waited = 0

    def begin(self, taken: Any) -> Any:
        self.begun.append(taken)
        return taken

    def ready(self, begun: Any) -> bool:
        return self.done.is_set()

    def end(self, begun: Any, deadline: float | None = None) -> None:
        if not self.done.is_set():
            self.waited += 1
            assert self.done.wait(10 * UNIT_S)
        self.ended.append(begun)


def test_with_a_step_in_flight_and_no_gil_it_looks_at_inbound_and_the_step_instead_of_blocking_on_it(
        io: IOSide) -> None:
    inbound = Inbound(io.queue)
    step = Step()
    flight = StepsInFlight(step, 3)  # type: ignore[arg-type]
    taker = intake(inbound, NO_GIL, flight)
    flight(_taken(1))  # a step in flight, not done
    taker._worked()
    putter = put_once(io, inbound.looked, chunk(2))
    while len(step.begun) < 2:  # each cycle looks at the step and at inbound, between pauses
        taker.cycle(10 * UNIT_S)
    putter.join()
    # the message that arrived while the step ran was taken by a look and its batch dispatched behind it
    assert len(flight) == 2 and step.waited == 0 and inbound.blocking_gets == 0
    step.done.set()
    while len(flight):
        taker.cycle(10 * UNIT_S)
    assert [t.seq for t in step.ended] == [[1], [2]] and step.waited == 0  # finished once done, never waited on


def test_with_a_step_in_flight_under_the_gil_it_blocks_on_the_step_while_the_io_loop_spins(io: IOSide) -> None:
    inbound = Inbound(io.queue)
    step = Step()
    flight = StepsInFlight(step, 3)  # type: ignore[arg-type]
    taker = intake(inbound, UNDER_GIL, flight)
    flight(_taken(1))
    taker._worked()
    finisher = threading.Thread(target=lambda: (_until(lambda: step.waited == 1), step.done.set()))
    finisher.start()
    assert taker.cycle(10 * UNIT_S) == 0  # nothing waiting: it finished the oldest step, waiting for it
    finisher.join()
    assert [t.seq for t in step.ended] == [[1]] and step.waited == 1


def _until(condition: Any) -> None:
    deadline = time.monotonic() + 10 * UNIT_S
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def _taken(seq: int) -> Any:
    batcher = MicroBatcher(4, 0.0)
    batcher.add(chunk(seq), 0.0)
    return batcher.take()
