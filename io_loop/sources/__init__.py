"""The built-in sources, each written on the public ``Source`` protocol: the WebSocket feed (``client``, ``connect``,
the hooks ``before_connect`` and ``on_connect``, ``relogin`` for a user's own client), the JetStream feed
(``jetstream``, ``jsconsumer``, ``jspublish``, ``jsprobe``, the ``partitions`` vocabulary), the demo feed
(``demo_feed``, ``demo_source``) and ``--check``'s network half (``probe``).

Rules:
- A room of ``forkless.io_loop``: each module is imported by its full name (``forkless.io_loop.sources.client``);
  this ``__init__`` imports nothing, so importing one module of the room loads only what that module imports.
- The layers and their directions are the modules' own (tests/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
- Part of the leaf: nothing here imports ``controller``.
"""
