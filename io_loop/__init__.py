"""The IO side: the IO thread, one asyncio loop with every feed's socket (the checkpoint and lease
store keeps its own thread and NATS connection: ``io_loop/natsstore.py``).

A leaf: nothing here imports ``controller``. Names are imported lazily, so importing one small
module (``io_loop.backoff``, ``io_loop.netaddr``, the settings) loads neither janus nor aiohttp.
"""

from __future__ import annotations

import importlib
from typing import Any

if __name__ == "io_loop":  # imported by its old top-level name, in a checkout: forkless/_oldpath.py
    from forkless._oldpath import alias

    alias(__name__)

# the IO side's public part: the exceptions, your own source, your own coroutine on the IO thread
# (the controller re-exports each, where the documents name it); the rest is imported from its module
_EXPORTS = {
    "DeploymentMismatch": "forkless.io_loop.errors",
    "FeedFatal": "forkless.io_loop.errors",
    "ForklessError": "forkless.io_loop.errors",
    "IOThreadError": "forkless.io_loop.errors",
    "LeaseHeld": "forkless.io_loop.errors",
    "LeaseLost": "forkless.io_loop.errors",
    "MetricsServerError": "forkless.io_loop.errors",
    "PositionLost": "forkless.io_loop.errors",
    "StoreError": "forkless.io_loop.errors",
    "Handshake": "forkless.io_loop.before_connect",
    "IOPortal": "forkless.io_loop.portal",
    "PortalClosed": "forkless.io_loop.portal",
    "WorkerFailed": "forkless.io_loop.portal",
    "ReplyBatch": "forkless.io_loop.source",
    "Source": "forkless.io_loop.source",
    "SourceContext": "forkless.io_loop.source",
    "SourceStopped": "forkless.io_loop.source",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'io_loop' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
