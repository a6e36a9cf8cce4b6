"""Whether the GIL is on and why (io_loop/gil.py): the standard build says it has one; on a free-threaded build
an extension module that does not declare ``Py_mod_gil`` is built here with the C compiler and loaded in a
fresh interpreter (the GIL, once on, stays on for the process), before forkless, and must be named."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from forkless.io_loop import gil
from forkless.io_loop.gil import GilStatus, gil_status, log_gil
from tests.harness import ROOT, UNIT_S
from tests.races import FREE_THREADED

MODULE = "forkless_test_needs_gil"
# a module with no Py_mod_gil slot: CPython assumes it needs the GIL and turns it on when it is imported
SOURCE = f"""
#include <Python.h>
static struct PyModuleDef def = {{PyModuleDef_HEAD_INIT, "{MODULE}", NULL, 0, NULL}};
PyMODINIT_FUNC PyInit_{MODULE}(void) {{ return PyModuleDef_Init(&def); }}
"""


@pytest.mark.skipif(FREE_THREADED, reason="a standard build's answer; the free-threaded build's are below")
def test_a_build_with_a_gil_says_so():
    status = gil_status()
    assert (status.free_threaded, status.enabled, str(status)) == (False, True, "on: the build has a GIL")


def test_the_status_is_logged_once_for_each_text(caplog, monkeypatch):
    monkeypatch.setattr(gil, "_logged", set())  # as in a new process: nothing said yet
    log = logging.getLogger("forkless.test.gil")
    with caplog.at_level(logging.INFO, logger=log.name):
        log_gil(log)
        log_gil(log)
        monkeypatch.setattr(gil, "gil_status", lambda: GilStatus(True, True, "enabled by module 'x'", ("x",)))
        log_gil(log)  # another text: said once more
        log_gil(log)
    said = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert len(said) == 2, said
    assert f"the GIL is {'on' if gil_status().enabled else 'off'}" in said[0]
    assert "a free-threaded build: the GIL is on (enabled by module 'x')" in said[1]


def test_the_texts_say_on_or_off_and_why():
    assert str(GilStatus(True, False)) == "off"
    assert str(GilStatus(True, True, "enabled by module 'x'", ("x",))) == "on: enabled by module 'x'"
    assert str(GilStatus(True, False, "PYTHON_GIL=0 keeps it off, though module 'x' needs it", ("x",))).startswith(
        "off: PYTHON_GIL=0")


@pytest.fixture(scope="module")
def needs_gil(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the extension module, built for this interpreter."""
    if not FREE_THREADED:
        pytest.skip("the GIL is on already: a module that turns it on says nothing here")
    compiler = shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc")
    include = Path(sysconfig.get_paths()["include"])
    if compiler is None or not (include / "Python.h").is_file():
        pytest.skip("no C compiler or no Python.h for this interpreter: the module cannot be built")
    folder = tmp_path_factory.mktemp("needs_gil")
    (folder / f"{MODULE}.c").write_text(SOURCE)
    target = folder / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([compiler, "-shared", "-fPIC", f"-I{include}", str(folder / f"{MODULE}.c"), "-o", str(target)],
                   check=True, capture_output=True, timeout=60 * UNIT_S)
    return folder


def _status_in_a_fresh_interpreter(folder: Path, *, first: str = "", env: dict[str, str] | None = None,
                                   args: tuple[str, ...] = ()) -> dict:
    """``gil_status()`` in a new process of this interpreter that runs ``first`` (one line) before it."""
    code = textwrap.dedent(f"""
        import json, warnings
        warnings.simplefilter("default")
        {first}
        from forkless.io_loop import gil
        status = gil.gil_status()
        print(json.dumps({{"text": str(status), "enabled": status.enabled, "modules": list(status.modules)}}))
    """)
    environment = {name: value for name, value in os.environ.items() if name != "PYTHON_GIL"}
    environment.update(PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]), **(env or {}))
    done = subprocess.run([sys.executable, *args, "-c", code], env=environment, capture_output=True, text=True,
                          timeout=60 * UNIT_S, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.threads
def test_a_module_that_turned_the_gil_on_is_named_though_imported_before_forkless(needs_gil):
    status = _status_in_a_fresh_interpreter(needs_gil, first=f"import {MODULE}")
    assert status == {"text": f"on: enabled by module '{MODULE}'", "enabled": True, "modules": [MODULE]}


@pytest.mark.threads
def test_the_module_is_named_from_cpythons_warning_where_its_declaration_cannot_be_read(needs_gil):
    """An interpreter whose module objects are laid out otherwise (not 3.13's or 3.14's): the warning CPython
    gave when the module turned the GIL on, kept in a warnings registry, names it."""
    status = _status_in_a_fresh_interpreter(needs_gil, first=f"import {MODULE}; import forkless.io_loop.gil as g; "
                                            "g._LAYOUTS = ()")
    assert status["text"] == f"on: enabled by module '{MODULE}'"


@pytest.mark.threads
def test_without_such_a_module_the_gil_stays_off(needs_gil):
    assert _status_in_a_fresh_interpreter(needs_gil)["text"] == "off"


@pytest.mark.threads
def test_the_gil_asked_for_on_the_command_line_or_kept_off_is_said(needs_gil):
    assert _status_in_a_fresh_interpreter(needs_gil, env={"PYTHON_GIL": "1"})["text"] == "on: PYTHON_GIL=1"
    assert _status_in_a_fresh_interpreter(needs_gil, args=("-X", "gil=1"))["text"] == "on: -X gil=1"
    kept_off = _status_in_a_fresh_interpreter(needs_gil, first=f"import {MODULE}", env={"PYTHON_GIL": "0"})
    assert kept_off == {"text": f"off: PYTHON_GIL=0 keeps it off, though module '{MODULE}' needs it",
                        "enabled": False, "modules": [MODULE]}
