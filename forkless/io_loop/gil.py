"""Whether this interpreter runs with the GIL, and why: said once at a start, in ``stats()`` and on /metrics.

On free-threaded CPython (PEP 703) an extension module that has not declared it runs without the GIL turns it back
on for the whole process when imported, and a user should be told which one did.

Rules:
- ``gil_status()`` reads the interpreter as it is now: the build (``Py_GIL_DISABLED``), whether the GIL is on
  (``sys._is_gil_enabled()``; absent before 3.13: on), and on a free-threaded build why: ``-X gil=1``,
  ``PYTHON_GIL=1`` (unless ``-E``/``-I``), or the extension modules loaded that need it; ``str(status)`` is its text.
- Which modules need it is read from the modules themselves, so one imported before forkless is named too:
  ``_needing_gil`` reads each module object's ``md_gil`` with ``ctypes``, only where the layout is one it knows
  (``_LAYOUTS``: the size checked, every value one of the slot's two); elsewhere the warning is looked for in the
  modules' warning registries; failing both, the reason is unknown. Named in import order: the first turned it on.
- The modules are read again only when the GIL's state or the number of modules changed (``stats()`` runs every
  scrape).
- ``log_gil(log)`` logs each distinct status once per process: INFO, WARNING when a free-threaded build runs with
  the GIL on.
- Any thread: nothing is written but the last status (one reference, replaced whole) and the texts logged (a set,
  behind a lock).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import sysconfig
import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["GilStatus", "gil_status", "log_gil"]

# CPython's warning when an extension module that does not declare Py_mod_gil turns the GIL on (Python/import.c)
_ENABLED_BY = re.compile(r"The global interpreter lock \(GIL\) has been enabled to load module '([^']+)'")
_LAYOUTS = ((3, 13), (3, 14))  # versions whose PyModuleObject ends in md_gil after five pointers
_GIL_USED, _GIL_NOT_USED = 0, 1  # Py_MOD_GIL_USED, Py_MOD_GIL_NOT_USED: (void *)0 and (void *)1
_FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))  # the build's: fixed for the process


@dataclass(frozen=True)
class GilStatus:
    """Whether the GIL is on and why (see the module rules). ``modules``: the extension modules loaded that
    need it, in the order imported (a free-threaded build only)."""

    free_threaded: bool  # the build is free-threaded (PEP 703)
    enabled: bool  # the GIL is on now
    why: str = ""  # why it is on ("the build has a GIL", "PYTHON_GIL=1", "enabled by module 'x'", …)
    modules: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.enabled:
            return f"on: {self.why}"
        return f"off: {self.why}" if self.why else "off"


_last: tuple[tuple[bool, int], GilStatus] | None = None  # (enabled, modules loaded) and what it made
_logged: set[str] = set()
_logged_lock = threading.Lock()


def gil_status() -> GilStatus:
    """The GIL's status now (module rules); any thread."""
    global _last
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    enabled = True if is_enabled is None else bool(is_enabled())
    if not _FREE_THREADED:
        return GilStatus(False, enabled, "the build has a GIL")
    key = (enabled, len(sys.modules))
    last = _last
    if last is not None and last[0] == key:
        return last[1]
    status = _free_threaded_status(enabled)
    _last = (key, status)
    return status


def log_gil(log: logging.Logger) -> GilStatus:
    """Log the GIL's status, once per process for each distinct text (module rules); the status."""
    status = gil_status()
    text = str(status)
    with _logged_lock:
        if text in _logged:
            return status
        _logged.add(text)
    build = "a free-threaded build" if status.free_threaded else "a build with a GIL"
    why = f" ({status.why})" if status.free_threaded and status.why else ""
    head = f"Python {sys.version.split()[0]}, {build}: the GIL is {'on' if status.enabled else 'off'}{why}"
    if status.free_threaded and status.enabled:
        log.warning("%s, so the threads take turns as under a GIL (PYTHON_GIL=0 or -X gil=0 keeps it off, at the "
                    "risk of the modules that need it)", head)
    elif status.modules:
        log.warning("%s: those modules run without the lock they declared they need", head)
    else:
        log.info("%s", head)
    return status


def _free_threaded_status(enabled: bool) -> GilStatus:
    """A free-threaded build's status: why the GIL is on, or whether it is kept off despite modules needing it."""
    forced = _forced()
    modules = _needing_gil()
    named = f"module '{modules[0]}'" if len(modules) == 1 else "modules " + ", ".join(f"'{m}'" for m in modules)
    if not enabled:
        return GilStatus(True, False, f"{forced} keeps it off, though {named} need{'s' if len(modules) == 1 else ''} it"
                         if forced and modules else "", modules)
    if forced:
        return GilStatus(True, True, forced, modules)
    if modules:
        return GilStatus(True, True, f"enabled by {named}", modules)
    return GilStatus(True, True, "enabled, by a module no longer loaded or for a reason unknown", modules)


def _forced() -> str:
    """How the GIL was set on or off from the command line or the environment ("" where it was not)."""
    option = getattr(sys, "_xoptions", {}).get("gil")
    if option is not None:
        return f"-X gil={option}"
    value = os.environ.get("PYTHON_GIL")
    if value is not None and not sys.flags.ignore_environment:
        return f"PYTHON_GIL={value}"
    return ""


def _needing_gil() -> tuple[str, ...]:
    """The extension modules loaded that need the GIL, in the order imported (module rules)."""
    modules = sys.modules.copy()  # one copy: another thread may import meanwhile (iterating it would raise)
    named = _by_declaration(modules)
    if named is None:
        named = _by_warning(modules)
    return named


def _by_declaration(modules: Mapping[str, object]) -> tuple[str, ...] | None:
    """The modules whose ``md_gil`` says they need the GIL; None where the layout is not the one known."""
    pointer = ctypes.sizeof(ctypes.c_void_p)
    head = object.__basicsize__
    if sys.version_info[:2] not in _LAYOUTS or types.ModuleType.__basicsize__ != head + 6 * pointer:
        return None
    def_at, gil_at = head + pointer, head + 5 * pointer  # md_dict, md_def, md_state, md_weaklist, md_name, md_gil
    needing = []
    for name, module in modules.items():
        if not isinstance(module, types.ModuleType):  # anything may be put in sys.modules
            continue
        address = id(module)  # the module is alive: ``modules`` holds it
        if not ctypes.c_void_p.from_address(address + def_at).value:
            continue  # made from Python, not from an extension's PyModuleDef: it declares nothing
        gil = ctypes.c_void_p.from_address(address + gil_at).value or _GIL_USED
        if gil not in (_GIL_USED, _GIL_NOT_USED):
            return None  # not the slot: the layout is not the one known
        if gil == _GIL_USED:
            needing.append(name)
    return tuple(needing)


def _by_warning(modules: Mapping[str, object]) -> tuple[str, ...]:
    """The module CPython's warning named, where a warning registry kept it (module rules)."""
    for module in modules.values():
        registry = getattr(module, "__warningregistry__", None)
        if isinstance(registry, dict):
            for key in registry.copy():  # a copy: another thread may warn meanwhile
                found = _ENABLED_BY.search(key[0]) if isinstance(key, tuple) and key and isinstance(key[0], str) \
                    else None
                if found:
                    return (found.group(1),)
    return ()
