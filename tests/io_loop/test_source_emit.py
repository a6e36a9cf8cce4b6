"""One way to hand over each kind of thing on a source's ``SourceContext`` (io_loop/source.py): ``emit`` takes one
frame, the frames of one socket read, or a frame ``ctx.decode`` read, and hands each over alike; the spellings it
replaced (``emit_frames``, ``emit_decoded``), ``set_connected`` and ``ctx.name`` warn for a release, naming the new
spelling, and do what it does (io_loop/renamed.py), then raise.

Each test runs a real ``SourceRunner`` with the built-in ``JsonCodec`` on a loop of its own, its queues plain asyncio
ones, and reads what it handed over (the chunks on inbound, the error replies on its outbox) and its books."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from forkless.controller.codec import JsonCodec
from forkless.controller.ioside import feed_plan
from forkless.io_loop import renamed
from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import Origin
from forkless.io_loop.renamed import RENAMED
from forkless.io_loop.source import SourceContext, SourceRunner
from tests.harness import quick_config

FEATURES = 4
CONFIG = quick_config(features=FEATURES)


class Quiet:
    """A source that is only its name: the tests call its context themselves."""

    name = "mine"

    async def run(self, ctx: Any) -> None:  # pragma: no cover - never run here
        ...


def _frame(seqs: range, stream: str = "s") -> str:
    return json.dumps([{"seq": i, "stream": stream, "x": [float(i)] * FEATURES} for i in seqs])


FRAMES = [_frame(range(0, 3)), json.dumps([{"seq": 3, "stream": "s", "x": [1.0] * FEATURES}, {"seq": 4}]),
          _frame(range(5, 7))]  # the second has a bad element: answered with an error reply


def handed_over(steps: Callable[[SourceContext], Awaitable[Any]]) -> dict[str, Any]:
    """Run ``steps(ctx)`` on a real runner; what it handed over and its books."""
    feed = feed_plan(CONFIG, [Quiet()]).specs[0]
    io = CONFIG.io_settings()

    async def run() -> dict[str, Any]:
        inbound: asyncio.Queue[Any] = asyncio.Queue()
        outbox: asyncio.Queue[Any] = asyncio.Queue()
        stats = IOStats()
        runner = SourceRunner(Quiet(), io.limits, JsonCodec(FEATURES), stats, feed, features=io.features,
                              max_batch=io.max_batch, timeouts=io.timeouts, inbound=inbound, outbox=outbox, index=0)
        returned = await steps(runner.ctx)
        await runner.handover.flush()
        chunks = [inbound.get_nowait() for _ in range(inbound.qsize())]
        replies = [outbox.get_nowait() for _ in range(outbox.qsize())]
        return {"returned": returned, "seq": [s for c in chunks for s in c.seq],
                "origin": [o for c in chunks for o in (c.origin or [])],
                "errors": [json.loads(f) for r in replies for f in r.frames], "frames_in": stats.frames_in,
                "messages_in": stats.messages_in, "connected": stats.connected, "connects": stats.connects,
                "last_error": stats.last_error, "connection": runner.connection_id}

    return asyncio.run(run())


def test_emit_hands_over_one_frame_a_reads_frames_and_a_frame_decode_read_alike():
    async def one_by_one(ctx: SourceContext) -> list[int]:
        return [await ctx.emit(frame) for frame in FRAMES]

    async def one_read(ctx: SourceContext) -> list[int]:
        return [await ctx.emit(FRAMES)]

    async def decoded(ctx: SourceContext) -> list[int]:
        return [await ctx.emit(ctx.decode(frame)) for frame in FRAMES]

    runs = {how.__name__: handed_over(how) for how in (one_by_one, one_read, decoded)}
    for run in runs.values():
        assert (run["seq"], run["frames_in"], run["messages_in"]) == ([0, 1, 2, 3, 5, 6], 3, 6)
        assert run["errors"] == [{"error": "missing field: stream", "seq": 4}]
    assert [runs[how]["returned"] for how in runs] == [[3, 1, 2], [6], [3, 1, 2]]


def test_emit_of_what_decode_read_hands_over_what_a_filter_left_and_the_bad_parts_it_added():
    async def filtered(ctx: SourceContext) -> int:
        decoded = ctx.decode(_frame(range(0, 4)))
        keep = [i for i, seq in enumerate(decoded.seq) if seq % 2 == 0]  # a user's filter: the even ones
        decoded.errors = [("odd", decoded.seq[i]) for i in range(len(decoded.seq)) if i not in keep] + decoded.errors
        decoded.seq, decoded.stream, decoded.x = ([decoded.seq[i] for i in keep], [decoded.stream[i] for i in keep],
                                                  decoded.x[keep])
        return await ctx.emit(decoded, 7)

    run = handed_over(filtered)
    assert (run["returned"], run["seq"], run["frames_in"]) == (2, [0, 2], 1)
    assert run["origin"] == [Origin(7, 0, False), Origin(7, 1, True)]
    assert run["errors"] == [{"error": "odd", "seq": 1}, {"error": "odd", "seq": 3}]


def test_emit_with_first_leaves_out_the_messages_the_state_holds_of_a_frame_or_of_what_decode_read():
    async def resuming(ctx: SourceContext) -> list[int]:
        return [await ctx.emit(_frame(range(0, 3)), 5, first=1),
                await ctx.emit(ctx.decode(_frame(range(3, 6))), 6, first=2),
                await ctx.emit(_frame(range(6, 8)), 7, first=0)]

    run = handed_over(resuming)
    assert (run["returned"], run["seq"], run["frames_in"]) == ([2, 1, 2], [1, 2, 5, 6, 7], 3)
    assert run["origin"] == [Origin(5, 1, False), Origin(5, 2, True), Origin(6, 2, True), Origin(7, 0, False),
                             Origin(7, 1, True)]  # the indices stay the frame's own


def test_emit_refuses_a_position_or_first_with_a_reads_frames_and_a_first_that_is_no_count_taking_nothing():
    refused: list[BaseException] = []

    async def misuse(ctx: SourceContext) -> None:
        for wrong in (ctx.emit(FRAMES, 3), ctx.emit(FRAMES, first=1), ctx.emit(FRAMES[0], 3, first=1.0),
                      ctx.emit(FRAMES[0], first=1), ctx.emit(ctx.decode(FRAMES[0]), 3, first=-1)):
            try:
                await wrong
            except (TypeError, ValueError) as exc:
                refused.append(exc)

    run = handed_over(misuse)
    assert (run["seq"], run["frames_in"], run["errors"]) == ([], 0, [])
    assert [type(e) for e in refused] == [ValueError, ValueError, TypeError, ValueError, ValueError]
    assert "emit(frames) of 3 frames takes no position or first (given position=3, first=0)" in str(refused[0])
    assert "emit's first is an int" in str(refused[2])
    assert "emit(..., first=1) needs the frame's position" in str(refused[3])


# ---- the renamed spellings --------------------------------------------------------------------------------------

# each old spelling: its use, and the new spelling's use that it must equal
async def _old_frames(ctx: Any) -> Any:
    return await ctx.emit_frames(FRAMES)


async def _new_frames(ctx: Any) -> Any:
    return await ctx.emit(FRAMES)


async def _old_decoded(ctx: Any) -> Any:
    return await ctx.emit_decoded(ctx.decode(FRAMES[0]), 5, first=1, received_ns=1)


async def _new_decoded(ctx: Any) -> Any:
    return await ctx.emit(ctx.decode(FRAMES[0]), 5, first=1, received_ns=1)


async def _old_connected(ctx: Any) -> Any:
    ctx.set_connected(False, "lost", code=1006)
    ctx.set_connected(True)
    ctx.set_connected(True)  # connected already: nothing, as it always was
    ctx.set_connected(False, "lost again")


async def _new_connected(ctx: Any) -> Any:
    ctx.connection_closed("lost", code=1006)
    ctx.connection_opened()
    ctx.connection_closed("lost again")


async def _old_name(ctx: Any) -> Any:
    return ctx.name


async def _new_name(ctx: Any) -> Any:
    return Quiet.name


USES = {
    "ctx.emit_frames(frames)": (_old_frames, _new_frames),
    "ctx.emit_decoded(decoded, ...)": (_old_decoded, _new_decoded),
    "ctx.set_connected(flag, reason, code=...)": (_old_connected, _new_connected),
    "ctx.name": (_old_name, _new_name),
}


@pytest.mark.parametrize("old", list(USES))
def test_an_old_spelling_on_the_context_warns_naming_the_new_one_and_does_what_it_does(old):
    entry = RENAMED[old]
    use, new = USES[old]
    with pytest.warns(DeprecationWarning, match=re.escape(
            f"{old} is deprecated since forkless {entry.deprecated_in} and is removed in {entry.removed_in}: "
            f"write {entry.new}")) as warned:
        got = handed_over(use)
    assert {w.filename for w in warned} == {__file__}  # the warning points at the source's own line
    assert got == handed_over(new)


def test_emit_frames_still_refuses_one_frame_as_it_always_did():
    refused: list[BaseException] = []

    async def one(ctx: Any) -> None:
        try:
            await ctx.emit_frames(FRAMES[0])
        except TypeError as exc:
            refused.append(exc)

    with pytest.warns(DeprecationWarning):
        run = handed_over(one)
    assert run["frames_in"] == 0 and "emit_frames takes a list of frames, not one str (one frame: emit)" in \
        str(refused[0])


def test_at_the_release_that_removes_them_the_old_spellings_raise_naming_the_new_ones(monkeypatch):
    monkeypatch.setattr(renamed, "VERSION", "0.4.0")
    for old, (use, _) in USES.items():
        with pytest.raises(AttributeError, match=re.escape(f"{old} was removed in forkless 0.4.0: write "
                                                           f"{RENAMED[old].new}")):
            handed_over(use)


# ---- the surface: what is public on a source's context, each documented, each method used ---------------------

ROOT = Path(__file__).resolve().parents[2]
SURFACE = {  # a name added or dropped is a decision, made here
    "emit", "decode", "emit_rows", "emit_event",  # one way to hand over each kind of thing
    "outgoing", "replies", "replies_ended", "send_failed", "sends_while_disconnected",  # what the main thread sends
    "connection_opened", "connection_closed", "connect_failed", "reconnecting",  # the source's connections
    "count", "count_error", "replies_written", "unconfirmed",  # its books
    "features", "resume_from", "stopping", "stop_deadline",
}
RENAMED_ON_IT = {"emit_frames", "emit_decoded", "set_connected", "name"}  # each warns for a release (USES above)
# where a method must be used: the built-in sources, Relogin, the examples, and the documents' examples
USERS = (*sorted((ROOT / "forkless" / "io_loop" / "connectors").rglob("*.py")), ROOT / "forkless/io_loop/relogin.py",
         *sorted((ROOT / "examples").glob("*.py")))


def _public_names() -> set[str]:
    ctx = SourceRunner(Quiet(), CONFIG.io_settings().limits, JsonCodec(FEATURES), IOStats(),
                       feed_plan(CONFIG, [Quiet()]).specs[0], features=FEATURES, max_batch=CONFIG.max_batch,
                       timeouts=CONFIG.io_settings().timeouts, inbound=None, outbox=None, index=0).ctx
    return {name for name in [*dir(type(ctx)), *vars(ctx)] if not name.startswith("_")}


def test_the_context_s_public_names_are_the_surface_and_the_renamed_ones():
    assert _public_names() == SURFACE | RENAMED_ON_IT
    assert {f"ctx.{old.split('(')[0].removeprefix('ctx.')}" for old in USES} == {f"ctx.{n}" for n in RENAMED_ON_IT}


def test_each_public_name_is_in_the_table_of_your_own_source_and_each_method_is_used_by_a_source_or_an_example():
    page = (ROOT / "docs" / "embedding" / "sources.md").read_text()
    table = page[page.index("What `ctx` (a `forkless.SourceContext`) gives a source"):page.index("Renamed in 0.3.0")]
    assert sorted(name for name in SURFACE if f"`ctx.{name}" not in table and f"ctx.{name}(" not in table) == []
    examples = "".join(re.findall(r"<!-- example: \w+ -->\n```python\n(.*?)```", "".join(
        path.read_text() for path in (ROOT / "docs" / "embedding").glob("*.md")), re.S))
    code = examples + "".join(path.read_text() for path in USERS)
    methods = {name for name in SURFACE if callable(getattr(SourceContext, name, None))}
    assert sorted(name for name in methods if not re.search(rf"ctx\.{name}\b", code)) == []
