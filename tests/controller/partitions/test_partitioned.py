"""Partitioned instances (issue 24) against a real nats-server: instances as subprocesses, each
owning a share of P=12 partitions of one stream (the server's subject transform assigns them),
leases in a KV bucket, per-partition checkpoints in an object-store bucket; killed with -9,
rescaled 3 -> 2 -> 4, every input answered exactly once with the result of a run that never
stopped; overlapping partitions refused; dead holders' leases waited out.

Several JAX processes share two cores here: the timeouts are generous and explicit."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from tests.harness import KILLED_EXIT_S, UNIT_S, wait_until
from tests.io_loop.connectors.jetstream.test_jetstream import FEATURES, Publisher, _never_restarted, _results
from tests.servers import assert_results_match_reference

pytestmark = pytest.mark.timeout(400 * UNIT_S)

P = 12
OPEN = r"connection \d+ open"


def _feed(url: str, **extra: Any) -> dict[str, Any]:
    return {"name": "ticks", "nats": url, "stream": "TICKS", "subject": "ticks.{partition}.>", "results": "scores",
            "partition_count": P, **extra}


def _env(url: str, tmp: Any, *, instance: int | None = None, instances: int | None = None,
         feed: dict[str, Any] | None = None, lease_s: float = 8.0, **extra: str) -> dict[str, str]:
    env = {"FORKLESS_FEEDS": json.dumps([feed or _feed(url)]), "FORKLESS_FEATURES": str(FEATURES),
           "FORKLESS_MAX_BATCH": "16", "FORKLESS_MAX_STREAMS": "64", "FORKLESS_STATUS_S": "0",
           "FORKLESS_CHECKPOINT_BUCKET": "forkless-ckpt", "FORKLESS_CHECKPOINT_S": "1",
           "FORKLESS_CHECKPOINT_PRIORITY": "normal", "FORKLESS_LEASE_S": str(lease_s),
           "FORKLESS_RECONNECT_MIN_S": "0.1", "FORKLESS_RECONNECT_MAX_S": "0.5",
           **extra}  # the compiled steps: from the session's cache (tests/harness.py)
    if instance is not None:
        env["FORKLESS_INSTANCE"], env["FORKLESS_INSTANCES"] = str(instance), str(instances)
    return env


def _create_partitioned_streams(url: str, duplicate_window_s: float = 300.0, **limits: Any) -> None:
    """TICKS stores ``ticks.<key>`` as ``ticks.<partition>.<key>`` (the server's partition
    function; ``limits``: its max_msgs, max_age …), SCORES holds the results with a duplicate window."""
    import asyncio

    import nats
    from nats.js.api import StreamConfig, SubjectTransform

    async def main() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(
            name="TICKS", subjects=["ticks.*"],
            subject_transform=SubjectTransform(
                src="ticks.*", dest=f"ticks.{{{{partition({P},1)}}}}.{{{{wildcard(1)}}}}"), **limits))
        await js.add_stream(StreamConfig(name="SCORES", subjects=["scores"], duplicate_window=duplicate_window_s))
        await nc.close()

    asyncio.run(main())


def _checkpoint_objects(url: str) -> set[str]:
    """The objects in the checkpoint bucket, read with nats-py's own ObjectStore."""
    import asyncio

    import nats
    import nats.js.errors

    async def main() -> set[str]:
        nc = await nats.connect(url)
        try:
            store = await nc.jetstream().object_store("forkless-ckpt")
            return {info.name for info in await store.list()}
        except nats.js.errors.Error:  # no bucket, or no object yet
            return set()
        finally:
            await nc.close()

    return asyncio.run(main())


def _checkpointed(url: str) -> set[int]:
    return {int(name.split("/")[1]) for name in _checkpoint_objects(url)}


def _start(app: Any, envs: list[dict[str, str]]) -> list[Any]:
    procs = [app(env=env) for env in envs]
    for proc in procs:
        proc.wait_for_line(OPEN, stream="stderr", timeout_s=120 * UNIT_S)
    return procs


