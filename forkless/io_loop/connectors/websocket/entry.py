"""A WebSocket entry of ``FORKLESS_FEEDS`` (one without ``"nats"``, docs/feeds.md) into its ``FeedSpec``: its schema
(a msgspec ``Struct``, the fields' types and bounds declared once), the refusal each field's fault is reported with,
then the checks a schema cannot express (the URL's syntax, the socket's path).

Rules:
- Imported only where ``FORKLESS_FEEDS`` is read (io_loop/feedlist.py): a run without it never loads msgspec.
- A fault is reported by its field's text in ``WEBSOCKET_REFUSALS`` (the field, what is allowed), never by msgspec's own
  message, which may quote the value (io_loop/connectors/connector.py's ``entry_refusal``): a secret
  (``subscribe``, ``headers``, a URL's credentials) never reaches an error.
- A pattern is anchored with ``^…\\Z``: msgspec searches it, and ``$`` would let a trailing newline through.
- An entry with several faults is refused for one: the schema's first (in the entry's order of fields), else the
  first of the checks after it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from forkless.io_loop.connectors.connector import COMMON_REFUSALS, entry_refusal
from forkless.io_loop.connectors.websocket.settings import WEBSOCKET, subscribe_text, ws_url
from forkless.io_loop.errors import ValueProblem
from forkless.io_loop.feedspec import FEED_NAME, FeedSpec
from forkless.io_loop.net.netaddr import socket_path
from forkless.io_loop.settings import ReplyPolicy

__all__ = ["WEBSOCKET_FIELDS", "WEBSOCKET_REFUSALS", "WebSocketEntry", "websocket_feed"]

Name = Annotated[str, Meta(pattern=rf"^{FEED_NAME.pattern}\Z")]


class WebSocketEntry(Struct, kw_only=True, forbid_unknown_fields=True):
    """A WebSocket feed: an entry without ``"nats"`` (docs/feeds.md); fields in the documents' order."""

    url: str
    unix_socket: str | UnsetType = UNSET  # present and empty is refused: leave it out for TCP
    subscribe: Any = ""  # a JSON text, or any JSON value sent as its compact text
    headers: dict[str, str] = {}
    name: Name | UnsetType = UNSET  # the entry's index when unset
    required: bool = True
    replies: ReplyPolicy | UnsetType = UNSET  # FORKLESS_REPLIES when unset
    overflow: Literal["", "block", "drop_oldest"] = ""
    buffer: Annotated[int, Meta(ge=0, le=10_000_000)] | None = None


WEBSOCKET_FIELDS: tuple[str, ...] = WebSocketEntry.__struct_fields__
UNIX_SOCKET = ('"unix_socket" must be the absolute path of a unix-domain socket, the handshake still sending '
               '"url"\'s path and host')
# what each field allows, as a fault of it is reported (after "feed i ('name'): ")
WEBSOCKET_REFUSALS: dict[str, str] = {
    **COMMON_REFUSALS,
    "url": '"url" must be a ws:// or wss:// URL (port 1-65535)',
    "unix_socket": f"{UNIX_SOCKET}: expected the path of a unix-domain socket (leave the field out for TCP)",
    "headers": '"headers" must be a JSON object of string values',
    "overflow": '"overflow" must be "block" or "drop_oldest"',
    "buffer": '"buffer" must be an integer from 0 to 10000000 (messages it may hold while the inbound queue is full)',
}


def websocket_feed(item: dict[str, Any], index: str, where: str, replies: ReplyPolicy) -> FeedSpec:
    """The feed of ``item`` (a JSON object of ``FORKLESS_FEEDS``, the ``index``-th), ``replies`` its policy unless
    it names one; ``ValueProblem`` ``"{where}: …"`` naming the field, never a secret."""
    try:
        entry = msgspec.convert(item, WebSocketEntry)
    except msgspec.ValidationError as exc:
        raise ValueProblem(f"{where}: {entry_refusal(str(exc), item, WEBSOCKET_FIELDS, WEBSOCKET_REFUSALS)}") from None
    try:
        if not ws_url(entry.url):
            raise ValueError
    except ValueError:
        raise ValueProblem(f"{where}: {WEBSOCKET_REFUSALS['url']}") from None
    path = ""
    if entry.unix_socket is not UNSET:
        if entry.unix_socket.strip() == "":
            raise ValueProblem(f"{where}: {WEBSOCKET_REFUSALS['unix_socket']}")
        try:
            path = socket_path(entry.unix_socket)
        except ValueProblem as exc:
            raise ValueProblem(f"{where}: {UNIX_SOCKET}: {exc}") from None
    try:
        subscribe = subscribe_text(entry.subscribe)  # as FORKLESS_SUBSCRIBE given in code is written
    except ValueProblem:  # NaN or an infinity (1e999): JSON has neither, and the frame would not be JSON
        raise ValueProblem(f'{where}: "subscribe" is a text or a JSON value with finite numbers only') from None
    return FeedSpec(index if entry.name is UNSET else entry.name, entry.url.strip(), subscribe,
                    tuple(entry.headers.items()), entry.required, replies if entry.replies is UNSET else entry.replies,
                    overflow=entry.overflow, buffer=entry.buffer, unix_socket=path, kind=WEBSOCKET)
