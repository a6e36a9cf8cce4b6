"""Partitioned instances under faults (issue 30) against a real nats-server, each instance a
subprocess: a zombie paused past its lease, a stop during the lease wait, a partial deployment.

Several JAX processes share two cores here: the timeouts are generous and explicit; a bound
that is the behaviour under test is written in ``UNIT_S`` as well."""

from __future__ import annotations

import collections
import json
import re
import signal
import time

import pytest

from tests.harness import UNIT_S, wait_until
from tests.servers import assert_results_match_reference
from tests.test_jetstream import Publisher, _never_restarted, _results
from tests.test_partitioned import OPEN, P, _checkpointed, _create_partitioned_streams, _env, _feed, _results_grow

pytestmark = pytest.mark.timeout(400 * UNIT_S)


def _burst(url: str, publisher: Publisher, n: int) -> None:
    """``n`` more of the publisher's messages at once, published while it is paused (their
    stream sequences follow its own: seq + 1)."""
    from tests.natsserver import publish

    batch = [publisher.message(len(publisher.messages) + k) for k in range(n)]
    seqs = publish(url, lambda i: f"ticks.{batch[i]['stream']}", [json.dumps(m) for m in batch])
    assert seqs == [m["seq"] + 1 for m in batch]
    publisher.messages.extend(batch)


def _scores(url: str) -> int:
    from tests.natsserver import stream_state

    return stream_state(url, "SCORES").messages


