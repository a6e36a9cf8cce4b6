"""Every public name renamed since 0.1.0, and the one deprecation policy they follow (docs/embedding/versions.md).

Rules:
- The release that renames a public name keeps the old spelling working: using it warns ``DeprecationWarning``
  naming the new spelling and the release that removes it (``deprecated``). The next minor release removes it:
  the old spelling then raises, naming the new one (``TypeError`` for a keyword, ``AttributeError`` for an
  attribute, ``ImportError`` for an import), for as long as its entry stays here (``removed``).
- Every renamed name is one entry of ``RENAMED``, keyed by its old spelling; CHANGELOG.md lists it under
  "Deprecated" in the release that renamed it and under "Removed" in the one that removes it
  (tests/docs/test_changelog.py holds both).
- Not renames, so not here: a wrong import path (``import controller``, ``import io_loop``: it would load a second
  copy of every module, whose exceptions ``except forkless.ConfigError`` never catches, so it stays an
  ``ImportError``), and a field set from outside (``ctl.on_results = f``: read by nothing once the controller runs).
- In the leaf, so that every part may follow it: the controller's keywords and attributes, the settings groups of
  io_loop and its rooms (io_loop/settings.py's ``settings_group(moved=...)``), and a source's context
  (``SourceContext``'s methods, io_loop/source.py).
- Pure: only ``warnings``; the call sites translate an old spelling into its new one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from forkless import __version__

__all__: list[str] = []  # the policy's machinery; the public names are the new spellings

VERSION = __version__  # the release running (a test sets a later one to see what that release removes)
POLICY = "docs/embedding/versions.md"


@dataclass(frozen=True)
class Renamed:
    old: str  # the old spelling, as a program wrote it
    new: str  # the spelling that replaces it
    deprecated_in: str  # the release that renamed it: the old spelling warns
    removed_in: str  # the next release: the old spelling raises


_ENTRIES = (
    # the Controller's keywords before its arguments were grouped (controller/wiring.py translates them)
    Renamed("Controller(on_results=f)", "Controller(sinks=[forkless.OnResults(f)])", "0.2.0", "0.3.0"),
    Renamed("Controller(events_only=True)", "Controller(processor=forkless.EVENTS_ONLY)", "0.2.0", "0.3.0"),
    Renamed("Controller(on_connect=h)", "Controller(connect=forkless.ConnectHooks(on_connect=h))", "0.2.0", "0.3.0"),
    Renamed("Controller(before_connect=h)", "Controller(connect=forkless.ConnectHooks(before_connect=h))", "0.2.0",
            "0.3.0"),
    Renamed("Controller(on_event=f, connection_events=True)",
            "Controller(on_event=forkless.OnEvent(f, connections=True))", "0.2.0", "0.3.0"),
    Renamed("Controller(out=f)", "Controller(runtime=forkless.Runtime(out=f))", "0.2.0", "0.3.0"),
    Renamed("Controller(freeze_gc=True)", "Controller(runtime=forkless.Runtime(freeze_gc=True))", "0.2.0", "0.3.0"),
    Renamed("Controller(notify_systemd=True)", "Controller(runtime=forkless.Runtime(notify_systemd=True))", "0.2.0",
            "0.3.0"),
    Renamed("Controller(checkpoint_store=s)", "Controller(runtime=forkless.Runtime(checkpoint_store=s))", "0.2.0",
            "0.3.0"),
    Renamed("Controller(io_factory=f)", "Controller(runtime=forkless.Runtime(io_factory=f))", "0.2.0", "0.3.0"),
    # the sink of records (SinkRun's, the relay's), named apart from a sink of results
    Renamed("forkless.Sink", "forkless.RecordSink (a sink of a controller's results: forkless.ResultSink)", "0.2.0",
            "0.3.0"),
    # one way to do each thing on a source's context: frames, a read's frames and a frame decode() read are all
    # emit's; a connection's state is said by connection_opened() and connection_closed() (io_loop/source.py)
    Renamed("ctx.emit_frames(frames)", "ctx.emit(frames)", "0.3.0", "0.4.0"),
    Renamed("ctx.emit_decoded(decoded, ...)", "ctx.emit(decoded, ...)", "0.3.0", "0.4.0"),
    Renamed("ctx.set_connected(flag, reason, code=...)",
            "ctx.connection_opened() when it connects, ctx.connection_closed(reason, code=...) when it ends",
            "0.3.0", "0.4.0"),
    Renamed("ctx.name", "the source's own name", "0.3.0", "0.4.0"),
    # a portal's restarts follow the peer as Relogin's reconnects do, on the same Backoff (io_loop/portal.py)
    Renamed("RestartPolicy(min_s=..., max_s=..., reset_s=...)",
            "RestartPolicy(backoff=forkless.Backoff(min_s=..., max_s=..., reset_s=...))", "0.3.0", "0.4.0"),
    # what a processor carried itself before its Description
    Renamed("Processor(init, step, name=..., ...)", "Processor(init, step, description=Description(name=..., ...))",
            "0.1.0", "0.2.0"),
    Renamed("processor.name", "processor.description.name", "0.1.0", "0.2.0"),
    Renamed("processor._replace(name=...)",
            "processor._replace(description=dataclasses.replace(processor.description, name=...))", "0.1.0", "0.2.0"),
    Renamed("stream_processor(..., name=...)", "stream_processor(..., description=Description(name=...))", "0.1.0",
            "0.2.0"),
    # received messages not yet answered, named apart from steps in flight
    Renamed("StatsSnapshot.in_flight", "StatsSnapshot.unanswered", "0.1.0", "0.2.0"),
    # each setting declared once, in one group: a field that was in two groups is now in the one that reads it
    # (io_loop/settings.py's settings_group(moved=...) translates them, given or read)
    Renamed("Limits(features=...)", "StepSettings(features=...)", "0.3.0", "0.4.0"),
    Renamed("Limits(max_batch=...)", "StepSettings(max_batch=...)", "0.3.0", "0.4.0"),
    Renamed("DemoSettings(features=...)", "StepSettings(features=...)", "0.3.0", "0.4.0"),
    Renamed("DemoSettings(warmup=...)", "DetectorSettings(warmup=...)", "0.3.0", "0.4.0"),
    Renamed("CheckpointSettings(bucket=...)", "PartitionSettings(checkpoint_bucket=...)", "0.3.0", "0.4.0"),
    # Config is its groups: what these built is a group of it now
    Renamed("config.step_settings()", "config.step", "0.3.0", "0.4.0"),
    Renamed("config.checkpoint_settings()", "config.checkpoints (a partitioned feed's bucket: "
            "config.partitioning.checkpoint_bucket)", "0.3.0", "0.4.0"),
    Renamed("config.relay_settings()", "config.relay (the relay's settings) and config.io_settings() (its feeds')",
            "0.3.0", "0.4.0"),
)
RENAMED = {entry.old: entry for entry in _ENTRIES}


def release(version: str) -> tuple[int, ...]:
    """``"0.2.0"`` as ``(0, 2, 0)``, for comparing releases."""
    return tuple(int(part) for part in version.split(".")[:3])


def is_removed(entry: Renamed) -> bool:
    """Whether the release running has removed ``entry``'s old spelling."""
    return release(VERSION) >= release(entry.removed_in)


