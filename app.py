"""forkless: an asyncio WebSocket feed and a JAX loop in one process, no fork.

    python app.py            run (the embedded demo feed when FORKLESS_WS_URL is unset)
    python app.py --check    validate the set-up, compile, try the feed, and exit
    python app.py --help     list every FORKLESS_* variable with its default
    python app.py relay      publish the WebSocket feeds into a JetStream stream (no JAX)

The program itself is ``controller.commands.cli`` (also installed as the ``forkless`` command);
its exit statuses are stated in controller/errors.py.
"""

from __future__ import annotations

from forkless.controller.commands.cli import exit_with, main
from forkless.controller.commands.edge import load_config

__all__ = ["load_config", "main"]

if __name__ == "__main__":
    exit_with(main())
