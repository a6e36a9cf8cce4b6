"""Sinks: where what the sources hand over, or a controller's results, leave. ``sink`` holds the public
``RecordSink`` and ``ResultSink`` seams, their contexts, runner and books; ``results`` hands a controller's results to
its result sinks.

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room. Part of the leaf: nothing here imports ``controller``.
"""
