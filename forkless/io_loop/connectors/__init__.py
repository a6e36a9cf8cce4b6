"""The connectors: each feed kind that is not a user's own source, in a room of its own (bytewax's ``connectors/``):
``jetstream`` and ``websocket``. The composition root talks to a connector through connector.py's protocols, never
to the modules of its room.

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room. Part of the leaf: nothing here imports ``controller``.
"""
