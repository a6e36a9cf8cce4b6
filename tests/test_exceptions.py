"""What an embedding program gets when something fails (EMBEDDING.md, "Exceptions"), against a
fake IO side (tests/fake_io.py): no thread, no socket.

- ``on_results`` raising: ``process_pending()`` raises it after the batch's replies are handed
  over; ``stop()`` goes on with the orderly stop and raises the first one at the end; ``run()``
  stops in order, then raises it.
- A start that fails once the process was changed (the IO side did not start) gives it back.
- EMBEDDING.md's table names every exception class forkless defines for a caller.
"""

from __future__ import annotations

import re
import sys

import pytest

from controller import errors
from controller.config import ConfigError
from controller.errors import MetricsServerError
from controller.loop import Controller
from tests.fake_io import FakeIO, drain
from tests.harness import ROOT
from tests.test_loop import CONFIG, PROCESSOR, chunk, frames


class HostFailure(Exception):
    """What the host program's callback raised."""


def _failing_on(first_failing_call: int):
    calls: list[list[int]] = []

    def on_results(seq, stream, outputs):
        calls.append(list(seq))
        if len(calls) >= first_failing_call:
            raise HostFailure(f"call {len(calls)}")

    return calls, on_results


def test_process_pending_raises_what_on_results_raised_after_handing_the_batch_s_replies_over():
    _, on_results = _failing_on(1)
    fake = FakeIO()
    with Controller(CONFIG, processor=PROCESSOR, io_factory=fake, on_results=on_results) as ctl:
        fake.inbound.put_nowait(chunk([0], ["a"]))
        with pytest.raises(HostFailure, match="call 1"):
            ctl.process_pending()
        assert [r["seq"] for r in frames(drain(fake.outbound))] == [0]
        ctl.on_results = None  # the stop at the end of the block is not what this test is about


def test_stop_goes_on_past_an_on_results_failure_and_raises_the_first_once_stopped():
    calls, on_results = _failing_on(1)
    fake = FakeIO()
    ctl = Controller(CONFIG, processor=PROCESSOR, io_factory=fake, on_results=on_results)
    ctl.start()
    for i in range(3):
        fake.inbound.put_nowait(chunk([i], ["a"]))
    with pytest.raises(HostFailure, match="call 1"):
        ctl.stop()
    assert calls == [[0], [1], [2]]  # every queued batch processed: the stop went on
    assert [r["seq"] for r in frames(drain(fake.outbound))] == [0, 1, 2]
    assert fake.outbound.is_shutdown and fake.stop_requested
    assert ctl.stats().dropped == {}
    ctl.stop()  # stopped: a second call does nothing


def test_run_stops_in_order_then_raises_what_on_results_raised():
    calls, on_results = _failing_on(1)
    fake = FakeIO()
    ctl = Controller(CONFIG.replace(duration_s=30.0), processor=PROCESSOR, io_factory=fake, on_results=on_results)
    for i in range(3):
        fake.inbound.put_nowait(chunk([i], ["a"]))
    switch = sys.getswitchinterval()
    with pytest.raises(HostFailure, match="call 1"):
        ctl.run()
    assert fake.stop_requested and fake.outbound.is_shutdown  # stopped in order, not left running
    assert calls == [[0], [1], [2]]
    assert [r["seq"] for r in frames(drain(fake.outbound))] == [0, 1, 2]
    assert sys.getswitchinterval() == switch


class NoIO(FakeIO):
    def start(self):
        raise MetricsServerError("cannot serve metrics on FORKLESS_METRICS_ADDR=127.0.0.1:1: Address already in use")


def test_a_start_whose_io_side_fails_gives_the_process_back_and_stop_then_does_nothing():
    switch = sys.getswitchinterval()
    ctl = Controller(CONFIG, processor=PROCESSOR, io_factory=NoIO())
    with pytest.raises(MetricsServerError):
        with ctl:
            pass
    assert sys.getswitchinterval() == switch
    ctl.stop()  # nothing to stop: it does not raise


def test_the_embedding_guide_names_every_exception_a_caller_can_get():
    text = (ROOT / "EMBEDDING.md").read_text()
    section = text[text.index("## Exceptions"):]
    section = section[:section.index("\n## ")]
    named = set(re.findall(r"^\| `(\w+)`", section, re.M))
    expected = {name for name in errors.__all__ if not name.startswith("EXIT")} | {
        ConfigError.__name__, "KeyboardInterrupt", "RuntimeError"}
    assert expected <= named, f"EMBEDDING.md's exception table lacks {sorted(expected - named)}"
