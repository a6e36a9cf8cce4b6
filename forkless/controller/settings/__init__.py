"""The ``FORKLESS_*`` variables: the registry (``variables``), the value parsers (``values``), ``FORKLESS_FEEDS``
parsed (``feedspec``, each entry by its schema: ``feedschema``), the variables as documentation (``vardocs``) and
the controller side's settings groups (``groups``); ``Config`` itself is controller/config.py.

Rules:
- A room of ``forkless.controller``: each module is imported by its full name
  (``forkless.controller.settings.variables``); this ``__init__`` imports nothing, so importing one module of the
  room loads only what that module imports.
- The layers and their directions are the modules' own (tests/docs/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
"""
