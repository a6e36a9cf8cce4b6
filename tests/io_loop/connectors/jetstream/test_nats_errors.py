"""nats-py's exceptions mapped to ours at one edge (io_loop/connectors/jetstream/transport.py: the one mapper,
``_mapped``, inside every call of a ``Transport``), against a real nats-server (tests/natsserver.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.harness import UNIT_S

pytest.importorskip("nats", reason="nats-py is not installed (pip install -r requirements-dev.txt)")

LIMIT_S = 10.0 * UNIT_S  # bounds each wait if something hangs; nothing waits this long when it works


def _mapped(url: str, body: Any) -> BaseException:
    """What ``body(nc)`` raised inside the transport's one mapper on a nats-py connection to ``url``."""
    import nats

    from forkless.io_loop.connectors.jetstream.transport import _mapped as mapped_nats_errors

    async def main() -> BaseException:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
        try:
            async with asyncio.timeout(LIMIT_S):
                with mapped_nats_errors():
                    await body(nc)
        except Exception as exc:
            return exc
        finally:
            await nc.close()
        raise AssertionError("nothing was raised")

    return asyncio.run(main())


def test_each_nats_failure_becomes_ours_with_nats_py_s_as_the_cause(nats_server):
    import nats.errors
    import nats.js.errors

    from forkless.io_loop.connectors.jetstream.transport import (
        NatsApiError,
        NatsError,
        NatsNotFound,
        NatsUnavailable,
        describe_error,
    )

    async def missing_stream(nc: Any) -> None:
        await nc.jsm(timeout=2).stream_info("NO_SUCH_STREAM")

    async def no_responders(nc: Any) -> None:
        await nc.request("nobody.listens", b"", timeout=2)

    async def bad_request(nc: Any) -> None:
        await nc.jsm(timeout=2).add_stream(name="BAD", subjects=["bad.>"], max_msgs_per_subject=-5, num_replicas=7)

    async def closed(nc: Any) -> None:
        await nc.close()
        await nc.publish("x", b"")

    exc = _mapped(nats_server.url, missing_stream)
    assert type(exc) is NatsNotFound and isinstance(exc.__cause__, nats.js.errors.NotFoundError)
    assert str(exc).startswith("NotFoundError: ") and describe_error(exc) == describe_error(exc.__cause__)
    exc = _mapped(nats_server.url, no_responders)
    assert type(exc) is NatsUnavailable and isinstance(exc.__cause__, nats.errors.NoRespondersError)
    exc = _mapped(nats_server.url, bad_request)
    assert type(exc) is NatsApiError and isinstance(exc.__cause__, nats.js.errors.APIError)
    exc = _mapped(nats_server.url, closed)
    assert type(exc) is NatsError and isinstance(exc.__cause__, nats.errors.ConnectionClosedError)


def test_a_write_at_an_old_revision_and_a_subject_no_stream_stores_are_named(nats_server):
    import nats.js.errors

    from forkless.io_loop.connectors.jetstream.transport import (
        NatsApiError,
        NatsError,
        NatsNoStreamResponse,
        NatsWrongLast,
    )

    async def old_revision(nc: Any) -> None:
        kv = await nc.jetstream(timeout=2).create_key_value(bucket="wrong_last_test", history=1)
        first = await kv.put("k", b"a")
        await kv.put("k", b"b")
        await kv.update("k", b"c", last=first)

    async def no_stream(nc: Any) -> None:
        await nc.jetstream(timeout=2).publish("no.stream.stores.this", b"")

    exc = _mapped(nats_server.url, old_revision)
    assert type(exc) is NatsWrongLast and isinstance(exc, NatsApiError)
    assert isinstance(exc.__cause__, nats.js.errors.KeyWrongLastSequenceError)
    assert exc.api and exc.description == exc.__cause__.description and "wrong last sequence" in exc.description
    exc = _mapped(nats_server.url, no_stream)
    assert type(exc) is NatsNoStreamResponse and isinstance(exc.__cause__, nats.js.errors.NoStreamResponseError)
    assert not exc.api and exc.code is None and isinstance(exc, NatsError)


def test_other_exceptions_pass_through_unmapped():
    from forkless.io_loop.connectors.jetstream.transport import _mapped as mapped_nats_errors

    with pytest.raises(KeyError), mapped_nats_errors():
        raise KeyError("a bug")


def test_every_call_of_a_transport_raises_ours_never_nats_py_s(nats_server):
    """The room's modules call a ``Transport`` and catch ours: a missing stream, a write at an old revision, a
    publication no stream stores, a call on a closed connection, each raised by the transport's own call."""
    import nats.errors
    import nats.js.errors

    from forkless.io_loop.connectors.jetstream.settings import JetStreamSpec
    from forkless.io_loop.connectors.jetstream.transport import (
        NatsError,
        NatsNoStreamResponse,
        NatsNotFound,
        NatsWrongLast,
        Transport,
        connect_options,
    )
    from forkless.io_loop.feedspec import FeedSpec
    from forkless.io_loop.settings import Timeouts, TlsSettings

    timeouts = Timeouts(connect_timeout_s=2.0, heartbeat_s=0.0, stale_s=0.0, shutdown_timeout_s=2.0)
    feed = FeedSpec("errors", nats_server.url, kind="jetstream", options=JetStreamSpec(""))
    options = connect_options(feed, timeouts, TlsSettings(ca_file="", insecure=False))

    async def main() -> list[BaseException]:
        transport = await Transport.connect(timeouts, options)
        raised: list[BaseException] = []

        async def caught(call: Any) -> None:
            try:
                async with asyncio.timeout(LIMIT_S):
                    await call
            except Exception as exc:
                raised.append(exc)

        await caught(transport.stream_info("NO_SUCH_STREAM"))
        await transport.create_key_value("transport_errors", history=1, ttl_s=0.0, description="a test's")
        kv = transport.key_value("transport_errors", direct=False)
        first = await kv.put("k", b"a")
        await kv.put("k", b"b")
        await caught(kv.update("k", b"c", last=first))
        await caught(transport.publish_acked("no.stream.stores.this", b""))
        await transport.close(LIMIT_S)
        await caught(transport.publish("x", b""))
        return raised

    missing, old, nowhere, closed = asyncio.run(main())
    assert type(missing) is NatsNotFound and isinstance(missing.__cause__, nats.js.errors.NotFoundError)
    assert type(old) is NatsWrongLast and old.api and "wrong last sequence" in old.description
    assert type(nowhere) is NatsNoStreamResponse and isinstance(nowhere.__cause__, nats.js.errors.NoStreamResponseError)
    assert type(closed) is NatsError and isinstance(closed.__cause__, nats.errors.ConnectionClosedError)
