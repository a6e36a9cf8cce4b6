"""forkless: an asyncio feed and a JAX loop in one process, no fork. ``from forkless import Controller, Source, …``.

The repository keeps its two packages at the top (``controller/``, the main thread; ``io_loop/``, the IO thread);
they are imported as ``forkless.controller`` and ``forkless.io_loop``, and only so: installed as such
(pyproject.toml), and in a checkout as the two folders beside this one (``_checkout_package``). So a program's own
``controller.py`` or ``io_loop.py`` beside it shadows neither its own imports of forkless nor forkless's imports of
itself, and nothing else of the checkout (``bench``, ``tests``, ``app``) is a ``forkless.`` module. The public names
below are imported lazily, so reading the configuration (the program's first step, which must fail fast on a bad
variable) does not import JAX.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it (tool.setuptools.dynamic)

PACKAGES = ("controller", "io_loop")


def _checkout_package(name: str, checkout: str) -> None:
    """``forkless.<name>`` as the checkout's top-level ``<name>/`` folder, that folder alone: this package's own
    path stays its own folder (an installed copy holds both packages inside it, and needs none of this)."""
    folder = os.path.join(checkout, name)
    spec = importlib.util.spec_from_file_location(f"{__name__}.{name}", os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # the package's __init__ imports nothing (tests/docs/test_architecture.py)
    globals()[name] = module


if not os.path.isdir(os.path.join(os.path.dirname(__file__), "controller")):
    # a checkout: controller/ and io_loop/ sit beside this folder, not inside it
    for _name in PACKAGES:
        if f"{__name__}.{_name}" not in sys.modules:
            _checkout_package(_name, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    del _name

# the user API, each name from the module that defines it
_EXPORTS = {
    "Batch": "forkless.controller.batching",
    "Codec": "forkless.controller.codec",
    "Decoded": "forkless.controller.codec",
    "JsonCodec": "forkless.controller.codec",
    "Config": "forkless.controller.config",
    "CheckpointSettings": "forkless.controller.settings.groups",
    "StepSettings": "forkless.controller.settings.groups",
    "Credentials": "forkless.io_loop.settings",
    "DemoSettings": "forkless.io_loop.settings",
    "Limits": "forkless.io_loop.settings",
    "PartitionSettings": "forkless.io_loop.settings",
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
    "ConnectionEvent": "forkless.io_loop.crossing",
    "CapabilityWarning": "forkless.io_loop.capabilities",
    "Source": "forkless.io_loop.source",
    "SourceContext": "forkless.io_loop.source",
    "SourceStopped": "forkless.io_loop.source",
    "Relogin": "forkless.io_loop.relogin",
    "Backoff": "forkless.io_loop.backoff",
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

# names the API had, and what took their place: asked for, each raises an ImportError that says so (an
# AttributeError's message would be lost: ``from forkless import Sink`` replaces it with Python's own)
_REPLACED = {
    "Sink": "forkless.Sink is now two protocols: forkless.RecordSink (SinkRun's sink, the relay's: MessageBatch and "
            "EventBatch) and forkless.ResultSink (Controller(sinks=[...]): ResultBatch)",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if name in _REPLACED:
            raise ImportError(_REPLACED[name], name=name)
        raise AttributeError(f"module 'forkless' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
