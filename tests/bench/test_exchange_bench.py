"""The exchange-session benchmark's pieces (issue 29): the toy exchange (bench/exchange.py),
driven with the ``websockets`` client, and the user's program in the thread and spawn designs
(bench/exchange_thread.py, bench/exchange_spawn.py) run as subprocesses against it. Counts and
content only, never speed."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from bench.exchange import Exchange
from bench.exchange_session import (
    Design,
    _wait_sampling,
    day_markdown,
    differences,
    markdown,
    ratios,
    select_designs,
    summarise,
    summarise_day,
)
from tests.harness import UNIT_S, app_env

REPO_ROOT = Path(__file__).resolve().parents[2]
PRICE = re.compile(r"^\d+\.\d{1,10}$")
WAIT_S = 10 * UNIT_S  # the longest any frame or count is waited for


@pytest.fixture
def start_exchange() -> Iterator[Callable[..., Exchange]]:
    """A factory: ``start_exchange(**options)`` starts an in-process ``Exchange`` (pings every
    0.2 s, recording what it sends unless told otherwise); every one is stopped at teardown."""
    started: list[Exchange] = []

    def start(**options: Any) -> Exchange:
        ex = Exchange(**{"ping_every_s": 0.2, "record": True, **options})
        started.append(ex)
        ex.start()
        return ex

    yield start
    for ex in started:
        ex.stop()


@pytest.fixture
def exchange(start_exchange: Callable[..., Exchange]) -> Exchange:
    return start_exchange()


def login(url: str, user: str = "alice", password: str = "s3cret") -> str:
    body = json.dumps({"user": user, "password": password}).encode()
    req = urllib.request.Request(f"{url}/login", data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=WAIT_S) as resp:
        return json.load(resp)["token"]


def ws_url(url: str, token: str) -> str:
    return f"{url.replace('http', 'ws', 1)}/ws?token={token}"


def recv_type(ws: ClientConnection, kind: str, answer_pings: bool = True) -> dict[str, Any]:
    """The next frame of ``kind``, answering the pings on the way; fails after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        msg = json.loads(ws.recv(timeout=WAIT_S))
        if msg["type"] == kind:
            return msg
        if msg["type"] == "ping" and answer_pings:
            ws.send(json.dumps({"type": "pong", "id": msg["id"]}))
    raise AssertionError(f"no {kind!r} frame within {WAIT_S:.0f}s")


def close_code(ws: ClientConnection, answer_pings: bool) -> int | None:
    """Read until the exchange closes the connection; the code it closed with. Fails after WAIT_S."""
    with pytest.raises(ConnectionClosed) as closed:
        recv_type(ws, "never sent", answer_pings)
    return closed.value.rcvd.code if closed.value.rcvd is not None else None


@contextlib.contextmanager
def subscribed(ex: Exchange, symbols: list[str]) -> Iterator[ClientConnection]:
    """A logged-in connection, subscribed to ``symbols``."""
    with connect(ws_url(ex.url, login(ex.url)), open_timeout=WAIT_S) as ws:
        ws.send(json.dumps({"type": "subscribe", "symbols": symbols}))
        assert recv_type(ws, "subscribed") == {"type": "subscribed", "symbols": symbols}
        yield ws


# ---- the exchange ----------------------------------------------------------------------------------


def test_login_gives_a_token_for_the_right_password_and_403_for_a_wrong_one(exchange: Exchange) -> None:
    assert re.fullmatch(r"[0-9a-f]{32}", login(exchange.url))
    with pytest.raises(urllib.error.HTTPError) as refused:
        login(exchange.url, password="guess")
    assert refused.value.code == 403
    assert (exchange.counters()["logins"], exchange.counters()["logins_refused"]) == (1, 1)


def test_subscribed_symbols_get_trades_with_a_global_seq_and_decimal_text(exchange: Exchange) -> None:
    with subscribed(exchange, ["BTCUSDT", "SOLUSDT"]) as ws:
        trades = [recv_type(ws, "trade") for _ in range(200)]
    assert {t["symbol"] for t in trades} == {"BTCUSDT", "SOLUSDT"}
    assert [t["seq"] for t in trades] == list(range(trades[0]["seq"], trades[0]["seq"] + 200))
    assert all(PRICE.match(t["price"]) and PRICE.match(t["qty"]) for t in trades)
    assert any(t["price"].endswith("0") for t in trades), "trailing zeros, which a float round trip would drop"
    assert len({len(t["price"].split(".")[1]) for t in trades}) > 3, "the number of decimals varies"
    sent = exchange.sent_prices()
    assert all(sent[t["seq"]] == t["price"] for t in trades)


