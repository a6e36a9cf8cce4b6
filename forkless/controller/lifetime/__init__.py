"""A started controller's lifetime: what it takes and gives back (``lifecycle``), its changes to the host process
(``host``), its endpoints (``endpoints``, ``sdnotify``), ``run()``'s loop (``serving``) and a source → sink run
(``sinkrun``).

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room.
"""
