"""Loaded by every Python process of a ``FORKLESS_BENCH_UNIX=1`` benchmark run (``bench.unix.child_env``
puts this folder first on ``PYTHONPATH``): such a process may open no TCP or UDP socket, as on
the lent TPU host (``bench.unix.refuse_inet``). Not a package: Python imports this file by its
name at start-up, before the script's folder is on ``sys.path``, so ``bench/unix.py`` (standard
library imports only) is loaded from its path."""

from __future__ import annotations

import os

if os.environ.get("FORKLESS_BENCH_UNIX", "") == "1":
    import importlib.util
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location("_forkless_bench_unix", Path(__file__).resolve().parent.parent
                                                   / "unix.py")
    assert _spec is not None and _spec.loader is not None
    _unix = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_unix)
    _unix.refuse_inet()