def test_a_book_of_five_levels_comes_for_a_subscribed_symbol(exchange: Exchange) -> None:
    with subscribed(exchange, ["ETHUSDT"]) as ws:
        book = recv_type(ws, "book")
    assert book["symbol"] == "ETHUSDT"
    assert len(book["bids"]) == len(book["asks"]) == 5
    assert all(PRICE.match(p) and PRICE.match(q) for p, q in book["bids"] + book["asks"])


def test_a_ping_answered_in_time_is_counted_on_time(exchange: Exchange) -> None:
    with subscribed(exchange, ["BTCUSDT"]) as ws:
        ping = recv_type(ws, "ping", answer_pings=False)
        ws.send(json.dumps({"type": "pong", "id": ping["id"]}))
        counters = exchange.wait_for(lambda c: c["pongs_on_time"] >= 1, WAIT_S, "a pong on time")
    assert counters["violations"] == {}


def test_an_order_fills_at_a_traded_price_and_a_bad_one_is_rejected(exchange: Exchange) -> None:
    with subscribed(exchange, ["BTCUSDT"]) as ws:
        recv_type(ws, "trade")
        ws.send(json.dumps({"type": "order", "symbol": "BTCUSDT", "side": "buy", "qty": "0.50",
                            "client_order_id": "o-1"}))
        fill = recv_type(ws, "fill")
        ws.send(json.dumps({"type": "order", "symbol": "BTCUSDT", "side": "hold", "qty": "1",
                            "client_order_id": "o-2"}))
        reject = recv_type(ws, "reject")
    assert {k: fill[k] for k in ("client_order_id", "symbol", "side", "qty")} == {
        "client_order_id": "o-1", "symbol": "BTCUSDT", "side": "buy", "qty": "0.50"}
    assert fill["price"] in exchange.sent_prices().values()
    assert reject["client_order_id"] == "o-2" and "side" in reject["reason"]
    counters = exchange.counters()
    assert (counters["orders"], counters["fills"], counters["rejects"], counters["violations"]) == (2, 1, 1, {})


def test_anything_but_subscribe_pong_and_order_is_a_violation_by_kind(exchange: Exchange) -> None:
    with connect(ws_url(exchange.url, login(exchange.url)), open_timeout=WAIT_S) as ws:
        ws.send(json.dumps({"type": "order", "symbol": "BTCUSDT", "side": "buy", "qty": "1", "client_order_id": "x"}))
        ws.send(json.dumps({"type": "subscribe", "symbols": ["BTCUSDT"]}))
        recv_type(ws, "subscribed")
        for frame in ({"type": "subscribe", "symbols": ["ETHUSDT"]}, {"type": "hello"}, {"type": "pong", "id": 999}):
            ws.send(json.dumps(frame))
        ws.send("not json")
        counters = exchange.wait_for(lambda c: sum(c["violations"].values()) >= 5, WAIT_S, "five violations")
    assert counters["violations"] == {"before_subscribe": 1, "subscribe_again": 1, "type:hello": 1,
                                      "pong_unexpected": 1, "not_json_object": 1}
    assert counters["orders"] == 0


def test_an_unanswered_ping_closes_the_connection_with_4001(start_exchange: Callable[..., Exchange]) -> None:
    exchange = start_exchange(pong_within_s=0.2)
    with subscribed(exchange, ["BTCUSDT"]) as ws:
        assert close_code(ws, answer_pings=False) == 4001
    counters = exchange.wait_for(lambda c: c["closes"]["4001"] == 1, WAIT_S, "a 4001 close counted")
    assert counters["pings_missed"] == 1


def test_an_expired_token_closes_with_4003_and_is_then_refused_401(start_exchange: Callable[..., Exchange]) -> None:
    exchange = start_exchange(token_ttl_s=0.5)
    token = login(exchange.url)
    with connect(ws_url(exchange.url, token), open_timeout=WAIT_S) as ws:
        ws.send(json.dumps({"type": "subscribe", "symbols": ["BTCUSDT"]}))
        assert close_code(ws, answer_pings=True) == 4003
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(exchange.url, token), open_timeout=WAIT_S)
    assert refused.value.response.status_code == 401
    counters = exchange.wait_for(lambda c: c["closes"]["4003"] == 1, WAIT_S, "a 4003 close counted")
    assert counters["ws_refused_401"] == 1


