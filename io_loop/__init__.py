"""The IO side: one thread, one asyncio loop, every socket."""

from io_loop.bridge import Bridge, MainSide, Outgoing
from io_loop.client import FeedClient, FeedFatal
from io_loop.thread import IOThread, IOThreadError

__all__ = ["Bridge", "FeedClient", "FeedFatal", "IOThread", "IOThreadError", "MainSide", "Outgoing"]
