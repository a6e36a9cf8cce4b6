"""DESIGN.md and its module map (docs/design/*.md) checked against the code where they name a module, a constant
or a rule, so the design cannot drift from what is built:

- **A path** it names (`io_loop/bridge.py`, `controller/checkpoints/`, `tests/docs/test_architecture.py`; on a
  module-map page also relative to its package, `sinks/sink.py`) exists, and **a name it gives a module**
  (`` `io_loop/waiting.py`'s `Expecting` ``) is defined at that module's top level.
- **A constant** it names in capitals (`HOPS`, `PULL_BATCH`) is defined in the product, and where the text gives its
  value beside it, written `` `LAG_INTERVAL_S` (0.1 s) ``, the code's value is that value (a name ending ``_S`` is
  in seconds, ``_MS`` in milliseconds; the text may say µs, ms or s).
- **A rule it states that a test pins names that test**: each statement of ``PINNED`` is in DESIGN.md, and a test
  whose name says the statement exists (``test_io_loop_is_a_leaf_…`` for "io_loop is a leaf"), so renaming
  either, or dropping the test, fails here.

Each check is also shown a literal text that breaks it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from forkless.controller.config import VARIABLES

ROOT = Path(__file__).resolve().parents[2]
VARIABLE_NAMES = {variable.env for variable in VARIABLES}
PAGES = ("DESIGN.md", *sorted(f"docs/design/{p.name}" for p in (ROOT / "docs" / "design").glob("*.md")))
PACKAGES = ("controller", "io_loop")  # the links at the top to forkless/controller and forkless/io_loop
# paths the pages name that are not this repository's: bytewax's connector room, the model of ours
FOREIGN_PATHS = {"connectors/kafka"}
# names in capitals that are not the product's constants: systemd's environment, read by controller/lifetime/sdnotify.py
FOREIGN_NAMES = {"NOTIFY_SOCKET", "WATCHDOG_USEC"}
UNITS_S = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}


def _text(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


def _package_of(page: str) -> str | None:
    """The package a module-map page lists (docs/design/io_loop-rooms.md: io_loop), whose modules it names
    relative to it; None for DESIGN.md, which writes every path from the repository's root."""
    name = Path(page).stem
    return next((package for package in PACKAGES if page.startswith("docs/design/") and name.startswith(package)),
                None)


def _module_file(named: str, page: str, root: Path) -> Path | None:
    """The file a page means by ``named`` (a path from the root, from the page's package, from either package where
    the page lists none, as DESIGN.md's rooms, or a module's bare file name found once in the product), or None."""
    package = _package_of(page)
    for base in (root, *(root / p for p in ((package,) if package else PACKAGES))):
        if (base / named).exists():
            return base / named
    if "/" not in named:
        found = [p for package in PACKAGES for p in (root / package).rglob(named)]
        if len(found) == 1:
            return found[0]
    return None


def missing_paths(text: str, page: str, root: Path = ROOT) -> list[str]:
    """Each path the page names that does not exist, and each ``path's `Name` `` its module does not define."""
    wrong = []
    for named in re.findall(r"`((?:[\w.-]+/)+[\w.-]*)`", text):
        if named.rstrip("/") not in FOREIGN_PATHS and "*" not in named and _module_file(named, page, root) is None:
            wrong.append(f"{page}: `{named}`: no such file or folder")
    for named, name in re.findall(r"`([\w/.-]+\.py)`'s `([A-Za-z_]\w*)", text):
        path = _module_file(named, page, root)
        if path is None:
            wrong.append(f"{page}: `{named}`: no such module")
        elif name not in top_level_names(path):
            wrong.append(f"{page}: `{named}`'s `{name}`: {named} defines no {name}")
    return wrong


def top_level_names(path: Path) -> set[str]:
    """What a module defines at its top level: functions, classes, assigned names."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
    return names


def constants(root: Path = ROOT, where: tuple[str, ...] = ("forkless/**/*.py",)) -> dict[str, dict[str, object]]:
    """name -> {module path: value} of every top-level assignment in capitals in the files ``where`` names, the
    product's by default (the value where it is a literal, else ``...``)."""
    found: dict[str, dict[str, object]] = {}
    for path in sorted(p for pattern in where for p in root.glob(pattern)):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Name) and re.fullmatch(r"[A-Z][A-Z0-9_]+", target.id):
                    try:
                        literal = ast.literal_eval(value)
                    except ValueError:
                        literal = ...
                    found.setdefault(target.id, {})[path.relative_to(root).as_posix()] = literal
    return found


def wrong_constants(text: str, page: str, known: dict[str, dict[str, object]],
                    elsewhere: frozenset[str] = frozenset()) -> list[str]:
    """Each constant the page names that the product (or ``elsewhere``: the tests' and the benchmark's, named
    only) does not define, and each value it gives one that is not the product's."""
    wrong = []
    for name in sorted(set(re.findall(r"`([A-Z][A-Z0-9]*_[A-Z0-9_]+|[A-Z]{3,})`", text))):
        if name.startswith("FORKLESS_") or f"FORKLESS_{name}" in VARIABLE_NAMES or name in FOREIGN_NAMES:
            continue  # a variable, with or without its prefix (tests/docs/test_docs.py holds each), or not ours
        if name not in known and name not in elsewhere:
            wrong.append(f"{page}: `{name}`: no such constant in the product")
    for name, said, unit in re.findall(r"`([A-Z][A-Z0-9_]+)`\s\((\d+(?:\.\d+)?)\s?(µs|ms|s)?\)", text):
        values = set(known.get(name, {}).values())
        if len(values) != 1:
            wrong.append(f"{page}: `{name}` ({said}{' ' + unit if unit else ''}): defined "
                         f"{'nowhere' if not values else 'with several values'} in the product")
            continue
        (value,) = values
        scale = 1.0
        if unit:
            code_unit = 1e-3 if name.endswith("_MS") else 1.0 if name.endswith("_S") else None
            if code_unit is None:
                wrong.append(f"{page}: `{name}` ({said} {unit}): a constant with a unit ends _S or _MS")
                continue
            scale = UNITS_S[unit] / code_unit
        if not isinstance(value, (int, float)) or abs(float(said) * scale - value) > 1e-12 * max(1.0, abs(value)):
            shown = f"{value} s" if name.endswith("_S") else f"{value} ms" if name.endswith("_MS") else f"{value}"
            wrong.append(f"{page}: `{name}` ({said}{' ' + unit if unit else ''}): the code says {shown}")
    return wrong


