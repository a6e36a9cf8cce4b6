"""The WebSocket connector: the built-in WebSocket feed in one room. Its source (``client``: the reconnect loop around
one connection), opening a connection (``connect``: headers, TLS, redirects refused, aiohttp's exceptions mapped at
this one edge), ``--check``'s try of it (``probe``), the embedder's hooks (``before_connect``: each attempt's URL and
headers, a re-login; ``on_connect``: frames sent first on each connection), and the embedded demo feed
(``demo_feed``, its server; ``demo_source``, the server and this room's client together: a WebSocket feed whose
server forkless runs itself).

Rules:
- A room of ``forkless.io_loop``: each module is imported by its full name
  (``forkless.io_loop.connectors.websocket.client``); this ``__init__`` imports nothing, so importing one module of
  the room loads only what that module imports.
- The layers and their directions are the modules' own (tests/docs/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
- Part of the leaf: nothing here imports ``controller``.
"""
