"""The classic program on ``IOPortal`` (issue 44, item 5): a ``Controller`` main loop and a
``DataClientWorker`` written for ``multiprocessing.Queue`` (tests/classic_program.py), ported
with the worker unchanged (examples/portal_session.py), run as a process against a real loopback
exchange written with ``websockets`` (tests/ws_exchange.py): login, subscribe, heartbeats,
orders and fills, and the token's expiry, which ends the worker on its own.
"""

from __future__ import annotations

import ast
import difflib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import UNIT_S
from tests.ws_exchange import WsExchange

ROOT = Path(__file__).resolve().parents[1]
CLASSIC = ROOT / "tests" / "classic_program.py"
PORTED = ROOT / "examples" / "portal_session.py"


def _class_source(path: Path, name: str) -> str:
    text = path.read_text(encoding="utf-8")
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == name)
    return ast.get_source_segment(text, node) or ""


@pytest.fixture
def exchange() -> Iterator[WsExchange]:
    ex = WsExchange(token_ttl_s=3 * UNIT_S, trade_every_s=0.02, ping_every_s=0.2)
    ex.start()
    yield ex
    ex.stop()


def test_the_port_keeps_the_worker_verbatim_and_changes_the_main_loop_by_one_except_clause():
    assert _class_source(PORTED, "DataClientWorker") == _class_source(CLASSIC, "DataClientWorker")
    diff = [line for line in difflib.unified_diff(_class_source(CLASSIC, "Controller").splitlines(),
                                                  _class_source(PORTED, "Controller").splitlines(), lineterm="")
            if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert diff == ["+            except PortalClosed:  # the worker ended on its own, and everything it sent is taken",
                    "+                break"]


def test_the_classic_program_runs_on_the_portal_through_heartbeats_orders_and_the_token_s_expiry(exchange):
    proc = subprocess.run([sys.executable, str(PORTED), "--url", exchange.url, "--seconds", str(60 * UNIT_S)],
                          capture_output=True, text=True, timeout=90 * UNIT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    orders = [f"o{i}" for i in range(5)]
    assert done["orders"] == orders
    assert done["fills"] == orders  # every order the main loop put reached the exchange, every fill came back
    assert done["trades"] >= 5
    assert done["closed"] == 4003  # the worker's last word, then PortalClosed ended the main loop cleanly
    figures = exchange.figures()
    assert figures["orders"] == orders
    assert figures["sessions"] == [4003]  # the heartbeat was answered all along: never 4001
    assert figures["pongs"] >= 1 and figures["violations"] == []
    assert "the IO worker returned before the stop" in proc.stderr  # the IO side says so in its log
    assert "Traceback" not in proc.stderr
