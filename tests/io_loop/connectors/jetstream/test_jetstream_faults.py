"""JetStream feeds against the faults of issue 30, each with a real nats-server (tests/natsserver.py)
and the app as a subprocess: a stream deleted and made again, retention of other subjects'
messages, every checkpoint damaged, a payload over FORKLESS_MAX_MSG_BYTES."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import pytest

from tests.harness import UNIT_S, wait_until
from tests.io_loop.connectors.jetstream.test_jetstream import _app_env, _js_feed, _results
from tests.servers import make_messages

pytestmark = pytest.mark.timeout(180 * UNIT_S)


def _admin(url: str, body: Any) -> Any:
    from tests.natsserver import _with_js

    return asyncio.run(_with_js(url, body))


def _scores(url: str) -> int:
    from tests.natsserver import stream_state

    return stream_state(url, "SCORES").messages


def test_a_stream_deleted_and_made_again_while_running_exits_2_and_is_never_resumed_into(app, nats_server, tmp_path):
    from tests.natsserver import create_streams, publish

    create_streams(nats_server.url)
    messages = make_messages(330, streams=3, seed=31)
    publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages[:30]])
    # a fixed 2 s before each reconnect: the new stream holds more than the old position before it
    env = _app_env(nats_server.url, tmp_path / "ckpt", FORKLESS_RECONNECT_MIN_S="2",
                   FORKLESS_RECONNECT_MAX_S="2")
    proc = app(env=env)
    wait_until(lambda: _scores(nats_server.url) == 30, timeout_s=60 * UNIT_S, what="30 results", poll_s=0.1)

    async def make_again(nc: Any, js: Any) -> None:
        from nats.js.api import StreamConfig

        await js.delete_stream("TICKS")
        await js.add_stream(StreamConfig(name="TICKS", subjects=["ticks.>"]))
        futures = [await js.publish_async("ticks.a", json.dumps(m).encode()) for m in messages[30:]]
        assert [(await f).seq for f in futures][-1] == 300  # past the old position (30)

    _admin(nats_server.url, make_again)
    done = proc.finish(60 * UNIT_S)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "stream 'TICKS' was deleted and made again" in line and "FORKLESS_CHECKPOINT_RESTORE=never" in line, line
    assert _scores(nats_server.url) == 30  # nothing of the new stream answered from the old one's state


def test_a_stream_deleted_and_made_again_between_two_runs_is_refused_by_the_checkpoints_created_time(
        nats_server, tmp_path):
    from forkless.controller.checkpoints.checkpoint import load_newest
    from forkless.controller.loop import Controller
    from forkless.io_loop.errors import PositionLost
    from tests.harness import drive
    from tests.io_loop.connectors.jetstream.test_jetstream import _config
    from tests.natsserver import create_streams, publish

    create_streams(nats_server.url)
    messages = make_messages(330, streams=3, seed=32)
    publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages[:30]])
    cfg = _config([_js_feed(nats_server.url)], checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_s=0.2,
                  checkpoint_priority="normal")
    with Controller(cfg) as ctl:
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == 30, timeout_s=30 * UNIT_S, what="30 results")
    recorded = load_newest(tmp_path / "ckpt", {}, Controller(cfg).processor.init(cfg)).positions["ticks"]
    assert recorded["seq"] == 30 and recorded["created"]

    async def make_again(nc: Any, js: Any) -> None:
        from nats.js.api import StreamConfig

        await js.delete_stream("TICKS")
        await js.add_stream(StreamConfig(name="TICKS", subjects=["ticks.>"]))

    _admin(nats_server.url, make_again)
    publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages[30:]])  # 1..300: past the position
    with pytest.raises(PositionLost) as lost, Controller(cfg) as ctl:
        drive(ctl, lambda: False, timeout_s=30 * UNIT_S, what="refused")
    text = str(lost.value)
    assert "stream 'TICKS' was deleted and made again since the checkpoint was written" in text, text
    assert f"the checkpoint recorded its position in a stream created {recorded['created']}" in text, text
    assert _scores(nats_server.url) == 30


def _feed(**extra: Any) -> Any:
    pytest.importorskip("nats")
    from forkless.io_loop.connectors.jetstream.source import JetStreamSource
    from tests.io_loop.connectors.jetstream.test_jetstream import _config

    cfg = _config([_js_feed("nats://127.0.0.1:4222", **extra)])
    io = cfg.io_settings()
    return JetStreamSource(cfg.feed_specs[0], timeouts=io.timeouts, reconnect=io.reconnect, tls=io.tls,
                           max_msg_bytes=io.limits.max_msg_bytes)


def test_a_stream_that_ends_before_what_this_run_saw_of_it_or_was_created_again_is_refused():
    import datetime

    from forkless.io_loop.errors import PositionLost

    feed = _feed()
    created = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)
    feed._check_identity(40, created)
    feed.consumer.check_stream(1, 40)
    feed._check_identity(45, created)  # the same stream, grown
    feed.figures.stream_last_seq = 45
    with pytest.raises(PositionLost, match="ends at sequence 44, but this run saw it reach 45"):
        feed._check_identity(44, created)
    with pytest.raises(PositionLost, match=r"was deleted and made again: created 2026-12-01T12:00:01\+00:00"):
        feed._check_identity(500, created + datetime.timedelta(seconds=1))


# ---- retention of other subjects' messages (issue 30, fault 4) ------------------------------------


def _answered(url: str, seqs: list[int]) -> dict[Any, list[dict]]:
    """The results stream's result to each input stream sequence, by the input message's "seq"."""
    by_id, _ = _results(url)
    return {by_id[f"TICKS:{s}:0"]["seq"]: [by_id[f"TICKS:{s}:0"]] for s in seqs if f"TICKS:{s}:0" in by_id}


def _source(ctl: Any) -> Any:
    return ctl.stats().feeds[0].io.source


def test_a_feed_whose_subject_got_nothing_while_retention_removed_other_subjects_messages_reconnects_and_goes_on(
        nats_server, monkeypatch):
    from forkless.controller.loop import Controller
    from tests.harness import drive
    from tests.io_loop.connectors.jetstream.test_jetstream import _config
    from tests.natsserver import create_streams, publish
    from tests.servers import assert_results_match_reference

    monkeypatch.setattr("forkless.io_loop.connectors.jetstream.source.PULL_EXPIRES_S", 1.5)  # an idle pull ends sooner
    # (the server wants it below half of that)
    monkeypatch.setattr("forkless.io_loop.connectors.jetstream.source.PULL_HEARTBEAT_S", 0.5)
    create_streams(nats_server.url, max_msgs=50)  # the stream keeps the newest 50 messages, of any subject
    ours = make_messages(15, streams=3, seed=41)
    seqs = publish(nats_server.url, "ticks.a", [json.dumps(m) for m in ours[:10]])
    cfg = _config([_js_feed(nats_server.url, subject="ticks.a")], reconnect_min_s=0.1, reconnect_max_s=0.3)
    with Controller(cfg) as ctl:
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == 10, timeout_s=30 * UNIT_S, what="10 results")
        others = publish(nats_server.url, "ticks.b", [json.dumps(m) for m in make_messages(100, seed=42)])
        assert others[-1] == 110 and _stream_first(nats_server.url) == 61  # 1..60 removed: ours among them
        drive(ctl, lambda: _source(ctl).covered[1] >= 110, timeout_s=30 * UNIT_S,
              what="a pull that found nothing more of ticks.a after the others were published")
        nats_server.restart()  # a reconnect: the position (10) is below the stream's first sequence (61)
        drive(ctl, lambda: ctl.stats().feeds[0].io.reconnects >= 1 and ctl.stats().feeds[0].io.connected,
              timeout_s=30 * UNIT_S, what="connected again")
        seqs += publish(nats_server.url, "ticks.a", [json.dumps(m) for m in ours[10:]])
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == 15, timeout_s=30 * UNIT_S,
              what="the 5 new messages of ticks.a answered")
    assert_results_match_reference(ours, _answered(nats_server.url, seqs))  # one history, nothing lost


def _stream_first(url: str) -> int:
    from tests.natsserver import stream_state

    return stream_state(url, "TICKS").first_seq


def _first_life(url: str, cfg: Any, ours: list[dict]) -> list[int]:
    """A run that answers the first 10 of ``ours`` (subject ticks.a) and stops; its checkpoints go to cfg's dir."""
    from forkless.controller.loop import Controller
    from tests.harness import drive
    from tests.natsserver import publish

    seqs = publish(url, "ticks.a", [json.dumps(m) for m in ours[:10]])
    with Controller(cfg) as ctl:
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == 10, timeout_s=30 * UNIT_S, what="10 results")
        publish(url, "ticks.b", [json.dumps(m) for m in make_messages(100, seed=42)])
        drive(ctl, lambda: _source(ctl).covered[1] >= 110, timeout_s=30 * UNIT_S,
              what="a pull that found nothing more of ticks.a after the others were published")
    return seqs


