"""The reconnect driver (io_loop/reconnect.py) on its own: a scripted ``Link`` (the loops that use it,
the WebSocket feed, the JetStream feed, the relay and ``Relogin``, are tested with real servers in
their own files), a ``Backoff`` with a fixed seed, a clock of our own, no sleeping."""

from __future__ import annotations

import asyncio
import random

import pytest

from forkless.io_loop.backoff import Backoff
from forkless.io_loop.errors import FeedFatal
from forkless.io_loop.reconnect import DONE, drive


class Refused(Exception):
    pass


class Fatal(Exception):
    pass


class ScriptedLink:
    """Each attempt takes the next step of ``script``: an exception is raised by ``connect``,
    anything else is the connection, which ``serve`` ends with that value (a lost reason or DONE)."""

    failures = (Refused, Fatal)

    def __init__(self, script: list, *, more_after: int | None = None) -> None:
        self.script = list(script)
        self.events: list[tuple] = []
        self.served = 0
        self.more_after = more_after  # more() turns false once this many connections were served

    def more(self) -> bool:
        return self.more_after is None or self.served < self.more_after

    async def connect(self) -> object:
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step

    def attempt_failed(self, exc: BaseException) -> str:
        if isinstance(exc, Fatal):
            raise FeedFatal(f"fatal: {exc}")
        self.events.append(("failed", str(exc)))
        return f"refused: {exc}"

    def retrying(self, reason: str, delay: float) -> None:
        self.events.append(("retrying", reason))

    async def serve(self, conn: object) -> str | None:
        self.served += 1
        self.events.append(("served", conn))
        return conn  # type: ignore[return-value]

    def reconnecting(self, reason: str, delay: float) -> None:
        self.events.append(("reconnecting", reason))

    def gave_up(self, reason: str, failures: int, lost: bool) -> FeedFatal:
        return FeedFatal(f"gave up after {failures} {'lost connections' if lost else 'failed attempts'}: {reason}")

    async def pause(self, delay: float) -> None:
        self.events.append(("pause", round(delay, 6)))


def policy(tries: int = 0, reset_s: float = 1e9) -> Backoff:
    return Backoff(0.01, 1.0, reset_s, tries, rng=random.Random(7))


def test_failed_attempts_then_a_connection_served_until_done() -> None:
    link = ScriptedLink([Refused("one"), Refused("two"), "lost: reset", DONE])
    backoff = policy()
    asyncio.run(drive(link, backoff, clock=lambda: 0.0))
    kinds = [e[0] for e in link.events]
    assert kinds == ["failed", "retrying", "pause", "failed", "retrying", "pause", "served", "reconnecting", "pause",
                     "served"]
    assert link.events[1] == ("retrying", "refused: one")
    assert link.events[7] == ("reconnecting", "lost: reset")
    assert backoff.failures == 3  # two attempts and one connection too short to reset (reset_s)


def test_tries_used_up_on_attempts_and_on_lost_connections_say_which() -> None:
    link = ScriptedLink([Refused("a"), Refused("b"), Refused("c")])
    with pytest.raises(FeedFatal, match=r"gave up after 3 failed attempts: refused: c"):
        asyncio.run(drive(link, policy(tries=3)))
    link = ScriptedLink(["lost: x", "lost: y"])
    with pytest.raises(FeedFatal, match=r"gave up after 2 lost connections: lost: y"):
        asyncio.run(drive(link, policy(tries=2)))


def test_a_fatal_failure_is_raised_at_once_and_other_errors_end_the_drive() -> None:
    link = ScriptedLink([Refused("a"), Fatal("credentials")])
    with pytest.raises(FeedFatal, match="fatal: credentials"):
        asyncio.run(drive(link, policy()))
    link = ScriptedLink([KeyError("a bug")])
    with pytest.raises(KeyError):
        asyncio.run(drive(link, policy()))
    assert link.events == []


def test_more_false_after_a_connection_ends_the_drive_without_a_reconnect() -> None:
    link = ScriptedLink(["lost: one", "lost: two"], more_after=1)
    asyncio.run(drive(link, policy()))
    assert link.events == [("served", "lost: one")]
    link = ScriptedLink([], more_after=0)
    asyncio.run(drive(link, policy()))  # more() false at the start: not one attempt
    assert link.events == []


def test_a_stable_connection_resets_the_count_a_short_one_does_not() -> None:
    now = [0.0]

    class Timed(ScriptedLink):
        async def serve(self, conn: object) -> str | None:
            now[0] += 5.0  # the connection stayed up 5 s
            return await super().serve(conn)

    stable = policy(tries=2, reset_s=5.0)  # up 5 s: reset; two lost in a row would give up
    link = Timed(["lost: 1", "lost: 2", "lost: 3", DONE])
    asyncio.run(drive(link, stable, clock=lambda: now[0]))
    assert [e for e in link.events if e[0] == "reconnecting"] == [("reconnecting", f"lost: {i}") for i in (1, 2, 3)]
    short = policy(tries=2, reset_s=6.0)
    with pytest.raises(FeedFatal, match="gave up after 2 lost connections: lost: 2"):
        asyncio.run(drive(Timed(["lost: 1", "lost: 2", DONE]), short, clock=lambda: now[0]))
