"""The direction of imports (DESIGN.md, "Which way imports go"), read with ``ast`` from the source.

Every module of controller/, io_loop/ and app.py is in exactly one layer, listed below; a new
module fails ``test_every_module_is_in_exactly_one_layer`` until it is classified. ``io_loop`` is
a leaf: none of its modules imports ``controller``; its pure modules (settings, what crosses the
bridge, counters, errors, addresses, the decoder protocol) are in the core, where the
controller's core may import them. Imports are
counted wherever they are written: at the top of a file, inside functions and methods, under
``if``/``try``. Importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``, so those
count as imported too. bench/ is out of their scope. No two modules import each other, directly or around
a loop, function-level imports counted. Not seen: ``importlib.import_module(name)`` with
a computed name (``forkless/__init__.py`` exports the user API lazily that way, composition
names such as ``Controller`` included); the subprocess tests at the bottom import for real.
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import app_env

ROOT = Path(__file__).resolve().parents[2]
SCANNED_DIRS = ("controller", "io_loop")
SCANNED_FILES = ("app.py",)

# ---- the layers: explicit lists, so that a new module must be put in one ---------------------

CORE = [
    "controller/__init__.py",
    "controller/checkpoints/__init__.py",
    "controller/partitions/__init__.py",
    "controller/device/__init__.py",
    "controller/settings/__init__.py",
    "controller/commands/__init__.py",
    "controller/lifetime/__init__.py",
    "controller/batching.py",
    "controller/checkpoints/ckptformat.py",
    "controller/codec.py",
    "controller/config.py",
    "controller/declared.py",
    "controller/errors.py",
    "controller/eventsonly.py",
    "controller/settings/groups.py",
    "controller/commands/vardocs.py",
    "controller/logs.py",
    "controller/metrics.py",
    "controller/device/placement.py",
    "controller/checkpoints/positions.py",
    "controller/processor.py",
    "io_loop/renamed.py",
    "controller/replies.py",
    "controller/rowcopy.py",
    "controller/slots.py",
    "controller/stats.py",
    "io_loop/__init__.py",
    "io_loop/connectors/websocket/__init__.py",
    "io_loop/connectors/__init__.py",
    "io_loop/connectors/jetstream/__init__.py",
    "io_loop/relay/__init__.py",
    "io_loop/sinks/__init__.py",
    "io_loop/net/__init__.py",
    "io_loop/backoff.py",
    "io_loop/seconds.py",
    "io_loop/capabilities.py",
    "io_loop/counters.py",
    "io_loop/crossing.py",
    "io_loop/decoding.py",
    "io_loop/jsontext.py",
    "io_loop/errors.py",
    "io_loop/connectors/connector.py",
    "io_loop/connectors/jetstream/consumer.py",
    "io_loop/connectors/jetstream/entry.py",
    "io_loop/connectors/jetstream/figures.py",
    "io_loop/connectors/jetstream/settings.py",
    "io_loop/connectors/websocket/entry.py",
    "io_loop/connectors/websocket/settings.py",
    "io_loop/feedlist.py",
    "io_loop/feedspec.py",
    "io_loop/iosettings.py",
    "io_loop/relay/settings.py",
    "io_loop/connectors/jetstream/positions.py",
    "io_loop/net/netaddr.py",
    "io_loop/connectors/jetstream/partitions.py",
    "io_loop/relay/relaystats.py",
    "io_loop/settings.py",
]
DEVICE = [
    "controller/checkpoints/checkpoint.py",
    "controller/device/compiled.py",
    "controller/engine.py",
    "controller/device/layouts.py",
    "controller/device/programs.py",
    "controller/checkpoints/snapshot.py",
    "controller/device/weights.py",
]
IO = [
    "io_loop/net/aiohttp_compat.py",
    "io_loop/net/appsite.py",
    "io_loop/connectors/websocket/before_connect.py",
    "io_loop/bridge.py",
    "io_loop/connectors/websocket/client.py",
    "io_loop/connectors/websocket/connector.py",
    "io_loop/connectors/websocket/connect.py",
    "io_loop/connectors/websocket/demo_feed.py",
    "io_loop/connectors/websocket/demo_source.py",
    "io_loop/emitted.py",
    "io_loop/feeds.py",
    "io_loop/finishing.py",
    "io_loop/gil.py",
    "io_loop/handover.py",
    "io_loop/hooks.py",
    "io_loop/kinds.py",
    "io_loop/waiting.py",
    "io_loop/spill.py",
    "io_loop/net/http.py",
    "io_loop/net/tls.py",
    "io_loop/connectors/websocket/on_connect.py",
    "io_loop/connectors/websocket/probe.py",
    "io_loop/connectors/jetstream/connector.py",
    "io_loop/connectors/jetstream/source.py",
    "io_loop/connectors/jetstream/probe.py",
    "io_loop/connectors/jetstream/replies.py",
    "io_loop/loopthread.py",
    "io_loop/portal.py",
    "io_loop/portalqueue.py",
    "io_loop/reconnect.py",
    "io_loop/relogin.py",
    "io_loop/connectors/jetstream/deployment.py",
    "io_loop/connectors/jetstream/leases.py",
    "io_loop/connectors/jetstream/transport.py",
    "io_loop/connectors/jetstream/store.py",
    "io_loop/connectors/jetstream/objects.py",
    "io_loop/connectors/jetstream/storethread.py",
    "io_loop/connectors/jetstream/nats_compat.py",
    "io_loop/probe.py",
    "io_loop/connectors/jetstream/publisher.py",
    "io_loop/sinks/results.py",
    "io_loop/sinks/sink.py",
    "io_loop/sends.py",
    "io_loop/source.py",
    "io_loop/thread.py",
    "io_loop/net/unixsocket.py",
    "io_loop/writer.py",
]
COMPOSITION = [
    "app.py",
    "controller/batchstep.py",
    "controller/commands/check.py",
    "controller/checkpoints/checkpointer.py",
    "controller/commands/cli.py",
    "controller/commands/edge.py",
    "controller/lifetime/endpoints.py",
    "controller/lifetime/host.py",
    "controller/inflight.py",
    "controller/ioside.py",
    "controller/lifetime/lifecycle.py",
    "controller/lifetime/sdnotify.py",
    "controller/loop.py",
    "controller/partitions/partitioned.py",
    "controller/queues.py",
    "controller/recovery.py",
    "controller/commands/relaycmd.py",
    "controller/lifetime/serving.py",
    "controller/lifetime/sinkrun.py",
    "controller/wiring.py",
]
LAYERS = {"core": CORE, "device": DEVICE, "io": IO, "composition": COMPOSITION}

# ---- what the core and the device layer may not import ----------------------------------------

# threads, event loops, sockets, cross-thread queues: the core is pure (DESIGN.md, layer 1), and so
# is the device layer, which only compiles
CONCURRENCY = {"threading", "asyncio", "aiohttp", "janus", "socket", "ssl", "selectors", "queue",
               "multiprocessing", "concurrent", "subprocess"}
CLOCK = {"time", "datetime"}
# The one core module that reads the clock: logs.RateLimitFilter lets a repeated warning through
# once per window_s, and logging.Filter.filter(record) is given no "now" to compare with
# (record.created is wall-clock time, which can jump; the window uses time.monotonic()).
CLOCK_ALLOWED_IN_CORE = {"controller/logs.py": {"time"}}
# io_loop/settings.py's pem_file parses FORKLESS_CA_FILE with OpenSSL at validation (no socket is opened), so a file
# that is not PEM is a configuration error (exit 2) rather than a TLS failure at the first connect
# logs.RateLimitFilter is run by logging on every thread that logs a warning, before the handler's lock is
# taken: what it remembers is behind a lock of its own (the one core module that makes one)
CONCURRENCY_ALLOWED_IN_CORE = {"io_loop/settings.py": {"ssl"}, "controller/logs.py": {"threading"}}
# Third-party libraries the core imports only where named: prometheus_client costs about 10 MiB
# and is loaded only when metrics are served; JAX must not load before the configuration is
# valid, and the IO side imports most of the core, so JAX only where processors are defined.
RESTRICTED_IN_CORE = {
    "prometheus_client": {"controller/metrics.py"},
    "jax": {"controller/processor.py"},
    "jaxlib": set(),
}
JAX = {"jax", "jaxlib"}


# ---- reading the source ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    path: str  # the importing file, relative to the repository root
    line: int
    end_line: int
    targets: tuple[str, ...]  # dotted module names this statement loads
    lazy: bool  # written inside a function
    scope: str = ""  # the enclosing class and function names, e.g. "MetricsServer._metrics"

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def key(self) -> str:
        """Names the statement without its line number, which moves when the file is edited."""
        return f"{self.path}:{self.scope}:{','.join(self.targets)}"


def module_name(path: str) -> str:
    """The dotted name a file is imported as: ``controller/loop.py`` is ``forkless.controller.loop``."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in SCANNED_DIRS:
        parts.insert(0, "forkless")
    return ".".join(parts)