def _filtered_config(url: str, tmp_path: Any) -> Any:
    from tests.io_loop.connectors.jetstream.test_jetstream import _config

    return _config([_js_feed(url, subject="ticks.a")], checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_s=0.2,
                   checkpoint_priority="normal")


def test_a_restart_after_only_other_subjects_messages_were_removed_resumes_from_the_checkpoint(
        nats_server, monkeypatch, tmp_path):
    from forkless.controller.checkpoints.checkpoint import load_newest
    from forkless.controller.loop import Controller
    from tests.harness import drive
    from tests.natsserver import create_streams, publish
    from tests.servers import assert_results_match_reference

    monkeypatch.setattr("forkless.io_loop.connectors.jetstream.source.PULL_EXPIRES_S", 1.5)
    monkeypatch.setattr("forkless.io_loop.connectors.jetstream.source.PULL_HEARTBEAT_S", 0.5)
    create_streams(nats_server.url, max_msgs=50)
    ours = make_messages(15, streams=3, seed=43)
    cfg = _filtered_config(nats_server.url, tmp_path)
    seqs = _first_life(nats_server.url, cfg, ours)
    newest = load_newest(tmp_path / "ckpt", {}, Controller(cfg).processor.init(cfg))
    assert (newest.positions["ticks"]["seq"], newest.positions["ticks"]["covered"]) == (10, 110)
    assert _stream_first(nats_server.url) == 61  # 1..60 removed: the 10 of ticks.a and 50 of ticks.b
    with Controller(cfg) as ctl:  # restores; resumes after 110: nothing of ticks.a lies between
        seqs += publish(nats_server.url, "ticks.a", [json.dumps(m) for m in ours[10:]])
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == 5, timeout_s=30 * UNIT_S,
              what="the 5 new messages of ticks.a answered")
        assert ctl.restored_from is not None
    assert_results_match_reference(ours, _answered(nats_server.url, seqs))  # on the restored state