def _results_grow(url: str, by: int) -> None:
    from tests.natsserver import stream_state

    target = stream_state(url, "SCORES").messages + by
    wait_until(lambda: stream_state(url, "SCORES").messages >= target, timeout_s=60 * UNIT_S,
               what=f"{by} more results", poll_s=0.2)


def _waited_out(proc: Any, killed: float, *, lease_s: float) -> None:
    """``proc``, started after a holder was killed at ``killed`` (``time.monotonic()``), serves
    only once that holder's lease has expired: it logged that it waited for the lease (held by
    the dead holder) or, where its start-up outlasted the lease (a slow or loaded machine), it
    opened its feed no sooner than the lease allows (the holder renewed every lease/3, so its
    lease ran out at least 2/3 of a lease after the kill). Either way, never before."""
    proc.wait_for_line(OPEN, stream="stderr", timeout_s=120 * UNIT_S)
    opened = time.monotonic()
    waited = [line for line in proc.stderr.splitlines() if "waiting for the lease" in line]
    if waited:
        assert all("held by" in line for line in waited), waited
    else:
        assert opened - killed >= lease_s * 2 / 3, f"served {opened - killed:.1f} s after the kill, lease {lease_s} s"


def test_three_instances_killed_restarted_as_two_then_four_answer_every_input_exactly_once(app, nats_server, tmp_path):
    from tests.natsserver import stream_state

    url = nats_server.url
    _create_partitioned_streams(url)
    with Publisher(url, streams=24, rate_hz=300.0) as publisher:
        three = _start(app, [_env(url, tmp_path, instance=i, instances=3) for i in range(3)])
        _results_grow(url, 150)
        wait_until(lambda: _checkpointed(url) == set(range(P)), timeout_s=60 * UNIT_S,
                   what="a checkpoint object of every partition", poll_s=0.5)
        _results_grow(url, 100)  # and then some more: killed between checkpoints
        for proc in three:
            proc.signal(signal.SIGKILL)
        killed = time.monotonic()
        for proc in three:
            assert proc.finish(KILLED_EXIT_S).returncode == -9
        # the dead holders' leases (8 s) are waited out, then every partition is served again
        two = [app(env=_env(url, tmp_path, instance=i, instances=2)) for i in range(2)]
        for proc in two:
            _waited_out(proc, killed, lease_s=8.0)
        _results_grow(url, 150)
        first = _checkpoint_objects(url)
        wait_until(lambda: _checkpoint_objects(url) - first, timeout_s=60 * UNIT_S, what="newer checkpoint objects",
                   poll_s=0.5)
        for proc in two:
            proc.signal(signal.SIGTERM)  # an orderly stop releases the leases: the four wait for nothing
        for proc in two:
            done = proc.finish(60 * UNIT_S)
            assert done.returncode == 0, done.stderr
            assert "restored" in done.stderr  # each took over partitions from the dead three
        four = _start(app, [_env(url, tmp_path, instance=i, instances=4) for i in range(4)])
        assert not any("waiting for the lease" in proc.stderr for proc in four)
        _results_grow(url, 100)
    published = len(publisher.messages)
    wait_until(lambda: stream_state(url, "SCORES").messages >= published, timeout_s=90 * UNIT_S,
               what=f"{published} results in the results stream", poll_s=0.2)
    for proc in four:
        proc.signal(signal.SIGTERM)
    for proc in four:
        done = proc.finish(60 * UNIT_S)
        assert done.returncode == 0, done.stderr

    by_id, ids = _results(url)
    expected = [f"TICKS:{i + 1}:0" for i in range(published)]
    assert len(ids) == published and sorted(ids) == sorted(expected)  # exactly one result per input
    results = {by_id[f"TICKS:{i + 1}:0"]["seq"]: [by_id[f"TICKS:{i + 1}:0"]] for i in range(published)}
    assert_results_match_reference(publisher.messages, results)
    replies, _ = _never_restarted(publisher.messages)  # one run over all partitions, never stopped
    assert [results[m["seq"]][0] for m in publisher.messages] == [replies[m["seq"]] for m in publisher.messages]


