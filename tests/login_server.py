"""A loopback exchange that wants a login first: ``POST /login`` issues a token, and the feed
(``GET /feed?token=…``, or ``Authorization: Bearer …``) opens only with a token that has not
expired; otherwise the handshake is refused with ``refusal`` (401 unless told).

It is ``tests/servers.py``'s aiohttp ``FeedServer`` (same scripts, ``connections``, ``wait_for``)
with two more records, appended to in the server's thread: ``logins`` (every token issued, in
order) and ``handshakes`` (every feed request: its token, headers, and the status it was refused
with, or None). A script expires a token with ``conn.server.expire(token)``; ``token_of(conn)``
is the one its connection was opened with.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

from aiohttp import web
from multidict import CIMultiDictProxy

from tests.servers import PATH, AiohttpConn, FeedServer

__all__ = ["LOGIN_KEY", "HandshakeSeen", "LoginFeedServer", "token_of"]

LOGIN_KEY = "key-1"  # what ``POST /login`` wants in its JSON body as "key"


class HandshakeSeen(NamedTuple):
    token: str | None
    headers: CIMultiDictProxy[str]
    status: int | None  # the HTTP status it was refused with; None: upgraded


class LoginFeedServer(FeedServer):
    def __init__(self, script: Any = None, *, refusal: int = 401, **options: Any) -> None:
        super().__init__(script, **options)
        self.refusal = refusal
        self.logins: list[str] = []
        self.handshakes: list[HandshakeSeen] = []
        self._live: set[str] = set()
        self._numbers = itertools.count(1)

    @property
    def login_url(self) -> str:
        return f"{'https' if self.ssl_context is not None else 'http'}://127.0.0.1:{self.port}/login"

    def expire(self, token: str) -> None:
        """From now on ``token`` is refused (server loop only)."""
        self._live.discard(token)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/login", self._login)
        app.router.add_get(PATH, self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await self._listen()

    async def _login(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("key") != LOGIN_KEY:
            return web.json_response({"error": "bad key"}, status=403)
        token = f"tok-{next(self._numbers)}"
        self._live.add(token)
        self.logins.append(token)
        self._changed()
        return web.json_response({"token": token})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        token = request.query.get("token")
        if token is None and request.headers.get("Authorization", "").startswith("Bearer "):
            token = request.headers["Authorization"].removeprefix("Bearer ")
        status = None if token in self._live else self.refusal
        self.handshakes.append(HandshakeSeen(token, request.headers, status))
        self._changed()
        if status is not None:
            return web.Response(status=status, text="token expired or unknown")
        return await super()._handle(request)


def token_of(conn: AiohttpConn) -> str | None:
    """The token a connection was opened with."""
    return conn.request.query.get("token") or conn.request.headers.get("Authorization", "").removeprefix("Bearer ")
