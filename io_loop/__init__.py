"""The IO side: one thread, one asyncio loop, every socket.

A leaf: nothing here imports ``controller``. Names are imported lazily, so importing one small
module (``io_loop.backoff``, ``io_loop.netaddr``, the settings) loads neither janus nor aiohttp.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Bridge": "io_loop.bridge",
    "MainSide": "io_loop.bridge",
    "FeedClient": "io_loop.client",
    "FeedFatal": "io_loop.errors",
    "IOThreadError": "io_loop.errors",
    "MetricsServerError": "io_loop.errors",
    "FeedSpec": "io_loop.settings",
    "IOSettings": "io_loop.settings",
    "IOPortal": "io_loop.portal",
    "PortalClosed": "io_loop.portal",
    "WorkerFailed": "io_loop.portal",
    "IOThread": "io_loop.thread",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'io_loop' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
