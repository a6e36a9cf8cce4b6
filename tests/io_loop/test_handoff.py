"""How the threads wait for each other (FORKLESS_HANDOFF, io_loop/waiting.py): what the spinning
hand-off must not change, and how a spinning thread behaves beside the other.

The IO loop here is a real one on its own thread (``LoopThread``) with the bridge's real queues;
the test's thread plays the main thread. Nothing is timed: each wait is bounded generously and
each assertion is on what arrived, in which order, and what the spinning thread did.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from forkless import OnResults
from forkless.controller.config import Config
from forkless.io_loop.bridge import Bridge, MainSide
from forkless.io_loop.crossing import Outgoing
from forkless.io_loop.errors import ConfigError
from forkless.io_loop.loopthread import LoopThread
from forkless.io_loop.waiting import (
    PARK,
    Expecting,
    SpinningSelector,
    WaitSettings,
    cpu_of,
    keep_apart,
    processor_of,
    resolve_handoff,
    wait_settings,
)
from tests.harness import UNIT_S

# the bridge's queues between a real IO loop thread and the test's: run on free-threaded CPython too (.ci/run)
pytestmark = pytest.mark.threads


def test_auto_spins_on_an_accelerator_and_parks_on_the_cpu_and_an_explicit_choice_is_kept() -> None:
    assert [resolve_handoff("auto", p) for p in ("cpu", "tpu", "gpu", "cuda")] == ["park", "spin", "spin", "spin"]
    assert [resolve_handoff(h, "tpu") for h in ("park", "spin")] == ["park", "spin"]
    assert resolve_handoff("spin", "cpu") == "spin"
    with pytest.raises(ValueError, match="'busy' is not one of auto, park, spin"):
        resolve_handoff("busy", "cpu")


def test_without_a_gil_a_spin_is_both_threads_kept_apart_and_auto_still_parks_on_the_cpu() -> None:
    assert wait_settings("spin", "tpu", gil=True) == WaitSettings("spin")  # one spinner under one GIL
    assert wait_settings("spin", "tpu", gil=False) == WaitSettings("spin", both=True, apart=True)
    assert wait_settings("auto", "tpu", gil=False) == WaitSettings("spin", both=True, apart=True)
    assert wait_settings("spin", "cpu", gil=False) == WaitSettings("spin", both=True, apart=True)
    assert wait_settings("auto", "cpu", gil=False) is PARK and wait_settings("auto", "cpu", gil=True) is PARK
    assert wait_settings("park", "tpu", gil=False) is PARK
    assert wait_settings("auto", "tpu").spins  # this interpreter's own GIL, whichever it is


def test_the_cpu_a_thread_last_ran_on_is_read_past_a_name_with_spaces_and_parentheses() -> None:
    tail = " ".join(["S"] + [str(n) for n in range(4, 39)] + ["5"] + ["0"] * 13)  # fields 3.., "processor" = 5
    assert processor_of(b"1234 (a) b (c)) " + tail.encode()) == 5
    assert processor_of(b"1234 (short) S 1 2") is None
    assert cpu_of(threading.get_native_id()) in os.sched_getaffinity(0)


@pytest.mark.threads
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to keep apart")
def test_kept_apart_the_io_thread_runs_off_the_main_threads_core_within_the_cpus_the_host_allows() -> None:
    main = threading.get_native_id()
    allowed = os.sched_getaffinity(0)
    seen: dict[str, Any] = {}

    def io_thread() -> None:
        seen["had"] = keep_apart(main)
        seen["mine"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=io_thread)
    thread.start()
    thread.join()
    assert seen["had"] == allowed
    assert len(allowed - seen["mine"]) == 1  # one CPU left out: the one the main thread ran on then
    assert os.sched_getaffinity(0) == allowed  # the main thread's own is untouched


@pytest.mark.threads
def test_where_the_host_allows_the_thread_one_cpu_keep_apart_changes_nothing() -> None:
    main = threading.get_native_id()
    seen: dict[str, Any] = {}

    def pinned_by_the_host() -> None:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})  # this thread's own: the host's choice, which wins
        seen["had"] = keep_apart(main)
        seen["mine"] = os.sched_getaffinity(0)
        seen["cpu"] = cpu

    thread = threading.Thread(target=pinned_by_the_host)
    thread.start()
    thread.join()
    assert seen["had"] is None and seen["mine"] == {seen["cpu"]}


def test_forkless_handoff_takes_auto_park_or_spin_and_names_the_choices_otherwise() -> None:
    assert Config.from_env({}).handoff == "auto"
    assert Config.from_env({"FORKLESS_HANDOFF": " Spin "}).handoff == "spin"
    with pytest.raises(ConfigError, match=r"FORKLESS_HANDOFF.*auto, park or spin"):
        Config.from_env({"FORKLESS_HANDOFF": "yield"})


class SpinningIO:
    """A loop thread on the spinning selector with a bridge, and a reader of its outbound queue
    that records what it takes (in order), as the feeds' writers do."""

    def __init__(self, nap_s: float = 20e-6) -> None:
        self.selector = SpinningSelector(nap_s)
        self.expecting = Expecting()
        self.taken: list[Any] = []
        self.woken = 0  # how many times the main side woke the loop through its self-pipe
        self._side: MainSide | None = None
        self._made = threading.Event()
        self.runner = LoopThread("test-spinning-io", cleanup_s=1.0,
                                 loop_factory=lambda: asyncio.SelectorEventLoop(self.selector))

    async def _main(self) -> None:
        bridge = Bridge(16, self.expecting)
        self.selector.attach(self.expecting, bridge.outbound.poll)
        self._side = bridge.main_side()
        self.runner.ready()
        outbound = bridge.outbound
        while True:
            item = await outbound.get()
            self.taken.append(item.frames[0])

    def __enter__(self) -> SpinningIO:
        assert self.runner.start(self._main, timeout=10 * UNIT_S)
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner.cancel()
        self.runner.join(10 * UNIT_S)

    @property
    def side(self) -> MainSide:
        assert self._side is not None
        return self._side

    def count_wakes(self) -> None:
        """Count the main side's wake-ups of the loop (its self-pipe) from now on."""
        loop = self.runner.loop
        assert loop is not None
        call = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.woken += 1
            return call(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]


