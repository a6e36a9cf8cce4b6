"""RowCopy: the rows of a few tables as they were at one moment, copied a chunk at a time while the tables keep
changing (copy-on-write), so the main thread never copies a whole table between two steps.

Rules:
- Pure: numpy only, no threads, no clock. The caller hands in the columns as they are *now* on every call: fresh
  views, dropped before the next step (a donated JAX buffer a host view still holds is copied, not updated).
- ``before_write(columns, rows)`` is called before any write to ``rows`` from the moment the ``RowCopy`` is made
  until it is ``done``; ``advance`` copies the next ``count`` rows between writes. A row is copied either by
  ``advance`` before any write reached it or by ``before_write`` with its value from before the first write, so
  ``result()`` is exactly the columns at the moment the copy was made.
- Memory: one copy of the rows, the rows kept by ``before_write`` and one bool per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["RowCopy"]


class RowCopy:
    """Rows ``0 .. rows - 1`` of same-length columns as they were when this was made."""

    def __init__(self, columns: Sequence[np.ndarray], rows: int) -> None:
        if any(len(column) < rows for column in columns):
            raise ValueError(f"every column needs at least {rows} rows, got {[len(c) for c in columns]}")
        self.rows = rows
        self.copied = 0  # rows [0, copied) are copied; a row >= copied is kept before its first write
        self._dest = [np.empty((rows, *column.shape[1:]), column.dtype) for column in columns]
        self._kept_mask = np.zeros(rows, bool)
        self._kept: list[tuple[np.ndarray, list[np.ndarray]]] = []

    @property
    def done(self) -> bool:
        return self.copied == self.rows

    def before_write(self, columns: Sequence[np.ndarray], rows: np.ndarray) -> None:
        """Keep the present values of ``rows`` (any int array; repeats and rows past ``self.rows``
        allowed) that are not copied yet; call before writing them. O(len(rows))."""
        rows = np.asarray(rows)
        rows = rows[(rows >= self.copied) & (rows < self.rows)]
        if not rows.size:
            return
        rows = np.unique(rows)
        rows = rows[~self._kept_mask[rows]]
        if rows.size:
            self._kept_mask[rows] = True
            self._kept.append((rows, [column[rows] for column in columns]))  # fancy indexing copies

    def advance(self, columns: Sequence[np.ndarray], count: int) -> bool:
        """Copy the next ``count`` rows (fewer at the end); returns ``done``."""
        start, end = self.copied, min(self.rows, self.copied + max(1, count))
        for dest, column in zip(self._dest, columns):
            dest[start:end] = column[start:end]
        self.copied = end
        return self.done

    @property
    def kept_rows(self) -> int:
        """Rows kept by ``before_write`` so far (written while the copy ran, before it reached them)."""
        return int(sum(len(rows) for rows, _ in self._kept))

    def result(self) -> list[np.ndarray]:
        """The columns as they were when this was made; call once ``done``."""
        if not self.done:
            raise RuntimeError(f"RowCopy.result() before the copy is done ({self.copied} of {self.rows} rows)")
        for rows, values in self._kept:
            for dest, value in zip(self._dest, values):
                dest[rows] = value
        self._kept.clear()
        return self._dest