def test_an_instance_paused_past_its_lease_and_the_duplicate_window_publishes_nothing_it_held(
        app, nats_server, tmp_path):
    """SIGSTOP past the lease: a second instance takes the partitions over from the checkpoint
    and answers everything; SIGCONT once the results' duplicate window has passed: the old owner
    finds its lease lost and drops what it held (exit 3), so no input is answered twice."""
    url = nats_server.url
    window_s = 30 * UNIT_S  # the results stream's duplicate window
    _create_partitioned_streams(url, duplicate_window_s=window_s)
    env = _env(url, tmp_path, feed=_feed(url, partitions=f"0-{P - 1}"), lease_s=2.0)
    with Publisher(url, streams=24, rate_hz=300.0) as publisher:
        old = app(env=env)
        old.wait_for_line(OPEN, stream="stderr", timeout_s=120 * UNIT_S)
        wait_until(lambda: _checkpointed(url) == set(range(P)), timeout_s=60 * UNIT_S,
                   what="a checkpoint object of every partition", poll_s=0.5)
        with publisher.paused():
            wait_until(lambda: _scores(url) >= len(publisher.messages), timeout_s=60 * UNIT_S,
                       what="the old owner caught up", poll_s=0.2)
            before = _scores(url)
            _burst(url, publisher, 4000)
            wait_until(lambda: _scores(url) >= before + 200, timeout_s=60 * UNIT_S, what="the burst answered",
                       poll_s=0.01)
            paused = old.signal(signal.SIGSTOP)  # mid-burst: replies held in its queues and in flight
        new = app(env=env)
        new.wait_for_line(OPEN, stream="stderr", timeout_s=120 * UNIT_S)
        # the premise: the new owner replays what the old one published after its last checkpoint
        # within the duplicate window (else the replay, not the zombie, would store those twice)
        assert time.monotonic() - paused < window_s - 5 * UNIT_S, "the new owner started too late for the window"
        _results_grow(url, 100)
    published = len(publisher.messages)
    wait_until(lambda: _scores(url) >= published, timeout_s=90 * UNIT_S, what="every input answered", poll_s=0.5)
    time.sleep(window_s + 2 * UNIT_S)  # what the zombie held is now outside the duplicate window
    old.signal(signal.SIGCONT)
    zombie = old.finish(60 * UNIT_S)
    new.signal(signal.SIGTERM)
    done = new.finish(60 * UNIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    by_id, ids = _results(url)
    twice = sorted(i for i, n in collections.Counter(ids).items() if n > 1)
    assert not twice, f"{len(twice)} inputs answered twice: {twice[:10]}"
    assert zombie.returncode == 3, zombie.stderr[-3000:]
    assert "lost the lease" in zombie.stderr
    assert "closed after publishing every reply" not in zombie.stderr
    held = re.search(r"the lease of a partition is lost: (\d+) received messages dropped", zombie.stderr)
    assert held and int(held.group(1)) >= 1, zombie.stderr[-3000:]  # it did hold replies when paused
    messages = publisher.messages
    assert set(ids) == {f"TICKS:{m['seq'] + 1}:0" for m in messages}
    results = {m["seq"]: [by_id[f"TICKS:{m['seq'] + 1}:0"]] for m in messages}
    assert_results_match_reference(messages, results)
    replies, _ = _never_restarted(messages)
    assert [results[m["seq"]][0] for m in messages] == [replies[m["seq"]] for m in messages]


def _lease_holders(url: str) -> dict[str, str]:
    """The lease bucket's keys with a value now: key -> holder name (read with nats-py)."""
    import asyncio

    import nats
    import nats.js.errors

    async def main() -> dict[str, str]:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value("forkless-leases")
            try:
                keys = await kv.keys()
            except nats.js.errors.NoKeysError:
                return {}
            out = {}
            for key in keys:
                try:
                    out[key] = (await kv.get(key)).value.decode()
                except nats.js.errors.KeyNotFoundError:
                    pass
            return out
        finally:
            await nc.close()

    return asyncio.run(main())


def test_sigterm_during_the_wait_for_a_dead_holders_lease_stops_within_the_deadline_holding_nothing(
        app, nats_server, tmp_path):
    url = nats_server.url
    _create_partitioned_streams(url)
    shutdown_s = 2.0
    env = _env(url, tmp_path, feed=_feed(url, partitions=f"0-{P - 1}"), lease_s=20.0,
               FORKLESS_SHUTDOWN_TIMEOUT_S=str(shutdown_s))
    holder = app(env=_env(url, tmp_path, feed=_feed(url, partitions="0-5"), lease_s=20.0))
    holder.wait_for_line(OPEN, stream="stderr", timeout_s=120 * UNIT_S)
    holder.signal(signal.SIGKILL)  # its leases of 0-5 stay live for FORKLESS_LEASE_S
    assert holder.finish(10 * UNIT_S).returncode == -9
    waiting = app(env=env)  # takes 6-11 at once, waits for 0-5
    waiting.wait_for_line(r"waiting for the lease", stream="stderr", timeout_s=120 * UNIT_S)
    taken = {key for key, who in _lease_holders(url).items() if f":{waiting.proc.pid}:" in who}
    assert taken == {f"TICKS.{p}" for p in range(6, P)}, taken  # the free ones, taken before the wait
    time.sleep(1.0)
    told = waiting.signal(signal.SIGTERM)
    done = waiting.finish(60 * UNIT_S)
    took_s = time.monotonic() - told
    assert done.returncode == 0, done.stderr[-3000:]
    # a correctness bound (the dead holder's lease had ~18 s to run), with slack for a loaded host
    assert took_s < shutdown_s + 0.5 + 2 * UNIT_S, (took_s, done.stderr[-3000:])
    assert "stop requested during the wait for the partitions' leases" in done.stderr
    assert "connection 1 open" not in done.stderr and "restored" not in done.stderr
    mine = {key: who for key, who in _lease_holders(url).items() if f":{waiting.proc.pid}:" in who}
    assert not mine, mine  # every lease it had taken is released


def test_an_instance_started_with_another_instance_count_is_refused_with_exit_2_naming_both(
        app, nats_server, tmp_path):
    url = nats_server.url
    _create_partitioned_streams(url)
    first = app(env=_env(url, tmp_path, instance=0, instances=2, lease_s=2.0))  # partitions 0-5
    first.wait_for_line(OPEN, stream="stderr", timeout_s=120 * UNIT_S)
    wrong = app(env=_env(url, tmp_path, instance=2, instances=3, lease_s=2.0))  # 8-11: no lease in common
    refused = wrong.finish(60 * UNIT_S)
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = next(line for line in refused.stderr.splitlines() if line.startswith("forkless:"))
    assert "FORKLESS_INSTANCES=2" in line and "FORKLESS_INSTANCES=3" in line and "partition_count 12" in line, line
    assert first.proc.poll() is None  # the deployment runs on
    assert not [who for who in _lease_holders(url).values() if f":{wrong.proc.pid}:" in who]  # 8-11 released
    first.signal(signal.SIGTERM)
    assert first.finish(60 * UNIT_S).returncode == 0


def test_partitions_without_a_live_lease_for_longer_than_a_lease_are_warned_of_and_counted(
        app, nats_server, tmp_path):
    import urllib.request

    url = nats_server.url
    _create_partitioned_streams(url)
    alone = app(env=_env(url, tmp_path, instance=0, instances=2, lease_s=2.0,  # 0-5; nobody runs 1 of 2
                         FORKLESS_METRICS_ADDR="127.0.0.1:0"))
    alone.wait_for_line(OPEN, stream="stderr", timeout_s=120 * UNIT_S)
    line = alone.wait_for_line(r"have had no live lease", stream="stderr", timeout_s=30 * UNIT_S)
    assert "partitions 6-11 (of 12)" in line, line
    where = re.search(r"metrics on (\S+)", alone.wait_for_line(r"metrics on ", stream="stderr",
                                                               timeout_s=10 * UNIT_S)).group(1)
    with urllib.request.urlopen(where, timeout=10) as response:
        text = response.read().decode()
    assert re.search(r"^forkless_partitions_unowned 6\.0$", text, re.M), [x for x in text.splitlines() if "unown" in x]
    alone.signal(signal.SIGTERM)
    assert alone.finish(60 * UNIT_S).returncode == 0
