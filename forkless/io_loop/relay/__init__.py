"""The relay's own figures (``relaystats``): the gaps in the feeds' seqs and the publisher's counters. Its publisher, a
``RecordSink`` publishing to JetStream, lives with the JetStream connector (io_loop/connectors/jetstream/publisher.py).

Rules:
- A room of ``forkless.io_loop``: each module is imported by its full name (``forkless.io_loop.relay.relaystats``);
  this ``__init__`` imports nothing, so importing one module of the room loads only what that module imports.
- The layers and their directions are the modules' own (tests/docs/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
- Part of the leaf: nothing here imports ``controller``.
"""
