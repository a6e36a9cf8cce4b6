"""The network's edges shared by the rooms: addresses (``netaddr``), TLS (``tls``), unix-domain sockets
(``unixsocket``), aiohttp's private parts (``aiohttp_compat``), an aiohttp site (``appsite``) and the metrics server
(``http``).

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room. Part of the leaf: nothing here imports ``controller``.
"""
