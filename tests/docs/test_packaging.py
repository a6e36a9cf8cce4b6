"""forkless installs as a package: a wheel holding ``forkless`` with controller/ and io_loop/ inside it (not bench,
not tests), the dependencies of requirements.txt, and a ``forkless`` console script that is ``python app.py``.
Built with pip from the repository's own pyproject.toml. A program's own ``controller.py`` or ``io_loop.py`` beside
it shadows nothing of forkless, installed or in a checkout; in a checkout, as installed, ``forkless.controller`` and
``forkless.io_loop`` are forkless's only packages, real folders inside ``forkless/`` (the top-level ``controller``
and ``io_loop`` are links to them, and no import path of their own)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import forkless

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The wheel, and a directory it is installed into (without dependencies: this
    interpreter already has them)."""
    tmp = tmp_path_factory.mktemp("pkg")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(ROOT)],
                   check=True, capture_output=True, text=True, timeout=240)
    (wheel,) = (tmp / "dist").glob("forkless-*.whl")
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=240)
    return wheel, target


def _env(target: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKLESS_") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), JAX_PLATFORMS="cpu")
    return env


def _requirements() -> list[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return sorted(line.split("#")[0].strip() for line in lines if line.split("#")[0].strip())


def test_the_wheel_holds_forkless_alone_and_the_requirements(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        tops = {n.split("/")[0] for n in names}
        meta = z.read(next(n for n in names if n.endswith("dist-info/METADATA"))).decode()
        entry = z.read(next(n for n in names if n.endswith("dist-info/entry_points.txt"))).decode()
    assert tops == {"forkless", wheel.name.split("-py3")[0] + ".dist-info"}
    assert {"forkless/controller/loop.py", "forkless/io_loop/source.py", "forkless/controller/checkpoints/snapshot.py",
            "forkless/io_loop/connectors/websocket/client.py"} <= set(names)
    requires = sorted(line.removeprefix("Requires-Dist: ") for line in meta.splitlines()
                      if line.startswith("Requires-Dist: ") and "extra ==" not in line)
    extras = [line for line in meta.splitlines() if line.startswith("Requires-Dist: ") and "extra ==" in line]
    norm = lambda r: r.replace(" ", "").split("<")[0].split(">")[0].lower()
    assert sorted(map(norm, requires)) == sorted(map(norm, _requirements()))
    assert [norm(e.split(";")[0].removeprefix("Requires-Dist: ")) for e in extras] == ["nats-py"]  # ".[nats]"
    assert "forkless = forkless.controller.commands.cli:console_main" in entry
    assert f"\nVersion: {forkless.__version__}\n" in meta  # written once, in forkless/__init__.py


def test_the_installed_packages_import_from_any_directory(installed, tmp_path):
    _, target = installed
    proc = subprocess.run([sys.executable, "-c", "import forkless.controller as c; print(c.__file__)"],
                          cwd=tmp_path, env=_env(target), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(target / "forkless" / "controller" / "__init__.py")


def test_the_console_script_is_the_app(installed, tmp_path):
    _, target = installed
    script = target / "bin" / "forkless"
    help_ = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, env=_env(target),
                           capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0, help_.stderr
    assert help_.stdout.startswith("usage: forkless [-h] [--check]") and "FORKLESS_WS_URL" in help_.stdout
    bad = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**_env(target), "FORKLESS_ALPHA": "2"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("forkless: configuration error: FORKLESS_ALPHA='2' is invalid: "
                                  "expected a number in (0, 1]")


# a user's program folder: his own controller.py and io_loop.py (the seed's program names its class Controller)
SHADOWING = {
    "controller.py": "class Controller:\n    mine = True\n",
    "io_loop.py": "raise ImportError('the user program\\'s io_loop.py was imported by forkless')\n",
    "main.py": ("import controller\nfrom forkless import Config, Controller, Source, ewma_processor\n"
                "from forkless.io_loop.source import SourceContext\n"
                "assert controller.Controller.mine and Controller.__module__ == 'forkless.controller.loop'\n"
                "import forkless.controller.loop, forkless.io_loop.thread\n"
                "print('ok', Config().max_batch, Source.__module__)\n"),
}


def _program_folder(tmp_path: Path) -> Path:
    for name, text in SHADOWING.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_program_s_own_controller_py_shadows_nothing_installed(installed, tmp_path):
    _, target = installed
    folder = _program_folder(tmp_path)
    proc = subprocess.run([sys.executable, "main.py"], cwd=folder, env=_env(target), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "256", "forkless.io_loop.source"]


def test_a_program_s_own_controller_py_shadows_nothing_in_a_checkout(tmp_path):
    folder = _program_folder(tmp_path)
    env = {**_env(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "main.py"], cwd=folder, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "256", "forkless.io_loop.source"]


def test_a_checkout_imports_forkless_s_two_packages_and_nothing_else_of_the_repository_under_forkless(tmp_path):
    # bench/, tests/, app.py, gendocs.py and examples/ sit beside controller/ and io_loop/ in the repository: none of
    # them is a forkless module, as none is in the wheel
    code = ("import importlib, forkless.controller.loop, forkless.io_loop.source\n"
            "print(forkless.controller.loop.__file__, forkless.io_loop.source.__file__, *forkless.__path__)\n"
            "for name in ('bench', 'tests', 'app', 'gendocs', 'examples', 'forkless'):\n"
            "    try:\n"
            "        importlib.import_module('forkless.' + name)\n"
            "    except ModuleNotFoundError as exc:\n"
            "        assert exc.name == 'forkless.' + name, exc\n"
            "    else:\n"
            "        print('imported forkless.' + name)\n")
    env = {**_env(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(ROOT / "forkless" / "controller" / "loop.py"),
                                   str(ROOT / "forkless" / "io_loop" / "source.py"), str(ROOT / "forkless")]


def test_every_import_path_is_a_folder_on_disk_none_made_at_run_time():
    # a type checker, an IDE and an import-graph tool resolve forkless.controller.loop to forkless/controller/loop.py
    # in a plain checkout: the packages are real folders inside forkless/, and forkless/__init__.py maps nothing
    for name in ("controller", "io_loop"):
        folder = ROOT / "forkless" / name
        assert folder.is_dir() and not folder.is_symlink() and (folder / "__init__.py").is_file()
        link = ROOT / name  # the top level the project was specified with: a link to the package
        assert link.is_symlink() and link.resolve() == folder.resolve()
    init = (ROOT / "forkless" / "__init__.py").read_text()
    for runtime_path in ("spec_from_file_location", "sys.modules", "__path__", "sys.path"):
        assert runtime_path not in init


@pytest.mark.parametrize("statement", ["import controller", "from io_loop.source import Source",
                                       "import controller.loop"])
def test_the_checkout_s_folders_are_no_import_path_of_their_own(tmp_path, statement):
    # the old path (before forkless) would load a second copy of every module, whose classes are not forkless's
    env = {**_env(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", statement], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    name = statement.split()[1].split(".")[0]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ImportError: '{name}' is no import path of forkless: its packages are forkless.controller and "
        f"forkless.io_loop (write 'from forkless import …', or 'import forkless.{name}.<module>')")
