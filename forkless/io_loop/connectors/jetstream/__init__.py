"""The JetStream connector: every NATS part of forkless in one room. The NATS client behind one transport
(``transport``: connecting, the JetStream API, publishing, KV, objects, pulls, and the one place nats-py's exceptions
are mapped to ours; nats-py's private parts in ``nats_compat``), the feed's source (``source``, its pure bookkeeping
``consumer``, its replies ``replies``), ``--check``'s probe (``probe``), the relay's publisher sink (``publisher``),
positions in checkpoints (``positions``), a partitioned stream's vocabulary (``partitions``), the store's thread,
leases, deployment record and objects (``storethread``, ``leases``, ``deployment``, ``objects``, composed in
``store``), and the connector object the composition root talks to (``connector``).

Rules:
- A room of ``forkless.io_loop``: each module is imported by its full name
  (``forkless.io_loop.connectors.jetstream.source``); this ``__init__`` imports nothing, so importing one module of
  the room loads only what that module imports (nats-py is an optional extra: ``connector``, ``positions``,
  ``partitions`` and ``consumer`` import none of it).
- Every ``import nats`` of the product is in this room (tests/docs/test_architecture.py holds it).
- The layers and their directions are the modules' own (tests/docs/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
- Part of the leaf: nothing here imports ``controller``.
"""
