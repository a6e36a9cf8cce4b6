"""The import path before ``forkless`` (``import controller``, ``from io_loop.source import Source``), in a checkout.

Rules:
- Only a checkout on ``sys.path`` has top-level ``controller`` and ``io_loop`` folders (an installed forkless holds
  them inside ``forkless/``): importing one of them by its old name gives the very modules of ``forkless.controller``
  or ``forkless.io_loop`` (one module object per file, so classes and exceptions are the same), with one
  ``FutureWarning`` naming the fix. A program's own ``controller.py`` beside it is found first, as Python always did.
- ``alias`` is called by the package's ``__init__`` when it runs under its old name; a meta-path finder then maps
  each ``controller.X`` / ``io_loop.X`` to ``forkless.controller.X`` / ``forkless.io_loop.X``; a module since
  moved into a room is found by its old name too (``MOVED``).
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
# the modules that moved into a room (rooms.py, issue 47): an old name finds the module's new one
MOVED = {
    "controller.check": "controller.commands.check",
    "controller.checkpoint": "controller.checkpoints.checkpoint",
    "controller.checkpointer": "controller.checkpoints.checkpointer",
    "controller.ckptformat": "controller.checkpoints.ckptformat",
    "controller.cli": "controller.commands.cli",
    "controller.compiled": "controller.device.compiled",
    "controller.feedspec": "controller.settings.feedspec",
    "controller.host": "controller.lifetime.host",
    "controller.layouts": "controller.device.layouts",
    "controller.lifecycle": "controller.lifetime.lifecycle",
    "controller.partitioned": "controller.partitions.partitioned",
    "controller.placement": "controller.device.placement",
    "controller.positions": "controller.checkpoints.positions",
    "controller.programs": "controller.device.programs",
    "controller.recovery": "controller.checkpoints.recovery",
    "controller.relaycmd": "controller.commands.relaycmd",
    "controller.rowcopy": "controller.checkpoints.rowcopy",
    "controller.serving": "controller.lifetime.serving",
    "controller.snapshot": "controller.checkpoints.snapshot",
    "controller.values": "controller.settings.values",
    "controller.vardocs": "controller.settings.vardocs",
    "controller.variables": "controller.settings.variables",
    "controller.weights": "controller.device.weights",
    "io_loop.aiohttp_compat": "io_loop.net.aiohttp_compat",
    "io_loop.before_connect": "io_loop.sources.before_connect",
    "io_loop.client": "io_loop.sources.client",
    "io_loop.connect": "io_loop.sources.connect",
    "io_loop.demo_feed": "io_loop.sources.demo_feed",
    "io_loop.demo_source": "io_loop.sources.demo_source",
    "io_loop.deployment": "io_loop.nats.deployment",
    "io_loop.http": "io_loop.net.http",
    "io_loop.jetstream": "io_loop.sources.jetstream",
    "io_loop.jsconsumer": "io_loop.sources.jsconsumer",
    "io_loop.jsprobe": "io_loop.sources.jsprobe",
    "io_loop.jspublish": "io_loop.sources.jspublish",
    "io_loop.leases": "io_loop.nats.leases",
    "io_loop.nats_compat": "io_loop.nats.nats_compat",
    "io_loop.natsconn": "io_loop.nats.natsconn",
    "io_loop.natsstore": "io_loop.nats.natsstore",
    "io_loop.netaddr": "io_loop.net.netaddr",
    "io_loop.objects": "io_loop.nats.objects",
    "io_loop.on_connect": "io_loop.sources.on_connect",
    "io_loop.partitions": "io_loop.sources.partitions",
    "io_loop.probe": "io_loop.sources.probe",
    "io_loop.relay": "io_loop.relay.publisher",
    "io_loop.relaystats": "io_loop.relay.relaystats",
    "io_loop.relogin": "io_loop.sources.relogin",
    "io_loop.storethread": "io_loop.nats.storethread",
    "io_loop.unixsocket": "io_loop.net.unixsocket",
}


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
        module = importlib.import_module("forkless." + MOVED.get(spec.name, spec.name))
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