def scanned_paths() -> list[str]:
    paths = [p.relative_to(ROOT).as_posix() for d in SCANNED_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return paths + [f for f in SCANNED_FILES if (ROOT / f).is_file()]


PATHS = scanned_paths()
MODULES = {module_name(p): p for p in PATHS}  # dotted name -> path
PROJECT_PACKAGES = {name.split(".")[0] for name in MODULES}


def find_imports(source: str, path: str, modules: dict[str, str] = MODULES) -> list[Import]:
    """Every import statement of ``source``, top-level or nested, with what it loads."""
    this = module_name(path)
    package = this if path.endswith("__init__.py") else this.rpartition(".")[0]
    found: list[Import] = []

    def targets_of(node: ast.Import | ast.ImportFrom) -> tuple[str, ...]:
        if isinstance(node, ast.Import):
            return tuple(alias.name for alias in node.names)
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        # "from pkg import name" loads pkg.name when that is a module, else only pkg
        return tuple(dict.fromkeys(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                                   for a in node.names))

    def visit(node: ast.AST, lazy: bool, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(Import(path, child.lineno, child.end_lineno or child.lineno, targets_of(child), lazy,
                                    scope))
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)), inner)

    visit(ast.parse(source, filename=path), lazy=False, scope="")
    return found


def loaded(target: str) -> list[str]:
    """``a.b.c`` and the packages whose ``__init__`` importing it runs: ``a``, ``a.b``."""
    parts = target.split(".")
    # forkless/__init__.py, which every one of them runs, only names the two packages: no layer of its own
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if parts[:i] != ["forkless"]]


def read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


IMPORTS = {path: find_imports(read(path), path) for path in PATHS}


def layer_of(path: str) -> str | None:
    for layer, paths in LAYERS.items():
        if path in paths:
            return layer
    return None


def project_imports(path: str) -> list[tuple[Import, str]]:
    """(statement, path of a project module it loads), parent packages included."""
    out = []
    for imp in IMPORTS[path]:
        for target in imp.targets:
            for name in loaded(target):
                dep = MODULES.get(name)
                if dep is not None and dep != path:
                    out.append((imp, dep))
    return out


def external_imports(path: str) -> list[tuple[Import, str]]:
    """(statement, top-level name) for everything outside the project (stdlib and third-party)."""
    return [(imp, target.split(".")[0]) for imp in IMPORTS[path] for target in imp.targets
            if target.split(".")[0] not in PROJECT_PACKAGES]


