"""forkless: an asyncio feed and a JAX loop in one process, no fork. ``from forkless import Controller, Source, …``.

Two packages: ``forkless.controller`` (the main thread) and ``forkless.io_loop`` (the IO thread), plain folders
inside this one, so that every tool resolves their imports to their files; the repository's top-level
``controller`` and ``io_loop`` are links to them. Being inside ``forkless``, a program's own ``controller.py`` or
``io_loop.py`` shadows nothing of them. The public names below are imported lazily, so reading the configuration
(the program's first step, which must fail fast on a bad variable) does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"  # the one place it is written: pyproject.toml reads it (tool.setuptools.dynamic)

# the user API, each name from the module that defines it
_EXPORTS = {
    "Batch": "forkless.controller.batching",
    "Codec": "forkless.controller.codec",
    "Decoded": "forkless.controller.codec",
    "JsonCodec": "forkless.controller.codec",
    "Config": "forkless.controller.config",
    "CheckpointSettings": "forkless.controller.settings.groups",
    "DetectorSettings": "forkless.controller.settings.groups",
    "LoopSettings": "forkless.controller.settings.groups",
    "RunSettings": "forkless.controller.settings.groups",
    "StepSettings": "forkless.controller.settings.groups",
    "Credentials": "forkless.io_loop.connectors.websocket.settings",
    "DemoSettings": "forkless.io_loop.connectors.websocket.settings",
    "WebSocketSettings": "forkless.io_loop.connectors.websocket.settings",
    "PartitionSettings": "forkless.io_loop.connectors.jetstream.settings",
    "FeedSettings": "forkless.io_loop.feedlist",
    "RelaySettings": "forkless.io_loop.relay.settings",
    "Limits": "forkless.io_loop.settings",
    "ReconnectSettings": "forkless.io_loop.settings",
    "Timeouts": "forkless.io_loop.settings",
    "TlsSettings": "forkless.io_loop.settings",
    "Controller": "forkless.controller.loop",
    "ConnectHooks": "forkless.controller.wiring",
    "EVENTS_ONLY": "forkless.controller.wiring",
    "OnEvent": "forkless.controller.wiring",
    "OnResults": "forkless.controller.wiring",
    "Runtime": "forkless.controller.wiring",
    "Handshake": "forkless.io_loop.connectors.websocket.before_connect",
    "Description": "forkless.controller.declared",
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
    "ConfigError": "forkless.io_loop.errors",
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
    "ConnectionEvent": "forkless.io_loop.crossing",
    "CapabilityWarning": "forkless.io_loop.capabilities",
    "Source": "forkless.io_loop.source",
    "SourceContext": "forkless.io_loop.source",
    "SourceStopped": "forkless.io_loop.source",
    "Relogin": "forkless.io_loop.relogin",
    "Backoff": "forkless.io_loop.backoff",
    "DEFAULT_BACKOFF": "forkless.io_loop.backoff",
    "SendFailed": "forkless.io_loop.sends",
    "RecordSink": "forkless.io_loop.sinks.sink",
    "ResultSink": "forkless.io_loop.sinks.sink",
    "SinkBatch": "forkless.io_loop.sinks.sink",
    "SinkContext": "forkless.io_loop.sinks.sink",
    "RecordContext": "forkless.io_loop.sinks.sink",
    "ResultContext": "forkless.io_loop.sinks.sink",
    "SinkStats": "forkless.io_loop.sinks.sink",
    "MessageBatch": "forkless.io_loop.sinks.sink",
    "EventBatch": "forkless.io_loop.sinks.sink",
    "ResultBatch": "forkless.io_loop.sinks.sink",
    "SinkRun": "forkless.controller.lifetime.sinkrun",
    "SinkView": "forkless.controller.lifetime.sinkrun",
    "IOPortal": "forkless.io_loop.portal",
    "PortalClosed": "forkless.io_loop.portal",
    "RestartPolicy": "forkless.io_loop.portal",
    "WorkerFailed": "forkless.io_loop.portal",
}

__all__ = sorted(_EXPORTS)

# names the API had, and the public name each is now: warned of for a release, then refused
# (forkless/io_loop/renamed.py, docs/embedding/versions.md)
_RENAMED = {"Sink": ("forkless.Sink", "RecordSink")}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if name in _RENAMED:
            # the policy's module only when an old name is asked for: importing forkless loads nothing else
            from forkless.io_loop.renamed import deprecated

            spelled, now = _RENAMED[name]
            # an ImportError, not an AttributeError: ``from forkless import Sink`` replaces the latter's message
            deprecated(spelled, error=lambda message: ImportError(message, name=name))
            return __getattr__(now)
        raise AttributeError(f"module 'forkless' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
