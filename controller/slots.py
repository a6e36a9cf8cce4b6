"""Stream slots: stream name -> row of the state table, with idle streams recycled.

Rules:
- Pure: no threads, no clock; the caller passes ``now`` (seconds, the same monotonic clock
  on every call).
- O(1) per message: an ``OrderedDict`` ordered by when each stream was last seen (least
  recent first, ``move_to_end`` on each sight), so the eviction candidate is always the
  first entry. Nothing scans the table. (A plain dict would not do: deleting from its
  front leaves holes that ``next(iter(d))`` walks over, O(table) per eviction.)
- A new stream takes the lowest never-used slot (0, 1, 2, … in order of first sight).
  When all ``max_streams`` slots are used, and ``idle_s`` is set, the least recently seen
  stream is evicted if it is idle, strictly ``now - last_seen > idle_s``, and the new
  stream takes its slot; the slot is reported in ``recycled``. Otherwise the message is
  refused (``ok`` False, slot ``max_streams``, the spare) and the stream is not remembered.
- Slots in use are always exactly ``0 .. len(self) - 1``: a slot is freed only by an
  eviction, which hands it straight to the new stream.
- The caller must reset a recycled slot's state (``processor.reset_rows``) *before* the
  step that runs the batch, so the new stream never sees its previous owner's statistics.
  An evicted stream that comes back is new: it gets a fresh or recycled slot.
- A stream seen in a call has ``last_seen = now``, and ``idle_s >= 0``, so a later message
  of the same call can never evict it; each slot is recycled at most once per call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np


class StreamSlots:
    """Stream name -> state slot, first come first served, idle streams recycled (LRU)."""

    def __init__(self, max_streams: int, idle_s: float | None = None) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        if idle_s is not None and not idle_s >= 0:
            raise ValueError(f"idle_s must be None (never recycle) or >= 0 seconds, got {idle_s}")
        self.max_streams = max_streams
        self.idle_s = idle_s
        self.evicted = 0  # streams evicted so far, i.e. slots recycled
        # name -> slot, least recently seen first; _last_seen has the same keys
        self._slots: OrderedDict[str, int] = OrderedDict()
        self._last_seen: dict[str, float] = {}

    def __len__(self) -> int:
        """How many streams hold a slot now."""
        return len(self._slots)

    def lookup(self, streams: Sequence[str], now: float) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Slots for ``streams`` (int32), a bool mask of those that got one, recycled slots.

        Marks every stream that got a slot as seen at ``now`` (without ``idle_s``, where nothing
        is ever evicted, only its first sight is kept). ``recycled`` lists, in order,
        the slots taken from an evicted idle stream during this call; reset their state
        before running the batch. Refused messages get the spare slot ``max_streams``.
        """
        n = len(streams)
        slots = np.empty(n, np.int32)
        ok = np.ones(n, bool)
        recycled: list[int] = []
        table = self._slots
        last_seen = self._last_seen
        idle_s = self.idle_s
        if idle_s is None:  # nothing is ever evicted: no recency to keep (last_seen is first sight)
            for i, name in enumerate(streams):
                slot = table.get(name)
                if slot is None:
                    if len(table) >= self.max_streams:
                        ok[i] = False
                        slots[i] = self.max_streams
                        continue
                    slot = table[name] = len(table)
                    last_seen[name] = now
                slots[i] = slot
            return slots, ok, recycled
        for i, name in enumerate(streams):
            slot = table.get(name)
            if slot is not None:
                table.move_to_end(name)
            else:
                if len(table) < self.max_streams:
                    slot = len(table)
                elif idle_s is not None and now - last_seen[oldest := next(iter(table))] > idle_s:
                    slot = table.pop(oldest)
                    del last_seen[oldest]
                    self.evicted += 1
                    recycled.append(slot)
                else:
                    ok[i] = False
                    slots[i] = self.max_streams
                    continue
                table[name] = slot  # a new key goes to the end: the most recently seen
            last_seen[name] = now
            slots[i] = slot
        return slots, ok, recycled

    def items(self) -> Iterator[tuple[str, int, float]]:
        """``(name, slot, last_seen)`` of every stream, least recently seen first."""
        for name, slot in self._slots.items():
            yield name, slot, self._last_seen[name]

    def export(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The table as arrays (names str, slots int32, last_seen float64), LRU order, for a checkpoint.

        ``last_seen`` is on the caller's clock; a process restoring it with another
        monotonic clock should shift it (``last_seen - then + now``) before ``restore``.
        """
        names = np.array(list(self._slots), dtype=str)
        slots = np.fromiter(self._slots.values(), np.int32, len(self._slots))
        last_seen = np.fromiter((self._last_seen[name] for name in self._slots), np.float64, len(self._slots))
        return names, slots, last_seen

    def restore(self, names: Sequence[str], slots: Sequence[int], last_seen: Sequence[float]) -> None:
        """Replace the table with ``export``'s arrays; the least recently seen comes first.

        The slots must be exactly ``0 .. len(names) - 1`` in some order and at most
        ``max_streams`` of them (the rule every table obeys); ``evicted`` is kept.
        """
        names = [str(name) for name in names]
        slots = [int(slot) for slot in slots]
        seen = [float(t) for t in last_seen]
        if not len(names) == len(slots) == len(seen):
            raise ValueError(f"names, slots and last_seen differ in length: {len(names)}, {len(slots)}, {len(seen)}")
        if len(set(names)) != len(names):
            raise ValueError("a stream name appears twice")
        if sorted(slots) != list(range(len(slots))) or len(slots) > self.max_streams:
            raise ValueError(f"slots must be 0 .. n - 1, each once, with n <= max_streams ({self.max_streams}); "
                             f"got {len(slots)} slots, {len(set(slots))} distinct, largest {max(slots, default=0)}")
        self._slots = OrderedDict(zip(names, slots))
        self._last_seen = dict(zip(names, seen))
