"""The IO side: the IO thread, one asyncio loop with every feed's socket (the checkpoint and lease store keeps its own
thread and NATS connection).

A leaf: nothing here imports ``controller``. Its public part is exported by ``forkless`` alone (``from forkless
import Source``); this package exports nothing and imports nothing eagerly, so importing one small module (the
settings, ``io_loop.backoff``) loads neither janus nor aiohttp.
"""

from __future__ import annotations

# the top-level io_loop link imported by its own name (the repository root on sys.path): a second copy of every
# module, classes and exceptions that are not forkless's own, so it is refused
if __name__ != "forkless.io_loop":
    raise ImportError(f"{__name__!r} is no import path of forkless: its packages are forkless.controller and "
                      "forkless.io_loop (write 'from forkless import …', or 'import forkless.io_loop.<module>')")