def until(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s * UNIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s * UNIT_S:.0f}s: {what}"
        time.sleep(0.001)


def item(text: str) -> Outgoing:
    return Outgoing([text], answers=False, feed=0, sent=True)


@pytest.fixture
def io() -> Iterator[SpinningIO]:
    with SpinningIO() as spinning:
        yield spinning


def test_while_a_step_is_in_flight_the_loop_spins_and_takes_a_put_without_being_woken(io: SpinningIO) -> None:
    io.count_wakes()
    io.side.expect(1)  # a step begins: the loop is woken once, and spins from then on
    until(lambda: io.expecting.spinning and io.selector.naps > 10, "the loop spinning")
    woken = io.woken
    io.side.outbound.put(item("a"))
    until(lambda: io.taken == ["a"], "the reply taken")
    assert io.woken == woken  # the put did not wake the loop: the spinning selector saw it
    io.side.expect(0)
    until(lambda: not io.expecting.spinning, "the loop parking")
    naps = io.selector.naps
    time.sleep(0.05)
    assert io.selector.naps == naps  # with no step in flight it parks: no nap, no look
    io.side.outbound.put(item("b"))  # a parked loop is woken by the put, as before
    until(lambda: io.taken == ["a", "b"], "the second reply taken")
    assert io.woken == woken + 1


def test_no_reply_is_lost_or_reordered_however_the_puts_and_the_spin_s_end_interleave(io: SpinningIO) -> None:
    # a step begins, its reply is put, it ends; over and over, the loop starting and stopping its
    # spin as it goes: a put made just as the spin ends must still wake the loop or be seen by it
    expected = []
    for i in range(400):
        io.side.expect(1)
        if i % 3 == 0:
            time.sleep(0.0002)
        text = f"r{i}"
        io.side.outbound.put(item(text))
        expected.append(text)
        io.side.expect(0)
        if i % 7 == 0:
            n = len(expected)
            until(lambda: len(io.taken) == n, f"reply {i}")  # noqa: B023 (used at once, inside the loop)
    until(lambda: len(io.taken) == len(expected), "every reply taken")
    assert io.taken == expected


