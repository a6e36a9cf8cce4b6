"""The main-thread side: configuration, codec, batching, processors, statistics, the loop.

The user API is ``forkless``'s alone (``from forkless import Controller``): this package exports nothing, each
module's ``__all__`` lists only what that module defines, and importing the package loads nothing else, so reading
the configuration (which must fail fast on a bad variable) does not import JAX.
"""

from __future__ import annotations

# the top-level controller link imported by its own name (the repository root on sys.path): a second copy of every
# module, classes and exceptions that are not forkless's own, so it is refused
if __name__ != "forkless.controller":
    raise ImportError(f"{__name__!r} is no import path of forkless: its packages are forkless.controller and "
                      "forkless.io_loop (write 'from forkless import …', or 'import forkless.controller.<module>')")
