"""A trading day on forkless (issue 55; issue 65 for the portal): the trader's program both ways,
examples/exchange_session.py (the user's own client as a source) and examples/portal_exchange.py (the
user's ``multiprocessing`` worker unchanged on an ``IOPortal``), against the toy exchange (bench/exchange.py,
in this process) through a token expiry, the exchange killed and restarted on the same port, orders
with a deadline, connection events, and Ctrl-C with closing orders in flight, whose fills the stop
delivers.

One run per program, its figures read by several tests. Nothing is timed: the test waits on the
exchange's own counters (a login after the expiry, one after the restart, a fill after it) and the
run's books.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.exchange import Exchange
from tests.harness import UNIT_S, app_env

REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 60 * UNIT_S
OUTAGE_S = 1.5  # the exchange dead this long: longer than an order's deadline (0.5 s), so orders are given up
CLOSING = 8  # orders placed right before the stop: in flight when Ctrl-C has asked for it


@pytest.fixture(scope="module", params=["exchange_session", "portal_exchange"], ids=["source", "portal"])
def day(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("trading-day")
    ex = Exchange(ping_every_s=0.3, token_ttl_s=2.0, record=False)
    url = ex.start()
    cmd = [sys.executable, f"examples/{request.param}.py", "--url", url, "--stats", str(tmp / "stats.json"),
           "--force-order-every", "0.2", "--orders-at-stop", str(CLOSING)]
    with open(tmp / "stderr.txt", "w+", encoding="utf-8") as err:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=app_env({"PYTHONPATH": str(REPO_ROOT)}),
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            # the token expires (closed with 4003), the client logs in again and its new session is up (a
            # connection not yet closed: the exchange dies under it, not between its login and its connect)
            before = ex.wait_for(lambda c: c["closes"]["4003"] >= 1 and c["fills"] >= 3
                                 and c["connections"] > sum(c["closes"].values()), WAIT_S, "a session up after expiry")
            # ... and subscribed, trades on it (sent on the one session open): the exchange dies under a session
            # that has delivered, one the portal's worker too has said is up (its first item crossed)
            before = ex.wait_for(lambda c: c["trades_sent"] >= before["trades_sent"] + 10, WAIT_S, "trades on it")
            ex.kill()  # the exchange dies: connections dropped without a close frame, nothing listening
            time.sleep(OUTAGE_S)
            ex.restart()
            ex.wait_for(lambda c: c["logins"] > before["logins"], WAIT_S, "a login after the restart")
            after = ex.counters()
            ex.wait_for(lambda c: c["fills"] >= after["fills"] + 3, WAIT_S, "orders filled after the restart")
            proc.send_signal(signal.SIGINT)  # Ctrl-C: the closing orders are placed, and their fills still come
            rc = proc.wait(WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            ex.stop()
        err.seek(0)
        stderr = err.read()
    stats = json.loads((tmp / "stats.json").read_text()) if (tmp / "stats.json").exists() else None
    yield {"rc": rc, "stderr": stderr, "stats": stats, "counters": ex.counters(), "program": request.param}


def test_the_day_ends_in_order_with_exit_0(day: dict[str, Any]) -> None:
    assert day["rc"] == 0, day["stderr"]
    assert day["stats"]["stopped_by"] == "SIGINT"
    assert day["counters"]["violations"] == {}  # nothing sent that the exchange did not ask for


def test_the_main_loop_hears_each_connection_go_down_and_come_back_in_order_with_its_reason(
        day: dict[str, Any]) -> None:
    events = day["stats"]["connections"]
    ups = [up for up, _, _ in events]
    assert ups[0] is True and all(a != b for a, b in itertools.pairwise(ups)), events  # up, down, up, … in order
    assert all(reason for up, reason, _ in events if not up), events  # each loss says why
    codes = [code for up, _, code in events if not up]
    if day["program"] == "portal_exchange":  # the unchanged worker says nothing of its close: its run's end
        assert len(codes) >= 2 and all(r.startswith("the worker returned") for up, r, _ in events if not up), events
        return
    assert 4003 in codes, events  # the token expired: the exchange closed the session
    assert 1006 in codes, events  # the exchange died: no close frame
    assert codes.index(4003) < codes.index(1006), events


def test_orders_older_than_their_deadline_are_given_up_and_reported_never_written(day: dict[str, Any]) -> None:
    stats = day["stats"]
    assert stats["orders_given_up"] >= 1, stats  # decided while the exchange was dead, past their 0.5 s
    # every order is accounted for once: filled, rejected, or reported (SendFailed: given up, or lost with its
    # session); none is left without a word
    assert stats["fills"] + stats["rejects"] + stats["orders_lost_with_session"] + stats["orders_given_up"] \
        == stats["orders"], stats
    assert stats["unfilled"] == 0 and stats["orders_unsent"] == 0, stats


def test_the_stop_delivers_the_fills_of_the_orders_in_flight(day: dict[str, Any]) -> None:
    stats = day["stats"]
    assert stats["orders_at_stop"] == CLOSING and stats["closing_fills"] == CLOSING, stats
    assert stats["events_unhandled"] == 0, stats
    assert set(stats["awaited_unanswered"]) <= {"connection lost"}, stats  # none left at the stop
    assert stats["awaited_unanswered"].get("connection lost", 0) == stats["orders_lost_with_session"], stats


def test_the_client_logged_in_again_after_the_expiry_and_after_the_restart(day: dict[str, Any]) -> None:
    assert day["stats"]["logins"] >= 3 and len(day["stats"]["ups_at_s"]) >= 3, day["stats"]
    assert day["counters"]["closes"]["4001"] == 0 and day["counters"]["pings_missed"] == 0
