"""The on-connect hook: frames an embedder computes for each new connection of a feed (its contract:
docs/embedding/subscriptions.md, "Subscriptions").

Rules:
- The hook is the embedder's callable (``ConnectHooks(on_connect=hook)``), handed to the IO side as a constructor
  argument; the IO side never imports the controller.
- ``hook(feed, connection)`` runs on the IO loop for every connection of every feed, after the handshake and the
  feed's fixed ``subscribe`` text, before anything else is sent.
- It returns what to send (``frames_of``): None; one frame; or a list or tuple of frames, in order. A frame is a
  ``str``, UTF-8 ``bytes`` (sent as text) or any other JSON value (sent as its compact JSON text). An awaitable is
  awaited within ``FORKLESS_CONNECT_TIMEOUT_S``.
- It must not block the loop, and runs on the IO thread: it may read only what is safe from another thread, never
  JAX arrays.
- A hook that raises, returns something else or times out fails that attempt like a failed connect (``HookFailed``:
  closed with 1011, counted, retried with the backoff, logged once per distinct error); the IO thread never dies
  of it.
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
