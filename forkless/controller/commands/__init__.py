"""The programs: ``forkless`` (``cli``, the one place that ends the process), ``--check`` (``check``), ``forkless
relay`` (``relaycmd``), their shared edges (``edge``) and the variables as documentation (``vardocs``).

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room.
"""