def test_a_restart_after_retention_removed_a_message_of_the_feeds_own_subject_still_exits_2(
        nats_server, monkeypatch, tmp_path):
    from forkless.controller.loop import Controller
    from forkless.io_loop.errors import PositionLost
    from tests.harness import drive
    from tests.natsserver import create_streams, publish

    monkeypatch.setattr("forkless.io_loop.connectors.jetstream.source.PULL_EXPIRES_S", 1.5)
    monkeypatch.setattr("forkless.io_loop.connectors.jetstream.source.PULL_HEARTBEAT_S", 0.5)
    create_streams(nats_server.url, max_msgs=50)
    ours = make_messages(15, streams=3, seed=44)
    cfg = _filtered_config(nats_server.url, tmp_path)
    _first_life(nats_server.url, cfg, ours)  # recorded: 10, and nothing of ticks.a up to 110
    publish(nats_server.url, "ticks.a", [json.dumps(ours[10])])  # 111: ours, then removed with 61..110
    publish(nats_server.url, "ticks.b", [json.dumps(m) for m in make_messages(50, seed=45)])
    assert _stream_first(nats_server.url) == 112
    with pytest.raises(PositionLost) as lost, Controller(cfg) as ctl:
        drive(ctl, lambda: False, timeout_s=30 * UNIT_S, what="refused")
    text = str(lost.value)
    assert "may no longer hold messages of 'ticks.a' that the checkpoint needs: its first sequence is 112" in text, text
    assert "the checkpoint recorded 110 as the last applied" in text, text


# ---- issue 43, items 15-16: what the feed covered, learned while it has nothing pending --------------


