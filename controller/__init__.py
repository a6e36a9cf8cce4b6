"""The main-thread side: configuration, codec, batching, processors, statistics, the loop.

Imported as ``forkless.controller`` (forkless/__init__.py says why). The user API is ``forkless``'s
(``from forkless import Controller``); its names are found here too, lazily, so reading the configuration
(``app.py``'s first step, which must fail fast on a bad variable) does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

from forkless import __all__  # the user API's names (forkless/__init__.py imports nothing heavy)

if __name__ == "controller":  # imported by its old top-level name, in a checkout: forkless/_oldpath.py
    from forkless._oldpath import alias

    alias(__name__)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'forkless.controller' has no attribute {name!r}")
    return getattr(importlib.import_module("forkless"), name)
