"""The public API, pinned, and one root for its exceptions.

- ``controller.__all__`` is the user API and ``io_loop.__all__`` the IO side's public part:
  both are pinned here exactly (a name added or dropped is a decision, made here), and every
  name resolves.
- Every exception class defined in controller/ and io_loop/ (found by importing each module
  and walking its classes; an ast walk checks none is hidden in a function) derives from
  ``ForklessError`` unless ``INTERNAL`` names it with the reason it never reaches a caller;
  ``except controller.ForklessError`` catches each of them.
- The classes that end a run for a reason of their own (``exit_status`` not a crash's, or a
  label, or a line for the README's table) are exactly ``controller.errors.ENDS_A_RUN``.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import queue
from pathlib import Path

import forkless.controller as controller
import forkless.io_loop as io_loop
import janus
import pytest
from forkless.controller.errors import ENDS_A_RUN, EXIT_CRASH, EXIT_STATUSES, ForklessError
from forkless.io_loop.portal import Empty, Full, PortalClosed

ROOT = Path(__file__).resolve().parents[1]

CONTROLLER_ALL = [
    "Batch",
    "CheckpointMismatch",
    "Codec",
    "Config",
    "ConfigError",
    "Controller",
    "Decoded",
    "DeploymentMismatch",
    "EWMAState",
    "FeedFatal",
    "ForklessError",
    "Handshake",
    "IOPortal",
    "IOThreadError",
    "JsonCodec",
    "LeaseHeld",
    "LeaseLost",
    "MetricsServerError",
    "PortalClosed",
    "PositionLost",
    "Processor",
    "ProcessorContractError",
    "Relogin",
    "ReplyBatch",
    "SendFailed",
    "Source",
    "SourceContext",
    "SourceStopped",
    "StatsSnapshot",
    "StoreError",
    "WorkerFailed",
    "default_processor",
    "ewma_processor",
    "setup_logging",
    "stream_processor",
]

IO_LOOP_ALL = [
    "DeploymentMismatch",
    "FeedFatal",
    "ForklessError",
    "Handshake",
    "IOPortal",
    "IOThreadError",
    "LeaseHeld",
    "LeaseLost",
    "MetricsServerError",
    "PortalClosed",
    "PositionLost",
    "ReplyBatch",
    "Source",
    "SourceContext",
    "SourceStopped",
    "StoreError",
    "WorkerFailed",
]

# exceptions that never reach a caller, and why; every other one derives from ForklessError
INTERNAL = {
    "forkless.controller.check._Failure":
        "--check's record of a failed step: run_check turns it into its exit status",
    "forkless.controller.snapshot.CheckpointAbandoned":
        "a checkpoint copy the state outran: the checkpointer drops it and counts the failure",
    "forkless.controller.ckptformat.CheckpointDamaged":
        "a truncated or corrupt checkpoint file: the restore logs it and takes an older one",
    "forkless.controller.values.ValueProblem":
        "a value's parser's complaint: Config.from_env raises ConfigError naming the variable instead",
    "forkless.controller.engine.StepFailed":
        "a step that failed while running: the loop answers the batch 'processing failed' and counts it",
    "forkless.io_loop.connect.ConnectFailed":
        "one failed connection attempt: the client tries again, then gives up with FeedFatal",
    "forkless.io_loop.connect.HandshakeRefused":
        "one refused handshake: tried again, or (a 4xx) given up with FeedFatal",
    "forkless.io_loop.connect._RedirectRefused":
        "a 3xx answer inside open_feed, which raises HandshakeRefused for it",
    "forkless.io_loop.natsconn.NatsConnectFailed":
        "one failed attempt to reach NATS: tried again, then given up with FeedFatal (a feed, the relay) or "
        "StoreError (the checkpoint store)",
    "forkless.io_loop.on_connect.HookFailed":
        "an on_connect hook that failed: the connection attempt fails and is tried again",
    "forkless.io_loop.errors.StopRequested":
        "a stop requested while the partition store waited: the controller's start ends there and the run "
        "stops cleanly",
    "forkless.io_loop.probe.ProbeFailed":
        "--check's probe of a feed or the metrics address: run_check reports it",
}


def _modules() -> list[str]:
    names = []
    for package in ("controller", "io_loop"):
        for path in sorted((ROOT / package).glob("*.py")):
            names.append(f"forkless.{package}" if path.stem == "__init__" else f"forkless.{package}.{path.stem}")
    return names


def _exception_classes() -> dict[str, type[BaseException]]:
    """``module.QualName`` of every exception class defined in controller/ and io_loop/."""
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException):
                found[f"{name}.{cls.__qualname__}"] = cls
    return found


EXCEPTIONS = _exception_classes()
PUBLIC = sorted(name for name in EXCEPTIONS if name not in INTERNAL)


def test_controller_exports_exactly_the_user_api():
    assert sorted(controller.__all__) == CONTROLLER_ALL


def test_io_loop_exports_exactly_its_own_public_part():
    assert sorted(io_loop.__all__) == IO_LOOP_ALL


@pytest.mark.parametrize("package", [controller, io_loop], ids=lambda p: p.__name__)
def test_every_exported_name_resolves(package):
    for name in package.__all__:
        assert getattr(package, name) is not None, name


def test_what_both_packages_export_is_the_same_object():
    for name in set(controller.__all__) & set(io_loop.__all__):
        assert getattr(controller, name) is getattr(io_loop, name), name


@pytest.mark.parametrize("name", ["GuardedCodec", "compilations"])
def test_internals_are_not_exported_but_stay_importable_from_their_modules(name):
    assert name not in controller.__all__
    with pytest.raises(AttributeError):
        getattr(controller, name)
    module = {"GuardedCodec": "forkless.controller.codec", "compilations": "forkless.controller.compiled"}[name]
    assert callable(getattr(importlib.import_module(module), name))


def test_the_walk_finds_the_exceptions_it_is_meant_to():
    # a walk that found nothing would pass every test below
    assert {"forkless.io_loop.errors.ForklessError", "forkless.controller.errors.ConfigError",
            "forkless.io_loop.portalqueue.Empty", "forkless.io_loop.source.SourceStopped",
            "forkless.controller.check._Failure"} <= set(EXCEPTIONS)


def test_the_walk_misses_no_exception_class_the_source_defines():
    # inspect sees a module's top-level classes; ast sees every class statement, nested ones too
    names = {cls.__name__ for cls in EXCEPTIONS.values()} | {"Exception", "BaseException"}
    written = set()
    for module in _modules():
        inside = module.removeprefix("forkless.")
        path = ROOT / (inside.replace(".", "/") + ("/__init__.py" if "." not in inside else ".py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                if bases & names or any(b.endswith(("Error", "Exception", "Empty", "Full", "ShutDown")) for b in bases):
                    written.add(f"{module}.{node.name}")
    assert written == set(EXCEPTIONS), sorted(written ^ set(EXCEPTIONS))


def test_every_internal_exception_listed_exists_and_says_why():
    assert set(INTERNAL) <= set(EXCEPTIONS), sorted(set(INTERNAL) - set(EXCEPTIONS))
    assert all(len(why) > 20 for why in INTERNAL.values())


@pytest.mark.parametrize("name", PUBLIC)
def test_every_exception_a_caller_can_get_derives_from_forkless_error(name):
    assert issubclass(EXCEPTIONS[name], ForklessError), (
        f"{name} derives from {[b.__name__ for b in EXCEPTIONS[name].__mro__[1:]]}: make it a ForklessError, "
        f"or list it in INTERNAL with the reason it never reaches a caller")


@pytest.mark.parametrize("name", PUBLIC)
def test_except_controller_forkless_error_catches_it(name):
    cls = EXCEPTIONS[name]
    raised = cls.__new__(cls)  # without __init__: whatever arguments it takes
    try:
        raise raised
    except controller.ForklessError as caught:
        assert caught is raised
    except BaseException:
        pytest.fail(f"except controller.ForklessError does not catch {name}")


@pytest.mark.parametrize("name", [n for n in CONTROLLER_ALL if n[0].isupper()])
def test_every_exported_exception_is_a_forkless_error(name):
    obj = getattr(controller, name)
    if isinstance(obj, type) and issubclass(obj, BaseException):
        assert issubclass(obj, ForklessError), name


def test_the_built_in_bases_callers_catch_are_kept():
    bases = {controller.ConfigError: ValueError, controller.ProcessorContractError: ValueError,
             controller.CheckpointMismatch: ValueError, controller.MetricsServerError: RuntimeError,
             controller.IOThreadError: RuntimeError, controller.WorkerFailed: RuntimeError}
    for cls, base in bases.items():
        assert issubclass(cls, base), cls
    assert issubclass(Empty, queue.Empty) and issubclass(Empty, asyncio.QueueEmpty)
    assert issubclass(Full, queue.Full) and issubclass(Full, asyncio.QueueFull)
    assert issubclass(PortalClosed, janus.SyncQueueShutDown)


def test_the_classes_that_end_a_run_for_a_reason_of_their_own_are_exactly_ends_a_run():
    own = {cls for cls in EXCEPTIONS.values() if issubclass(cls, ForklessError)
           and (cls.exit_status != EXIT_CRASH or cls.exit_label or cls.exit_meaning)}
    assert own == set(ENDS_A_RUN)
    for cls in ENDS_A_RUN:
        assert cls.exit_status in EXIT_STATUSES and cls.exit_meaning, cls
        assert cls.exit_label or cls.exit_status == EXIT_CRASH, cls  # a crash's line is the message alone
