"""An embedded controller leaves its host process as it found it: tests/host_program.py is a
host program with process-wide settings of its own, run as a subprocess (signals, threads and
the collector are the process's), which reports what it finds before, during and after a run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import pytest

from tests.harness import UNIT_S, AppProcess
from tests.servers import AiohttpConn, make_messages

HOST = ("tests/host_program.py",)
# a per-stream leaf of 65,536 x 8 float32 (2 MiB) makes the compile hold every thread on one CPU
SETTINGS = {"FORKLESS_MAX_STREAMS": "65536", "FORKLESS_MAX_BATCH": "16", "FORKLESS_STATUS_S": "0"}


def report(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_after_an_embedded_run_the_host_finds_its_gc_signals_switch_interval_and_affinities_as_it_left_them(app):
    proc: AppProcess = app(env={**SETTINGS, "FORKLESS_DURATION": "2"}, program=HOST)
    code, out, err, _ = proc.finish(120 * UNIT_S)
    assert code == 0, err
    found = report(out)
    assert found["results"] > 0 and not found["interrupted"]
    before, during, after = found["before"], found["during"], found["after"]
    assert before["sentinel_frozen"] and not before["gc_enabled"]
    assert during["switch_interval"] == 0.001 != before["switch_interval"]  # the controller did change it
    assert during["sigint"] != before["sigint"] and during["sigterm"] != before["sigterm"]  # and handled signals
    assert after == before


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: the compile holds no thread on fewer")
def test_the_compile_gives_every_host_thread_its_own_cpus_back(app):
    proc: AppProcess = app(env={**SETTINGS, "FORKLESS_DURATION": "0.5"}, program=HOST)
    code, out, err, _ = proc.finish(120 * UNIT_S)
    assert code == 0, err
    found = report(out)
    assert found["before"]["affinity"] == {"main": found["cpus"], "worker": [found["cpus"][-1]]}
    assert found["after"]["affinity"] == found["before"]["affinity"]


def test_a_second_sigint_raises_keyboard_interrupt_from_run_and_never_ends_the_host(feed_server, app):
    stop_feeding = threading.Event()

    async def script(conn: AiohttpConn) -> None:
        conn.stop_reading()  # never reads the replies, so the orderly stop cannot finish
        seq = 0
        while not stop_feeding.is_set():
            await conn.send(make_messages(50, start=seq, features=8, seed=seq))
            seq += 50
            await asyncio.sleep(0.001)

    server = feed_server(script, compress=False)
    # an orderly stop left to itself would take FORKLESS_SHUTDOWN_TIMEOUT_S, past finish()'s bound
    proc: AppProcess = app(env={**SETTINGS, "FORKLESS_WS_URL": server.url, "FORKLESS_SHUTDOWN_TIMEOUT_S": "600"},
                           program=HOST)
    try:
        proc.wait_for_line("first results", timeout_s=120 * UNIT_S)
        proc.signal(signal.SIGINT)
        proc.wait_for_line("SIGINT received", stream="stderr", timeout_s=10 * UNIT_S)
        proc.signal(signal.SIGINT)
        code, out, err, _ = proc.finish(60 * UNIT_S)
    finally:
        stop_feeding.set()
    assert code == 0, err  # the host ended on its own terms
    found = report(out)
    assert found["interrupted"]
    assert found["after"] == found["before"]


def test_two_controllers_with_overlapping_lives_leave_the_host_as_it_was_whatever_the_order_of_their_stops(app):
    proc: AppProcess = app(env={"FORKLESS_STATUS_S": "0"}, program=("-m", "tests.overlap_program"))
    code, out, err, _ = proc.finish(180 * UNIT_S)
    assert code == 0, err
    found = report(out)
    before = found["before"]
    assert found["during"]["switch_interval"] == 0.001 and found["during"]["frozen"]  # both ran, settings changed
    assert not before["frozen"] and before["switch_interval"] == 0.0123
    assert found["inside B"]["sigint"] != before["sigint"]  # A's run, then B's, handled the signals
    for sequence in ("after A B A B", "after A B B A", "after nested runs"):
        assert found[sequence] == before, sequence


def test_a_second_sigint_inside_the_stops_join_of_the_io_thread_raises_with_the_books_balanced(app):
    proc: AppProcess = app(env={"FORKLESS_STATUS_S": "0"}, program=("-m", "tests.interrupt_program"))
    proc.wait_for_line("emitted 200", timeout_s=120 * UNIT_S)
    proc.signal(signal.SIGINT)
    proc.wait_for_line("in the join", timeout_s=60 * UNIT_S)  # every reply is held by the IO thread, unwritten
    proc.signal(signal.SIGINT)
    code, out, err, _ = proc.finish(60 * UNIT_S)
    assert code == 0, err  # the host ended on its own terms
    books = report(out)
    assert books["interrupted"] and books["messages_in"] >= 200
    assert books["unanswered"] == 0, books
    assert books["messages_in"] == (books["messages_out"] + books["answer_errors_out"] + books["no_reply"]
                                    + sum(books["dropped"].values())), books
