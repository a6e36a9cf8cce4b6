"""Sinks: where what the sources hand over leaves; ``sink`` holds the public ``Sink`` seam, its runner and its
books (the relay's publisher, io_loop/connectors/jetstream/publisher.py, is one; the reply writer, io_loop/writer.py,
the per-feed
form of its batches).

Rules:
- A room of ``forkless.io_loop``: each module is imported by its full name (``forkless.io_loop.sinks.sink``);
  this ``__init__`` imports nothing, so importing one module of the room loads only what that module imports.
- The layers and their directions are the modules' own (tests/test_architecture.py lists each module in one layer).
- Part of the leaf: nothing here imports ``controller``.
"""
