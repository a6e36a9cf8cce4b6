"""An embedder's callable called on the IO loop: bounded in time, whatever it raises contained, its reason fit for
the logs. The on-connect and before-connect hooks of the WebSocket feed (io_loop/connectors/websocket/on_connect.py,
before_connect.py) and ``Relogin``'s ``connect(attempt)`` (io_loop/relogin.py) are called through it.

Rules:
- ``guarded_call`` returns what the callable returned (awaited within the timeout when it is awaitable) as its
  caller converts it, or raises ``HookFailed`` naming the hook: for whatever the callable or the conversion raised,
  for the timeout, and for a ``CancelledError`` that is not its caller's own cancellation (a library's future
  cancelled under it: ``own_cancellation``). The caller's own cancellation (the stop) is passed on.
- A failure's text (``reason_of``) is ``Type: first line``, URLs in it redacted (tokens live in their queries), at
  most 200 characters; an exception whose ``str()`` itself raises is named by its type.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable
from typing import Any

from forkless.io_loop.net.netaddr import redact_url

__all__ = ["HookFailed", "guarded_call", "own_cancellation", "reason_of"]

# a URL in the text of a hook's exception (aiohttp's errors name the URL, query and all): shown redacted
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


class HookFailed(Exception):
    """An embedder's hook (the on-connect or before-connect hook, ``Relogin``'s ``connect``) raised, returned
    something it may not, or timed out; ``str`` says which (without the traceback, URLs in it redacted); ``__cause__``
    is the hook's exception, if any."""


def reason_of(exc: BaseException) -> str:
    """``Type: first line of its text`` for the logs and counters: URLs in it redacted (tokens live
    in their queries), at most 200 characters; an exception whose ``str()`` itself raises is named
    by its type alone (a reason must never fail to be made: the failure it names would be lost)."""
    try:
        lines = str(exc).strip().splitlines()
        text = URL_IN_TEXT.sub(lambda url: redact_url(url.group()), lines[0] if lines else "")[:200]
    except Exception:
        text = "(its str() raised)"
    return f"{type(exc).__name__}{': ' + text if text else ''}"


def own_cancellation() -> bool:
    """True when the running task is being cancelled (a ``CancelledError`` now is its own, to pass
    on); False for a ``CancelledError`` that a hook's code raised or let out by itself (a library's
    future cancelled under it): that is the hook's failure, not a stop."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


async def guarded_call(name: str, hook: Callable[[str, int], Any], feed: str, number: int, timeout_s: float,
                       convert: Callable[[Any], Any]) -> Any:
    """``convert(hook(feed, number))``, awaiting what the hook returns (if awaitable) within
    ``timeout_s``; ``HookFailed`` naming the ``name`` hook for whatever it or ``convert`` raised,
    or the timeout (see the module rules)."""
    limit = asyncio.timeout(timeout_s)
    try:
        result = hook(feed, number)
        if inspect.isawaitable(result):
            async with limit:
                result = await result
        return convert(result)
    except asyncio.CancelledError as exc:
        if own_cancellation():  # the stop: passed on
            raise
        raise HookFailed(f"the {name} hook failed: {reason_of(exc)} (raised by the hook, not a cancellation of "
                         "its caller)") from exc
    except Exception as exc:
        if isinstance(exc, TimeoutError) and limit.expired():
            raise HookFailed(f"the {name} hook did not return within FORKLESS_CONNECT_TIMEOUT_S={timeout_s}s") \
                from None
        raise HookFailed(f"the {name} hook failed: {reason_of(exc)}") from exc
