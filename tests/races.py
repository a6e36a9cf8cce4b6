"""The race tests' one harness: many threads released together on the same object, every exception
a thread raised raised again in the test, and on the GIL build a switch interval of a microsecond
while they run (the host's given back after).

A race test is written the way books are checked: many threads, many iterations, then totals that
must balance (what one side counted equals what the other did, nothing lost, nothing counted twice).
On the free-threaded build (3.13t, ``FREE_THREADED``) the threads run at once and a race shows in the
first iterations. On the GIL build a thread is switched out only every switch interval (5 ms, the
default), so a read-modify-write of a few bytecodes is rarely cut in two; ``hammer`` makes the
interpreter switch every microsecond (``sys.setswitchinterval``) while the threads run, which is what
makes most races show there too, in a fraction of a second of CPU. The tests are marked
``@pytest.mark.threads``: the normal suite runs them on the GIL build, and ``.ci/run`` runs them on
the free-threaded build where it has one (``-m threads``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from tests.harness import UNIT_S

__all__ = ["FREE_THREADED", "SWITCH_S", "hammer", "switching_often"]

FREE_THREADED = not getattr(sys, "_is_gil_enabled", lambda: True)()  # absent before 3.13: the GIL is on
SWITCH_S = 1e-6  # the GIL build's switch interval while the threads run


@contextmanager
def switching_often(interval_s: float = SWITCH_S) -> Iterator[None]:
    """The interpreter switches threads every ``interval_s`` inside, the host's interval restored after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def hammer(bodies: Sequence[Callable[[], object]], *, timeout_s: float = 30 * UNIT_S) -> None:
    """Run each of ``bodies`` on a thread of its own, all released at once (a barrier), switching often;
    wait for them all (``AssertionError`` naming the ones not done after ``timeout_s``, which says a
    thread is stuck: never a measure of speed) and raise the first exception one of them raised."""
    barrier = threading.Barrier(len(bodies))
    failures: list[BaseException] = []

    def run(body: Callable[[], object]) -> None:
        try:
            barrier.wait()
            body()
        except BaseException as exc:  # raised again below, in the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(body,), name=f"race-{i}", daemon=True)
               for i, body in enumerate(bodies)]
    with switching_often():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"threads {stuck} did not finish within {timeout_s}s"
    if failures:
        raise failures[0]