# ---- the layers -------------------------------------------------------------------------------------


def test_every_module_is_in_exactly_one_layer():
    listed = [p for paths in LAYERS.values() for p in paths]
    unclassified = sorted(set(PATHS) - set(listed))
    stale = sorted(set(listed) - set(PATHS))
    twice = sorted({p for p in listed if listed.count(p) > 1})
    assert not unclassified, f"put these modules in a layer list at the top of this file: {unclassified}"
    assert not stale, f"these listed modules no longer exist: {stale}"
    assert not twice, f"these modules are listed in two layers: {twice}"


def test_core_imports_only_core_modules():
    wrong = [f"{imp.where} loads {dep} ({layer_of(dep)})"
             for path in CORE for imp, dep in project_imports(path) if dep not in CORE]
    assert not wrong, "\n".join(wrong)


def test_core_imports_no_threads_event_loops_sockets_or_queues():
    wrong = [f"{imp.where} imports {name}"
             for path in CORE for imp, name in external_imports(path)
             if name in CONCURRENCY and name not in CONCURRENCY_ALLOWED_IN_CORE.get(path, set())]
    assert not wrong, "\n".join(wrong)


def test_only_logs_reads_the_clock_in_the_core():
    wrong = [f"{imp.where} imports {name}"
             for path in CORE for imp, name in external_imports(path)
             if name in CLOCK and name not in CLOCK_ALLOWED_IN_CORE.get(path, set())]
    assert not wrong, "\n".join(wrong)
    # the exception is still needed; drop it from CLOCK_ALLOWED_IN_CORE when it is not
    assert {name for _, name in external_imports("controller/logs.py")} & CLOCK == {"time"}


def test_prometheus_client_and_jax_are_imported_in_the_core_only_where_named():
    wrong = [f"{imp.where} imports {name}"
             for path in CORE for imp, name in external_imports(path)
             if name in RESTRICTED_IN_CORE and path not in RESTRICTED_IN_CORE[name]]
    assert not wrong, "\n".join(wrong)


def test_the_device_layer_imports_only_core_and_device_modules_and_no_concurrency():
    wrong = [f"{imp.where} loads {dep} ({layer_of(dep)})"
             for path in DEVICE for imp, dep in project_imports(path) if dep not in CORE + DEVICE]
    wrong += [f"{imp.where} imports {name}"
              for path in DEVICE for imp, name in external_imports(path) if name in CONCURRENCY]
    assert not wrong, "\n".join(wrong)


def test_io_imports_only_core_and_io_modules():
    wrong = [f"{imp.where} loads {dep} ({layer_of(dep)})"
             for path in IO for imp, dep in project_imports(path) if dep not in CORE and dep not in IO]
    assert not wrong, "\n".join(wrong)


def test_io_loop_is_a_leaf_that_imports_nothing_from_controller():
    # every io_loop module, pure or not: controller composes io_loop, never the other way round
    wrong = [f"{imp.where} loads {dep}"
             for path in PATHS if path.startswith("io_loop/")
             for imp, dep in project_imports(path) if not dep.startswith("io_loop/")]
    assert not wrong, "\n".join(wrong)


# partitions_of (the checkpoints' split of the stream table by partition) is vectorised with numpy,
# imported inside it: importing io_loop.connectors.jetstream.partitions still loads none (the test below);
# the wire's JSON text is msgspec's where it is installed (the controller's codec and the relay use it); a
# FORKLESS_FEEDS entry's schema is a msgspec Struct in its connector room's entry.py, which io_loop/feedlist.py
# imports only when FORKLESS_FEEDS is set (a run without it loads no msgspec: the test below the layers')
THIRD_PARTY_ALLOWED_IN_LEAF_CORE = {"io_loop/connectors/jetstream/partitions.py": {"numpy"},
                                    "io_loop/jsontext.py": {"msgspec"},
                                    "io_loop/connectors/jetstream/entry.py": {"msgspec"},
                                    "io_loop/connectors/websocket/entry.py": {"msgspec"}}


def test_the_io_loop_modules_in_the_core_import_no_third_party_library():
    # what the controller's core takes from the leaf (settings, what crosses the bridge, counters,
    # errors, addresses, the decoder protocol, partitions) costs it no import of numpy, janus or aiohttp
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    wrong = [f"{imp.where} imports {name}"
             for path in CORE if path.startswith("io_loop/")
             for imp, name in external_imports(path)
             if name not in stdlib and name not in THIRD_PARTY_ALLOWED_IN_LEAF_CORE.get(path, set())]
    assert not wrong, "\n".join(wrong)


def test_io_never_imports_jax():
    wrong = [f"{imp.where} imports {name}" for path in IO for imp, name in external_imports(path) if name in JAX]
    assert not wrong, "\n".join(wrong)


# ---- no import cycle, lazy imports counted ---------------------------------------------------------
# A function-level import hides a cycle from Python, not from the design: who composes whom goes one way
# (a composition root hands the parts in), and an import moved into a function does not change who that is.


