"""Checkpoints: the directory store (``checkpoint``), the format (``ckptformat``), the device snapshot (``snapshot``,
``rowcopy``), the writer thread and the store protocol (``checkpointer``), the positions a checkpoint records
(``positions``) and the restore (``recovery``).

Rules:
- A room of ``forkless.controller``: each module is imported by its full name
  (``forkless.controller.checkpoints.checkpoint``); this ``__init__`` imports nothing, so importing one module of
  the room loads only what that module imports.
- The layers and their directions are the modules' own (tests/docs/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
"""
