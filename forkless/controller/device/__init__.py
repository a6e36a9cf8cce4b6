"""The device layer under the engine: the processor-contract checks and the compile (``compiled``), one device or a
mesh (``layouts``, ``placement``), the executables kept per program (``programs``) and live weights (``weights``).

Rules:
- A room of ``forkless.controller``: each module is imported by its full name
  (``forkless.controller.device.compiled``); this ``__init__`` imports nothing, so importing one module of the room
  loads only what that module imports.
- The layers and their directions are the modules' own (tests/docs/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
"""
