"""forkless installs as a package: a wheel holding controller and io_loop (not bench, not
tests), the dependencies of requirements.txt, and a ``forkless`` console script that is
``python app.py``. Built with pip from the repository's own pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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


def test_the_wheel_holds_the_two_packages_and_the_requirements(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        tops = {n.split("/")[0] for n in names}
        meta = z.read(next(n for n in names if n.endswith("dist-info/METADATA"))).decode()
        entry = z.read(next(n for n in names if n.endswith("dist-info/entry_points.txt"))).decode()
    assert tops == {"controller", "io_loop", wheel.name.split("-py3")[0] + ".dist-info"}
    requires = sorted(line.removeprefix("Requires-Dist: ") for line in meta.splitlines()
                      if line.startswith("Requires-Dist: ") and "extra ==" not in line)
    extras = [line for line in meta.splitlines() if line.startswith("Requires-Dist: ") and "extra ==" in line]
    norm = lambda r: r.replace(" ", "").split("<")[0].split(">")[0].lower()
    assert sorted(map(norm, requires)) == sorted(map(norm, _requirements()))
    assert [norm(e.split(";")[0].removeprefix("Requires-Dist: ")) for e in extras] == ["nats-py"]  # ".[nats]"
    assert "forkless = controller.cli:console_main" in entry


def test_the_installed_packages_import_from_any_directory(installed, tmp_path):
    _, target = installed
    proc = subprocess.run([sys.executable, "-c", "import controller, io_loop; print(controller.__file__)"],
                          cwd=tmp_path, env=_env(target), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(target / "controller" / "__init__.py")


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