# ---- the harness's bookkeeping (bench/exchange_session.py), on literal runs -------------------------


def test_harness_skips_a_design_whose_program_does_not_exist_with_a_note(tmp_path: Path) -> None:
    (tmp_path / "here.py").write_text("")
    known = (Design("a", "here.py", ()), Design("b", "not_yet.py", ()))
    assert select_designs(["b", "a"], known, tmp_path) == ([known[0]], {"b": "not_yet.py does not exist yet"})
    with pytest.raises(ValueError, match="unknown designs \\['c'\\]"):
        select_designs(["a", "c"], known, tmp_path)


def test_harness_reports_medians_over_rounds_and_ratios_to_thread() -> None:
    def run(rtt_p50: float, cpu_per_s: float, closes_4001: int = 0) -> dict[str, Any]:
        stats = {"order_rtt_ms_p50": rtt_p50, "cpu_per_s": cpu_per_s, "orders": 10, "fills": 10}
        return {"rc": 0, "stats": stats, "exchange": {"closes": {"4001": closes_4001}, "violations": {"x": 1}}}

    medians = {"thread": summarise([run(1.0, 0.1), run(3.0, 0.3), run(2.0, 0.2)]),
               "spawn": summarise([run(4.0, 0.4), run(4.0, 0.4, closes_4001=1)])}
    assert (medians["thread"]["order_rtt_ms_p50"], medians["thread"]["cpu_per_s"]) == (2.0, 0.2)
    assert (medians["spawn"]["orders"], medians["spawn"]["closes_4001"], medians["spawn"]["violations"]) == (20, 1, 2)
    vs = ratios(medians)
    assert vs["spawn"]["order_rtt_ms_p50"] == 2.0 and vs["spawn"]["trade_ms_p99"] is None
    assert "| spawn | 4 (×2.00) |" in markdown(medians, vs, {"forkless": "not there"})


def test_harness_reports_a_trading_day_s_figures_as_a_median_with_its_range() -> None:
    def day(back: float | None, exit_s: float) -> dict[str, Any]:
        return {"rc": 0, "stats": {}, "reconnect_after_restart_s": back, "orders_given_up": 9,
                "orders_without_word": 0, "closing_fills": 8, "ctrl_c_to_exit_s": exit_s, "cpu_s": 6.5}

    portal = summarise_day([day(0.3, 0.5), day(0.1, 0.9), day(None, 0.7)])
    assert portal["runs"] == portal["runs_ok"] == 3
    assert portal["reconnect_after_restart_s"] == {"median": 0.2, "min": 0.1, "max": 0.3}  # a day not back: none
    assert portal["ctrl_c_to_exit_s"] == {"median": 0.7, "min": 0.5, "max": 0.9}
    assert "| portal | 0.2 (0.1–0.3) | 9 (9–9) | 0 (0–0) | 8 (8–8) | 0.7 (0.5–0.9) |" in day_markdown(
        {"portal": portal}, 8)


def test_harness_reports_rss_as_a_ratio_and_a_difference_to_thread() -> None:
    def run(steady_mb: float) -> dict[str, Any]:
        stats = {"order_rtt_ms_p50": 1.0, "rss_mb_peak": steady_mb + 1, "rss_mb_steady": steady_mb}
        return {"rc": 0, "stats": stats, "exchange": None}

    medians = {"thread": summarise([run(200.0), run(210.0), run(190.0)]), "forkless": summarise([run(204.0)])}
    assert medians["thread"]["rss_mb_steady"] == 200.0
    assert differences(medians)["forkless"] == {"rss_mb_peak": 4.0, "rss_mb_steady": 4.0}
    vs = ratios(medians)
    assert vs["forkless"]["rss_mb_steady"] == 204.0 / 200.0
    assert "| 204.0 (×1.02, +4.0) |" in markdown(medians, vs, {})


