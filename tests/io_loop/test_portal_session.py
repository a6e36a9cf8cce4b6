"""The classic program on ``IOPortal`` (issue 44, item 5; issue 55, item 4): a ``Controller`` main
loop and a ``DataClientWorker`` written for ``multiprocessing.Queue`` (tests/classic_program.py),
ported with the worker unchanged (examples/portal_session.py), against a real loopback exchange
written with ``websockets`` (tests/ws_exchange.py): login, subscribe, heartbeats, orders and fills,
and the token's expiry, which ends the worker on its own; the portal's restart policy calls it
again, so it trades on through every expiry, and through the exchange killed and back.
"""

from __future__ import annotations

import ast
import difflib
import json
import queue
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkless import Backoff, ConnectionEvent, IOPortal, RestartPolicy
from tests.classic_program import DataClientWorker
from tests.harness import UNIT_S, wait_until
from tests.ws_exchange import WsExchange

ROOT = Path(__file__).resolve().parents[2]
CLASSIC = ROOT / "tests" / "classic_program.py"
PORTED = ROOT / "examples" / "portal_session.py"
WAIT_S = 20 * UNIT_S


def _class_source(path: Path, name: str) -> str:
    text = path.read_text(encoding="utf-8")
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == name)
    return ast.get_source_segment(text, node) or ""


@pytest.fixture
def exchange() -> Iterator[WsExchange]:
    ex = WsExchange(token_ttl_s=1 * UNIT_S, trade_every_s=0.02, ping_every_s=0.2)
    ex.start()
    yield ex
    ex.stop()