# ---- the rules DESIGN.md states, each with the test that pins it (its name says the statement) -------------------

PINNED = {
    "io_loop is a leaf": "test_io_loop_is_a_leaf_that_imports_nothing_from_controller",
    "No import cycle": "test_no_import_cycle_among_the_product_modules_counting_lazy_imports",
    "the core imports no threads": "test_core_imports_no_threads_event_loops_sockets_or_queues",
    "only the engine assigns the device state": "test_only_the_engine_assigns_the_device_state",
    "the controller never branches on a feed's kind": "test_the_controller_never_branches_on_a_feed_s_kind",
}
# a statement DESIGN.md makes that the code does not hold yet (issue 64 item 4 moves what branches into the
# connectors and adds its test): strict, so that the day the test exists this mark fails and is removed
NOT_YET_PINNED = {"the controller never branches on a feed's kind": "issue 64 item 4: config.py and feedspec.py still "
                                                                    "branch on a feed's kind"}


def _words(text: str) -> str:
    """``text`` as the words a test's name is made of: lower case, punctuation and articles dropped."""
    words = re.sub(r"[^a-z0-9]+", " ", text.replace("`", "").lower()).split()
    return "_".join(w for w in words if w not in {"a", "an", "the"})


def _test_names(root: Path = ROOT) -> set[str]:
    """The name of every test function under tests/."""
    return {node.name for path in (root / "tests").rglob("test_*.py")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def unpinned(statement: str, test: str, design: str, tests: set[str]) -> list[str]:
    """Why ``statement`` is not pinned by ``test``: DESIGN.md does not say it, the test does not exist, or its
    name does not say the statement."""
    wrong = []
    if _words(statement) not in _words(design):
        wrong.append(f"DESIGN.md no longer says {statement!r}")
    if test not in tests:
        wrong.append(f"{test}: no such test")
    if _words(statement) not in _words(test.removeprefix("test_").replace("_", " ")):
        wrong.append(f"{test}: its name does not say {statement!r}")
    return wrong


# ---- the checks on the real pages --------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_every_path_the_design_names_exists_and_defines_what_it_says(page):
    assert missing_paths(_text(page), page) == []


@pytest.mark.parametrize("page", PAGES)
def test_every_constant_the_design_names_is_the_code_s_with_the_value_it_gives(page):
    elsewhere = frozenset(constants(ROOT, ("tests/*.py", "bench/*.py")))
    assert wrong_constants(_text(page), page, constants(), elsewhere) == []


@pytest.mark.parametrize("statement", [
    pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=NOT_YET_PINNED[s])) if s in NOT_YET_PINNED else s
    for s in PINNED])
def test_a_rule_the_design_states_is_pinned_by_a_test_that_names_it(statement):
    assert unpinned(statement, PINNED[statement], _text("DESIGN.md"), _test_names()) == []


# ---- each check shown a literal text that breaks it ----------------------------------------------------------------


def test_the_path_check_names_a_module_that_does_not_exist_and_a_name_it_does_not_define():
    text = "the queues (`io_loop/bridge.py`), the lag (`io_loop/lagging.py`), `io_loop/waiting.py`'s `Expects`"
    assert missing_paths(text, "DESIGN.md") == ["DESIGN.md: `io_loop/lagging.py`: no such file or folder",
                                                "DESIGN.md: `io_loop/waiting.py`'s `Expects`: io_loop/waiting.py "
                                                "defines no Expects"]
    assert missing_paths("`sinks/sink.py`", "docs/design/io_loop-rooms.md") == []  # relative to its package


def test_the_constant_check_names_a_value_the_code_does_not_have_and_a_constant_it_lacks():
    known = constants()
    assert known["LAG_INTERVAL_S"] == {"forkless/io_loop/counters.py": 0.1}
    text = ("the lag is a `LAG_INTERVAL_S` (20 ms) timer's lateness; spin `SPIN_S` (2 ms) after; `NO_SUCH_LIMIT`; "
            "`LAG_INTERVAL_S` (0.1 s)")
    assert wrong_constants(text, "DESIGN.md", known) == [
        "DESIGN.md: `NO_SUCH_LIMIT`: no such constant in the product",
        "DESIGN.md: `LAG_INTERVAL_S` (20 ms): the code says 0.1 s"]


def test_the_rule_check_names_a_statement_without_its_test_and_a_test_that_does_not_say_it():
    design = "`io_loop` is a leaf: it imports nothing from `controller`."
    tests = {"test_io_loop_imports_nothing_from_controller"}
    assert unpinned("io_loop is a leaf", "test_io_loop_imports_nothing_from_controller", design, tests) == [
        "test_io_loop_imports_nothing_from_controller: its name does not say 'io_loop is a leaf'"]
    assert unpinned("io_loop is a leaf", "test_io_loop_is_a_leaf", "io_loop imports nothing", tests) == [
        "DESIGN.md no longer says 'io_loop is a leaf'", "test_io_loop_is_a_leaf: no such test"]
