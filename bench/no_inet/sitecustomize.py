"""Loaded by every Python process of a ``FORKLESS_BENCH_UNIX=1`` benchmark run (``bench.unix.child_env``
puts this folder first on ``PYTHONPATH``): such a process may open no TCP or UDP socket, as on
the lent TPU host (``bench.unix.refuse_inet``). Not a package: Python imports this file by its
name at start-up, before the script's folder is on ``sys.path``, so ``bench/unix.py`` (standard
library imports only) is loaded from its path. A ``sitecustomize`` this one hides (one of the
interpreter's own, further on ``sys.path``) is run after it, as it would have been without it."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path) -> None:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if name == "_forkless_bench_unix":
        module.refuse_inet()


if os.environ.get("FORKLESS_BENCH_UNIX", "") == "1":
    _load("_forkless_bench_unix", _HERE.parent / "unix.py")

for _entry in sys.path:  # the sitecustomize this one hides, if any
    _other = Path(_entry or ".").resolve() / "sitecustomize.py"
    if _other.parent != _HERE and _other.is_file():
        _load("_hidden_sitecustomize", _other)
        break
