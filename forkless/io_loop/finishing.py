"""The stop's finishing phase: a source that declares what it still awaits keeps handing its replies (fills, acks)
over through the orderly stop, until it awaits nothing or the deadline.

Rules:
- A source may declare ``awaiting()`` (``SupportsAwaiting``): how many replies it still awaits, an ``int`` >= 0,
  asked on the IO loop; or ``send_answered(event)``, and then awaits the answer of each send it wrote (each still
  awaited when the phase ends early is reported, ``SendFailed``).
- Its stop: ``before_stop``, ``ctx.stopping`` (no new work), then ``finish_awaited``: its emits are still taken and
  handed on until every frame the main thread sent it before the stop was handed to it and ``awaiting()`` is 0, or
  the stop's work deadline, or its ``run`` ended. Then its emits raise ``SourceStopped``.
- What it still awaited when the wait ended early is counted in ``awaited_unanswered`` by why and logged once; these
  replies never arrived, so the books do not hold them.
- ``awaiting()`` is asked every ``AWAIT_POLL_S`` (a count may fall without an emit). One that raises or returns
  anything but an ``int`` >= 0 fails the source as a raising ``before_stop`` does (``FeedFatal``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["AWAIT_POLL_S", "DEADLINE_REASON", "ENDED_REASON", "finish_awaited"]

log = logging.getLogger("forkless.source")

AWAIT_POLL_S = 0.01  # how often awaiting() is asked during the phase
DEADLINE_REASON = "stop deadline"
ENDED_REASON = "source ended"


def _count(awaiting: Callable[[], Any]) -> int:
    """What ``awaiting()`` says, checked: an int >= 0 (a numpy integer too; not a bool)."""
    said = awaiting()
    left = said.__index__() if hasattr(said, "__index__") and not isinstance(said, bool) else -1
    if left < 0:
        raise ValueError(f"awaiting() returned {said!r}: it says how many replies the source still awaits, "
                         "an int >= 0")
    return left


def _handed(runner: Any, unrouted: Callable[[], int]) -> bool:
    """True when nothing the main thread sent this source waits on the IO side: its outbox (and,
    with several feeds, the bridge's outbound queue before the router) is empty and no item is
    held. Frames put before the stop began are ahead of any later ones, so once this holds they
    have all been handed to the source (it asked for the next one)."""
    return not unrouted() and not runner.outbox.qsize() and runner.out.held.item is None


async def finish_awaited(runner: Any, awaiting: Callable[[], Any], deadline: float | None,
                         unrouted: Callable[[], int] = lambda: 0) -> str:
    """The finishing phase of ``runner`` (a ``SourceRunner`` whose ``ctx.stopping`` is set, its
    emits still taken); see the module rules. A failing ``awaiting()`` is handed to
    ``runner.fail_in_stop``. Returns why it ended with replies still awaited ("": none was)."""
    name = runner.feed.name
    if deadline is None:
        deadline = time.monotonic() + runner.timeouts.shutdown_timeout_s
    handed = False
    while True:
        handed = handed or _handed(runner, unrouted)
        try:
            left = _count(awaiting)
        except BaseException as exc:  # awaiting() runs no coroutine: nothing it raises is a cancellation of ours
            runner.fail_in_stop(exc, " in awaiting()")
            return ""
        if handed and not left:
            return ""
        remaining = deadline - time.monotonic()
        reason = ENDED_REASON if runner.ended else DEADLINE_REASON if remaining <= 0 else ""
        if reason:
            break
        await asyncio.sleep(min(AWAIT_POLL_S, remaining))
    if left:
        runner.stats.awaited_unanswered[reason] += left
        why = "by the stop's deadline" if reason == DEADLINE_REASON else "before its run ended"
        log.error("source %r: %d replies it awaited had not come %s%s; counted in awaited_unanswered",
                  name, left, why, "" if handed else " (frames sent to it before the stop were not all written)")
    return reason if left else ""