def test_a_filtered_feed_stopped_right_after_retention_removed_other_subjects_messages_resumes_at_restart(
        app, nats_server, tmp_path):
    """Issue 43, item 16: a feed of ticks.a answers 100 inputs; 1,200 of ticks.b follow at once
    (max_msgs 500: the stream then holds 801-1300) and the app is stopped with SIGTERM right
    away. Its stop's checkpoint records what the feed covered (nothing of ticks.a after 100 up
    to 1300), so the restart resumes and answers 5 more on the same state (before this, exit 2:
    the coverage came only from a pull that expired after the others were published). Then one
    message of ticks.a is removed by retention while the app is stopped: the next start exits 2."""
    from tests.natsserver import create_streams, publish
    from tests.servers import assert_results_match_reference

    url = nats_server.url
    create_streams(url, max_msgs=500)
    ours = make_messages(106, streams=3, seed=51)
    seqs = publish(url, "ticks.a", [json.dumps(m) for m in ours[:100]])
    env = {**_app_env(url, tmp_path / "ckpt"), "FORKLESS_FEEDS": json.dumps([_js_feed(url, subject="ticks.a")])}
    first = app(env=env)
    wait_until(lambda: _scores(url) == 100, timeout_s=60 * UNIT_S, what="100 results", poll_s=0.1)
    others = publish(url, "ticks.b", [json.dumps(m) for m in make_messages(1200, seed=52)])
    assert others[-1] == 1300 and _stream_first(url) == 801  # 1..800 removed: every one of ours among them
    first.signal(signal.SIGTERM)
    done = first.finish(60 * UNIT_S)
    assert done.returncode == 0, done.stderr[-3000:]

    again = app(env=env)
    line = again.wait_for_line(r"connection \d+ open|^forkless: ", stream="stderr", timeout_s=60 * UNIT_S)
    assert "connection" in line, f"the restart was refused: {line}"
    seqs += publish(url, "ticks.a", [json.dumps(m) for m in ours[100:105]])
    wait_until(lambda: _scores(url) == 105, timeout_s=60 * UNIT_S, what="the 5 new inputs answered", poll_s=0.1)
    again.signal(signal.SIGTERM)
    done = again.finish(60 * UNIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming at stream sequence 1301 (the checkpoint's position)" in done.stderr, done.stderr[-3000:]
    assert_results_match_reference(ours[:105], _answered(url, seqs))  # one history, on the restored state

    # a message of ticks.a (1306), then 500 of ticks.b remove it before any run read it: still refused
    assert publish(url, "ticks.a", [json.dumps(ours[105])]) == [1306]
    publish(url, "ticks.b", [json.dumps(m) for m in make_messages(500, seed=53)])
    assert _stream_first(url) == 1307
    refused = app(env=env).finish(60 * UNIT_S)
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert "messages of 'ticks.a' that the checkpoint needs: its first sequence is 1307" in line, line
    assert "the checkpoint recorded 1305 as the last applied" in line, line


def test_an_idle_feed_learns_what_it_covered_while_its_pull_waits_and_a_reconnect_after_retention_goes_on(
        nats_server, monkeypatch):
    """Issue 43, items 15-16, the running guard: pulls that never expire during the test (so no
    pull's end can say anything); a feed of ticks.a answers 10, then 1,200 of ticks.b push the
    stream past them at once (max_msgs 500). The feed learns, from the consumer's and the
    stream's state while its pull waits, that nothing of ticks.a lies up to 1210; the server
    restarts, the feed reconnects past the removed messages and answers 5 more on the same state
    (before this, it learned nothing until a pull expired, and the reconnect exited 2)."""
    from forkless.controller.loop import Controller
    from tests.harness import drive
    from tests.io_loop.connectors.jetstream.test_jetstream import _config
    from tests.natsserver import create_streams, publish
    from tests.servers import assert_results_match_reference

    # no pull ends while the test runs
    monkeypatch.setattr("forkless.io_loop.connectors.jetstream.source.PULL_EXPIRES_S", 600.0)
    create_streams(nats_server.url, max_msgs=500)
    ours = make_messages(15, streams=3, seed=54)
    seqs = publish(nats_server.url, "ticks.a", [json.dumps(m) for m in ours[:10]])
    cfg = _config([_js_feed(nats_server.url, subject="ticks.a")], reconnect_min_s=0.1, reconnect_max_s=0.3)
    with Controller(cfg) as ctl:
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == 10, timeout_s=30 * UNIT_S, what="10 results")
        others = publish(nats_server.url, "ticks.b", [json.dumps(m) for m in make_messages(1200, seed=55)])
        assert others[-1] == 1210 and _stream_first(nats_server.url) == 711
        drive(ctl, lambda: _source(ctl).covered == (10, 1210), timeout_s=30 * UNIT_S,
              what="the feed found nothing of ticks.a pending with the stream at 1210")
        nats_server.restart()
        drive(ctl, lambda: ctl.stats().feeds[0].io.reconnects >= 1 and ctl.stats().feeds[0].io.connected,
              timeout_s=30 * UNIT_S, what="connected again")
        seqs += publish(nats_server.url, "ticks.a", [json.dumps(m) for m in ours[10:]])
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == 15, timeout_s=30 * UNIT_S,
              what="the 5 new messages of ticks.a answered")
    assert_results_match_reference(ours, _answered(nats_server.url, seqs))


