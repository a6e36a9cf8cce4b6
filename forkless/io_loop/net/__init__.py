"""The network's edges shared by the rooms: addresses (``netaddr``), unix-domain sockets (``unixsocket``), aiohttp's
private parts (``aiohttp_compat``) and the metrics server (``http``).

Rules:
- A room of ``forkless.io_loop``: each module is imported by its full name (``forkless.io_loop.net.netaddr``); this
  ``__init__`` imports nothing, so importing one module of the room loads only what that module imports.
- The layers and their directions are the modules' own (tests/docs/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
- Part of the leaf: nothing here imports ``controller``.
"""