def test_overlapping_partitions_are_refused_and_a_dead_holders_lease_is_waited_out(app, nats_server, tmp_path):
    url = nats_server.url
    _create_partitioned_streams(url)
    (first,) = _start(app, [_env(url, tmp_path, feed=_feed(url, partitions="0-5"))])
    second = app(env=_env(url, tmp_path, feed=_feed(url, partitions="4-8")))
    refused = second.finish(120 * UNIT_S)
    assert refused.returncode == 2, refused.stderr
    line = next(line for line in refused.stderr.splitlines() if line.startswith("forkless:"))
    assert "TICKS.4" in line and "TICKS.5" in line and "TICKS.6" not in line, line  # the held ones only
    assert f":{first.proc.pid}:" in line, line  # and who holds them
    assert first.proc.poll() is None  # the holder runs on
    first.signal(signal.SIGKILL)
    killed = time.monotonic()
    assert first.finish(KILLED_EXIT_S).returncode == -9
    again = app(env=_env(url, tmp_path, feed=_feed(url, partitions="4-8")))
    _waited_out(again, killed, lease_s=8.0)
    again.signal(signal.SIGTERM)
    done = again.finish(60 * UNIT_S)
    assert done.returncode == 0, done.stderr


def test_an_element_published_under_another_streams_partition_is_answered_with_an_error_never_applied(
        nats_server, tmp_path):
    from forkless.controller.config import Config
    from forkless.controller.loop import Controller
    from forkless.io_loop.connectors.jetstream.partitions import escape_stream, partition_of
    from tests.harness import drive
    from tests.natsserver import publish

    url = nats_server.url
    _create_partitioned_streams(url)
    names = [f"s{i}" for i in range(40)]
    a = names[0]
    b = next(n for n in names if partition_of(escape_stream(n), P) != partition_of(escape_stream(a), P))
    x = [1.0] * FEATURES
    publish(url, lambda i: ["ticks." + a, "ticks." + b, "ticks." + b][i],
            [json.dumps({"seq": 1, "stream": a, "x": x}),  # in its own partition
             json.dumps({"seq": 2, "stream": a, "x": x}),  # under b's subject, so b's partition
             json.dumps([{"seq": 3, "stream": b, "x": x}, {"seq": 4, "stream": a, "x": x}])])
    cfg = Config(feeds=json.dumps([_feed(url, partitions=f"0-{P - 1}")]), features=FEATURES, max_batch=16,
                 max_streams=64, status_s=0.0, lease_s=2.0, reconnect_min_s=0.05, reconnect_max_s=0.3)
    with Controller(cfg) as ctl:
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out + ctl.stats().feeds[0].io.errors_out >= 4,
              timeout_s=30 * UNIT_S, what="two results and two error replies")
        snap = ctl.stats()
        assert ctl.main_stats.processed == 2 and len(ctl.slots) == 2  # a once, b once
    assert snap.feeds[0].io.errors["stream not in this subject's partition"] == 2
    by_id, _ = _results(url)
    assert by_id["TICKS:2:0"] == {"error": "stream not in this subject's partition", "seq": 2}
    assert by_id["TICKS:3:1"]["error"] == "stream not in this subject's partition" and by_id["TICKS:3:1"]["seq"] == 4
    assert by_id["TICKS:3:0"]["stream"] == b and by_id["TICKS:1:0"]["stream"] == a


def test_an_instance_whose_partition_count_is_not_the_streams_exits_3_naming_both(app, nats_server, tmp_path):
    url = nats_server.url
    _create_partitioned_streams(url)
    feed = {**_feed(url, partitions="0-3"), "partition_count": 8}
    done = app(env=_env(url, tmp_path, feed=feed, FORKLESS_RECONNECT_TRIES="1")).finish(120 * UNIT_S)
    assert done.returncode == 3, done.stderr
    assert f"makes {P} partitions, the feed's \"partition_count\" is 8" in done.stderr