def strongly_connected(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Every strongly connected set of two or more nodes of ``edges`` (node -> its deps), sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    sets: list[list[str]] = []
    for root in edges:  # Tarjan's algorithm without recursion: a frame is (node, its next deps)
        if root in index:
            continue
        frames = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while frames:
            node, deps = frames[-1]
            dep = next(deps, None)
            if dep is None:
                frames.pop()
                if frames:
                    low[frames[-1][0]] = min(low[frames[-1][0]], low[node])
                if low[node] == index[node]:
                    members = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(members) > 1:
                        sets.append(sorted(members))
            elif dep not in index:
                index[dep] = low[dep] = len(index)
                stack.append(dep)
                frames.append((dep, iter(edges[dep])))
            elif dep in stack:
                low[node] = min(low[node], index[dep])
    return sets


def import_cycles(imports: dict[str, list[Import]], modules: dict[str, str] = MODULES) -> list[list[str]]:
    """Every import cycle among ``imports``' files, each as its edges ("a.py:12 -> b.py", "(lazy)" where
    the statement is in a function): one per strongly connected set of two or more files (Tarjan), every
    statement counted (top-level, in functions, under ``if``/``try``, ``TYPE_CHECKING`` included)."""
    edges: dict[str, dict[str, Import]] = {path: {} for path in imports}
    for path, statements in imports.items():
        for imp in statements:
            for target in imp.targets:
                for name in loaded(target):
                    dep = modules.get(name)
                    if dep is not None and dep != path and dep in edges:
                        edges[path].setdefault(dep, imp)
    return [[f"{edges[a][b].where} -> {b}{' (lazy)' if edges[a][b].lazy else ''}"
             for a in members for b in edges[a] if b in members] for members in strongly_connected(edges)]


def test_no_import_cycle_among_the_product_modules_counting_lazy_imports():
    cycles = import_cycles(IMPORTS)
    assert not cycles, "import cycles (break them by who composes whom, not by a function-level import):\n" + \
        "\n".join("  " + "; ".join(cycle) for cycle in cycles)


def test_the_cycle_finder_finds_a_cycle_closed_by_a_lazy_import_and_none_in_a_chain():
    modules = {"forkless.io_loop.a": "io_loop/a.py", "forkless.io_loop.b": "io_loop/b.py",
               "forkless.io_loop.c": "io_loop/c.py"}
    sources = {"io_loop/a.py": "from forkless.io_loop.b import B\n",
               "io_loop/b.py": "from forkless.io_loop import c\n",
               "io_loop/c.py": "def make():\n    from forkless.io_loop.a import A  # later\n    return A\n"}
    imports = {path: find_imports(text, path, modules) for path, text in sources.items()}
    assert import_cycles(imports, modules) == [["io_loop/a.py:1 -> io_loop/b.py", "io_loop/b.py:1 -> io_loop/c.py",
                                                "io_loop/c.py:2 -> io_loop/a.py (lazy)"]]
    del imports["io_loop/c.py"][0]
    assert import_cycles(imports, modules) == []


# ---- no cycle between rooms, a room counted as one node ---------------------------------------------
# A room is a folder of modules, counted as one node: the innermost (io_loop/connectors/jetstream/) and, around its
# rooms, the folder at a package's top level (io_loop/connectors/, holding them all); a module at a package's top
# level (controller/engine.py) is a room of its own. Two rooms that import each other, directly or around a loop of
# rooms, are one feature cut in two, even when no two of their modules form a cycle.


def room_of(path: str) -> str:
    """The innermost room ``path`` is in: its folder below ``controller/`` or ``io_loop/``
    ("io_loop/connectors/jetstream/"), or itself at a package's top level ("controller/engine.py")."""
    folder, _, _ = path.rpartition("/")
    return folder + "/" if folder.count("/") >= 1 else path


def wing_of(path: str) -> str:
    """The outermost room ``path`` is in: its package's folder holding it ("io_loop/connectors/" for every module of
    the connector rooms), or itself at a package's top level."""
    parts = path.split("/")
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else path


def room_cycles(imports: dict[str, list[Import]], modules: dict[str, str] = MODULES,
                room: Callable[[str], str] = room_of) -> list[list[str]]:
    """Every cycle between rooms, each as its edges ("room -> room (file:line)"): one per strongly connected set
    of two or more rooms. An edge is a statement importing a module of another room (the packages it runs on the
    way count for nothing: a room's ``__init__`` imports nothing, a test holds it), function-level ones too."""
    edges: dict[str, dict[str, Import]] = {}
    for path, statements in imports.items():
        edges.setdefault(room(path), {})
        for imp in statements:
            for target in imp.targets:
                dep = modules.get(target)
                if dep is not None and room(dep) != room(path):
                    edges[room(path)].setdefault(room(dep), imp)
                    edges.setdefault(room(dep), {})
    return [[f"{a} -> {b} ({edges[a][b].where})" for a in members for b in edges[a] if b in members]
            for members in strongly_connected(edges)]


@pytest.mark.parametrize("room", [room_of, wing_of], ids=["innermost", "outermost"])
def test_no_cycle_between_rooms_counting_a_room_as_one_node(room):
    cycles = room_cycles(IMPORTS, room=room)
    assert not cycles, "rooms that import each other (one concept cut in two: move what both need below both):\n" + \
        "\n".join("  " + "; ".join(cycle) for cycle in cycles)
    assert {room(p) for p in PATHS} >= {"controller/checkpoints/", "controller/engine.py",  # rooms and modules seen
                                        "io_loop/connectors/jetstream/" if room is room_of else "io_loop/connectors/"}


def test_the_room_cycle_finder_sees_two_rooms_importing_each_other_through_different_modules():
    # no module imports one that imports it back, yet the two rooms import each other: a cycle of rooms
    modules = {"forkless.controller.store.disk": "controller/store/disk.py",
               "forkless.controller.store.format": "controller/store/format.py",
               "forkless.controller.device.layout": "controller/device/layout.py",
               "forkless.controller.device.place": "controller/device/place.py",
               "forkless.controller.engine": "controller/engine.py"}
    sources = {"controller/store/disk.py": "from forkless.controller.device.place import Place\n",
               "controller/store/format.py": "",
               "controller/device/layout.py": "def f():\n    from forkless.controller.store import format  # late\n",
               "controller/device/place.py": "",
               "controller/engine.py": "from forkless.controller.store import disk\n"}
    imports = {path: find_imports(text, path, modules) for path, text in sources.items()}
    assert import_cycles(imports, modules) == []  # no cycle of modules
    assert room_cycles(imports, modules) == [[
        "controller/device/ -> controller/store/ (controller/device/layout.py:2)",
        "controller/store/ -> controller/device/ (controller/store/disk.py:1)"]]
    del imports["controller/device/layout.py"][0]  # the device room no longer imports the store: a chain
    assert room_cycles(imports, modules) == []


def test_the_outermost_rooms_see_a_loop_through_a_room_inside_another():
    # the connector rooms import a top-level module that imports the connectors' shared module: no cycle between
    # the innermost rooms, one between io_loop/connectors/ (every connector room) and that module
    modules = {"forkless.io_loop.connectors.connector": "io_loop/connectors/connector.py",
               "forkless.io_loop.connectors.nats.source": "io_loop/connectors/nats/source.py",
               "forkless.io_loop.source": "io_loop/source.py"}
    sources = {"io_loop/connectors/connector.py": "",
               "io_loop/connectors/nats/source.py": "from forkless.io_loop.source import Source\n",
               "io_loop/source.py": "from forkless.io_loop.connectors.connector import FeedSpec\n"}
    imports = {path: find_imports(text, path, modules) for path, text in sources.items()}
    assert room_cycles(imports, modules, room=room_of) == []
    assert room_cycles(imports, modules, room=wing_of) == [[
        "io_loop/connectors/ -> io_loop/source.py (io_loop/connectors/nats/source.py:1)",
        "io_loop/source.py -> io_loop/connectors/ (io_loop/source.py:1)"]]


# ---- lazy imports say why ------------------------------------------------------------------------


def comments_by_line(source: str) -> dict[int, str]:
    return {tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}


def is_reason(comment: str | None) -> bool:
    """A comment that says something: not empty and not only a linter or type-checker pragma."""
    if not comment:
        return False
    return not comment.lower().startswith(("noqa", "type:", "pragma", "fmt:", "ruff:"))


def lazy_imports_without_reason(source: str, imports: list[Import]) -> list[Import]:
    """The lazy imports with no reason written beside them.

    A reason is a comment on the statement's own line(s), or a comment-only line directly above
    it (above its ``try:`` when the import opens a ``try`` block). Imports separated only by blank
    lines (ruff puts one between third-party and first-party groups) form one group and share
    one reason.
    """
    lines = source.splitlines()
    comments = comments_by_line(source)

    def text(n: int) -> str:
        return lines[n - 1].strip() if 1 <= n <= len(lines) else ""

    def comment_above(n: int) -> bool:
        above = n - 1
        if text(above) == "try:":
            above -= 1
        return text(above).startswith("#") and is_reason(comments.get(above))

    lazy = sorted((imp for imp in imports if imp.lazy), key=lambda imp: imp.line)
    groups: list[list[Import]] = []
    for imp in lazy:
        prev = groups[-1][-1] if groups else None
        if prev is not None and all(text(n) == "" for n in range(prev.end_line + 1, imp.line)):
            groups[-1].append(imp)
        else:
            groups.append([imp])
    missing = []
    for group in groups:
        inline = any(is_reason(comments.get(n)) for imp in group for n in range(imp.line, imp.end_line + 1))
        if not inline and not comment_above(group[0].line):
            missing.extend(group)
    return missing


LAZY = [imp for path in PATHS for imp in IMPORTS[path] if imp.lazy]


def missing_reasons(sources: dict[str, str]) -> list[str]:
    """Each function-level import of ``sources`` (path -> text) with no reason written beside it, as a line
    naming it (what ``test_every_lazy_import_states_its_reason`` asserts there is none of)."""
    return [f"{imp.where}: a function-level import of {', '.join(imp.targets)} needs a comment giving its reason"
            for path, text in sources.items()
            for imp in lazy_imports_without_reason(text, find_imports(text, path))]


def test_the_known_lazy_imports_are_found():
    # some lazy imports that exist today, so that a scanner that stopped seeing them fails here
    assert {
        "controller/commands/cli.py:main:forkless.controller.commands.check",
        "controller/commands/cli.py:main:forkless.controller.loop",
        "controller/commands/check.py:_show_jax:jax",
        "controller/commands/check.py:_compile:forkless.controller.device.compiled",
        "controller/ioside.py:io_thread:forkless.controller.metrics",
    } <= {imp.key for imp in LAZY}


def test_every_lazy_import_states_its_reason():
    missing = missing_reasons({path: read(path) for path in PATHS})
    assert not missing, "\n".join(missing)


def test_the_reason_check_flags_a_module_s_lazy_import_without_a_reason():
    module = ("import os\n\n\ndef load():\n    import json  # only when asked: a reason\n\n"
              "    from forkless.io_loop import backoff\n\n    x = 1\n    import socket\n    return json, socket\n")
    assert missing_reasons({"controller/sample.py": module}) == [
        "controller/sample.py:10: a function-level import of socket needs a comment giving its reason"]


# ---- the checkers themselves, on literal source --------------------------------------------------

SAMPLE = '''\
import os
from forkless.io_loop import backoff


class A:
    import json

    def method(self):
        if True:
            import socket
        return socket

    async def coroutine(self):
        async def inner():
            from forkless.controller.stats import IOStats
            return IOStats
        return inner
'''


def test_the_scanner_sees_top_level_class_level_and_nested_function_imports():
    found = find_imports(SAMPLE, "controller/sample.py")
    assert [(imp.line, imp.targets, imp.lazy) for imp in found] == [
        (1, ("os",), False),
        (2, ("forkless.io_loop.backoff",), False),
        (6, ("json",), False),
        (10, ("socket",), True),
        (15, ("forkless.controller.stats",), True),
    ]


def test_the_scanner_resolves_relative_imports_and_counts_parent_packages():
    found = find_imports("from .. import backoff\nfrom ..bridge import Bridge\n", "io_loop/net/http.py")
    assert [imp.targets for imp in found] == [("forkless.io_loop.backoff",), ("forkless.io_loop.bridge",)]
    assert loaded("forkless.io_loop.backoff") == ["forkless.io_loop", "forkless.io_loop.backoff"]


LAZY_SAMPLE = '''\
def f():
    import a  # needed late: reason

    # reason for the group
    import b

    from c import d

    # reason for the try block
    try:
        import e
    except ImportError:
        pass

    x = 1  # a comment about x, not about g
    import g
    import h  # noqa: PLC0415
'''


def test_the_reason_rule_accepts_same_line_above_group_and_try_comments_only():
    imports = find_imports(LAZY_SAMPLE, "controller/sample.py")
    assert [imp.line for imp in lazy_imports_without_reason(LAZY_SAMPLE, imports)] == [16, 17]


# ---- JAX is not imported by what must start before it ----------------------------------------------


def modules_loaded_by(statement: str, env: dict[str, str] | None = None) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


IO_MODULES = sorted(module_name(p) for p in IO)


@pytest.mark.parametrize("statement", [
    "import forkless.controller.config",
    "from forkless import Config, ConfigError",
    "import app",
    "import " + ", ".join(IO_MODULES),
], ids=["forkless.controller.config", "forkless.Config", "app", "io_loop-and-every-io-module"])
def test_importing_this_does_not_import_jax(statement: str):
    loaded_modules = modules_loaded_by(statement)
    assert "forkless.controller.config" in loaded_modules or "forkless.io_loop" in loaded_modules  # imported something
    jax_modules = sorted(m for m in loaded_modules if m.split(".")[0] in JAX)
    assert not jax_modules, f"{statement!r} imported {len(jax_modules)} JAX modules, e.g. {jax_modules[:3]}"


OPTIONAL_LIBRARIES = {"nats", "prometheus_client"}  # JetStream feeds, /metrics (msgspec is the wire's JSON)


def test_a_websocket_only_run_imports_no_library_only_some_runs_need():
    # a whole run on the demo feed (WebSocket, no metrics): what it imports is what such a run pays in memory
    loaded_modules = modules_loaded_by(
        "import os\nos.environ.update(FORKLESS_DURATION='1', FORKLESS_STATUS_S='0')\n"
        "from app import load_config\nfrom forkless.controller.loop import Controller\nController(load_config()).run()",
        env=app_env())  # the session's compilation cache: the default step loaded, not compiled cold
    # it did start a feed and JAX
    assert "forkless.io_loop.connectors.websocket.client" in loaded_modules and "jax" in loaded_modules
    optional = sorted({m.split(".")[0] for m in loaded_modules} & OPTIONAL_LIBRARIES)
    assert not optional, f"a WebSocket-only run imported {optional}: import them only where they are used"


# ---- the JetStream connector is a room: nats-py is imported in it alone, its exceptions named by one module ----

NATS_ROOM = "io_loop/connectors/jetstream/"
# the transport maps nats-py's exceptions to ours (the one place), nats_compat raises nats-py's own from its
# private parts, inside the transport's mapping; every other module catches ours
NAMES_NATS_ERRORS = {"io_loop/connectors/jetstream/transport.py", "io_loop/connectors/jetstream/nats_compat.py"}
NATS_ERROR_MODULES = ("nats.errors", "nats.js.errors")


def nats_imports(path: str, imports: list[Import] | None = None) -> list[Import]:
    """The statements of ``path`` that import nats-py (any of its modules), wherever they are written."""
    return [imp for imp in (IMPORTS[path] if imports is None else imports)
            if any(target == "nats" or target.startswith("nats.") for target in imp.targets)]


def names_nats_errors(imports: list[Import]) -> list[Import]:
    return [imp for imp in imports if any(t.startswith(NATS_ERROR_MODULES) or t == "nats" for t in imp.targets)]


def test_every_nats_import_of_the_product_is_in_the_jetstream_connector_s_room():
    outside = [f"{imp.where} imports {', '.join(imp.targets)}" for path in PATHS if not path.startswith(NATS_ROOM)
               for imp in nats_imports(path)]
    assert not outside, "nats-py is the JetStream connector's (io_loop/connectors/jetstream/):\n" + "\n".join(outside)
    assert any(nats_imports(path) for path in PATHS if path.startswith(NATS_ROOM)), "the scanner sees no nats import"


def test_only_the_transport_names_nats_py_s_exceptions():
    # ``import nats`` reaches nats.errors too: only the transport and nats_compat import the package or its errors
    wrong = [f"{imp.where} imports {', '.join(imp.targets)}" for path in PATHS if path not in NAMES_NATS_ERRORS
             for imp in names_nats_errors(nats_imports(path))]
    assert not wrong, "catch the transport's errors (io_loop/connectors/jetstream/transport.py):\n" + "\n".join(wrong)


def test_the_nats_rules_see_an_import_outside_the_room_and_an_error_module_named_inside_it():
    # the two rules above, on literal source: each would fail on such a module
    outside = find_imports("def f():\n    from nats.js.api import StreamConfig  # lazily\n", "io_loop/feeds.py")
    assert [imp.targets for imp in nats_imports("io_loop/feeds.py", outside)] == [("nats.js.api",)]
    inside = find_imports("import nats.errors\nfrom nats.js import api\n", NATS_ROOM + "source.py")
    assert [imp.targets for imp in names_nats_errors(nats_imports(NATS_ROOM + "source.py", inside))] == [
        ("nats.errors",)]


# ---- the WebSocket connector is a room: the composition root reaches its feed through its connector -------------

WEBSOCKET_ROOM = "io_loop/connectors/websocket/"
# what a module outside the room may import of it: the room's package, the connector the composition root talks to,
# the connect hooks' public types (Controller's on_connect and before_connect, Handshake, frames_of), its settings
# (the configuration's groups) and its entry's schema (FORKLESS_FEEDS, read by io_loop/feedlist.py)
WEBSOCKET_DOORS = {WEBSOCKET_ROOM + name for name in ("__init__.py", "connector.py", "on_connect.py",
                                                      "before_connect.py", "settings.py", "entry.py")}


def into_the_websocket_room(path: str, imports: list[Import] | None = None) -> list[str]:
    """What ``path`` imports of the WebSocket room besides its doors (its client, connect, probe, demo feed), each as
    "file:line loads module"; nothing for a module inside the room."""
    if path.startswith(WEBSOCKET_ROOM):
        return []
    return [f"{imp.where} loads {dep}" for imp in (IMPORTS[path] if imports is None else imports)
            for target in imp.targets for name in loaded(target) if (dep := MODULES.get(name)) is not None
            and dep.startswith(WEBSOCKET_ROOM) and dep not in WEBSOCKET_DOORS]


def test_outside_the_websocket_room_only_its_connector_and_the_hooks_types_are_imported():
    # controller/ioside.py's connector_for chooses a feed's connector, which makes its source (a WebSocketSource, the
    # demo feed's DemoSource): no module outside the room names the client, connect, the probe or the demo feed
    wrong = [line for path in PATHS for line in into_the_websocket_room(path)]
    assert not wrong, ("reach the WebSocket feed through its connector (io_loop/connectors/websocket/connector.py):\n"
                       + "\n".join(wrong))
    assert {WEBSOCKET_ROOM + "client.py", WEBSOCKET_ROOM + "connector.py"} <= set(PATHS)  # the room is where it is


def test_the_websocket_room_rule_sees_a_lazy_import_of_its_client_and_lets_the_connector_through():
    found = find_imports("from forkless.io_loop.connectors.websocket.connector import WebSocketConnector\n"
                         "def f():\n    from forkless.io_loop.connectors.websocket import client  # lazily\n",
                         "controller/ioside.py")
    assert into_the_websocket_room("controller/ioside.py", found) == [
        "controller/ioside.py:3 loads io_loop/connectors/websocket/client.py"]
    assert into_the_websocket_room(WEBSOCKET_ROOM + "connector.py", found) == []


# ---- the controller asks a feed's connector, never its kind ------------------------------------------------------

CONNECTOR_ROOMS = ("io_loop/connectors/jetstream/", "io_loop/connectors/websocket/")
# what the controller may import of a connector room: its declarations, which the configuration and the metrics
# compose (its settings groups, its metric families), and the WebSocket connect hooks' public types; a feed's
# behaviour is reached through its connector, which io_loop/kinds.py finds by the feed's kind
DECLARATIONS = {"settings.py", "figures.py", "before_connect.py", "on_connect.py"}
# the words a feed's kind is told by, and the classes only one kind has: a controller module compares with none
KIND_WORDS = {"nats", "jetstream", "websocket", "url"}
KIND_CLASSES = {"JetStreamSpec", "JetStreamConnector", "WebSocketConnector", "JetStreamSource", "WebSocketSource"}


def into_a_connector_room(path: str, imports: list[Import] | None = None) -> list[str]:
    """What ``path`` imports of a connector room besides its declarations, each as "file:line loads module"."""
    return [f"{imp.where} loads {dep}" for imp in (IMPORTS[path] if imports is None else imports)
            for target in imp.targets if (dep := MODULES.get(target)) is not None
            and dep.startswith(CONNECTOR_ROOMS) and dep.rpartition("/")[2] not in DECLARATIONS]


def kind_branches(source: str, path: str) -> list[str]:
    """Where ``source`` asks which kind a feed is: a comparison with a kind's word (``spec.kind == "jetstream"``,
    ``"nats" in entry``), an ``isinstance`` naming one kind's class, or a spec's connector ``options`` read."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            words = [sub.value for sub in (node.left, *node.comparators) if isinstance(sub, ast.Constant)]
            if KIND_WORDS & {word for word in words if isinstance(word, str)}:
                found.append(f"{path}:{node.lineno} compares with {words}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            named = {sub.id for sub in ast.walk(node.args[1]) if isinstance(sub, ast.Name)}
            if named & KIND_CLASSES:
                found.append(f"{path}:{node.lineno} isinstance({', '.join(sorted(named))})")
        elif isinstance(node, ast.Attribute) and node.attr == "options":
            found.append(f"{path}:{node.lineno} reads .options")
    return found


def test_the_controller_reaches_a_connector_room_only_through_its_declarations():
    wrong = [line for path in PATHS if path.startswith("controller/") for line in into_a_connector_room(path)]
    assert not wrong, "reach a feed through its connector (io_loop/kinds.py's connector_for):\n" + "\n".join(wrong)


def test_the_controller_never_branches_on_a_feed_s_kind():
    wrong = [line for path in PATHS if path.startswith("controller/") for line in kind_branches(read(path), path)]
    assert not wrong, "ask the feed's connector (io_loop/connectors/connector.py), not its kind:\n" + "\n".join(wrong)
    assert kind_branches(read("io_loop/feedlist.py"), "io_loop/feedlist.py")  # where kinds are told, it sees them


def test_the_kind_rules_see_a_branch_on_the_kind_and_an_import_of_a_room_s_connector():
    branching = ('def f(spec, entry):\n    if spec.kind == "jetstream":\n        pass\n    if "nats" in entry:\n'
                 '        pass\n    return isinstance(spec.options, JetStreamSpec)\n')
    assert kind_branches(branching, "controller/x.py") == [
        "controller/x.py:2 compares with ['jetstream']", "controller/x.py:4 compares with ['nats']",
        "controller/x.py:6 isinstance(JetStreamSpec)", "controller/x.py:6 reads .options"]
    assert kind_branches("if codec.kind == 'a JetStream feed':\n    pass\n", "controller/x.py") == []
    found = find_imports("from forkless.io_loop.connectors.jetstream.settings import PartitionSettings\n"
                         "def f():\n"
                         "    from forkless.io_loop.connectors.jetstream.connector import JetStreamConnector\n",
                         "controller/ioside.py")
    assert into_a_connector_room("controller/ioside.py", found) == [
        "controller/ioside.py:3 loads io_loop/connectors/jetstream/connector.py"]


# ---- one owner of the device state ---------------------------------------------------------------

STATE_OWNER = "controller/engine.py"
STATE_NAMES = {"state", "_state"}


def state_assignments(path: str) -> list[str]:
    """Where ``path`` assigns an attribute named state/_state (``x.state = ...``, ``+=``, ``setattr``)."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in STATE_NAMES:
            found.append(f"{path}:{node.lineno}")
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr in STATE_NAMES:
                    found.append(f"{path}:{node.lineno}")
    return found


def test_only_the_engine_assigns_the_device_state():
    elsewhere = [where for path in PATHS if path != STATE_OWNER for where in state_assignments(path)]
    assert not elsewhere, "the device state is assigned outside controller/engine.py:\n" + "\n".join(elsewhere)
    assert state_assignments(STATE_OWNER), "the scanner finds no assignment even in the engine: it is broken"


# ---- io_loop is a leaf whose small modules import alone --------------------------------------------


def test_importing_io_loop_backoff_loads_neither_janus_nor_aiohttp():
    loaded_modules = modules_loaded_by("import forkless.io_loop.backoff")
    assert "forkless.io_loop.backoff" in loaded_modules
    assert not {"janus", "aiohttp", "numpy"} & loaded_modules


def test_importing_the_leaf_s_core_modules_loads_no_controller_janus_aiohttp_or_numpy():
    leaf_core = sorted(module_name(p) for p in CORE if p.startswith("io_loop/"))
    loaded_modules = modules_loaded_by("import " + ", ".join(leaf_core))
    assert set(leaf_core) <= loaded_modules
    assert not {m.split(".")[0] for m in loaded_modules} & {"controller", "janus", "aiohttp", "numpy"}


def test_importing_forkless_and_its_two_packages_loads_none_of_their_modules():
    loaded_modules = modules_loaded_by("import forkless, forkless.io_loop, forkless.controller")
    assert {"forkless.io_loop", "forkless.controller"} <= loaded_modules
    assert not {m for m in loaded_modules if m.startswith(("forkless.io_loop.", "forkless.controller."))}
    names = modules_loaded_by("import forkless; forkless.IOPortal; forkless.FeedFatal")  # the user API, lazily
    assert {"forkless.io_loop.portal", "forkless.io_loop.errors"} <= names


# ---- no object's fields set from another module ------------------------------------------------
# Counter records are plain records of counters, each written by its one owning thread, read as
# snapshots: the modules that declare them. A decoded frame may be cut by the source that
# decoded it (the JetStream consumer drops other partitions' messages from a copy). Anything else
# a module sets on an object of a class another module declares goes through a method there.
PRODUCT = [p for p in PATHS if p.startswith(("controller/", "io_loop/"))]
COUNTER_RECORDS = ("controller/stats.py", "io_loop/counters.py", "io_loop/relay/relaystats.py")
FRAME_CUTS = {("io_loop/connectors/jetstream/consumer.py", "out", attr) for attr in ("seq", "stream", "x", "errors")}


def _declared_fields() -> dict[str, set[str]]:
    """Each attribute name, and the product modules whose classes declare it (a class-level
    field, or ``self.NAME = …`` in a method)."""
    declared: dict[str, set[str]] = {}
    for path in PRODUCT:
        for cls in (n for n in ast.walk(ast.parse(read(path))) if isinstance(n, ast.ClassDef)):
            names = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
            names += [t.attr for n in ast.walk(cls) for t in _assigned(n)
                      if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"]
            for name in names:
                declared.setdefault(name, set()).add(path)
    return declared


def _assigned(node: ast.AST) -> list[ast.expr]:
    targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
               if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
    return [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def test_no_module_sets_fields_of_another_module_s_objects_but_counter_records():
    declared = _declared_fields()
    found = []
    for path in PRODUCT:
        for node in ast.walk(ast.parse(read(path))):
            for target in _assigned(node):
                if not isinstance(target, ast.Attribute) or (
                        isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")):
                    continue
                owners = declared.get(target.attr, set())
                base = ast.unparse(target.value)
                if (owners and path not in owners and not owners & set(COUNTER_RECORDS)
                        and (path, base, target.attr) not in FRAME_CUTS):
                    found.append(f"{path}:{node.lineno} sets {base}.{target.attr} (declared in {sorted(owners)})")
    assert not found, "give the owning class a method for it: " + "; ".join(found)


# ---- rooms: a feature's modules sit in a room (a subpackage) whose __init__ imports nothing ----


def test_every_room_is_a_package_whose_init_imports_nothing():
    rooms = sorted({p.rsplit("/", 1)[0] for p in PATHS if p.count("/") >= 2})
    assert rooms, "no room found: the walk does not go into subpackages"
    missing = [room for room in rooms if f"{room}/__init__.py" not in PATHS]
    assert not missing, f"these folders hold modules but no __init__.py: {missing}"
    eager = [f"{imp.where} imports {', '.join(imp.targets)}" for room in rooms
             for imp in IMPORTS[f"{room}/__init__.py"] if imp.targets != ("__future__",)]
    assert not eager, "a room's __init__ imports nothing (each module is imported by its own name): " + "; ".join(eager)
