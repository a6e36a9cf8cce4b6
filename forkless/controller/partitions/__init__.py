"""Partitions, the main thread's side: a partitioned instance's checkpoints, one object per partition, and its
ownership (``PartitionOwner``: the leases taken before the restore, released after the stop).

This ``__init__`` imports nothing: a module is imported by its full name and loads only what it imports; its layer
is its own (tests/docs/test_architecture.py), wherever its room.
"""