def _said(entry: Renamed, old: str | None, new: str | None) -> tuple[str, str]:
    return old or entry.old, new or entry.new


def removed(key: str, *, old: str | None = None, new: str | None = None,
            error: Callable[[str], Exception] = TypeError) -> Exception:
    """The exception for an old spelling this release has removed (``raise removed(...)``), naming the new one;
    ``old``, ``new``: the two spellings with the caller's own values, for the entry's general ones."""
    entry = RENAMED[key]
    if not is_removed(entry):
        raise AssertionError(f"{entry.old} is removed only in {entry.removed_in}: call deprecated() until then")
    was, now = _said(entry, old, new)
    return error(f"{was} was removed in forkless {entry.removed_in}: write {now} ({POLICY})")


def deprecated(key: str, *, old: str | None = None, new: str | None = None,
               error: Callable[[str], Exception] = TypeError, stacklevel: int = 2) -> None:
    """Warn that ``key``'s old spelling is deprecated, naming the new one and the release that removes it; once
    that release has come, raise ``error`` instead (``removed``). ``stacklevel``: as ``warnings.warn``'s, counted
    from the caller of this function."""
    entry = RENAMED[key]
    if is_removed(entry):
        raise removed(key, old=old, new=new, error=error)
    was, now = _said(entry, old, new)
    warnings.warn(f"{was} is deprecated since forkless {entry.deprecated_in} and is removed in {entry.removed_in}: "
                  f"write {now} ({POLICY})", DeprecationWarning, stacklevel=stacklevel + 1)
