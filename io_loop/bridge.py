"""The one place where the two threads meet: two bounded janus queues.

Rules:
- Both queues are created inside the IO thread's running loop (janus needs a loop).
- ``inbound`` carries ``Chunk``s IO -> main; ``outbound`` carries ``Outgoing`` items
  main -> IO. The IO thread only touches the async sides, the main thread only the sync
  sides (``MainSide``); nobody else holds both.
- Orderly stop, in this order: the IO thread stops reading and shuts ``inbound`` down
  (the main thread drains what is left, then gets ``SyncQueueShutDown``); the main thread
  sends its last results and shuts ``outbound`` down (the IO thread sends what is left,
  then gets ``AsyncQueueShutDown``); finally the IO thread closes both (``aclose``).
"""

from __future__ import annotations

from dataclasses import dataclass

import janus

from controller.batching import Chunk, Outgoing

__all__ = ["Bridge", "MainSide"]


@dataclass(frozen=True)
class MainSide:
    """What the main thread gets: the sync sides only."""

    inbound: janus.SyncQueue[Chunk]
    outbound: janus.SyncQueue[Outgoing]


class Bridge:
    """Owns both queues. Construct it in the IO thread's running loop."""

    def __init__(self, queue_size: int) -> None:
        self._inbound: janus.Queue[Chunk] = janus.Queue(queue_size)
        self._outbound: janus.Queue[Outgoing] = janus.Queue(queue_size)

    @property
    def inbound(self) -> janus.AsyncQueue[Chunk]:
        return self._inbound.async_q

    @property
    def outbound(self) -> janus.AsyncQueue[Outgoing]:
        return self._outbound.async_q

    def main_side(self) -> MainSide:
        return MainSide(self._inbound.sync_q, self._outbound.sync_q)

    def stop_inbound(self) -> None:
        """No more chunks will come; the main thread drains what is queued, then sees ShutDown."""
        self._inbound.shutdown()

    def depths(self) -> tuple[int, int]:
        return self._inbound.async_q.qsize(), self._outbound.async_q.qsize()

    async def aclose(self) -> None:
        """Close both queues; call last, from the IO loop, after both sides have stopped."""
        for q in (self._inbound, self._outbound):
            q.shutdown(immediate=True)
            await q.aclose()