def test_the_demo_feed_through_the_relay_into_the_partitioned_stream_is_answered_once_by_two_instances(
        app, nats_server, tmp_path):
    import re

    from tests.harness import run_app
    from tests.natsserver import read_stream, stream_state

    url = nats_server.url
    _create_partitioned_streams(url)
    relay_env = {"FORKLESS_RELAY_NATS": url, "FORKLESS_RELAY_SUBJECT": "ticks", "FORKLESS_FEATURES": str(FEATURES),
                 "FORKLESS_STATUS_S": "0", "FORKLESS_DEMO_RATE": "2000", "FORKLESS_DEMO_STREAMS": "24",
                 "FORKLESS_DURATION": "1.5"}
    two = _start(app, [_env(url, tmp_path, instance=i, instances=2) for i in range(2)])  # serving as it arrives
    relayed = run_app("relay", env=relay_env, timeout_s=90 * UNIT_S)
    assert relayed.returncode == 0, relayed.stderr[-3000:]
    read = int(re.search(r"relay books: (\d+) messages read = \1 stored", relayed.stderr).group(1))
    assert read > 0 and stream_state(url, "TICKS").messages == read
    wait_until(lambda: stream_state(url, "SCORES").messages >= read, timeout_s=90 * UNIT_S,
               what="a result for every relayed message", poll_s=0.2)
    for proc in two:
        proc.signal(signal.SIGTERM)
    for proc in two:
        done = proc.finish(60 * UNIT_S)
        assert done.returncode == 0, done.stderr
    inputs = [json.loads(payload) for _, payload in read_stream(url, "TICKS")]
    by_id, ids = _results(url)
    assert sorted(ids) == sorted(f"TICKS:{i + 1}:0" for i in range(read))  # exactly one result per message
    assert not [r for r in by_id.values() if "error" in r]
    assert {(r["stream"], r["seq"]) for r in by_id.values()} == {(m["stream"], m["seq"]) for m in inputs}
    assert all(two[i].stderr.count("books: in 0 ") == 0 for i in range(2))  # both instances had work


def _take_the_leases(url: str) -> int:
    """Write every partition's lease key as another holder would (their revisions move on): the
    holder's next renewal is refused. How many were written."""
    import asyncio

    import nats

    from forkless.io_loop.connectors.jetstream.connector import lease_key

    async def main() -> int:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value("forkless-leases")
            keys = set(await kv.keys()) & {lease_key("TICKS", p) for p in range(P)}
            for key in keys:
                await kv.put(key, b"another instance")
            return len(keys)
        finally:
            await nc.close()

    return asyncio.run(main())


def test_a_stop_that_finds_a_lease_lost_raises_lease_lost_naming_the_feed(nats_server, tmp_path):
    # the stop's own LeaseLost (with the context manager, __exit__'s stop() is what raises): before the
    # fix its message read the connector's label, which it has not, and the stop raised AttributeError
    from forkless.controller.config import Config
    from forkless.controller.loop import Controller
    from forkless.io_loop.errors import LeaseLost
    from tests.harness import drive

    url = nats_server.url
    _create_partitioned_streams(url)
    cfg = Config(feeds=json.dumps([_feed(url, partitions=f"0-{P - 1}")]), features=FEATURES, max_batch=16,
                 max_streams=64, status_s=0.0, lease_s=2.0, reconnect_min_s=0.05, reconnect_max_s=0.3)
    with pytest.raises(LeaseLost, match=r"^feed 'ticks' \(nats://.*\): the lease of a partition was lost or ran "
                                        r"out unrenewed") as raised:
        with Controller(cfg) as ctl:
            assert _take_the_leases(url) == P
            drive(ctl, lambda: False, timeout_s=30 * UNIT_S, what="the lease found lost")  # until LeaseLost
    assert isinstance(raised.value.__context__, LeaseLost)  # the cycle's, "could not be renewed in time"
