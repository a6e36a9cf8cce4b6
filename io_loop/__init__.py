"""The IO side: the IO thread, one asyncio loop with every feed's socket (the checkpoint and lease
store keeps its own thread and NATS connection: ``io_loop/connectors/jetstream/store.py``).

A leaf: nothing here imports ``controller``. Its public part (the exceptions, your own source, your own
coroutine on the IO thread) is exported by ``forkless`` alone (``from forkless import Source``); this package
exports nothing and imports nothing eagerly, so importing one small module (``io_loop.backoff``,
``io_loop.net.netaddr``, the settings) loads neither janus nor aiohttp.
"""

from __future__ import annotations

from typing import Any

from forkless._oldpath import old_name_attribute

if __name__ == "io_loop":  # imported by its old top-level name, in a checkout: forkless/_oldpath.py
    from forkless._oldpath import alias

    alias(__name__)


def __getattr__(name: str) -> Any:
    return old_name_attribute("io_loop", name)  # a program on the old path's names; otherwise AttributeError
