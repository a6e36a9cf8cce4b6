"""The IO side: one thread, one asyncio loop, every socket."""

from controller.errors import FeedFatal, IOThreadError, MetricsServerError
from io_loop.bridge import Bridge, MainSide
from io_loop.client import FeedClient
from io_loop.thread import IOThread

__all__ = ["Bridge", "FeedClient", "FeedFatal", "IOThread", "IOThreadError", "MainSide", "MetricsServerError"]
