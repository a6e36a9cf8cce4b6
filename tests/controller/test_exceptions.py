"""What an embedding program gets when something fails (docs/embedding/exceptions.md), against a
fake IO side (tests/fake_io.py): no thread, no socket.

- ``OnResults`` raising: ``process_pending()`` raises it after the batch's replies are handed
  over; ``stop()`` goes on with the orderly stop and raises the first one at the end; ``run()``
  stops in order, then raises it.
- A start that fails once the process was changed (the IO side did not start) gives it back.
- docs/embedding/exceptions.md's table names every exception class the controller exports, each by
  one path (`forkless.X`).
- The program (``forkless.controller.commands.cli.main``) ends a run with each ending class's ``exit_status`` and the
  line it always printed (``forkless: <label>: <message>``; a crash's traceback after it); 130 for a second Ctrl-C.
"""

from __future__ import annotations

import re
import sys

import pytest

import forkless
from forkless import OnResults, Runtime
from forkless.controller.loop import Controller
from forkless.io_loop.errors import MetricsServerError
from tests.controller.test_loop import CONFIG, PROCESSOR, chunk, frames
from tests.fake_io import FakeIO, drain
from tests.harness import ROOT


class HostFailure(Exception):
    """What the host program's callback raised."""


def _failing_on(first_failing_call: int, calling: list[bool] | None = None):
    """What the callback was called with, and the callback: it raises from its ``first_failing_call``-th call on,
    while ``calling`` (if given) holds True; set it False to make the callback do nothing."""
    calls: list[list[int]] = []

    def on_results(seq, stream, outputs):
        if calling is not None and not calling[0]:
            return
        calls.append(list(seq))
        if len(calls) >= first_failing_call:
            raise HostFailure(f"call {len(calls)}")

    return calls, on_results


def test_process_pending_raises_what_on_results_raised_after_handing_the_batch_s_replies_over():
    calling = [True]
    _, on_results = _failing_on(1, calling)
    fake = FakeIO()
    with Controller(CONFIG, processor=PROCESSOR, sinks=[OnResults(on_results)],
                    runtime=Runtime(io_factory=fake)) as ctl:
        fake.inbound.put_nowait(chunk([0], ["a"]))
        with pytest.raises(HostFailure, match="call 1"):
            ctl.process_pending()
        assert [r["seq"] for r in frames(drain(fake.outbound))] == [0]
        calling[0] = False  # the stop at the end of the block is not what this test is about


def test_stop_goes_on_past_an_on_results_failure_and_raises_the_first_once_stopped():
    calls, on_results = _failing_on(1)
    fake = FakeIO()
    ctl = Controller(CONFIG, processor=PROCESSOR, sinks=[OnResults(on_results)], runtime=Runtime(io_factory=fake))
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
    ctl = Controller(CONFIG.replace(duration_s=30.0), processor=PROCESSOR, sinks=[OnResults(on_results)],
                     runtime=Runtime(io_factory=fake))
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
    ctl = Controller(CONFIG, processor=PROCESSOR, runtime=Runtime(io_factory=NoIO()))
    with pytest.raises(MetricsServerError):
        with ctl:
            pass
    assert sys.getswitchinterval() == switch
    ctl.stop()  # nothing to stop: it does not raise


def test_the_embedding_guide_names_every_exception_a_caller_can_get():
    text = (ROOT / "docs" / "embedding" / "exceptions.md").read_text()
    section = text[text.index("## Exceptions"):]
    section = section.split("\n## ")[0]
    named = set(re.findall(r"^\| `(\w+)`", section, re.M))
    exported = {name for name in forkless.__all__
                if isinstance(getattr(forkless, name), type) and issubclass(getattr(forkless, name), BaseException)}
    expected = exported - {"ForklessError"} | {"KeyboardInterrupt", "RuntimeError"}  # the root: in the intro
    assert expected <= named, f"docs/embedding/exceptions.md's exception table lacks {sorted(expected - named)}"
    assert "`except forkless.ForklessError`" in section


# ---- the program: every ForklessError by its class's attributes, the lines as they always were ----

CAUSE = OSError("the socket went away")
ENDINGS = [
    (forkless.FeedFatal("every feed has given up"), 3, "forkless: feed error: every feed has given up"),
    (forkless.LeaseLost("lease of p0 lost"), 3, "forkless: feed error: lease of p0 lost"),
    (forkless.LeaseHeld(["p0"], "host-b"), 2,
     "forkless: partitions held by another instance: the leases of p0 are held by 'host-b', which is alive"),
    (forkless.ConfigError("FORKLESS_DEVICES", "9", "at most 1"), 2,
     "forkless: configuration error: FORKLESS_DEVICES='9' is invalid: expected at most 1"),
    (forkless.MetricsServerError("cannot serve metrics"), 2, "forkless: configuration error: cannot serve metrics"),
    (forkless.ProcessorContractError("bad step"), 2, "forkless: processor error: bad step"),
    (forkless.CheckpointMismatch("/ck/1", "features", 4, 3), 2,
     "forkless: checkpoint error: checkpoint /ck/1 does not fit this run: features: 4 in the checkpoint, 3 now; "
     "run with the settings it was written with, or start empty with FORKLESS_CHECKPOINT_RESTORE=never or another "
     "FORKLESS_CHECKPOINT_DIR"),
    (forkless.PositionLost("stream gone"), 2, "forkless: checkpoint error: stream gone"),
    (forkless.IOThreadError("the IO thread died: OSError()"), 1, "forkless: the IO thread died: OSError()"),
    (KeyboardInterrupt(), 130, "forkless: second interrupt: exiting now"),
]


@pytest.mark.parametrize(("raised", "status", "first_line"), ENDINGS, ids=lambda v: type(v).__name__)
def test_the_program_ends_a_run_with_the_class_s_exit_status_and_its_line(monkeypatch, capsys, raised, status,
                                                                          first_line):
    from forkless.controller import loop
    from forkless.controller.commands import cli

    class Ending:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def run(self) -> None:
            if isinstance(raised, forkless.IOThreadError):
                try:
                    raise CAUSE
                except OSError as cause:
                    raise raised from cause
            raise raised

    monkeypatch.setattr(cli, "load_config", lambda: CONFIG)
    monkeypatch.setattr(cli, "setup_logging", lambda *args: None)
    monkeypatch.setattr(loop, "Controller", Ending)
    assert cli.main([]) == status
    err = capsys.readouterr().err
    assert err.startswith(first_line), err
    if isinstance(raised, forkless.ForklessError):
        assert raised.exit_status == status
    if status == 1:  # a crash: the traceback of its cause follows the line
        assert "Traceback" in err and "OSError: the socket went away" in err
    else:
        assert err == first_line + "\n"


def test_a_bad_variable_ends_the_program_with_2_and_one_line(monkeypatch, capsys):
    from forkless.controller.commands import cli

    monkeypatch.setenv("FORKLESS_ALPHA", "2")
    assert cli.main([]) == 2
    assert capsys.readouterr().err == "forkless: configuration error: FORKLESS_ALPHA='2' is invalid: " \
                                      "expected a number in (0, 1]\n"
