"""The controller side's settings groups (``groups``); ``Config`` is controller/config.py, and the way a setting is
declared io_loop/settings.py.

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room.
"""
