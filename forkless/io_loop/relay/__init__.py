"""The relay's own figures (``relaystats``: the gaps in the feeds' seqs, the publisher's counters) and settings
(``settings``). Its publisher, a ``RecordSink`` publishing to JetStream, lives with the JetStream connector.

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room. Part of the leaf: nothing here imports ``controller``.
"""
