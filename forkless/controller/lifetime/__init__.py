"""A started controller's lifetime: what it takes and gives back (``lifecycle``), its changes to the host process
(``host``) and ``run()``'s loop between the start and the stop (``serving``).

Rules:
- A room of ``forkless.controller``: each module is imported by its full name
  (``forkless.controller.lifetime.lifecycle``); this ``__init__`` imports nothing, so importing one module of the
  room loads only what that module imports.
- The layers and their directions are the modules' own (tests/docs/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
"""
