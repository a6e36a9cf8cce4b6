"""Checkpoints: the directory store (``checkpoint``), the format (``ckptformat``), the device snapshot (``snapshot``,
``rowcopy``), the writer thread and the store protocol (``checkpointer``), the positions a checkpoint records
(``positions``) and the restore (``recovery``).

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room.
"""
