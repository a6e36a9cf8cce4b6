"""Partitions, the main thread's side: a partitioned instance's checkpoints, one object per partition, and its
ownership (``PartitionOwner``: the leases taken before the restore, released after the stop).

Rules:
- A room of ``forkless.controller``: each module is imported by its full name
  (``forkless.controller.partitions.partitioned``); this ``__init__`` imports nothing, so importing one module of
  the room loads only what that module imports.
- The layers and their directions are the modules' own (tests/docs/test_architecture.py lists each module in one layer);
  a room changes where a module lives, not what it may import.
"""