def test_the_port_keeps_the_worker_verbatim_and_changes_the_main_loop_by_two_except_clauses():
    assert _class_source(PORTED, "DataClientWorker") == _class_source(CLASSIC, "DataClientWorker")
    diff = [line for line in difflib.unified_diff(_class_source(CLASSIC, "Controller").splitlines(),
                                                  _class_source(PORTED, "Controller").splitlines(), lineterm="")
            if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert diff == ["-            self.handle(event)",
                    "+            except PortalClosed:  # the worker ended on its own, and everything it sent is taken",
                    "+                break",
                    "+            try:",
                    "+                self.handle(event)",
                    "+            except PortalClosed:  # an order's put raises it too, once the portal has ended",
                    "+                break"]


def test_the_classic_program_runs_on_the_portal_through_two_token_expiries(exchange):
    proc = subprocess.run([sys.executable, str(PORTED), "--url", exchange.url, "--seconds", str(5 * UNIT_S)],
                          capture_output=True, text=True, timeout=90 * UNIT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    orders = [f"o{i}" for i in range(5)]
    assert done["orders"] == orders
    assert done["fills"] == orders  # every order the main loop put reached the exchange, every fill came back
    assert done["trades"] >= 5
    assert done["closed"] == 4003 and done["restarts"] >= 2  # the worker's last word each time, then called again
    figures = exchange.figures()
    assert figures["orders"] == orders
    assert figures["sessions"][:2] == [4003, 4003] and figures["logins"] >= 3
    assert 4001 not in figures["sessions"]  # the heartbeat was answered all along
    assert figures["pongs"] >= 1 and figures["violations"] == []
    assert "the IO worker returned before the stop (run 1); restarting it" in proc.stderr  # the IO side's log
    assert "Traceback" not in proc.stderr


class MainLoop:
    """A trader's main loop over the unchanged classic worker: an order on the first trade of each
    session, quoting only while the portal's worker runs (its ``ConnectionEvent``s)."""

    def __init__(self, portal: IOPortal) -> None:
        self.portal = portal
        self.events: list[Any] = []
        self.orders: list[str] = []
        self.fills: list[str] = []
        self.quoting = False
        self._ordered_in: set[int] = set()

    def run_until(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, f"not within {WAIT_S:.0f}s: {what}; {self.events[-5:]}"
            try:
                event = self.portal.to_main.get(timeout=0.1)
            except queue.Empty:
                continue
            self.events.append(event)
            if isinstance(event, ConnectionEvent):
                self.quoting = event.connected
            elif event["type"] == "trade" and self.quoting and self.portal.runs not in self._ordered_in:
                self._ordered_in.add(self.portal.runs)
                self.order()
            elif event["type"] == "fill":
                self.fills.append(event["client_order_id"])

    def order(self) -> None:
        order_id = f"o{len(self.orders)}"
        self.orders.append(order_id)
        self.portal.from_main.put({"type": "order", "symbol": "BTCUSDT", "side": "buy", "qty": "0.01",
                                   "client_order_id": order_id})

    def changes(self) -> list[ConnectionEvent]:
        return [e for e in self.events if isinstance(e, ConnectionEvent)]


def _classic(url: str) -> Any:
    return lambda to_main, from_main: DataClientWorker(to_main, from_main, url).run()


def test_the_classic_worker_trades_through_two_token_expiries_each_order_filled_once(exchange):
    with IOPortal(_classic(exchange.url), restart=RestartPolicy(backoff=Backoff(min_s=0.05, max_s=0.2)),
                  connection_events=True) as portal:
        loop = MainLoop(portal)
        # an order right after each restart: the last run's executor get may still be blocked then
        loop.run_until(lambda: len(loop.fills) == 3, "a fill in each of three sessions")
        assert portal.restarts >= 2 and portal.poll()
    assert loop.fills == loop.orders == ["o0", "o1", "o2"]
    assert exchange.figures()["orders"] == ["o0", "o1", "o2"]  # each written once
    assert exchange.figures()["sessions"][:2] == [4003, 4003]
    closed = [e["code"] for e in loop.events if isinstance(e, dict) and e["type"] == "closed"]
    assert closed[:2] == [4003, 4003]
    assert [(e.connected, e.connection) for e in loop.changes()[:5]] == [
        (True, 1), (False, 1), (True, 2), (False, 2), (True, 3)]


def test_a_worker_that_fails_while_the_exchange_is_down_is_restarted_keeping_its_queues_and_says_so():
    exchange = WsExchange(trade_every_s=0.02, ping_every_s=0.2)
    exchange.start()
    try:
        with IOPortal(_classic(exchange.url), restart=RestartPolicy(backoff=Backoff(min_s=0.05, max_s=0.2)),
                      connection_events=True) as portal:
            loop = MainLoop(portal)
            loop.run_until(lambda: loop.fills == ["o0"], "the first session's fill")
            exchange.kill()
            loop.run_until(lambda: not loop.quoting, "the session lost")
            runs = portal.runs
            wait_until(lambda: portal.runs >= runs + 2, timeout_s=WAIT_S, what="two runs failing to log in")
            assert not loop.quoting and portal.poll()  # told, and not ended
            loop.order()  # put while the exchange is down: it waits in the queue for the next run
            exchange.restart()
            loop.run_until(lambda: loop.fills == ["o0", "o1", "o2"], "the held order's fill and the next session's")
            restarts = portal.restarts
    finally:
        exchange.stop()
    # up and down once per session: the runs that failed to log in while it was down said nothing
    assert [(e.connected, e.connection) for e in loop.changes()[:3]] == [(True, 1), (False, 1), (True, 2)]
    assert loop.changes()[1].reason.startswith("the worker returned; restarting in")  # the session lost: 1006
    assert restarts >= 3
    assert exchange.figures()["orders"] == ["o0", "o1", "o2"]
    closed = [e["code"] for e in loop.events if isinstance(e, dict) and e["type"] == "closed"]
    assert closed[0] == 1006


def test_the_documents_diff_adds_only_lines_the_port_has_and_names_the_ends_as_the_portal_passes_them():
    """docs/embedding/io-thread.md's diff of the classic program is examples/portal_session.py's port: each
    line it adds is the port's, and the worker's lambda names its arguments (to_main, from_main), the
    portal's order (it named them to_queue, from_queue: a worker whose to_queue ran the other way swapped them)."""
    text = (ROOT / "docs" / "embedding" / "io-thread.md").read_text(encoding="utf-8")
    diff = re.search(r"```diff\n(.*?)```", text, re.S)
    assert diff
    added = [line[1:] for line in diff.group(1).splitlines() if line.startswith("+")]
    ported = PORTED.read_text(encoding="utf-8").splitlines()
    assert [line for line in added if line.strip() and line not in ported] == []
    assert any("IOPortal(lambda to_main, from_main: DataClientWorker(to_main, from_main, url)" in line
               for line in added)
