"""The main-thread side: configuration, codec, batching, processors, statistics, the loop.

Names are imported lazily, so reading the configuration (``app.py``'s first step, which
must fail fast on a bad variable) does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

# the user API, each name from the module that defines it (one import path per type: ``controller.X``);
# internals (``GuardedCodec``, ``compilations``, …) are imported from their modules
_EXPORTS = {
    "Batch": "controller.batching",
    "Codec": "controller.codec",
    "Decoded": "controller.codec",
    "JsonCodec": "controller.codec",
    "Config": "controller.config",
    "Controller": "controller.loop",
    "Handshake": "io_loop.before_connect",
    "EWMAState": "controller.processor",
    "Processor": "controller.processor",
    "default_processor": "controller.processor",
    "ewma_processor": "controller.processor",
    "stream_processor": "controller.processor",
    "StatsSnapshot": "controller.stats",
    "setup_logging": "controller.logs",
    "ForklessError": "controller.errors",
    "CheckpointMismatch": "controller.errors",
    "ConfigError": "controller.errors",
    "DeploymentMismatch": "controller.errors",
    "FeedFatal": "controller.errors",
    "IOThreadError": "controller.errors",
    "LeaseHeld": "controller.errors",
    "LeaseLost": "controller.errors",
    "MetricsServerError": "controller.errors",
    "PositionLost": "controller.errors",
    "ProcessorContractError": "controller.errors",
    "StoreError": "controller.errors",
    "ReplyBatch": "io_loop.source",
    "Source": "io_loop.source",
    "SourceContext": "io_loop.source",
    "SourceStopped": "io_loop.source",
    "IOPortal": "io_loop.portal",
    "PortalClosed": "io_loop.portal",
    "WorkerFailed": "io_loop.portal",
    "Relogin": "io_loop.relogin",
    "SendFailed": "io_loop.relogin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'controller' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
