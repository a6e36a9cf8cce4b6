"""``controller.lifetime.serving.serve``, ``Controller.run()``'s loop, without a controller: what it is
given is called, it ends on a stop request or at the duration, and its status lines come one
an interval, never as a burst after a batch that held it past several. Its clock is the
test's own, moved by the calls it makes, so nothing here depends on how fast the machine is."""

from __future__ import annotations

import threading

from forkless.controller.lifetime.serving import serve
from forkless.controller.stats import StatsSnapshot
from forkless.io_loop.counters import SECONDS_BOUNDS, Histogram


def _snapshot(processed: int, at: float) -> StatsSnapshot:
    seconds = Histogram(SECONDS_BOUNDS).snapshot()
    return StatsSnapshot(
        at=at, messages_in=processed, frames_in=processed, messages_out=processed, errors_out=0,
        processed=processed, batches=processed, errors={}, dropped={}, connects=1, reconnects=0, connect_failures=0,
        connected=True, connection_since=0.0, inbound_depth=0, outbound_depth=0, unsent=0,
        batch_size=Histogram((1,)).snapshot(), latency=seconds, loop_lag=seconds, step_seconds=seconds, compilations=0,
        compilations_after_warmup=None, devices=(), ready=True)


class _Run:
    """What serve() is given. ``process_pending`` counts its calls, moves the clock by
    ``holds[call]`` (0 past the list) and asks the stop at call ``stop_at``; ``stats`` is a
    snapshot of the calls so far; ``lines`` what was printed, with the clock's time."""

    def __init__(self, *, holds: tuple[float, ...] = (), stop_at: int = 0) -> None:
        self.now, self.calls, self.polls, self.lines = 100.0, 0, [], []
        self.holds, self.stop_at = holds, stop_at
        self.stop = threading.Event()

    def clock(self) -> float:
        return self.now

    def process_pending(self, timeout: float) -> int:
        self.now += self.holds[self.calls] if self.calls < len(self.holds) else 0.0
        self.calls += 1
        self.polls.append(timeout)
        if self.calls == self.stop_at:
            self.stop.set()
        return 1

    def stats(self) -> StatsSnapshot:
        return _snapshot(self.calls, self.now)

    def out(self, line: str) -> None:
        self.lines.append((self.now, line))

    def serve(self, *, duration_s: float = 0.0, status_s: float = 0.0, poll_s: float = 0.1):
        return serve(self.process_pending, self.stats, self.out, self.stop, duration_s=duration_s,
                     status_s=status_s, poll_s=poll_s, clock=self.clock)


def test_it_processes_until_the_stop_is_asked_and_returns_the_snapshot_it_began_with() -> None:
    run = _Run(stop_at=5)
    first = run.serve(poll_s=0.25)
    assert run.calls == 5 and first.processed == 0
    assert run.polls == [0.25] * 5 and run.lines == []  # status_s=0: no line


def test_a_stop_asked_before_it_begins_processes_nothing() -> None:
    run = _Run()
    run.stop.set()
    run.serve(status_s=0.01)
    assert run.calls == 0 and run.lines == []


def test_it_ends_once_the_duration_is_over() -> None:
    run = _Run(holds=(0.25,) * 10)
    run.serve(duration_s=1.0)
    assert run.calls == 4 and run.now == 101.0 and not run.stop.is_set()  # at 100, 100.25, 100.5, 100.75


def test_a_line_every_interval_each_over_the_interval_since_the_last() -> None:
    # four calls in the first second, two in the second: each line's rate is over its own second
    run = _Run(holds=(0.25,) * 4 + (0.5,) * 3, stop_at=7)
    run.serve(status_s=1.0)
    assert [at for at, _ in run.lines] == [101.0, 102.0]
    (_, first), (_, second) = run.lines
    assert first.startswith("in 4 msg (4/s) | ") and second.startswith("in 6 msg (2/s) | "), run.lines


def test_a_batch_held_past_several_intervals_gets_one_line_then_one_an_interval_again() -> None:
    # the first call holds it for ten intervals; the next calls are quick: one line at once,
    # then the next an interval later, never the ten lines it fell behind by
    run = _Run(holds=(10.0, 0.0, 0.0, 0.0, 0.0, 0.75, 0.75, 0.0), stop_at=8)
    run.serve(status_s=1.0)
    assert [at for at, _ in run.lines] == [110.0, 111.5]
