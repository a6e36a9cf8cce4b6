"""The device layer under the engine: the processor-contract checks and the compile (``compiled``), one device or a
mesh (``layouts``, ``placement``), the executables kept per program (``programs``) and live weights (``weights``).

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room.
"""
