"""The on-connect hook: frames an embedder computes for each new connection of a feed.

Rules:
- The hook is the embedder's callable (``Controller(config, connect=ConnectHooks(on_connect=hook))``), handed to the
  IO side as a constructor argument (``IOThread`` → ``FeedSet`` → ``WebSocketSource``); the IO side
  never imports the controller. It is for subscriptions that must be made per connection:
  signed, timestamped, or listing what the program holds now.
- ``hook(feed, connection)`` runs on the IO thread's event loop for every connection of every
  feed (the embedded demo feed's too), after the handshake and before anything else is sent but
  the feed's fixed ``subscribe`` text: ``feed`` is the feed's name (``"0"`` for
  ``FORKLESS_WS_URL``), ``connection`` the number the connection has in the logs (1 for the
  feed's first; one more for each connection served, so an attempt that failed does not use one).
- It returns what to send (``frames_of``): ``None`` for nothing; one frame; or a list or tuple
  of frames, sent in order. A frame is a ``str``; ``bytes`` holding UTF-8 text (sent as a text
  frame, like a codec's replies); or any other JSON value (a dict, say), sent as its compact
  JSON text. To send one JSON array, return its text. An awaitable (an ``async def`` hook) is
  awaited, within ``FORKLESS_CONNECT_TIMEOUT_S``.
- It must not block the loop (every feed's reading and writing waits while it runs), and it runs
  in the IO thread: it may read only what is safe to read from another thread (an immutable
  value the main thread swaps in whole, a copy made under a lock), never JAX arrays.
- A hook that raises (a ``CancelledError`` of its own too: only its caller's cancellation is passed
  on; an exception whose ``str()`` raises is named by its type), returns something else or times
  out fails that connection attempt like a failed connect (``HookFailed``): the connection is
  closed with 1011, counted in ``connect_failures``, retried with the backoff
  (``FORKLESS_RECONNECT_TRIES`` counts it), and the traceback is logged once per distinct error.
  The IO thread never dies of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from forkless.io_loop.hooks import guarded_call

__all__ = ["OnConnect", "call_hook", "frames_of"]

OnConnect = Callable[[str, int], Any]
"""``on_connect(feed, connection) -> None | frame | list of frames`` (or an awaitable of one)."""


def frames_of(result: Any, given: str = "on_connect returned") -> list[str | bytes]:
    """What the hook returned, as the frames to send (see the rules); ``TypeError`` naming the
    type for anything that is not a frame, after ``given`` (who handed it: ``Controller.send``
    says ``"send() was given"``)."""
    if result is None:
        return []
    items = result if isinstance(result, (list, tuple)) else (result,)
    frames: list[str | bytes] = []
    for item in items:
        if isinstance(item, (str, bytes)):
            frames.append(item)
            continue
        try:
            frames.append(json.dumps(item, separators=(",", ":"), allow_nan=False))
        except (TypeError, ValueError, RecursionError):
            raise TypeError(f"{given} a {type(item).__name__} that json cannot write; a frame is "
                            "a str, bytes (UTF-8 text) or a JSON value (dict, list, …), or None") from None
    return frames


async def call_hook(hook: OnConnect, feed: str, connection: int, timeout_s: float) -> list[str | bytes]:
    """Call ``hook(feed, connection)`` (awaiting what it returns, if awaitable, within
    ``timeout_s``) and return its frames; ``HookFailed`` for anything else."""
    return await guarded_call("on_connect", hook, feed, connection, timeout_s, frames_of)