def test_harness_samples_a_programs_rss_and_its_threads_cpu_once_its_main_loop_runs(tmp_path: Path) -> None:
    log = tmp_path / "program.log"
    busy = ("import sys, time; time.sleep(0.6); print('main loop started', file=sys.stderr, flush=True)\n"
            "end = time.thread_time() + 0.3\nwhile time.thread_time() < end: pass\ntime.sleep(0.5)")
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", busy], stdout=out, stderr=subprocess.STDOUT)
        rc, sampler = _wait_sampling(proc, log, loop_s=60.0, timeout_s=60.0)
    figures = sampler.figures()
    assert rc == 0 and figures["rss_mb_peak"] > 1 and figures["rss_mb_steady"] > 1 and figures["rss_samples"] >= 1
    main = [cpu for name, cpu in figures["threads_cpu_s"].items() if name.split()[0] == str(proc.pid)]
    assert main and main[0] > 0.1  # the main thread's busy 0.3 s, after the line


# ---- the user's program, thread and spawn designs ------------------------------------------------

PROGRAM_S = 3.0
ORDERS_AT_STOP = 5  # the forkless program's orders sent right before its stop (without the stop's awaiting(): 0 filled)
TOKEN_TTL_S = 1.0


FORKLESS = {"forkless": "examples/exchange_session.py", "portal": "examples/portal_exchange.py"}  # its two ways


def program_cmd(design: str, url: str, tmp: Path, duration_s: float) -> list[str]:
    program = [FORKLESS[design]] if design in FORKLESS else ["-m", f"bench.exchange_{design}"]
    at_stop = ["--orders-at-stop", str(ORDERS_AT_STOP)] if design in FORKLESS else []  # closing out, then stop()
    return [sys.executable, *program, "--url", url, "--duration", str(duration_s),
            "--stats", str(tmp / "stats.json"), "--prices", str(tmp / "prices.txt"), "--force-order-every", "0.2",
            *at_stop]


def program_env() -> dict[str, str]:
    # the session's compilation cache (tests/harness.py): the programs load the default step
    # other tests compiled instead of compiling it cold in each run
    return app_env({"PYTHONPATH": str(REPO_ROOT)})


DESIGNS = ["thread", "spawn", "forkless", "portal"]  # forkless: the client a Source; portal: the worker on an IOPortal


