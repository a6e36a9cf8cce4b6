"""The WebSocket connector: the built-in WebSocket feed in one room. Its source (``client``), opening a connection
(``connect``: headers, TLS, redirects refused, aiohttp's exceptions mapped at this one edge), ``--check``'s try of it
(``probe``), the embedder's hooks (``before_connect``, ``on_connect``), and the embedded demo feed (``demo_feed``, its
server; ``demo_source``, the server and this room's client together).

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room. Part of the leaf: nothing here imports ``controller``.
"""
