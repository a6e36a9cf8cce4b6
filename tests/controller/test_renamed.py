"""The one deprecation policy (docs/embedding/versions.md, io_loop/renamed.py): a renamed public name keeps
working for one release, warning ``DeprecationWarning`` with its new spelling; the next release removes it, and
it then raises naming the new spelling. Every entry of ``RENAMED`` is used here, at this release and (the ones
still deprecated) at the release that removes them; tests/docs/test_changelog.py holds the CHANGELOG to them."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp
import pytest

import forkless
from forkless import (
    EVENTS_ONLY,
    ConnectHooks,
    Controller,
    Description,
    OnEvent,
    OnResults,
    Processor,
    Runtime,
    stream_processor,
)
from forkless.controller.wiring import grouped_keywords
from forkless.io_loop import renamed
from forkless.io_loop.renamed import RENAMED, is_removed, release
from forkless.io_loop.settings import moved_fields
from tests.controller.test_loop import CONFIG, PROCESSOR, chunk, frames
from tests.controller.test_stats import snapshot
from tests.fake_io import FakeIO, drain
from tests.io_loop.test_source_emit import USES as SOURCE_CONTEXT_USES  # a source's context's, used there


def _hook(*args: Any) -> None:
    """A callable the old keywords are given."""


STORE = object()
# each old keyword of the Controller, a value it took, and the arguments that say the same now
KEYWORDS = {
    "Controller(on_results=f)": ({"on_results": _hook}, {"sinks": [OnResults(_hook)]}),
    "Controller(events_only=True)": ({"events_only": True}, {"processor": EVENTS_ONLY}),
    "Controller(on_connect=h)": ({"on_connect": _hook}, {"connect": ConnectHooks(on_connect=_hook)}),
    "Controller(before_connect=h)": ({"before_connect": _hook}, {"connect": ConnectHooks(before_connect=_hook)}),
    "Controller(on_event=f, connection_events=True)": ({"on_event": _hook, "connection_events": True},
                                                       {"on_event": OnEvent(_hook, connections=True)}),
    "Controller(out=f)": ({"out": _hook}, {"runtime": Runtime(out=_hook)}),
    "Controller(freeze_gc=True)": ({"freeze_gc": True}, {"runtime": Runtime(freeze_gc=True)}),
    "Controller(notify_systemd=True)": ({"notify_systemd": True}, {"runtime": Runtime(notify_systemd=True)}),
    "Controller(checkpoint_store=s)": ({"checkpoint_store": STORE}, {"runtime": Runtime(checkpoint_store=STORE)}),
    "Controller(io_factory=f)": ({"io_factory": _hook}, {"runtime": Runtime(io_factory=_hook)}),
}


def _init(shape: Any) -> Any:
    return jnp.zeros(shape.max_streams + 1)


def _step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    return state, {"y": batch.x[:, 0]}


MADE = Processor(_init, _step, description=Description(name="spikes"))
# each old spelling removed from this release: its use, the error it raises and the new spelling that error names
REMOVED_USES = {
    "Processor(init, step, name=..., ...)": (lambda: Processor(_init, _step, name="spikes", version="2"), TypeError,
                                             "Processor(init, step, description=Description(name='spikes', "
                                             "version='2'))"),
    "processor.name": (lambda: MADE.name, AttributeError, "processor.description.name"),
    "processor._replace(name=...)": (lambda: MADE._replace(restore_shared=True), TypeError,
                                     "processor._replace(description=dataclasses.replace(processor.description, "
                                     "restore_shared=True))"),
    "stream_processor(..., name=...)": (lambda: stream_processor(lambda p, row, x: (row, {}),
                                                                 init_row=lambda shape: jnp.zeros(()), name="toy"),
                                        TypeError, "stream_processor(..., description=Description(name='toy'))"),
    "StatsSnapshot.in_flight": (lambda: snapshot(1.0, 20, 12).in_flight, AttributeError, "StatsSnapshot.unanswered"),
}


# each setting that moved to another group (io_loop/settings.py's settings_group(moved=...)), given the old way: the
# group and the keyword it was, and a value; and what built a group of the Config
MOVED_SETTINGS = {
    "Limits(features=...)": (forkless.Limits, "features", 4),
    "Limits(max_batch=...)": (forkless.Limits, "max_batch", 16),
    "DemoSettings(features=...)": (forkless.DemoSettings, "features", 4),
    "DemoSettings(warmup=...)": (forkless.DemoSettings, "warmup", 3),
    "CheckpointSettings(bucket=...)": (forkless.CheckpointSettings, "bucket", "ckpt"),
}
RESTART_DELAYS = "RestartPolicy(min_s=..., max_s=..., reset_s=...)"  # tests/io_loop/test_portal.py warns it
CONFIG_METHODS = {"config.step_settings()": "step_settings", "config.checkpoint_settings()": "checkpoint_settings",
                  "config.relay_settings()": "relay_settings"}


def test_each_renamed_name_is_used_here():
    assert set(RENAMED) == {*KEYWORDS, "forkless.Sink", *REMOVED_USES, *MOVED_SETTINGS, *CONFIG_METHODS,
                            *SOURCE_CONTEXT_USES, RESTART_DELAYS}


def test_a_renamed_name_warns_for_exactly_one_release():
    for entry in RENAMED.values():
        deprecated, removed = release(entry.deprecated_in), release(entry.removed_in)
        assert removed == (deprecated[0], deprecated[1] + 1, 0), entry  # the next minor release (before 1.0)


# ---- deprecated in this release: it warns, naming the new spelling, and works as the new spelling ----------------


@pytest.mark.parametrize("old", list(KEYWORDS))
def test_an_old_controller_keyword_warns_naming_its_new_spelling_and_becomes_it(old):
    given, now = KEYWORDS[old]
    assert not is_removed(RENAMED[old])
    with pytest.warns(DeprecationWarning, match=re.escape(f"write {RENAMED[old].new}")):
        assert grouped_keywords(given) == now


def test_the_old_keywords_still_build_a_controller_that_works():
    got: list[list[Any]] = []
    lines: list[str] = []
    fake = FakeIO()
    with pytest.warns(DeprecationWarning) as warned:
        ctl = Controller(CONFIG, processor=PROCESSOR, on_results=lambda seq, stream, outputs: got.append(list(seq)),
                         io_factory=fake, out=lines.append)
    assert [str(w.message).split(" is deprecated")[0] for w in warned] == [
        "Controller(on_results=f)", "Controller(out=f)", "Controller(io_factory=f)"]
    assert {w.filename for w in warned} == {__file__}  # each warning points at the program's own line
    with ctl:
        fake.inbound.put_nowait(chunk([0, 1], ["a", "b"]))
        assert ctl.process_pending() == 2
        assert [r["seq"] for r in frames(drain(fake.outbound))] == [0, 1]
    assert got == [[0, 1]]


def test_an_old_keyword_beside_the_group_that_replaced_it_is_refused_naming_both():
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match=re.escape(
            "Controller(out=...) and Controller(runtime=...) both given: put out in forkless.Runtime(...)")):
        grouped_keywords({"out": print, "runtime": Runtime(freeze_gc=True)})


@pytest.mark.parametrize("old", list(MOVED_SETTINGS))
def test_a_moved_setting_warns_naming_its_group_and_reaches_it(old):
    group, field, value = MOVED_SETTINGS[old]
    entry = RENAMED[old]
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is deprecated since forkless {entry.deprecated_in} "
                                                          f"and is removed in {entry.removed_in}: write {entry.new}")):
        given = group(**{field: value})
    keyword = RENAMED[old].new.partition("(")[2].partition("=")[0]
    assert moved_fields(given) == {keyword: value}  # what a Config takes from it, where it lives now


@pytest.mark.parametrize("old", list(CONFIG_METHODS))
def test_what_built_a_group_of_the_config_warns_and_gives_the_group(old):
    config = forkless.Config(relay_nats="nats://127.0.0.1:4222", relay_subject="md")
    with pytest.warns(DeprecationWarning, match=re.escape(f"write {RENAMED[old].new}")):
        got = getattr(config, CONFIG_METHODS[old])()
    if old == "config.relay_settings()":
        assert got[1] == config.relay and got[0].feed_specs  # the relay's IO side: its feeds never sent a reply
        assert [spec.replies for spec in got[0].feed_specs] == ["none"] * len(config.io_settings().feed_specs)
    else:
        assert got is {"config.step_settings()": config.step, "config.checkpoint_settings()": config.checkpoints}[old]


def test_the_old_sink_name_warns_and_is_the_record_sink():
    with pytest.warns(DeprecationWarning, match=re.escape("write forkless.RecordSink")):
        from forkless import Sink
    assert Sink is forkless.RecordSink


# ---- removed in this release: it raises, naming the new spelling ---------------------------------------------------


@pytest.mark.parametrize("old", list(REMOVED_USES))
def test_an_old_spelling_this_release_removed_raises_naming_the_new_one(old):
    use, error, new = REMOVED_USES[old]
    assert is_removed(RENAMED[old])
    with pytest.raises(error, match=re.escape(f"was removed in forkless {RENAMED[old].removed_in}: write {new}")):
        use()


def test_a_field_that_never_was_is_python_s_own_error_not_a_removed_name():
    with pytest.raises(AttributeError, match="'Processor' object has no attribute 'nmae'"):
        MADE.nmae  # noqa: B018
    with pytest.raises(TypeError, match="unexpected keyword 'nmae'"):
        Processor(_init, _step, nmae="x")
    with pytest.raises(TypeError, match="unexpected keyword argument 'sink'"):
        Controller(CONFIG, sink=print)
    assert MADE._replace(description=Description(name="x")).description.name == "x"
    assert dataclasses.replace(MADE.description, version="2").version == "2"


# ---- at the release that removes them, the deprecated ones raise too -------------------------------------------------


def test_at_the_next_release_every_deprecated_spelling_raises_naming_the_new_one(monkeypatch):
    monkeypatch.setattr(renamed, "VERSION", "0.3.0")
    for old, (given, _) in KEYWORDS.items():
        with pytest.raises(TypeError, match=re.escape(f"{old} was removed in forkless 0.3.0: write "
                                                      f"{RENAMED[old].new}")):
            grouped_keywords(given)
    with pytest.raises(ImportError, match=re.escape("forkless.Sink was removed in forkless 0.3.0: write "
                                                    "forkless.RecordSink")):
        from forkless import Sink  # noqa: F401


def test_at_the_release_after_next_a_moved_setting_and_the_config_s_old_builders_raise(monkeypatch):
    monkeypatch.setattr(renamed, "VERSION", "0.4.0")
    for old, (group, field, value) in MOVED_SETTINGS.items():
        with pytest.raises(TypeError, match=re.escape(f"{old} was removed in forkless 0.4.0: write "
                                                      f"{RENAMED[old].new}")):
            group(**{field: value})
    config = forkless.Config()
    with pytest.raises(AttributeError, match=re.escape("Limits.features was removed in forkless 0.4.0: write "
                                                       "StepSettings.features")):
        config.limits.features  # noqa: B018
    for old, method in CONFIG_METHODS.items():
        with pytest.raises(AttributeError, match=re.escape(f"{old} was removed in forkless 0.4.0")):
            getattr(config, method)()
    with pytest.raises(TypeError, match=re.escape("RestartPolicy(min_s=0.2) was removed in forkless 0.4.0: write "
                                                  "RestartPolicy(backoff=forkless.Backoff(min_s=0.2))")):
        forkless.RestartPolicy(min_s=0.2)
