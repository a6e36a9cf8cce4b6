"""The IO side: the IO thread, one asyncio loop with every feed's socket (the checkpoint and lease
store keeps its own thread and NATS connection: ``io_loop/natsstore.py``).

A leaf: nothing here imports ``controller``. Names are imported lazily, so importing one small
module (``io_loop.backoff``, ``io_loop.netaddr``, the settings) loads neither janus nor aiohttp.
"""

from __future__ import annotations

import importlib
from typing import Any

# the IO side's public part: the exceptions, your own source, your own coroutine on the IO thread
# (the controller re-exports each, where the documents name it); the rest is imported from its module
_EXPORTS = {
    "DeploymentMismatch": "io_loop.errors",
    "FeedFatal": "io_loop.errors",
    "ForklessError": "io_loop.errors",
    "IOThreadError": "io_loop.errors",
    "LeaseHeld": "io_loop.errors",
    "LeaseLost": "io_loop.errors",
    "MetricsServerError": "io_loop.errors",
    "PositionLost": "io_loop.errors",
    "StoreError": "io_loop.errors",
    "Handshake": "io_loop.before_connect",
    "IOPortal": "io_loop.portal",
    "PortalClosed": "io_loop.portal",
    "WorkerFailed": "io_loop.portal",
    "ReplyBatch": "io_loop.source",
    "Source": "io_loop.source",
    "SourceContext": "io_loop.source",
    "SourceStopped": "io_loop.source",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'io_loop' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