def test_a_reply_put_just_before_the_main_thread_holds_the_gil_is_taken_once_it_lets_go(io: SpinningIO) -> None:
    io.count_wakes()
    io.side.expect(1)
    until(lambda: io.expecting.spinning and io.selector.naps > 10, "the loop spinning")
    woken = io.woken
    # one long C call right after a put that did not wake the loop (it spins): a sort of small ints
    # compares in C, no bytecode runs. Once the main thread lets the GIL go, the spinning loop's next
    # look takes the reply without being woken. (How many looks the spinner took meanwhile is CPython's
    # business, not this test's: under a loaded suite it was seen to take some, 1 run in 3.)
    numbers = random.Random(53).sample(range(1 << 29), 2_000_000)
    io.side.outbound.put(item("a"))
    numbers.sort()
    until(lambda: io.taken == ["a"], "the reply taken")
    assert io.woken == woken
    io.side.expect(0)


def test_a_spin_with_nothing_to_take_sleeps_between_looks_instead_of_burning_a_core(io: SpinningIO) -> None:
    # between two looks at the sockets and at outbound a spinner naps with the GIL released: the
    # thread sleeps, which the kernel counts as a voluntary context switch of that thread. A bare
    # loop of looks (a look at the sockets with a zero timeout does not sleep) would count none.
    async def switches() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw  # the IO thread's own

    def io_switches() -> int:
        return io.runner.submit(switches()).result(10 * UNIT_S)

    io.side.expect(1)
    until(lambda: io.selector.naps > 10, "the loop spinning")
    naps, slept = io.selector.naps, io_switches()
    time.sleep(0.3)
    naps, slept = io.selector.naps - naps, io_switches() - slept
    io.side.expect(0)
    assert naps > 0
    assert slept >= naps // 2, f"{naps} naps but the thread slept only {slept} times"


def test_the_park_default_makes_no_spinning_selector_and_tells_the_io_side_nothing() -> None:
    assert not PARK.spins and PARK.handoff == "park"
    assert WaitSettings("spin").spins
    side = MainSide(inbound=None, outbound=None)  # type: ignore[arg-type]
    side.expect(3)  # a parking side: steps in flight are nobody's business


def _cpus_allowed(native_id: int) -> set[int]:
    """A thread's CPUs, as the kernel has them (/proc's Cpus_allowed_list: "0-3,6")."""
    with open(f"/proc/self/task/{native_id}/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("Cpus_allowed_list:"))
    cpus: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


@pytest.mark.threads
def test_with_both_threads_spinning_kept_apart_the_demo_feed_is_answered_whole_and_the_host_left_as_it_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the strategy a free-threaded build resolves to, taken here whatever this interpreter's GIL: correct
    # under the GIL too (only slower), and on a free-threaded build the same as FORKLESS_HANDOFF=auto
    from forkless.controller import loop

    monkeypatch.setattr(loop, "wait_settings", lambda setting, platform: WaitSettings("spin", both=True, apart=True))
    io_cpus: list[set[int]] = []

    def on_results(seq: Any, stream: Any, outputs: Any) -> None:
        if not io_cpus:
            (io,) = [t for t in threading.enumerate() if t.name == "forkless-io"]
            io_cpus.append(_cpus_allowed(io.native_id or 0))

    before = os.sched_getaffinity(0)
    ctl = loop.Controller(Config(duration_s=2.0, status_s=0.0), sinks=[OnResults(on_results)])
    ctl.run()
    (line,) = ctl.summaries()  # "demo feed: 400 sent, 400 answered, 0 errors; …"
    sent, answered, errors = map(int, re.match(r"demo feed: (\d+) sent, (\d+) answered, (\d+) errors", line).groups())
    assert sent > 100 and answered == sent and errors == 0, line
    assert os.sched_getaffinity(0) == before  # the main thread's, as the host had it
    if len(before) >= 2:
        assert len(before - io_cpus[0]) == 1  # the IO thread kept off one CPU: the main thread's
