"""forkless: an asyncio feed and a JAX loop in one process, no fork. ``from forkless import Controller, Source, …``.

The repository keeps its two packages at the top (``controller/``, the main thread; ``io_loop/``, the IO thread);
they are imported as ``forkless.controller`` and ``forkless.io_loop``: installed as such (pyproject.toml), and in a
checkout through this package's path. So a program's own ``controller.py`` or ``io_loop.py`` beside it shadows
neither its own imports of forkless nor forkless's imports of itself. The public names below are imported lazily,
so reading the configuration (the program's first step, which must fail fast on a bad variable) does not import JAX.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

if not os.path.isdir(os.path.join(os.path.dirname(__file__), "controller")):
    # a checkout: controller/ and io_loop/ sit beside this folder, not inside it (an installed copy holds them)
    __path__.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the user API, each name from the module that defines it
_EXPORTS = {
    "Batch": "forkless.controller.batching",
    "Codec": "forkless.controller.codec",
    "Decoded": "forkless.controller.codec",
    "JsonCodec": "forkless.controller.codec",
    "Config": "forkless.controller.config",
    "Controller": "forkless.controller.loop",
    "Handshake": "forkless.io_loop.sources.before_connect",
    "EWMAState": "forkless.controller.processor",
    "Processor": "forkless.controller.processor",
    "StateShape": "forkless.controller.processor",
    "default_processor": "forkless.controller.processor",
    "ewma_processor": "forkless.controller.processor",
    "stream_processor": "forkless.controller.processor",
    "StatsSnapshot": "forkless.controller.stats",
    "CheckpointStore": "forkless.controller.checkpoints.checkpointer",
    "setup_logging": "forkless.controller.logs",
    "ForklessError": "forkless.io_loop.errors",
    "CheckpointMismatch": "forkless.controller.errors",
    "ConfigError": "forkless.controller.errors",
    "DeploymentMismatch": "forkless.io_loop.errors",
    "FeedFatal": "forkless.io_loop.errors",
    "IOThreadError": "forkless.io_loop.errors",
    "LeaseHeld": "forkless.io_loop.errors",
    "LeaseLost": "forkless.io_loop.errors",
    "MetricsServerError": "forkless.io_loop.errors",
    "PositionLost": "forkless.io_loop.errors",
    "ProcessorContractError": "forkless.controller.errors",
    "StoreError": "forkless.io_loop.errors",
    "ReplyBatch": "forkless.io_loop.writer",
    "Source": "forkless.io_loop.source",
    "SourceContext": "forkless.io_loop.source",
    "SourceStopped": "forkless.io_loop.source",
    "Relogin": "forkless.io_loop.sources.relogin",
    "Backoff": "forkless.io_loop.backoff",
    "SendFailed": "forkless.io_loop.sends",
    "Sink": "forkless.io_loop.sinks.sink",
    "SinkBatch": "forkless.io_loop.sinks.sink",
    "SinkContext": "forkless.io_loop.sinks.sink",
    "SinkStats": "forkless.io_loop.sinks.sink",
    "MessageBatch": "forkless.io_loop.sinks.sink",
    "EventBatch": "forkless.io_loop.sinks.sink",
    "ResultBatch": "forkless.io_loop.sinks.sink",
    "SinkRun": "forkless.controller.lifetime.sinkrun",
    "SinkView": "forkless.controller.lifetime.sinkrun",
    "IOPortal": "forkless.io_loop.portal",
    "PortalClosed": "forkless.io_loop.portal",
    "WorkerFailed": "forkless.io_loop.portal",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'forkless' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
