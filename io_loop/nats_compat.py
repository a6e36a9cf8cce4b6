"""Everything forkless does with nats-py's private parts, in one place (the JetStream feed's hot path).

Rules:
- ``RawClient`` is nats-py's ``Client`` with raw subscriptions (``raw_subscribe``): a message for
  one goes from nats-py's protocol parser straight to a plain function of ours,
  ``handler(subject, reply, data, headers)`` (subject and reply as the protocol's bytes, the
  payload, the headers parsed by nats-py or None when there are none), called on the IO loop in
  the order the server sent them. No ``Msg`` object, no queue and no task of nats-py's in between:
  at full speed these were a third of the IO thread's time for a JetStream feed (bench/README.md).
  Every other subscription (the JetStream API's requests) is nats-py's own, unchanged. It
  overrides ``_process_msg`` (the parser's one call per MSG/HMSG) and ``_remove_sub``.
- ``RawClient``'s protocol parser is ``FastParser``: nats-py's ``Parser`` with a fast path for
  what a busy connection is made of, MSG and HMSG (one copy of the buffer, the control line split
  once, the buffer trimmed once per read instead of per message); it calls ``_process_msg`` with
  exactly what nats-py's would, and hands anything else (INFO, PING, PONG, +OK, -ERR, a malformed
  line, a payload split across reads that nats-py's parser began) to nats-py's ``parse``. A test
  feeds the same bytes, cut at every place, to both parsers and compares the calls.
- ``publish_commands(nc, data)`` appends publications already written as NATS protocol commands
  (HPUB, the client protocol's own format) to nats-py's outgoing buffer in one piece, which its
  flusher task writes: one buffer for a batch of replies instead of one command built per
  ``publish``. It makes the checks ``publish`` makes (closed, draining, disconnected); the
  payload size is the caller's (``nc.max_payload``).
- ``missing(nc)`` names what this nats-py no longer has; a test runs it against a real
  connection, so an upgrade that moves these fails the suite instead of breaking the feed.
- Imports nats-py only (an optional extra): imported only when a JetStream feed is configured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

__all__ = ["FastParser", "RawClient", "RawHandler", "missing", "publish_commands"]

RawHandler = Callable[[bytes, bytes, bytes, "dict[str, str] | None"], None]

_CLIENT_PRIVATE = ("_process_msg", "_process_headers", "_remove_sub", "_send_command", "_flush_pending")
_CONNECTED_PRIVATE = ("_subs", "_flush_queue", "_pending", "_ps")
_PARSER_PRIVATE = ("buf", "state", "nc")


class FastParser(Parser):
    """nats-py's protocol parser with a fast path for MSG and HMSG (see the module rules)."""

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        if self.state != AWAITING_CONTROL_LINE:  # nats-py's parser is inside a message: it finishes it
            return await super().parse()
        view = bytes(buf)  # one copy; slices of it are the payloads
        size = len(view)
        pos = 0
        process = self.nc._process_msg
        raw = getattr(self.nc, "_raw", {})  # RawClient's raw subscriptions, called here directly
        try:
            while pos < size:
                if view.startswith(b"MSG ", pos):
                    headers = False
                elif view.startswith(b"HMSG ", pos):
                    headers = True
                else:
                    break  # another operation: nats-py's parser
                end = view.find(b"\r\n", pos)
                if end < 0:
                    return  # the control line is not all here yet
                args = view[pos + (5 if headers else 4):end].split()
                try:  # MSG <subject> <sid> [reply] <size>, HMSG <subject> <sid> [reply] <header size> <size>
                    if headers:
                        header_size, total = int(args[-2]), int(args[-1])
                        reply = args[2] if len(args) == 5 else b""
                        if len(args) not in (4, 5):
                            break
                    else:
                        header_size, total = 0, int(args[-1])
                        reply = args[2] if len(args) == 4 else b""
                        if len(args) not in (3, 4):
                            break
                    sid = int(args[1])
                except (ValueError, IndexError):
                    break  # malformed: nats-py's parser says so
                start = end + 2
                if size < start + total + 2:
                    return  # the payload is not all here yet
                pos = start + total + 2
                if not headers:
                    handler = raw.get(sid)
                    if handler is not None:
                        handler(args[0], reply, view[start:start + total], None)
                    else:
                        await process(sid, args[0], reply, view[start:start + total], None)
                else:
                    await process(sid, args[0], reply, view[start + header_size:start + total],
                                  view[start:start + header_size])
        finally:
            del buf[:pos]
        if buf:
            await super().parse()


class RawClient(Client):
    """nats-py's client with raw subscriptions and ``FastParser`` (see the module rules)."""

    def __init__(self) -> None:
        super().__init__()
        self._raw: dict[int, RawHandler] = {}
        self._ps = FastParser(self)

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
        handler(subject, reply, data, await self._process_headers(headers) if headers else None)

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._raw.pop(sid, None)
        super()._remove_sub(sid, max_msgs)


async def publish_commands(nc: Any, data: bytes) -> None:
    """Queue ``data`` (whole NATS protocol commands) for nats-py's flusher task, as one piece."""
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    if not nc.is_connected:
        raise nats.errors.OutboundBufferLimitError  # what publish() raises with reconnecting off
    await nc._send_command(data)
    if nc._flush_queue is not None and nc._flush_queue.empty():  # as publish() does: kick the flusher
        await nc._flush_pending()


def missing(nc: Any) -> list[str]:
    """What of nats-py's private parts this module uses that ``nc`` (a connected ``RawClient``)
    does not have: empty when the feed's fast path works with this nats-py."""
    gone = [f"Client.{name}" for name in _CLIENT_PRIVATE if not callable(getattr(Client, name, None))]
    gone += [f"Client().{name}" for name in _CONNECTED_PRIVATE if not hasattr(nc, name)]
    parser = getattr(nc, "_ps", None)
    gone += [f"Client()._ps.{name}" for name in _PARSER_PRIVATE if not hasattr(parser, name)]
    return gone