# ---- issue 54, item 11: a filtered feed restarted after retention of other subjects' messages -----------


def _one_life_then_down(url: str, cfg: Any, ours: list[dict], subject: str) -> list[int]:
    """A run that answers ``ours`` (published to ``subject``) and stops at once, so no later probe covers
    what the other subjects publish while it is down; its checkpoints go to cfg's dir."""
    from forkless.controller.loop import Controller
    from tests.harness import drive
    from tests.natsserver import publish

    seqs = publish(url, subject, [json.dumps(m) for m in ours])
    with Controller(cfg) as ctl:
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == len(ours), timeout_s=30 * UNIT_S,
              what="the first life's results")
    return seqs


def _refused(cfg: Any) -> str:
    from forkless.controller.loop import Controller
    from forkless.io_loop.errors import PositionLost
    from tests.harness import drive

    with pytest.raises(PositionLost) as lost, Controller(cfg) as ctl:
        drive(ctl, lambda: False, timeout_s=30 * UNIT_S, what="refused")
    return str(lost.value)


def test_a_filtered_feed_refused_after_stream_wide_retention_says_what_is_known_and_how_to_keep_its_messages(
        nats_server, tmp_path):
    """Issue 54, item 11: a feed of ``ticks.a.>`` on a stream that keeps its newest 50 messages of any
    subject; while it is down 100 of ticks.b push every message up to 60 out. The stream cannot say of which
    subjects the removed messages were, so the restart is refused, and the refusal says so: what may be lost,
    where the stream holds from, and the fixes (per-subject limits, a longer retention, RESTORE=never)."""
    from tests.io_loop.connectors.jetstream.test_jetstream import _config
    from tests.natsserver import create_streams, publish

    url = nats_server.url
    create_streams(url, max_msgs=50)
    cfg = _config([_js_feed(url, subject="ticks.a.>")], checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_s=0.2,
                  checkpoint_priority="normal")
    _one_life_then_down(url, cfg, make_messages(10, streams=3, seed=61), "ticks.a.x")
    publish(url, "ticks.b.y", [json.dumps(m) for m in make_messages(100, seed=62)])  # 11..110: ours none of them
    assert _stream_first(url) == 61
    text = _refused(cfg)
    for words in ("may have removed messages of 'ticks.a.>'", "the stream holds from sequence 61",
                  "its first sequence is 61, the checkpoint recorded 10 as the last applied",
                  "max_msgs_per_subject", "keep messages longer (max_age, max_msgs, max_bytes)",
                  "FORKLESS_CHECKPOINT_RESTORE=never"):
        assert words in text, text
    assert "retention removed them" not in text, text  # it does not know that


