"""Steps in flight: the batches whose steps were dispatched and whose results are not yet handed over.

Rules:
- Main thread only; no threads, no clock of its own. ``begin`` dispatches a batch's step (``BatchStep.begin``)
  and keeps it; ``finish_oldest`` hands the oldest one's results over (``BatchStep.end``). Batches end in the
  order begun, so replies and ``on_results`` keep arrival order.
- At most ``depth`` (``FORKLESS_STEPS_IN_FLIGHT``) in flight: at ``depth`` the oldest is finished before another
  is dispatched (``full``); ``depth`` 1 is one batch at a time.
- What waits for what is the intake's (controller/queues.py): no finished step is held back for input.
- Whatever reads the state or the positions as a whole settles every step in flight first (``settle``): a
  checkpoint holds finished steps only.
- The stop settles them; a lost lease discards them (``discard``), their messages counted as dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from forkless.controller.batching import Taken

if TYPE_CHECKING:  # the step imports JAX (the engine); the queues that hold this FIFO must not (the relay's)
    from forkless.controller.batchstep import BatchStep, Begun

__all__ = ["StepsInFlight"]


class StepsInFlight:
    """The FIFO of begun batches between ``BatchStep.begin`` and ``BatchStep.end`` (module rules)."""

    def __init__(self, step: BatchStep, depth: int, expect: Callable[[int], None] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"steps in flight: depth must be at least 1, got {depth}")
        self.step = step
        self.depth = depth
        # told how many steps are in flight after each begin and end: a spinning IO loop looks at
        # outbound while any is (io_loop/waiting.py); None: nobody to tell
        self._expect = expect
        self._begun: deque[Begun] = deque()
        self.most = 0  # the most steps that were in flight at once

    def __len__(self) -> int:
        return len(self._begun)

    @property
    def messages(self) -> int:
        """Messages in the batches in flight."""
        return sum(len(begun) for begun in self._begun)

    @property
    def full(self) -> bool:
        """``depth`` steps are in flight: the oldest must be finished before another begins."""
        return len(self._begun) >= self.depth

    def __call__(self, taken: Taken, deadline: float | None = None) -> None:
        """Begin ``taken``'s step; then finish the oldest while ``depth`` steps are in flight
        (with ``depth`` 1: this one, at once) or it is done already (a step XLA:CPU ran inline,
        in its dispatch: handed over at once, as one at a time would)."""
        self._begun.append(self.step.begin(taken))
        self.most = max(self.most, len(self._begun))
        if self._expect is not None:
            self._expect(len(self._begun))
        while self._begun and (self.full or self.oldest_ready()):
            self.finish_oldest(deadline)

    def oldest_ready(self) -> bool:
        """The oldest step in flight is done: finishing it would not wait for the device."""
        return bool(self._begun) and self.step.ready(self._begun[0])

    def finish_oldest(self, deadline: float | None = None) -> int:
        """Hand the oldest batch's results over (waiting for its step); how many messages it held.
        Raises what ``on_results`` raised, once its replies are put."""
        begun = self._begun.popleft()
        try:
            self.step.end(begun, deadline)
        finally:  # after its replies were put: the IO loop spins until it has them
            if self._expect is not None:
                self._expect(len(self._begun))
        return len(begun)

    def settle(self, deadline: float | None = None) -> None:
        """Finish every step in flight, oldest first. What ``on_results`` raised is raised at once
        (its batch's replies put; the later ones stay in flight)."""
        while self._begun:
            self.finish_oldest(deadline)

    def settle_all(self, deadline: float | None = None) -> Exception | None:
        """Finish every step in flight, going on past failures (the stop); the first one."""
        raised: Exception | None = None
        while self._begun:
            try:
                self.finish_oldest(deadline)
            except Exception as exc:
                raised = raised or exc
        return raised

    def discard(self) -> int:
        """Forget the steps in flight unanswered (a lost lease: nothing more is published); how
        many messages they held."""
        held = self.messages
        self._begun.clear()
        self.step.engine.abandon()
        if self._expect is not None:
            self._expect(0)
        return held
