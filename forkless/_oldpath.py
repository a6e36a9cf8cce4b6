"""The import path before ``forkless`` (``import controller``, ``from io_loop.source import Source``), in a checkout.

Rules:
- Only a checkout on ``sys.path`` has top-level ``controller`` and ``io_loop`` folders (an installed forkless holds
  them inside ``forkless/``): importing one of them by its old name gives the very modules of ``forkless.controller``
  or ``forkless.io_loop`` (one module object per file, so classes and exceptions are the same), with one
  ``FutureWarning`` naming the fix. A program's own ``controller.py`` beside it is found first, as Python always did.
- ``alias`` is called by the package's ``__init__`` when it runs under its old name; a meta-path finder then maps
  each ``controller.X`` / ``io_loop.X`` to ``forkless.controller.X`` / ``forkless.io_loop.X``.
- The user API has one import path, ``forkless``: the packages themselves export nothing. Only under the old name do
  they still answer its names (``from controller import Config``, ``io_loop.IOPortal``: ``old_name_attribute``), as
  they did before; ``io_loop`` only its own, so it stays a leaf.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

OLD_NAMES = ("controller", "io_loop")


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``controller.X`` / ``io_loop.X`` as the already-imported (or now imported) ``forkless.…`` module."""

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}  # a module's own spec, between create_module and exec_module

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        top, dot, _ = fullname.partition(".")
        if not dot or top not in OLD_NAMES or getattr(sys.modules.get(top), "__name__", "") != "forkless." + top:
            return None  # not ours: a program's own controller package, or no alias made
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        module = importlib.import_module("forkless." + spec.name)
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system gave the module this alias's spec: it keeps its own (forkless.…)
        module.__spec__ = self._specs.pop(module.__name__, module.__spec__)


_FINDER = _OldPathFinder()


def alias(name: str) -> None:
    """``name`` (``"controller"`` or ``"io_loop"``) is being imported by its old top-level name: make it the
    ``forkless.`` package, and its submodules too, and say once how to import it now."""
    real = importlib.import_module("forkless." + name)
    sys.modules[name] = real  # what the import statement now returns
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    warnings.warn(f"'import {name}' is forkless's old import path: write 'from forkless import …' "
                  f"(or 'forkless.{name}.…' for a module of its own); the old path works in a checkout only",
                  FutureWarning, stacklevel=3)


def old_name_attribute(package: str, name: str) -> Any:
    """``controller.X`` / ``io_loop.X`` (a package's module ``__getattr__``): the user API's ``X`` for a program
    that imported the package by its old name; ``AttributeError`` naming the one path otherwise."""
    forkless = importlib.import_module("forkless")
    module = forkless._EXPORTS.get(name, "")
    if sys.modules.get(package) is sys.modules.get("forkless." + package) and module.startswith(
            "forkless.io_loop." if package == "io_loop" else "forkless."):
        return getattr(forkless, name)
    hint = f": write 'from forkless import {name}'" if module else ""
    raise AttributeError(f"module 'forkless.{package}' has no attribute {name!r}{hint}")
