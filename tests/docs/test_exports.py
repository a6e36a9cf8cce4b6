"""The public API, one import path per name, and one root for its exceptions.

- ``forkless.__all__`` is the user API, pinned here exactly (a name added or dropped is a decision, made here);
  every name resolves, to an object defined in the module ``forkless`` names for it, whose ``__all__`` lists it.
  ``forkless.controller`` and ``forkless.io_loop`` export nothing.
- One import path per name (websockets' tests/test_exports.py is the model): a module's ``__all__`` lists only names
  that module defines, no name is in two modules' ``__all__``, and every ``from forkless.… import name`` in the
  project (the product, tests, bench, examples) takes the name from the module that defines it. The documents name
  a public name as ``forkless.X`` and any other by the module that defines it.
- Every exception class defined in controller/ and io_loop/ (found by importing each module
  and walking its classes; an ast walk checks none is hidden in a function) derives from
  ``ForklessError`` unless ``INTERNAL`` names it with the reason it never reaches a caller;
  ``except forkless.ForklessError`` catches each of them.
- The classes that end a run for a reason of their own (``exit_status`` not a crash's, or a
  label, or a line for the README's table) are exactly ``controller.errors.ENDS_A_RUN``.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib
import inspect
import queue
import re
from pathlib import Path

import janus
import pytest

import forkless
import forkless.controller
import forkless.io_loop
from forkless.controller.errors import ENDS_A_RUN, EXIT_STATUSES
from forkless.io_loop.errors import EXIT_CRASH, ForklessError
from forkless.io_loop.portal import PortalClosed
from forkless.io_loop.portalqueue import Empty, Full

ROOT = Path(__file__).resolve().parents[2]

FORKLESS_ALL = [
    "Backoff",
    "Batch",
    "CapabilityWarning",
    "CheckpointMismatch",
    "CheckpointSettings",
    "CheckpointStore",
    "Codec",
    "Config",
    "ConfigError",
    "ConnectHooks",
    "ConnectionEvent",
    "Controller",
    "Credentials",
    "DEFAULT_BACKOFF",
    "Decoded",
    "DemoSettings",
    "DeploymentMismatch",
    "Description",
    "DetectorSettings",
    "EVENTS_ONLY",
    "EWMAState",
    "EventBatch",
    "FeedFatal",
    "FeedSettings",
    "ForklessError",
    "Handshake",
    "IOPortal",
    "IOThreadError",
    "JsonCodec",
    "LeaseHeld",
    "LeaseLost",
    "Limits",
    "LoopSettings",
    "MessageBatch",
    "MetricsServerError",
    "OnEvent",
    "OnResults",
    "PartitionSettings",
    "PortalClosed",
    "PositionLost",
    "Processor",
    "ProcessorContractError",
    "ReconnectSettings",
    "RecordContext",
    "RecordSink",
    "RelaySettings",
    "Relogin",
    "ReplyBatch",
    "RestartPolicy",
    "ResultBatch",
    "ResultContext",
    "ResultSink",
    "RunSettings",
    "Runtime",
    "SendFailed",
    "SinkBatch",
    "SinkContext",
    "SinkRun",
    "SinkStats",
    "SinkView",
    "Source",
    "SourceContext",
    "SourceStopped",
    "StateShape",
    "StatsSnapshot",
    "StepSettings",
    "StoreError",
    "Timeouts",
    "TlsSettings",
    "WebSocketSettings",
    "WorkerFailed",
    "default_processor",
    "ewma_processor",
    "setup_logging",
    "stream_processor",
]

# exceptions that never reach a caller, and why; every other one derives from ForklessError
INTERNAL = {
    "forkless.controller.commands.check._Failure":
        "--check's record of a failed step: run_check turns it into its exit status",
    "forkless.controller.checkpoints.snapshot.CheckpointAbandoned":
        "a checkpoint copy the state outran: the checkpointer drops it and counts the failure",
    "forkless.controller.checkpoints.ckptformat.CheckpointDamaged":
        "a truncated or corrupt checkpoint file: the restore logs it and takes an older one",
    "forkless.io_loop.errors.ValueProblem":
        "a value's parser's complaint: Config.from_env raises ConfigError naming the variable instead",
    "forkless.controller.engine.StepFailed":
        "a step that failed while running: the loop answers the batch 'processing failed' and counts it",
    "forkless.io_loop.connectors.websocket.connect.ConnectFailed":
        "one failed connection attempt: the client tries again, then gives up with FeedFatal",
    "forkless.io_loop.net.appsite.NoSocket":
        "an OSError: no listening socket for a TCP address; the metrics server raises MetricsServerError for it, "
        "the demo feed's start lets it through as the OSError it was before (--check's ProbeFailed, the source's "
        "failure)",
    "forkless.io_loop.connectors.websocket.connect.ConnectionLost":
        "aiohttp's failure on an open WebSocket mapped at the edge (mapped_aiohttp_errors): the client ends the "
        "connection with its text and reconnects",
    "forkless.io_loop.connectors.websocket.connect.HandshakeRefused":
        "one refused handshake: tried again, or (a 4xx) given up with FeedFatal",
    "forkless.io_loop.portal._NotUp":
        "a run of a portal's worker that ended before it was up: the reconnect driver retries it (or gives up)",
    "forkless.io_loop.portal._Over":
        "a run of a portal's worker that is not called again: the portal ends its drive with it (WorkerFailed or "
        "PortalClosed)",
    "forkless.io_loop.connectors.websocket.connect._RedirectRefused":
        "a 3xx answer inside open_feed, which raises HandshakeRefused for it",
    "forkless.io_loop.connectors.jetstream.transport.NatsConnectFailed":
        "one failed attempt to reach NATS: tried again, then given up with FeedFatal (a feed, the relay) or "
        "StoreError (the checkpoint store)",
    "forkless.io_loop.connectors.jetstream.transport.NatsError":
        "nats-py's failure mapped at the edge (the transport's calls): its users catch it and end the connection, "
        "fail the attempt (NatsConnectFailed) or report a --check problem",
    "forkless.io_loop.connectors.jetstream.transport.NatsNotFound":
        "a NatsError: what the server does not hold, caught where it is asked for",
    "forkless.io_loop.connectors.jetstream.transport.NatsUnavailable":
        "a NatsError: JetStream not answering, caught where it is asked (a failed attempt, a --check problem)",
    "forkless.io_loop.connectors.jetstream.transport.NatsApiError":
        "a NatsError: another JetStream API error, caught as a NatsError",
    "forkless.io_loop.connectors.jetstream.transport.NatsWrongLast":
        "a NatsApiError: a write at a revision no longer the last, caught where a lease is taken, renewed or "
        "released (someone else wrote the key)",
    "forkless.io_loop.connectors.jetstream.transport.NatsNoStreamResponse":
        "a NatsError: no stream stores a published subject, caught by the reply publisher (the connection ends)",
    "forkless.io_loop.hooks.HookFailed":
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
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(["forkless", *(parts[:-1] if parts[-1] == "__init__" else parts)]))
    return names


def _path(module: str) -> Path:
    inside = ROOT / module.removeprefix("forkless.").replace(".", "/")
    return inside / "__init__.py" if inside.is_dir() else inside.with_suffix(".py")  # a package (a room) or a module


@functools.cache  # read once a module: the project-wide import check asks for each module hundreds of times
def _defined(path: Path) -> frozenset[str]:
    """The names a module binds at its top level itself (def, class, assignment), not by an import."""
    names: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try)):
                walk(node.body)
                walk(node.orelse)

    walk(ast.parse(path.read_text(encoding="utf-8")).body)
    return frozenset(names)


def _declared_all(module: str) -> list[str] | None:
    for node in ast.parse(_path(module).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__all__"]:
            return list(ast.literal_eval(node.value))
    return None


SUBMODULES = [m for m in _modules() if m.count(".") >= 2]  # every module and room of the two packages
ALLS = {m: names for m in SUBMODULES if (names := _declared_all(m)) is not None}


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


def test_forkless_exports_exactly_the_user_api():
    assert sorted(forkless.__all__) == FORKLESS_ALL


@pytest.mark.parametrize("name", FORKLESS_ALL)
def test_every_public_name_is_defined_in_the_module_forkless_names(name):
    where = forkless._EXPORTS[name]
    obj = getattr(forkless, name)
    assert obj is getattr(importlib.import_module(where), name)
    assert obj.__module__ == where, f"forkless.{name} is defined in {obj.__module__}, not {where}"
    assert name in (ALLS.get(where) or [name]), f"{where}.__all__ lacks {name}"


@pytest.mark.parametrize("package", ["forkless.controller", "forkless.io_loop"])
def test_the_packages_export_nothing(package):
    module = importlib.import_module(package)
    assert not hasattr(module, "__all__")
    for name in ("Controller", "Source", "ForklessError"):
        assert not hasattr(module, name), f"{package}.{name}: the user API is forkless's alone"


def test_the_types_of_the_controller_s_arguments_and_their_groups_fields_are_exported():
    import dataclasses

    from forkless.controller.checkpoints.checkpointer import CheckpointStore

    assert forkless.CheckpointStore is CheckpointStore
    checkpoint_store = {f.name: f.type for f in dataclasses.fields(forkless.Runtime)}["checkpoint_store"]
    assert "CheckpointStore" in str(checkpoint_store)
    hints = {name: str(p.annotation) for name, p in inspect.signature(forkless.Controller).parameters.items()}
    named = {"processor": "Processor", "codec": "Codec", "sources": "Source", "sinks": "ResultSink",
             "connect": "ConnectHooks", "runtime": "Runtime"}
    for argument, exported in named.items():
        assert exported in hints[argument] and exported in forkless.__all__, (argument, hints[argument])
    assert "OnResults" in hints["sinks"] and "OnEvent" in hints["on_event"]


def test_a_name_the_api_renamed_says_its_new_name_and_one_that_never_was_is_python_s_error():
    with pytest.warns(DeprecationWarning, match=r"forkless\.Sink is deprecated .* write forkless\.RecordSink \(a sink "
                                                r"of a controller's results: forkless\.ResultSink\)"):
        from forkless import Sink
    assert Sink is forkless.RecordSink  # the one policy: tests/controller/test_renamed.py
    with pytest.raises(AttributeError, match="has no attribute 'Sinks'"):
        forkless.Sinks  # noqa: B018


def test_the_walk_finds_the_modules_and_their_all():
    # a walk that found nothing would pass every test below
    assert {"forkless.controller.loop", "forkless.io_loop.crossing", "forkless.io_loop.errors"} <= set(ALLS)
    assert {"Controller"} == set(ALLS["forkless.controller.loop"])
    assert _defined(_path("forkless.controller.batching")) >= {"Batch", "MicroBatcher", "pad_batch"}
    assert "Chunk" not in _defined(_path("forkless.controller.batching"))  # imported from io_loop.crossing


@pytest.mark.parametrize("module", sorted(ALLS))
def test_a_module_s_all_lists_only_names_it_defines(module):
    foreign = [name for name in ALLS[module] if name not in _defined(_path(module))]
    assert not foreign, f"{module}.__all__ re-exports {foreign}: list them where they are defined only"
    loaded = importlib.import_module(module)
    for name in ALLS[module]:
        obj = getattr(loaded, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__ == module, f"{module}.{name} is {obj.__module__}.{name}"


def test_no_name_is_in_two_modules_all():
    where: dict[str, list[str]] = {}
    for module, names in ALLS.items():
        assert len(set(names)) == len(names), module
        for name in names:
            where.setdefault(name, []).append(module)
    assert not {n: ms for n, ms in where.items() if len(ms) > 1}


def _project_files() -> list[Path]:
    tops = ["controller", "io_loop", "forkless", "tests", "bench", "examples"]
    files = [p for top in tops for p in sorted((ROOT / top).rglob("*.py")) if "out" not in p.relative_to(ROOT).parts]
    return files + sorted(ROOT.glob("*.py"))


def _imports_by_another_path(text: str, where: str) -> list[str]:
    """Each ``from forkless.… import name`` in ``text`` whose module does not define ``name``."""
    wrong = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                and node.module.startswith(("forkless.controller", "forkless.io_loop"))):
            continue
        for alias in node.names:
            if _path(node.module).name == "__init__.py":  # a package (or a room): its modules only
                ok = _path(f"{node.module}.{alias.name}").exists()
            else:
                ok = alias.name in _defined(_path(node.module))
            if not ok:
                wrong.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
    return wrong


def test_the_project_imports_each_name_from_the_module_that_defines_it():
    files = _project_files()
    assert len(files) > 150 and ROOT / "app.py" in files and ROOT / "bench" / "run.py" in files
    wrong = [line for path in files
             for line in _imports_by_another_path(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert not wrong, "\n".join(wrong)


def test_the_import_check_sees_an_import_by_another_path():
    text = ("from forkless.controller.batching import Chunk, pad_batch\n"
            "from forkless.controller import loop, Controller\n")
    assert _imports_by_another_path(text, "p.py") == [
        "p.py:1: from forkless.controller.batching import Chunk", "p.py:2: from forkless.controller import Controller"]


DOCS = [ROOT / "EMBEDDING.md", ROOT / "README.md", ROOT / "OPERATING.md", ROOT / "DESIGN.md",
        *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_documents_name_each_name_by_its_one_path():
    wrong = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for path in re.findall(r"`((?:forkless\.)?(?:controller|io_loop)\.\w+\.\w+)", text):
            module, name = path.removeprefix("forkless.").rsplit(".", 1)
            module = "forkless." + module
            if name in ("py", "md") or not _path(module).exists() or _path(f"{module}.{name}").exists():
                continue  # a file's name (controller/loop.py) or a module path alone (a room's module)
            if name in forkless.__all__:
                wrong.append(f"{doc.name}: `{path}`: write `forkless.{name}`")
            elif not path.startswith("forkless."):
                wrong.append(f"{doc.name}: `{path}`: write `{module}.{name}`")
            elif name not in _defined(_path(module)):
                wrong.append(f"{doc.name}: `{path}`: {module} does not define {name}")
        for name in re.findall(r"`forkless\.([A-Z]\w*)`", text):
            if name not in forkless.__all__:
                wrong.append(f"{doc.name}: `forkless.{name}` is not exported")
    assert not wrong, "\n".join(wrong)


def test_the_walk_finds_the_exceptions_it_is_meant_to():
    # a walk that found nothing would pass every test below
    assert {"forkless.io_loop.errors.ForklessError", "forkless.io_loop.errors.ConfigError",
            "forkless.io_loop.portalqueue.Empty", "forkless.io_loop.source.SourceStopped",
            "forkless.controller.commands.check._Failure"} <= set(EXCEPTIONS)


def test_the_walk_misses_no_exception_class_the_source_defines():
    # inspect sees a module's top-level classes; ast sees every class statement, nested ones too
    names = {cls.__name__ for cls in EXCEPTIONS.values()} | {"Exception", "BaseException"}
    written = set()
    for module in _modules():
        inside = module.removeprefix("forkless.")
        base = ROOT / inside.replace(".", "/")  # a package (a room too), or a module
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
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
def test_except_forkless_error_catches_it(name):
    cls = EXCEPTIONS[name]
    raised = cls.__new__(cls)  # without __init__: whatever arguments it takes
    try:
        raise raised
    except forkless.ForklessError as caught:
        assert caught is raised
    except BaseException:
        pytest.fail(f"except forkless.ForklessError does not catch {name}")


@pytest.mark.parametrize("name", [n for n in FORKLESS_ALL if n[0].isupper()])
def test_every_exported_exception_is_a_forkless_error(name):
    obj = getattr(forkless, name)
    if isinstance(obj, type) and issubclass(obj, BaseException):
        assert issubclass(obj, ForklessError), name


def test_the_built_in_bases_callers_catch_are_kept():
    bases = {forkless.ConfigError: ValueError, forkless.ProcessorContractError: ValueError,
             forkless.CheckpointMismatch: ValueError, forkless.MetricsServerError: RuntimeError,
             forkless.IOThreadError: RuntimeError, forkless.WorkerFailed: RuntimeError}
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
