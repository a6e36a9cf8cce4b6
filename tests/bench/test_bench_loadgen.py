"""Smoke tests of the benchmark load generator and the io-ceiling client.

The load generator runs in its own process (as in the benchmark); the client
runs in this process under ``asyncio.run``. Assertions are on accounting
only, never on timing thresholds.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from bench.io_ceiling import run_io_ceiling
from bench.loadgen import start_loadgen, wait_result
from forkless.io_loop.jsontext import dumps, loads
from tests.harness import UNIT_S

CLIENT_TIMEOUT_S = 20.0 * UNIT_S
RESULT_TIMEOUT_S = 15.0 * UNIT_S


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[Any]]]:
    """Collects started load generators; kills any still running at teardown."""
    started: list[subprocess.Popen[Any]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(procs: list[subprocess.Popen[Any]], args: list[str]) -> str:
    proc, url = start_loadgen(["--host", "127.0.0.1", "--port", "0", *args])
    procs.append(proc)
    assert url.startswith("ws://127.0.0.1:")
    return url


def _run_client(coro: Any) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro, CLIENT_TIMEOUT_S)

    asyncio.run(bounded())


def test_rate_mode_with_io_ceiling(procs: list[subprocess.Popen[Any]]) -> None:
    url = _start(
        procs,
        [
            "--mode",
            "rate",
            "--rate",
            "200",
            "--duration",
            "1",
            "--warmup-s",
            "0.2",
            "--streams",
            "4",
            "--seed",
            "7",
        ],
    )
    _run_client(run_io_ceiling(url, features=8))
    r = wait_result(procs[0], timeout=RESULT_TIMEOUT_S)

    assert r["mode"] == "rate"
    assert r["planned"] == 200
    assert r["sent"] == 200
    assert r["answered"] == r["sent"]
    assert r["missing"] == 0
    assert r["duplicates"] == 0
    assert r["errors"] == 0
    assert r["unexpected"] == 0
    assert r["mismatched"] == 0
    assert r["malformed"] == 0
    assert r["timed_out"] is False
    assert r["client_closed_early"] is False
    assert r["send_failed"] is None
    assert r["latency_basis"] == "due"
    # Messages due in the first 0.2 s (i < 40) are warm-up.
    assert r["measured"] == 160
    assert r["measured_missing"] == 0
    lat = r["latency_ms"]
    assert lat["p50"] > 0
    assert lat["p50"] <= lat["p99"] <= lat["p999"] <= lat["max"]
    assert lat["mean"] > 0
    assert len(r["latencies_ms_sample"]) == 160
    assert all(v > 0 for v in r["latencies_ms_sample"])
    assert r["throughput_msg_s"] > 0
    assert r["achieved_send_rate"] > 0


def test_window_mode_with_io_ceiling(procs: list[subprocess.Popen[Any]]) -> None:
    url = _start(procs, ["--mode", "window", "--window", "4", "--duration", "1"])
    _run_client(run_io_ceiling(url))
    r = wait_result(procs[0], timeout=RESULT_TIMEOUT_S)

    assert r["mode"] == "window"
    assert "latency_ms" not in r
    assert r["latency_basis"] == "send"
    assert r["sent"] >= 4
    assert r["answered"] == r["sent"]
    assert r["missing"] == 0
    assert r["duplicates"] == 0
    assert r["errors"] == 0
    assert r["throughput_msg_s"] > 0
    assert r["rtt_ms"]["p50"] > 0
    assert 0 < len(r["latencies_ms_sample"]) <= 20_000


async def _faulty_client(url: str) -> None:
    """Drops seq%10==3, answers seq%10==5 twice, errors seq%10==7."""
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        await ws.send_str('{"seq": 1000000000, "stream": "s0", "z": [], "score": 0.0, "anomaly": false}')
        await ws.send_str("not json")
        async for msg in ws:
            m = loads(msg.data)
            seq = m["seq"]
            reply = {
                "seq": seq,
                "stream": m["stream"],
                "z": [0.0],
                "score": 0.0,
                "anomaly": False,
            }
            if seq % 10 == 3:
                continue
            if seq % 10 == 7:
                await ws.send_bytes(dumps({"error": "boom", "seq": seq}))
                continue
            await ws.send_str(dumps(reply).decode())
            if seq % 10 == 5:
                await ws.send_str(dumps(reply).decode())


def test_missing_duplicates_and_errors_are_counted(
    procs: list[subprocess.Popen[Any]],
) -> None:
    url = _start(
        procs,
        [
            "--mode",
            "rate",
            "--rate",
            "200",
            "--duration",
            "0.5",
            "--warmup-s",
            "0",
            "--drain-s",
            "0.3",
        ],
    )
    _run_client(_faulty_client(url))
    r = wait_result(procs[0], timeout=RESULT_TIMEOUT_S)

    assert r["sent"] == 100
    assert r["missing"] == 10
    assert r["duplicates"] == 10
    assert r["errors"] == 10
    assert r["answered"] == 90
    assert r["unexpected"] == 1
    assert r["malformed"] == 1
    assert r["measured_missing"] == 10
    # Error replies are answers but not results: no latency for them.
    assert len(r["latencies_ms_sample"]) == 80


def test_exits_when_no_client_connects(procs: list[subprocess.Popen[Any]]) -> None:
    _start(procs, ["--mode", "rate", "--connect-timeout", "0.5"])
    r = wait_result(procs[0], timeout=RESULT_TIMEOUT_S)
    assert "no client connected" in r["error"]
    assert procs[0].returncode == 2


def test_several_connections_each_get_their_own_run_and_the_result_sums_them(
        procs: list[subprocess.Popen[Any]]) -> None:
    url = _start(procs, ["--mode", "rate", "--rate", "100", "--duration", "1", "--warmup-s", "0.2",
                         "--streams", "4", "--connections", "3"])

    async def three() -> None:
        await asyncio.gather(*(run_io_ceiling(url, features=8) for _ in range(3)))

    _run_client(three())
    r = wait_result(procs[0], timeout=RESULT_TIMEOUT_S)

    assert r["connections"] == 3 and len(r["per_connection"]) == 3
    assert [c["sent"] for c in r["per_connection"]] == [100, 100, 100]
    assert r["sent"] == r["answered"] == 300
    assert r["missing"] == r["duplicates"] == r["unexpected"] == r["mismatched"] == 0
    assert r["throughput_msg_s"] == sum(c["throughput_msg_s"] for c in r["per_connection"])


def test_the_cpu_figure_of_a_window_is_read_around_it_where_too_few_samples_fell_inside() -> None:
    """``bench.processes.cpu_cores``: CPU seconds a second over a run's measured window, from the
    sampler's ``(time, CPU seconds)`` series; a loaded machine's sampler may take fewer samples
    than the window needs, and the figure is then read at the samples around it."""
    from bench.processes import cpu_cores

    dense = [(t / 20, t / 40) for t in range(21)]  # every 50 ms, half a core
    assert cpu_cores(dense, 0.1, 0.5) == pytest.approx(0.5)
    sparse = [(0.0, 0.0), (0.3, 0.3), (0.9, 0.6)]  # one sample inside [0.1, 0.5]
    assert cpu_cores(sparse, 0.1, 0.5) == pytest.approx(0.6 / 0.9)
    assert cpu_cores([(0.0, 0.0), (0.3, 0.3)], 0.1, 0.5) is None  # nothing after it: no figure
