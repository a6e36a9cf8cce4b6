"""What a ``Controller`` is built from (controller/wiring.py): eight grouped, typed arguments (each old keyword is
tests/controller/test_renamed.py's), each group's misuse refused naming the fix, and the results' one way out
(``sinks``: ``OnResults`` in the main thread, each in order). Against a fake IO side (tests/fake_io.py) and the
sink contexts on a plain asyncio queue: no thread, no socket."""

from __future__ import annotations

import asyncio
import copy
import inspect
import pickle
from typing import Any

import numpy as np
import pytest

import forkless
from forkless import EVENTS_ONLY, Config, ConnectHooks, Controller, OnEvent, OnResults, Runtime
from forkless.io_loop.crossing import Chunk, Events, Results
from tests.controller.test_loop import CONFIG, PROCESSOR, chunk, frames
from tests.fake_io import FakeIO, drain

ARGUMENTS = ["config", "processor", "codec", "sources", "sinks", "on_event", "connect", "runtime"]


def test_the_controller_takes_at_most_8_arguments_each_named():
    parameters = inspect.signature(Controller).parameters
    assert len(parameters) <= 8
    assert list(parameters) == ARGUMENTS
    kinds = {p.kind for p in parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds
    assert [name for name, p in parameters.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] == ["config"]


# each old keyword still works in this release, warning with its new spelling: tests/controller/test_renamed.py (the
# one deprecation policy)


def test_a_keyword_that_never_was_gets_python_s_own_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'sink'"):
        Controller(CONFIG, sink=print)
    with pytest.raises(TypeError, match="positional argument"):
        Controller(CONFIG, PROCESSOR)


@pytest.mark.parametrize(("arguments", "message"), [
    ({"connect": print}, r"Controller\(connect=\.\.\.\) takes forkless\.ConnectHooks\(on_connect=\.\.\., "
                         r"before_connect=\.\.\.\), not <built-in function print>"),
    ({"runtime": {"out": print}}, r"Controller\(runtime=\.\.\.\) takes forkless\.Runtime\("),
    ({"connect": Runtime()}, r"Controller\(connect=\.\.\.\) takes forkless\.ConnectHooks"),
    ({"sinks": OnResults(print)}, r"Controller\(sinks=\.\.\.\) takes a list of sinks \(sinks=\[\.\.\.\]\)"),
    ({"sinks": [print]}, r"wrap it as forkless\.OnResults\(fn\) to call it in the main thread"),
    ({"sinks": [object()]}, r"a sink is an object with a name \(a non-empty str\) and async run\(ctx\): .* "
                            r"\(forkless\.ResultSink"),
    ({"processor": "ewma"}, r"Controller\(processor=\.\.\.\) takes a forkless\.Processor \(init, step\), or "
                            r"forkless\.EVENTS_ONLY to run none, not .ewma."),
    ({"processor": True}, r"takes a forkless\.Processor \(init, step\), or forkless\.EVENTS_ONLY to run none, "
                          r"not True"),
    ({"on_event": 42}, r"Controller\(on_event=\.\.\.\) takes a callable"),
    ({"on_event": OnResults(print)}, r"Controller\(on_event=\.\.\.\) takes fn\(source, event\) or "
                                     r"forkless\.OnEvent"),
])
def test_a_group_given_where_it_does_not_belong_is_refused_naming_the_right_one(arguments, message):
    with pytest.raises(TypeError, match=message):
        Controller(CONFIG, **({"processor": PROCESSOR} | arguments))


@pytest.mark.parametrize(("make", "message"), [
    (lambda: OnResults(None), r"OnResults\(fn\) takes a callable, fn\(seq, stream, outputs\); got None"),
    (lambda: OnEvent("print"), r"OnEvent\(fn\) takes a callable"),
    (lambda: ConnectHooks(on_connect="hook"), r"ConnectHooks\(on_connect=\.\.\.\) takes a callable"),
    (lambda: ConnectHooks(before_connect=1), r"ConnectHooks\(before_connect=\.\.\.\) takes a callable"),
    (lambda: Runtime(freeze_gc="yes"), r"Runtime\(freeze_gc=\.\.\.\) takes True or False, not 'yes'"),
    (lambda: Runtime(notify_systemd=1), r"Runtime\(notify_systemd=\.\.\.\) takes True or False"),
    (lambda: Runtime(out="stdout"), r"Runtime\(out=\.\.\.\) takes a callable, out\(line\)"),
    (lambda: Runtime(io_factory=3), r"Runtime\(io_factory=\.\.\.\) takes a callable"),
])
def test_a_group_refuses_a_wrong_field_where_it_is_written(make, message):
    with pytest.raises(TypeError, match=message):
        make()


def test_the_results_callback_attribute_is_refused_naming_the_sink_not_set_silently():
    ctl = Controller(CONFIG, processor=PROCESSOR, runtime=Runtime(io_factory=FakeIO()))
    for attempt in (lambda: ctl.on_results, lambda: setattr(ctl, "on_results", print)):
        with pytest.raises(AttributeError, match=r"Controller\.on_results is gone: .* "
                                                 r"Controller\(sinks=\[forkless\.OnResults\(f\)\]\)"):
            attempt()


def test_the_groups_are_frozen_values_and_events_only_is_one_value():
    runtime = Runtime(freeze_gc=True)
    with pytest.raises(AttributeError):
        runtime.freeze_gc = False  # type: ignore[misc]
    assert runtime == Runtime(freeze_gc=True) and OnEvent(print) == OnEvent(print, connections=False)
    assert copy.deepcopy(EVENTS_ONLY) is EVENTS_ONLY and pickle.loads(pickle.dumps(EVENTS_ONLY)) is EVENTS_ONLY
    assert type(EVENTS_ONLY)() is EVENTS_ONLY and repr(EVENTS_ONLY) == "forkless.EVENTS_ONLY"


def test_each_on_results_gets_every_batch_in_order_and_the_first_failure_is_raised_after_the_replies():
    first: list[tuple[list, list, list]] = []
    second: list[list] = []
    failing = [True]

    def record(seq: list, stream: list, outputs: dict[str, np.ndarray]) -> None:
        first.append((list(seq), list(stream), sorted(outputs)))
        if failing[0] and seq[0] == 1:
            raise RuntimeError("the first sink failed on seq 1")

    def failing_too(seq: list, stream: list, outputs: dict[str, np.ndarray]) -> None:
        second.append(list(seq))
        if failing[0] and seq[0] == 1:
            raise ValueError("the second sink failed too (logged, not raised)")

    fake = FakeIO()
    with Controller(CONFIG, processor=PROCESSOR, sinks=[OnResults(record), OnResults(failing_too)],
                    runtime=Runtime(io_factory=fake)) as ctl:
        fake.inbound.put_nowait(chunk([0], ["a"]))
        assert ctl.process_pending() == 1
        fake.inbound.put_nowait(chunk([1], ["b"]))
        with pytest.raises(RuntimeError, match="the first sink failed on seq 1"):
            ctl.process_pending()
        assert [r["seq"] for r in frames(drain(fake.outbound))] == [0, 1]  # its replies were put first
        failing[0] = False
        fake.inbound.put_nowait(chunk([2], ["a"]))
        assert ctl.process_pending() == 1
    assert [seq for seq, _, _ in first] == [[0], [1], [2]] and second == [[0], [1], [2]]
    assert first[0] == ([0], ["a"], ["anomaly", "score", "z"])


def test_a_record_context_hands_records_and_a_result_context_results():
    stats = forkless.SinkStats()
    chunk_ = Chunk([7], ["s"], np.ones((1, 2), np.float32), 0, feed=1)
    events = Events(0, ["a fill"], 0)
    results = Results([1], [7], ["s"], {"score": np.array([0.5])})

    async def take(context: type, items: list[Any]) -> list[Any]:
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        ctx = context("mine", queue, ["feed-a", "feed-b"], stats)
        return [await ctx.next_batch() for _ in items]

    records = asyncio.run(take(forkless.RecordContext, [chunk_, events]))
    assert [type(b) for b in records] == [forkless.MessageBatch, forkless.EventBatch]
    assert [b.feed for b in records] == ["feed-b", "feed-a"] and records[1].items == ["a fill"]
    (result,) = asyncio.run(take(forkless.ResultContext, [results]))
    assert isinstance(result, forkless.ResultBatch) and result.items[0][:3] == ("feed-b", 7, "s")
    assert stats.taken == 3 and stats.batches == 3 and stats.held == 3
    assert isinstance(forkless.RecordContext("x", None, [], stats), forkless.SinkContext)
    assert isinstance(forkless.ResultContext("x", None, [], stats), forkless.SinkContext)


def test_sink_run_refuses_an_on_results_naming_a_record_sink():
    with pytest.raises(TypeError, match=r"is not \(forkless\.RecordSink, docs/embedding/sinks\.md\)"):
        forkless.SinkRun(OnResults(print), config=Config(status_s=0.0))