def run_watching_children(cmd: list[str], tmp: Path) -> tuple[int, str, set[int]]:
    """Run the program to its end; its exit status, its stderr, and every process seen below
    it (its process tree sampled every 10 ms while it runs: a fork or a spawned child shows)."""
    with open(tmp / "stderr.txt", "w+", encoding="utf-8") as err:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=program_env(), stdout=subprocess.DEVNULL, stderr=err,
                                text=True)
        children: set[int] = set()
        deadline = time.monotonic() + 90 * UNIT_S
        try:
            tree = psutil.Process(proc.pid)
            while proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(psutil.Error):
                    children.update(child.pid for child in tree.children(recursive=True))
                time.sleep(0.01)
            rc = proc.wait(max(0.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        return rc, err.read(), children


@pytest.fixture(scope="module", params=DESIGNS)
def session(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One run of the design's program for PROGRAM_S against an exchange whose tokens expire
    every TOKEN_TTL_S; its stats, prices and exit status, and the exchange's counters after."""
    tmp = tmp_path_factory.mktemp(f"exchange-{request.param}")
    ex = Exchange(ping_every_s=0.3, token_ttl_s=TOKEN_TTL_S, quiet_every_s=1.0, quiet_for_s=0.5, record=True)
    url = ex.start()
    try:
        rc, stderr, children = run_watching_children(program_cmd(request.param, url, tmp, PROGRAM_S), tmp)
        counters = ex.wait_for(lambda c: sum(c["closes"].values()) >= c["connections"], WAIT_S,
                               "every connection's close counted")
        yield {"design": request.param, "rc": rc, "stderr": stderr, "counters": counters, "children": children,
               "stats": json.loads((tmp / "stats.json").read_text()) if (tmp / "stats.json").exists() else None,
               "prices": (tmp / "prices.txt").read_text().splitlines() if (tmp / "prices.txt").exists() else [],
               "sent": ex.sent_prices()}
    finally:
        ex.stop()


def test_program_runs_its_duration_and_exits_0(session: dict[str, Any]) -> None:
    assert session["rc"] == 0, session["stderr"]
    assert "main loop started" in session["stderr"]
    assert session["stats"]["stopped_by"] == "duration"


def test_program_gets_a_fill_for_its_forced_orders(session: dict[str, Any]) -> None:
    stats = session["stats"]
    assert stats["orders_forced"] >= 5
    assert stats["fills"] >= stats["orders"] - 2, "at most the orders in flight at the stop unfilled"
    assert stats["rejects"] == 0 and session["counters"]["rejects"] == 0
    assert stats["order_rtt_ms_p50"] is not None and stats["trade_ms_p50"] is not None


def test_forkless_program_gets_every_fill_of_the_orders_in_flight_through_its_stop_with_no_drain(
        session: dict[str, Any]) -> None:
    """Both of forkless's ways say which order a fill answers (``send_answered``, docs/embedding/stop.md): the
    stop delivers every fill still to come, and an order whose session ended before its fill (the exchange
    answers on the order's own session: a token expired under it) is reported, never left without a word."""
    if session["design"] not in FORKLESS:
        pytest.skip("the thread and spawn designs stop with what is in flight unfilled")
    stats = session["stats"]
    assert stats["orders_at_stop"] == ORDERS_AT_STOP and stats["closing_fills"] == ORDERS_AT_STOP, stats
    assert set(stats["awaited_unanswered"]) <= {"connection lost"}, stats
    assert stats["events_unhandled"] == 0 and stats["orders_unsent"] == 0 and stats["unfilled"] == 0, stats
    # an order given up at its deadline (the session down longer than --order-max-age) is never written
    assert stats["fills"] + stats["rejects"] + stats["orders_lost_with_session"] + stats["orders_given_up"] \
        == stats["orders"], stats


def test_program_gets_its_orders_filled_while_the_market_is_quiet(session: dict[str, Any]) -> None:
    stats = session["stats"]
    assert stats["order_rtt_quiet_n"] >= 1, "forced orders were decided while no trade came"
    assert stats["unfilled"] <= 2, "at most the orders in flight at the stop unfilled"


def test_program_logs_in_again_when_its_token_expires(session: dict[str, Any]) -> None:
    assert session["stats"]["logins"] >= 2
    assert session["counters"]["logins"] == session["stats"]["logins"]
    assert session["counters"]["closes"]["4003"] >= 1


def test_program_writes_prices_with_the_exchanges_text_in_order(session: dict[str, Any]) -> None:
    lines = [line.split(" ") for line in session["prices"]]
    assert len(lines) >= 100
    assert [session["sent"][int(seq)] for seq, _ in lines] == [price for _, price in lines]
    seqs = [int(seq) for seq, _ in lines]
    assert seqs == sorted(seqs), "in the order sent"
    assert any(price.endswith("0") for _, price in lines), "text a float round trip would change"


def test_program_answers_every_ping_and_sends_nothing_else(session: dict[str, Any]) -> None:
    counters = session["counters"]
    assert counters["pongs_on_time"] >= 1
    assert (counters["closes"]["4001"], counters["pings_missed"], counters["violations"]) == (0, 0, {})


def test_program_runs_in_one_process_unless_it_is_the_spawn_design(session: dict[str, Any]) -> None:
    if session["design"] == "spawn":  # the sampling's own check: the spawn design's child is seen
        assert session["children"], "the spawn design's child process was not seen"
    else:
        assert session["children"] == set(), "a process was started below the program"


@pytest.mark.parametrize("design", DESIGNS)
def test_program_exits_0_on_sigterm_with_its_stats(design: str, tmp_path: Path,
                                                   start_exchange: Callable[..., Exchange]) -> None:
    ex = start_exchange(ping_every_s=0.3, record=False)
    proc = subprocess.Popen(program_cmd(design, ex.url, tmp_path, 600.0), cwd=REPO_ROOT, env=program_env(),
                            stderr=subprocess.PIPE, text=True)
    try:
        ex.wait_for(lambda c: c["fills"] >= 2, 60 * UNIT_S, "two fills")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30 * UNIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert rc == 0, stderr
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["stopped_by"] == "SIGTERM"
    # the exchange filled two orders, so the main loop had placed them; whether a fill had come
    # back through the design's hand-over before the SIGTERM depends on the machine's speed
    # (spawn's once had not: fills 0 under load), so it is not asserted
    assert stats["orders"] >= 2
