"""The JetStream connector: every NATS part of forkless in one room. The NATS client behind one transport
(``transport``; nats-py's private parts in ``nats_compat``), the feed's source (``source``, its pure bookkeeping
``consumer``, its replies ``replies``), ``--check``'s probe (``probe``), the relay's publisher sink (``publisher``),
positions in checkpoints (``positions``), a partitioned stream's vocabulary (``partitions``), the store's thread,
leases, deployment record and objects (composed in ``store``), and the connector object (``connector``).

Rules:
- This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports
  (``connector``, ``positions``, ``partitions`` and ``consumer`` import no nats-py, an optional extra).
- Every ``import nats`` of the product is in this room (tests/docs/test_architecture.py holds it).
- Part of the leaf: nothing here imports ``controller``.
"""
