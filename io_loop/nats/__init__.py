"""One NATS connection edge: connecting with errors mapped once (``natsconn``), nats-py's private parts
(``nats_compat``), the store's thread (``storethread``), the partition leases (``leases``, ``deployment``),
checkpoint objects (``objects``) and the store composed of them (``natsstore``).

Rules:
- A room of ``forkless.io_loop``: each module is imported by its full name (``forkless.io_loop.nats.natsconn``);
  this ``__init__`` imports nothing, so importing one module of the room loads only what that module imports.
- The layers and their directions are the modules' own (tests/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
- Part of the leaf: nothing here imports ``controller``.
"""
