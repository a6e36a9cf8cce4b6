"""Stream slots: stream name -> row of the state table, with idle streams recycled.

Rules:
- Pure: no threads, no clock; the caller passes ``now`` (the same monotonic clock on every call).
- O(1) per message, nothing scans the table: an ``OrderedDict`` in least-recently-seen order, so the eviction
  candidate is the first entry (a plain dict's deleted front would be walked over at each eviction). Without
  ``idle_s`` nothing is evicted and a plain dict in order of first sight does. A batch of known streams is looked
  up in C loops; Python per message only for a batch holding a new stream.
- Beside it, columns by slot (name, last-seen time, sighting number: its order is the LRU order) are what a
  checkpoint copies (``begin_copy``): arrays copy in chunks, an ``OrderedDict`` of a million entries does not. A
  call writes its times once, after its loop, so the eviction test reads times from before the call (``_idle``).
- A new stream takes the lowest never-used slot. With all ``max_streams`` used and ``idle_s`` set, the least
  recently seen stream is evicted if ``now - last_seen > idle_s`` and its slot reported in ``recycled``;
  otherwise the message is refused (``ok`` False, the spare slot ``max_streams``) and the stream not remembered.
- Slots in use are always exactly ``0 .. len(self) - 1``: a slot is freed only by an eviction that hands it on.
- The caller resets a recycled slot's state (``processor.reset_rows``) *before* the step that runs the batch;
  an evicted stream that comes back is new. A stream seen in a call cannot be evicted by the same call.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from typing import cast, overload

import numpy as np

from forkless.controller.rowcopy import RowCopy

__all__ = ["OrderedNames", "StreamSlots", "TableCopy", "lru_order"]


def _no_pause() -> None:
    pass


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
        # name -> slot, least recently seen first; without idle_s (nothing is evicted, no recency
        # kept) a plain dict, in order of first sight, which restores faster than an OrderedDict
        self._slots: dict[str, int] = OrderedDict() if idle_s is not None else {}
        # by slot (rows 0 .. len - 1 in use): name, last seen (first sight without idle_s), and
        # the sighting number (larger: seen later). np.zeros: pages are only paid when touched.
        self._names: list[str] = []
        self._seen = np.zeros(max_streams, np.float64)
        self._order = np.zeros(max_streams, np.int64)
        self._sightings = 0
        self._copy: TableCopy | None = None  # a checkpoint's copy in progress (begin_copy)

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
        if self.idle_s is None:  # nothing is ever evicted: no recency to keep (last_seen is first sight)
            return self._lookup_kept(streams, now)
        return self._lookup_evicting(streams, now)

    def _lookup_kept(self, streams: Sequence[str], now: float) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``lookup`` without ``idle_s``: a slot once given is kept; only first sights are marked."""
        n = len(streams)
        table = self._slots
        found = list(map(table.get, streams))  # one C loop: the common batch holds only known streams
        if None not in found:
            return np.array(found, np.int32), np.ones(n, bool), []
        slots = np.empty(n, np.int32)
        ok = np.ones(n, bool)
        names = self._names
        first_new = len(table)
        for i, name in enumerate(streams):
            slot = table.get(name)
            if slot is None:
                if len(table) >= self.max_streams:
                    ok[i] = False
                    slots[i] = self.max_streams
                    continue
                slot = table[name] = len(table)
                names.append(name)
            slots[i] = slot
        if len(table) > first_new:  # new slots only: nothing a copy in progress holds changes
            new = np.arange(first_new, len(table))
            self._seen[new] = now
            self._order[new] = self._sightings + np.arange(len(new))
            self._sightings += len(new)
        return slots, ok, []

    def _lookup_evicting(self, streams: Sequence[str], now: float) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``lookup`` with ``idle_s``: recency kept (the table in order of last sight), idle streams evicted."""
        n = len(streams)
        table = cast("OrderedDict[str, int]", self._slots)  # with idle_s it is one
        copy = self._copy
        found = list(map(table.get, streams))  # one C loop: the common batch holds only known streams
        if None not in found:
            deque(map(table.move_to_end, streams), maxlen=0)  # each seen in turn, as the loop below moves them
            slots = np.array(found, np.int32)
            self._mark_seen(slots, now, copy)
            return slots, np.ones(n, bool), []
        slots = np.empty(n, np.int32)
        ok = np.ones(n, bool)
        recycled: list[int] = []
        names = self._names
        refused = False
        for i, name in enumerate(streams):
            slot = table.get(name)
            if slot is not None:
                table.move_to_end(name)
            else:
                if len(table) < self.max_streams:
                    slot = len(table)
                    names.append(name)
                elif self._idle(oldest := next(iter(table)), now, slots, i):
                    slot = table.pop(oldest)
                    if copy is not None:
                        copy.replacing(slot, oldest)
                    names[slot] = name
                    self.evicted += 1
                    recycled.append(slot)
                else:
                    ok[i] = False
                    slots[i] = self.max_streams
                    refused = True
                    continue
                table[name] = slot  # a new key goes to the end: the most recently seen
            slots[i] = slot
        self._mark_seen(slots[ok] if refused else slots, now, copy)
        return slots, ok, recycled

    def _mark_seen(self, seen: np.ndarray, now: float, copy: TableCopy | None) -> None:
        """The last-seen time and sighting number of each slot in ``seen`` (a call's slots, in order)."""
        if copy is not None:
            copy.before_write(seen)
        self._seen[seen] = now
        # the sighting numbers grow, so "the largest" is "the last sight" when a stream repeats
        np.maximum.at(self._order, seen, self._sightings + np.arange(len(seen)))
        self._sightings += len(seen)

    def _idle(self, oldest: str, now: float, slots: np.ndarray, i: int) -> bool:
        """Whether the least recently seen stream may be evicted by message ``i`` of this call.
        ``_seen`` holds the times from before this call: if ``oldest`` was seen in it, every
        stream was (those seen are behind those not), so that needs ``i >= len(table)``, and
        then its slot is among ``slots[:i]``."""
        slot = self._slots[oldest]
        if i >= len(self._slots) and (slots[:i] == slot).any():
            return False  # seen in this call: last seen now
        return bool(now - self._seen[slot] > self.idle_s)

    def items(self) -> Iterator[tuple[str, int, float]]:
        """``(name, slot, last_seen)`` of every stream, least recently seen first."""
        for name, slot in self._slots.items():
            yield name, slot, float(self._seen[slot])

    def export(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The table as arrays (names str, slots int32, last_seen float64), LRU order.

        ``last_seen`` is on the caller's clock; a process restoring it with another
        monotonic clock should shift it (``last_seen - then + now``) before ``restore``.
        A checkpoint uses ``begin_copy`` instead: this builds every array on the caller's thread.
        """
        n = len(self._slots)
        names, slots, last_seen = lru_order(list(self._names), self._seen[:n], self._order[:n])
        return np.array(names, dtype=str), slots, last_seen

    def restore(self, names: Sequence[str], slots: Sequence[int] | np.ndarray,
                last_seen: Sequence[float] | np.ndarray) -> None:
        """Replace the table with ``export``'s arrays; the least recently seen comes first.

        The slots must be exactly ``0 .. len(names) - 1`` in some order and at most
        ``max_streams`` of them (the rule every table obeys); ``evicted`` is kept.
        """
        names = names if isinstance(names, list) else list(map(str, names))
        slots = np.asarray(slots, np.int64).reshape(-1)
        seen = np.asarray(last_seen, np.float64).reshape(-1)
        if not len(names) == len(slots) == len(seen):
            raise ValueError(f"names, slots and last_seen differ in length: {len(names)}, {len(slots)}, {len(seen)}")
        n = len(slots)
        if n > self.max_streams or not np.array_equal(np.sort(slots), np.arange(n)):
            raise ValueError(f"slots must be 0 .. n - 1, each once, with n <= max_streams ({self.max_streams}); "
                             f"got {n} slots, {len(np.unique(slots))} distinct, largest {int(slots.max(initial=0))}")
        table = (OrderedDict if self.idle_s is not None else dict)(zip(names, slots.tolist()))
        if len(table) != n:
            raise ValueError("a stream name appears twice")
        by_slot = np.empty(n, object)  # C loops: a Python one over a million names takes a noticeable pause
        by_slot[slots] = names
        self._copy = None
        self._slots = table
        self._names = by_slot.tolist()
        self._seen[slots] = seen
        self._order[slots] = np.arange(n)
        self._sightings = n

    # ---- checkpoints ----------------------------------------------------------------------

    def begin_copy(self) -> TableCopy:
        """Start copying the table as it is now, a chunk at a time (``TableCopy.advance``) while
        ``lookup`` goes on: rows that change before the copy reaches them are kept first, and
        the names of recycled slots until ``TableCopy.release()``. One copy at a time: a new
        one replaces one in progress."""
        self._copy = TableCopy(self)
        return self._copy


class TableCopy:
    """The stream table as it was at ``StreamSlots.begin_copy()``.

    The main thread calls ``advance`` between lookups until it returns True (the times and
    sighting numbers are copied; rows a lookup writes first are kept first). The names are
    not copied: a slot's name changes only when the slot is recycled, and ``lookup`` hands
    the name it replaces to ``replacing`` first; so the copy stays attached to the table
    until ``release()``, and ``result()`` (the checkpoint writer's thread) reads the live
    by-slot list, under the GIL, with those names put back.
    """

    def __init__(self, table: StreamSlots) -> None:
        self._table = table
        self.rows = len(table)
        self._rows = RowCopy([table._seen, table._order], self.rows)
        self._replaced: dict[int, str] = {}  # slot -> its name at T0, once the slot was recycled

    @property
    def done(self) -> bool:
        return self._rows.done

    def replacing(self, slot: int, name: str) -> None:
        """``lookup`` is about to give ``slot`` (held by ``name``) to another stream."""
        if slot < self.rows:
            self._replaced.setdefault(slot, name)  # the first is the name at T0

    def before_write(self, slots: np.ndarray) -> None:
        """``lookup`` is about to write the times and sighting numbers of ``slots``."""
        if not self._rows.done:
            table = self._table
            self._rows.before_write([table._seen, table._order], slots)

    def advance(self, count: int) -> bool:
        """Copy the next ``count`` rows; True when the times and sighting numbers are copied."""
        table = self._table
        return self._rows.advance([table._seen, table._order], count)

    def result(self, pause: Callable[[], None] = _no_pause) -> tuple[Sequence[str], np.ndarray, np.ndarray]:
        """``(names, slots, last_seen)`` least recently seen first, as they were at
        ``begin_copy()`` and as ``StreamSlots.restore`` takes them; once ``done``, before
        ``release()``. ``names`` is an ``OrderedNames``: sliced, it reads the live names a chunk
        at a time. Meant for the writer's thread (``pause()`` between chunks of work)."""
        seen, order = self._rows.result()
        slots = np.argsort(order, kind="stable").astype(np.int32)  # the sort releases the GIL
        last_seen = np.empty(len(slots), np.float64)
        for start in range(0, len(slots), GATHER_CHUNK):
            last_seen[start:start + GATHER_CHUNK] = seen[slots[start:start + GATHER_CHUNK]]
            pause()
        return OrderedNames(self._table._names, self._replaced, slots), slots, last_seen

    def release(self) -> None:
        """The writer is done with ``result()``: the table forgets this copy."""
        if self._table._copy is self:
            self._table._copy = None


# Work done per step on the checkpoint writer's thread, which pauses between steps: every C-level call over a
# list of Python objects holds the GIL throughout, and one over a million names would stall the main thread.
NAMES_CHUNK = 2048
GATHER_CHUNK = 65536  # float64s gathered per step: a short hold of the GIL, as NAMES_CHUNK


class OrderedNames(Sequence[str]):
    """Stream names in a given slot order, read from a live by-slot list when sliced, with the
    names of recycled slots put back (``TableCopy.result``): no list of a million names is
    built, only one per slice."""

    def __init__(self, by_slot: list[str], replaced: dict[int, str], slots: np.ndarray) -> None:
        self._by_slot = by_slot
        self._replaced = replaced
        self._slots = slots

    def __len__(self) -> int:
        return len(self._slots)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            slots = self._slots[index].tolist()
            by_slot = self._by_slot
            names = [by_slot[s] for s in slots]
            if self._replaced:  # recorded before the live name changed, so read after it
                replaced = self._replaced
                for i, s in enumerate(slots):
                    if s in replaced:
                        names[i] = replaced[s]
            return names
        slot = int(self._slots[index])
        return self._replaced.get(slot, self._by_slot[slot])


def lru_order(names: list[str], seen: np.ndarray, order: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Columns by slot -> ``(names, slots, last_seen)`` least recently seen first, as
    ``StreamSlots.restore`` takes them (``export``)."""
    slots = np.argsort(order, kind="stable").astype(np.int32)
    return [names[s] for s in slots.tolist()], slots, np.asarray(seen, np.float64)[slots]
