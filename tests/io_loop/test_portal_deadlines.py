"""An ``IOPortal``'s ``from_main`` items with a deadline (io_loop/portalqueue.py's ``PortalSends``, issue 55
"What to build" 1): the worker never takes an item past its deadline, whichever way it takes (awaited on
the loop, ``get_nowait``, a blocking ``get`` in an executor thread), and the main thread learns each one
given up on ``to_main`` as a ``SendFailed`` at its own deadline, whatever was queued before it."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from forkless import SendFailed
from forkless.io_loop.portal import IOPortal


def _taker(how: str, go: threading.Event):
    """A worker that takes nothing until ``go`` is set, then takes what is left ``how`` and sends it back."""

    async def worker(to_main, from_main):
        while not go.is_set():
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        while True:
            try:
                if how == "await":
                    item = await from_main.get(timeout=0.2)
                elif how == "nowait":
                    item = from_main.get_nowait()
                else:
                    item = await loop.run_in_executor(None, from_main.get, True, 0.2)
            except queue.Empty:
                break
            to_main.put(("taken", item))
        to_main.put("done")
        await to_main.stopping.wait()

    return worker


@pytest.mark.parametrize("how", ["await", "nowait", "executor"])
def test_an_item_is_never_taken_after_its_deadline_and_each_is_reported_at_it(how, timeout_unit):
    go = threading.Event()
    with IOPortal(_taker(how, go), stop_timeout_s=10 * timeout_unit) as portal:
        assert portal.from_main.put("no deadline") is None  # held, queued before the ones below
        ids = [portal.from_main.put(f"order {i}", max_age_s=0.1) for i in range(3)]
        assert ids == [1, 2, 3]
        assert portal.from_main.put("named", max_age_s=0.1, id="o-named") == "o-named"
        assert portal.from_main.put("in time", max_age_s=60.0) == 5
        failed = [portal.to_main.get(timeout=10 * timeout_unit) for _ in range(4)]  # while the worker takes nothing
        go.set()
        taken = []
        while (item := portal.to_main.get(timeout=10 * timeout_unit)) != "done":
            taken.append(item)
        assert portal.sent_failed == {"deadline": 4}
    assert all(isinstance(event, SendFailed) and event.reason == "deadline" for event in failed)
    assert [(event.id, event.frame) for event in failed] == [
        (1, "order 0"), (2, "order 1"), (3, "order 2"), ("o-named", "named")]
    assert taken == [("taken", "no deadline"), ("taken", "in time")]


def test_a_deadline_is_from_main_s_and_is_checked():
    async def worker(to_main, from_main):
        await to_main.stopping.wait()

    with IOPortal(worker) as portal:
        with pytest.raises(TypeError, match=r"put\(max_age_s=, id=\) is from_main's"):
            portal.to_main.put("x", max_age_s=1.0)
        with pytest.raises(ValueError, match=r"put\(max_age_s=\) is a finite number of seconds > 0"):
            portal.from_main.put("x", max_age_s=-1)
        with pytest.raises(TypeError, match=r"put\(max_age_s=\) is a number of seconds"):
            portal.from_main.put_nowait("x", max_age_s="1")
        with pytest.raises(ValueError, match=r"put\(id=\) names an item put with a deadline: give max_age_s too"):
            portal.from_main.put("x", id="a")
        assert portal.from_main.qsize() == 0 and portal.sent_failed == {}