def test_a_filtered_feed_on_a_stream_that_removes_by_subject_only_resumes_where_its_subjects_lost_nothing(
        nats_server, tmp_path):
    """Issue 54, item 11, where the server can tell: a stream whose only limit is max_msgs_per_subject (20)
    removes a subject's messages only for newer ones of the same subject. The feed of ``ticks.a.>`` answers 10;
    while it is down its consumed messages are purged (``nats stream purge --subject 'ticks.a.>' --seq 11``) and
    ticks.b's limit removes 80 of its own 100: the stream's first sequence (91) passes the position (11), yet
    no subject of ticks.a.> holds its limit, so retention removed none of the feed's messages: the restart
    resumes (before this: exit 2, "retention removed them") and answers 5 more on the restored state. Then a
    subject of the feed that holds its limit from past the position is refused, naming it."""
    from forkless.controller.loop import Controller
    from tests.harness import drive
    from tests.io_loop.connectors.jetstream.test_jetstream import _config
    from tests.natsserver import _with_js, create_streams, publish
    from tests.servers import assert_results_match_reference

    url = nats_server.url
    create_streams(url, max_msgs_per_subject=20)
    cfg = _config([_js_feed(url, subject="ticks.a.>")], checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_s=0.2,
                  checkpoint_priority="normal")
    ours = make_messages(15, streams=3, seed=63)
    seqs = _one_life_then_down(url, cfg, ours[:10], "ticks.a.x")
    asyncio.run(_with_js(url, lambda nc, js: js.purge_stream("TICKS", subject="ticks.a.>", seq=11)))
    publish(url, "ticks.b.y", [json.dumps(m) for m in make_messages(100, seed=64)])  # 11..110: 91..110 kept
    assert _stream_first(url) == 91
    with Controller(cfg) as ctl:
        seqs += publish(url, "ticks.a.x", [json.dumps(m) for m in ours[10:]])
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == 5, timeout_s=30 * UNIT_S,
              what="the 5 new messages of ticks.a.x answered")
        assert ctl.restored_from is not None
    assert_results_match_reference(ours, _answered(url, seqs))  # one history, on the restored state

    # ticks.a.z: 25 messages while the feed is down, its oldest 5 removed by its own limit: refused, named
    asyncio.run(_with_js(url, lambda nc, js: js.purge_stream("TICKS", subject="ticks.a.x")))
    publish(url, "ticks.a.z", [json.dumps(m) for m in make_messages(25, seed=65)])
    publish(url, "ticks.b.y", [json.dumps(m) for m in make_messages(20, seed=66)])
    text = _refused(cfg)
    assert "subject ticks.a.z holds its limit of 20 messages (max_msgs_per_subject), from sequence" in text, text
    assert "FORKLESS_CHECKPOINT_RESTORE=never" in text, text


# ---- every checkpoint damaged (issue 30, fault 1) ------------------------------------------------------


def _damage_every_checkpoint(directory: Any) -> list[str]:
    """Flip a byte in the middle of each checkpoint file (its checksum then fails); their names."""
    from forkless.controller.checkpoints.checkpoint import list_checkpoints

    names = []
    for path in list_checkpoints(directory):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        names.append(path.name)
    assert names
    return names


def test_every_checkpoint_damaged_and_the_stream_missing_messages_exits_2_naming_the_files_and_the_first_sequence(
        app, nats_server, tmp_path):
    from tests.natsserver import create_streams, publish

    create_streams(nats_server.url, max_msgs=50)
    messages = make_messages(90, streams=3, seed=51)
    publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages[:30]])
    env = _app_env(nats_server.url, tmp_path / "ckpt")
    first = app(env=env)
    wait_until(lambda: _scores(nats_server.url) == 30, timeout_s=60 * UNIT_S, what="30 results", poll_s=0.1)
    first.signal(signal.SIGTERM)
    assert first.finish(30 * UNIT_S).returncode == 0
    names = _damage_every_checkpoint(tmp_path / "ckpt")
    publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages[30:]])  # 1..40 removed
    refused = app(env=env).finish(60 * UNIT_S)
    assert refused.returncode == 2, refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("forkless: checkpoint error: feed 'ticks' (nats://127.0.0.1:"), line
    for words in (f"every checkpoint in {tmp_path / 'ckpt'} is damaged ({', '.join(reversed(names))})",
                  "messages the lost state held may be gone from stream 'TICKS' (its first sequence is 41)",
                  "FORKLESS_CHECKPOINT_RESTORE=never"):
        assert words in line, line
    assert _scores(nats_server.url) == 30  # nothing answered from an empty state


