"""Sinks: where what the sources hand over, or a controller's results, leave; ``sink`` holds the public
``RecordSink`` and ``ResultSink`` seams, their contexts, runner and books (the relay's publisher,
io_loop/connectors/jetstream/publisher.py, is a record sink; the reply writer, io_loop/writer.py, the per-feed
form of their batches); ``results`` hands a controller's results to its result sinks.

Rules:
- A room of ``forkless.io_loop``: each module is imported by its full name (``forkless.io_loop.sinks.sink``);
  this ``__init__`` imports nothing, so importing one module of the room loads only what that module imports.
- The layers and their directions are the modules' own (tests/docs/test_architecture.py lists each module in one layer).
- Part of the leaf: nothing here imports ``controller``.
"""
