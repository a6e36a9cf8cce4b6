"""The main-thread side: configuration, codec, batching, processors, statistics, the loop.

Imported as ``forkless.controller`` (forkless/__init__.py says why). The user API is ``forkless``'s alone
(``from forkless import Controller``); this package exports nothing, and each module's ``__all__`` lists only
what that module defines. Importing it loads nothing else, so reading the configuration (``app.py``'s first step,
which must fail fast on a bad variable) does not import JAX.
"""

from __future__ import annotations

from typing import Any

from forkless._oldpath import old_name_attribute

if __name__ == "controller":  # imported by its old top-level name, in a checkout: forkless/_oldpath.py
    from forkless._oldpath import alias

    alias(__name__)


def __getattr__(name: str) -> Any:
    return old_name_attribute("controller", name)  # a program on the old path's names; otherwise AttributeError