def test_every_checkpoint_damaged_but_the_stream_holding_all_from_sequence_1_rebuilds_the_state_by_replaying_it(
        nats_server, tmp_path):
    from forkless.controller.loop import Controller
    from tests.harness import drive
    from tests.io_loop.connectors.jetstream.test_jetstream import _config
    from tests.natsserver import create_streams, publish
    from tests.servers import assert_results_match_reference

    create_streams(nats_server.url)  # no limits: the stream keeps every message
    messages = make_messages(50, streams=3, seed=52)
    seqs = publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages[:30]])
    cfg = _config([_js_feed(nats_server.url)], checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_s=0.2,
                  checkpoint_priority="normal")
    with Controller(cfg) as ctl:
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == 30, timeout_s=30 * UNIT_S, what="30 results")
    _damage_every_checkpoint(tmp_path / "ckpt")
    seqs += publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages[30:]])
    with Controller(cfg) as ctl:
        assert ctl.restored_from is None
        drive(ctl, lambda: ctl.stats().sources[0].applied == 50 and ctl.stats().feeds[0].io.results_out == 50,
              timeout_s=30 * UNIT_S, what="all 50 consumed again and answered")
        assert ctl.stats().sources[0].duplicates == 30  # the first 30 replies were stored already: dropped
    _, ids = _results(nats_server.url)
    assert sorted(ids) == sorted(f"TICKS:{s}:0" for s in seqs)  # one result per input
    assert_results_match_reference(messages, _answered(nats_server.url, seqs))


@pytest.mark.parametrize(("start", "first", "last", "deleted", "expected"), [
    ("first", 1, 40, 0, (1, 0)),  # everything from 1 is there: replayed
    ("new", 0, 0, 0, (1, 0)),  # the stream never held a message
    ("first", 41, 90, 0, "may be gone from stream 'TICKS' (its first sequence is 41)"),
    ("first", 1, 90, 3, "may be gone from stream 'TICKS' (3 of its messages were deleted)"),
    ("new", 1, 90, 0, "the feed's \"start\" is \"new\", which would skip what arrived since"),
])
def test_with_every_checkpoint_damaged_a_feed_starts_only_where_its_stream_still_holds_everything(
        start, first, last, deleted, expected):
    from forkless.io_loop.connectors.jetstream.consumer import Consumer
    from forkless.io_loop.counters import SourceStats
    from forkless.io_loop.crossing import PositionUnknown
    from forkless.io_loop.errors import PositionLost
    from tests.io_loop.connectors.jetstream.test_jetstream import _config

    spec = _config([_js_feed("nats://127.0.0.1:4222", start=start)]).feed_specs[0]
    consumer = Consumer(spec.options, spec.label, SourceStats(),
                        PositionUnknown("every checkpoint in /c is damaged (ckpt-000000001.fkc)"))
    if isinstance(expected, str):
        with pytest.raises(PositionLost) as lost:
            consumer.check_stream(first, last, deleted)
        text = str(lost.value)
        assert "every checkpoint in /c is damaged (ckpt-000000001.fkc)" in text and expected in text, text
        assert "FORKLESS_CHECKPOINT_RESTORE=never" in text
    else:
        consumer.check_stream(first, last, deleted)
        assert consumer.next == expected


# ---- FORKLESS_MAX_MSG_BYTES on JetStream payloads -------------------------------------------------------


def test_a_jetstream_payload_over_max_msg_bytes_gets_one_error_reply_is_counted_and_consuming_goes_on(nats_server):
    from forkless.controller.loop import Controller
    from tests.harness import drive
    from tests.io_loop.connectors.jetstream.test_jetstream import _config
    from tests.natsserver import create_streams, publish
    from tests.servers import assert_results_match_reference

    create_streams(nats_server.url)
    good = make_messages(2, streams=2, seed=61)
    listed = make_messages(6, streams=2, seed=62, start=100)  # six good elements in one payload
    payloads = [json.dumps(good[0]), json.dumps(listed), json.dumps(good[1])]
    assert len(payloads[1]) > 300 > max(len(payloads[0]), len(payloads[2]))
    seqs = publish(nats_server.url, "ticks.a", payloads)
    cfg = _config([_js_feed(nats_server.url)], max_msg_bytes=300)
    with Controller(cfg) as ctl:
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out + ctl.stats().feeds[0].io.errors_out >= 3,
              timeout_s=30 * UNIT_S, what="the three payloads answered")
        io = ctl.stats().feeds[0].io
        assert (io.results_out, io.errors_out, dict(io.errors)) == (2, 1, {"message too large": 1})
        assert ctl.stats().sources[0].applied == 2  # none of the six elements applied
    by_id, ids = _results(nats_server.url)
    assert sorted(ids) == sorted([f"TICKS:{seqs[0]}:0", f"TICKS:{seqs[1]}:0", f"TICKS:{seqs[2]}:0"])
    assert by_id[f"TICKS:{seqs[1]}:0"]["error"] == "message too large"
    assert_results_match_reference(good, _answered(nats_server.url, [seqs[0], seqs[2]]))
