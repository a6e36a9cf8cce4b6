"""Everything forkless does with nats-py's private parts, in one place (the JetStream feed's hot path).

Rules:
- ``RawClient`` is nats-py's ``Client`` with raw subscriptions (``raw_subscribe``): a message goes from nats-py's
  protocol parser straight to ``handler(subject, reply, data, headers)`` on the IO loop, in the server's order; what
  it raises goes to ``error_cb`` and the next message is handled (uncaught, it would end nats-py's read loop). No
  ``Msg``, queue or task of nats-py's between: they cost the IO thread a large share of its time (bench/README.md).
  Every other subscription is nats-py's own. It overrides ``_process_msg`` and ``_remove_sub``.
- ``publish_commands(nc, data)`` sends HPUB commands already written, in one piece. With nats-py's outgoing buffer
  empty they are written to the transport at once, in the same step as the caller's last check: a lease fence is
  never passed by bytes still waiting in the process, so a process paused after the check has handed them to the
  kernel. Otherwise they queue behind what is there, in order. It makes ``publish``'s checks but the payload size.
- ``nats_missing(nc)`` names what this nats-py no longer has; a test runs it against a real connection, so an
  upgrade that moves these fails the suite instead of the feed.
- Imports nats-py only: imported only when a JetStream feed is configured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client

__all__ = ["RawClient", "RawHandler", "nats_missing", "publish_commands"]

RawHandler = Callable[[bytes, bytes, bytes, "dict[str, str] | None"], None]

_CLIENT_PRIVATE = ("_process_msg", "_process_headers", "_remove_sub", "_send_command", "_flush_pending")
_CONNECTED_PRIVATE = ("_subs", "_flush_queue", "_pending", "_ps", "_transport")


class RawClient(Client):
    """nats-py's client with raw subscriptions (see the module rules)."""

    def __init__(self) -> None:
        super().__init__()
        self._raw: dict[int, RawHandler] = {}

    async def raw_subscribe(self, subject: str, handler: RawHandler) -> Any:
        """Subscribe ``subject``; its messages go to ``handler`` (module rules). Returns nats-py's
        ``Subscription`` (``unsubscribe()`` ends it)."""
        sub = await self.subscribe(subject)  # no callback: nats-py starts no task for it
        # nothing can have arrived yet: subscribe() only queued the SUB for the flusher task
        self._raw[sub._id] = handler
        return sub

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        handler = self._raw.get(sid)
        if handler is None:
            return await super()._process_msg(sid, subject, reply, data, headers)
        try:
            handler(subject, reply, data, await self._process_headers(headers) if headers else None)
        except Exception as exc:  # as nats-py does for a callback: to error_cb, and the next message goes on
            await self._error_cb(exc)

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._raw.pop(sid, None)
        super()._remove_sub(sid, max_msgs)


async def publish_commands(nc: Any, data: bytes) -> None:
    """Send ``data`` (whole NATS protocol commands) as one piece: at once when nothing is queued
    ahead of it, else behind what is, for nats-py's flusher task (see the module rules)."""
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    if not nc.is_connected:
        raise nats.errors.OutboundBufferLimitError  # what publish() raises with reconnecting off
    if not nc._pending and nc._transport is not None:
        nc._transport.write(data)  # nothing queued ahead of it: at once, the order kept
        return
    await nc._send_command(data)
    if nc._flush_queue is not None and nc._flush_queue.empty():  # as publish() does: kick the flusher
        await nc._flush_pending()


def nats_missing(nc: Any) -> list[str]:
    """What of nats-py's private parts this module uses that ``nc`` (a connected ``RawClient``)
    does not have: empty when the feed's fast path works with this nats-py."""
    gone = [f"Client.{name}" for name in _CLIENT_PRIVATE if not callable(getattr(Client, name, None))]
    gone += [f"Client().{name}" for name in _CONNECTED_PRIVATE if not hasattr(nc, name)]
    if not hasattr(getattr(nc, "_ps", None), "parse"):
        gone.append("Client()._ps.parse")
    return gone
