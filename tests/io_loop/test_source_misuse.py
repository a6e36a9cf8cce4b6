"""Misuse of the public source surface (issue 43): each gets a clear error naming the argument,
nothing is lost, the books balance. Every source here is a user's object written against the
public API only (``Source``: a ``name`` and ``async run(ctx)``), run by a real ``Controller``, as
tests/io_loop/test_source.py's are; each catches the error it provokes, as a careful user would, and goes
on, so the stop is the ordinary one and the books are read after it."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import numpy as np
import pytest

from forkless import Config, Controller
from forkless.controller.processor import ewma_processor
from tests.harness import UNIT_S, assert_books_balance, drive, quick_config

pytestmark = pytest.mark.timeout(90 * UNIT_S)

PROCESSOR = ewma_processor()
FEATURES = 4


def _config(**changes: Any) -> Config:
    return quick_config(features=FEATURES, **changes)


def _frame(seqs: range, stream: str = "s") -> str:
    return json.dumps([{"seq": i, "stream": stream, "x": [float(i)] * FEATURES} for i in seqs])


class Misuser:
    """Runs ``steps(ctx)`` (emits, some of them wrong: each error is kept in ``refused``), then
    collects what the main thread sends back (``answers``) until the stop."""

    name = "misuser"

    def __init__(self, steps: Any) -> None:
        self.steps = steps
        self.refused: list[BaseException] = []
        self.answers: list[Any] = []

    async def attempt(self, emit: Any) -> None:
        try:
            await emit
        except (TypeError, ValueError) as exc:
            self.refused.append(exc)

    async def run(self, ctx: Any) -> None:
        await self.steps(self, ctx)
        async for frame in ctx.outgoing():
            self.answers.append(json.loads(frame))


def _run(source: Misuser, answers: int, **config: Any) -> Any:
    """Run ``source`` until ``answers`` replies reached it, stop; the books must balance."""
    with Controller(_config(**config), processor=PROCESSOR, sources=[source]) as ctl:
        drive(ctl, lambda: len(source.answers) >= answers, timeout_s=20 * UNIT_S, what=f"{answers} replies yielded")
    assert_books_balance(ctl)
    return ctl.stats()


# ---- 2: positions on some emits and not others ---------------------------------------------------


def test_an_emit_without_a_position_after_ones_with_it_is_refused_and_nothing_is_lost():
    async def steps(self: Misuser, ctx: Any) -> None:
        await ctx.emit(_frame(range(0, 3)), position=1)
        await self.attempt(ctx.emit(_frame(range(3, 5))))  # the same loop turn: one chunk before the fix
        decoded = ctx.decode(_frame(range(5, 8)))
        await self.attempt(ctx.emit(decoded))
        await ctx.emit(_frame(range(8, 10)), position=2)

    source = Misuser(steps)
    snap = _run(source, 5)
    assert [type(e) for e in source.refused] == [ValueError, ValueError]
    assert "position=None, but its earlier emits had positions" in str(source.refused[0])
    assert sorted(a["seq"] for a in source.answers) == [0, 1, 2, 8, 9]
    assert (snap.messages_in, snap.messages_out, snap.feeds[0].io.frames_in) == (5, 5, 2)


def test_a_position_after_emits_without_one_is_refused():
    async def steps(self: Misuser, ctx: Any) -> None:
        await ctx.emit(_frame(range(0, 2)))
        await self.attempt(ctx.emit(_frame(range(2, 4)), position=7))
        await self.attempt(ctx.emit_rows([4], ["s"], [[1.0] * FEATURES], position=8))
        await ctx.emit(_frame(range(9, 10)))

    source = Misuser(steps)
    snap = _run(source, 3)
    assert [str(e).split(":")[1].strip() for e in source.refused] == ["position=7, but its earlier emits had none",
                                                                      "position=8, but its earlier emits had none"]
    assert sorted(a["seq"] for a in source.answers) == [0, 1, 9] and snap.messages_in == 3


def test_emit_skipping_messages_without_a_position_is_refused():
    async def steps(self: Misuser, ctx: Any) -> None:
        await self.attempt(ctx.emit(ctx.decode(_frame(range(0, 3))), first=1))
        await ctx.emit(_frame(range(3, 5)))

    source = Misuser(steps)
    snap = _run(source, 2)
    assert len(source.refused) == 1 and "emit(..., first=1) needs the frame's position" in str(source.refused[0])
    assert snap.messages_in == 2 and snap.feeds[0].io.frames_in == 1


def test_a_reads_frames_are_refused_with_a_position_and_from_a_positioned_source_and_nothing_is_taken():
    async def steps(self: Misuser, ctx: Any) -> None:
        await self.attempt(ctx.emit([_frame(range(0, 1)), _frame(range(1, 2))], 1))  # one position for two frames
        await ctx.emit(_frame(range(2, 4)), position=1)
        await self.attempt(ctx.emit([_frame(range(4, 6)), _frame(range(6, 8))]))  # no position each
        await ctx.emit(_frame(range(8, 9)), position=2)

    source = Misuser(steps)
    snap = _run(source, 3)
    assert [type(e) for e in source.refused] == [ValueError, ValueError]
    assert "emit(frames) of 2 frames takes no position or first" in str(source.refused[0])
    assert "position=None, but its earlier emits had positions" in str(source.refused[1])
    assert sorted(a["seq"] for a in source.answers) == [2, 3, 8]
    assert (snap.messages_in, snap.feeds[0].io.frames_in) == (3, 2)


def test_a_position_of_a_wrong_type_is_refused_before_anything_is_counted_and_decides_nothing():
    async def steps(self: Misuser, ctx: Any) -> None:
        await self.attempt(ctx.emit(_frame(range(0, 2)), position=1.5))
        await ctx.emit(_frame(range(2, 4)))  # the refused emit did not make this source a positioned one

    source = Misuser(steps)
    snap = _run(source, 2)
    assert len(source.refused) == 1 and "a position is an int or a str" in str(source.refused[0])
    assert sorted(a["seq"] for a in source.answers) == [2, 3]
    assert (snap.messages_in, snap.feeds[0].io.frames_in) == (2, 1)


# ---- 5: positions that do not increase ------------------------------------------------------------


def test_a_repeated_position_is_refused_so_no_frame_is_applied_twice_after_a_restart():
    async def steps(self: Misuser, ctx: Any) -> None:
        for k in range(3):  # three frames sharing a coarse timestamp as their position
            await self.attempt(ctx.emit(_frame(range(2 * k, 2 * k + 2)), position=1_700_000_000))
        await self.attempt(ctx.emit(_frame(range(6, 8)), position=1_699_999_999))  # backwards
        await ctx.emit(_frame(range(8, 10)), position=1_700_000_001)

    source = Misuser(steps)
    snap = _run(source, 4)
    assert [type(e) for e in source.refused] == [ValueError] * 3
    assert "position 1700000000 does not increase on the last one (1700000000)" in str(source.refused[0])
    assert sorted(a["seq"] for a in source.answers) == [0, 1, 8, 9]
    assert snap.messages_in == 4 and snap.feeds[0].io.frames_in == 2


def test_str_positions_must_increase_as_text_and_a_source_keeps_one_type():
    async def steps(self: Misuser, ctx: Any) -> None:
        await ctx.emit(_frame(range(0, 1)), position="2024-01-01T00:00:01")
        await self.attempt(ctx.emit(_frame(range(1, 2)), position="2024-01-01T00:00:01"))  # repeated
        await self.attempt(ctx.emit(_frame(range(2, 3)), position="2024-01-01T00:00:00"))  # earlier
        await self.attempt(ctx.emit(_frame(range(3, 4)), position=5))  # an int after str ones
        await ctx.emit(_frame(range(4, 5)), position="2024-01-01T00:00:02")

    source = Misuser(steps)
    snap = _run(source, 2)
    assert [type(e) for e in source.refused] == [ValueError, ValueError, TypeError]
    assert "str positions compare as text" in str(source.refused[0])
    assert "a source's positions are all int or all str" in str(source.refused[2])
    assert sorted(a["seq"] for a in source.answers) == [0, 4] and snap.messages_in == 2


# ---- 11: emit's first ----------------------------------------------------------------------------


def test_emit_refuses_a_first_that_is_not_a_count_of_messages():
    async def steps(self: Misuser, ctx: Any) -> None:
        for position, first in enumerate((-1, 1.0, "1", True, None), start=1):
            decoded = ctx.decode(_frame(range(10 * position, 10 * position + 3)))
            await self.attempt(ctx.emit(decoded, position, first=first))
        taken = await ctx.emit(ctx.decode(_frame(range(100, 103))), 10, first=1)
        beyond = await ctx.emit(_frame(range(200, 202)), 11, first=5)  # all held already
        self.taken = (taken, beyond)

    source = Misuser(steps)
    snap = _run(source, 2)
    assert [type(e) for e in source.refused] == [ValueError, TypeError, TypeError, TypeError, TypeError]
    assert all("emit's first" in str(e) for e in source.refused)
    assert "0 or more, not -1" in str(source.refused[0]) and "not float: 1.0" in str(source.refused[1])
    assert source.taken == (2, 0)
    assert sorted(a["seq"] for a in source.answers) == [101, 102] and snap.messages_in == 2


# ---- 4: emit_rows' bad values ---------------------------------------------------------------------


BAD_ROWS = {  # seq -> (a row of x, the reason it is refused)
    3: ([math.nan, 1.0, 1.0, 1.0], "x must be finite and within ±1e18"),
    5: ([1.0, math.inf, 1.0, 1.0], "x must be finite and within ±1e18"),
    7: ([1.0, 1.0, None, 1.0], "x must hold numbers only"),
    9: ([1e39, 1.0, 1.0, 1.0], "x must be finite and within ±1e18"),  # inf once float32
    11: ([1.0, 2 + 3j, 1.0, 1.0], "x must hold real numbers (a complex value's imaginary part would be lost)"),
}


class RowsSource(Misuser):
    """Hands ``batches`` over with ``emit_rows`` (each ``(seq, stream, x)``)."""

    name = "rows"

    def __init__(self, batches: list[tuple[list[int], list[str], Any]]) -> None:
        async def steps(self: Misuser, ctx: Any) -> None:
            for seq, stream, x in batches:
                self.taken.append(await ctx.emit_rows(seq, stream, x))

        super().__init__(steps)
        self.taken: list[int] = []


def _rows(seqs: list[int], bad: dict[int, tuple[list[Any], str]]) -> list[tuple[list[int], list[str], Any]]:
    """One emit_rows call per pair of seqs, stream "a"; x is seq's value, or the bad row."""
    batches = []
    for k in range(0, len(seqs), 2):
        pair = seqs[k:k + 2]
        batches.append((pair, ["a"] * len(pair), [bad[s][0] if s in bad else [float(s)] * FEATURES for s in pair]))
    return batches


def test_emit_rows_refuses_bad_values_row_by_row_and_the_stream_s_state_is_untouched():
    clean = RowsSource(_rows([s for s in range(14) if s not in BAD_ROWS], {}))
    _run(clean, 14 - len(BAD_ROWS))
    source = RowsSource(_rows(list(range(14)), BAD_ROWS))
    snap = _run(source, 14)
    results = {a["seq"]: a for a in source.answers if "error" not in a}
    assert results == {a["seq"]: a for a in clean.answers}  # the good rows' results as if the bad ones never came
    errors = {a["seq"]: a["error"] for a in source.answers if "error" in a}
    assert errors == {seq: reason for seq, (_, reason) in BAD_ROWS.items()}
    assert snap.errors == {"x must be finite and within ±1e18": 3, "x must hold numbers only": 1,
                           BAD_ROWS[11][1]: 1}
    assert source.taken == [2, 1, 1, 1, 1, 1, 2] and snap.messages_in == 9


def test_emit_rows_refuses_a_whole_array_of_complex_or_float64_beyond_float32_and_keeps_the_good_rows():
    x = np.array([[1.0] * FEATURES, [1e39] * FEATURES, [-1e19] * FEATURES], np.float64)
    batches = [([0, 1, 2], ["a", "b", "c"], x), ([3], ["a"], np.array([[1 + 1j] * FEATURES])),
               ([4], ["a"], np.array([[2 ** 70, 1, 1, 1]], object)), ([5], ["a"], np.array([[7] * FEATURES]))]
    source = RowsSource(batches)
    snap = _run(source, 6)
    assert source.taken == [1, 0, 0, 1]
    assert sorted(a["seq"] for a in source.answers if "error" not in a) == [0, 5]
    assert snap.errors == {"x must be finite and within ±1e18": 3, BAD_ROWS[11][1]: 1}


def test_emit_rows_of_the_wrong_shape_still_raises_value_error_and_takes_nothing():
    async def steps(self: Misuser, ctx: Any) -> None:
        await self.attempt(ctx.emit_rows([1, 2], ["a", "b"], [[1.0] * FEATURES, [1.0] * (FEATURES - 1)]))  # ragged
        await self.attempt(ctx.emit_rows([1], ["a", "b"], [[1.0] * FEATURES]))
        await ctx.emit_rows([3], ["a"], [[1.0] * FEATURES])

    source = Misuser(steps)
    snap = _run(source, 1)
    assert [type(e) for e in source.refused] == [ValueError, ValueError]
    assert "got 2, 2 and rows of different lengths" in str(source.refused[0])
    assert snap.messages_in == 1 and snap.errors_total == 0


# ---- 6: ReplyBatch.wrote(n) ------------------------------------------------------------------------


class BatchWriter:
    """Emits ten messages, then writes its replies a batch at a time, first trying wrong counts."""

    name = "batches"

    def __init__(self) -> None:
        self.refused: list[BaseException] = []
        self.written = 0

    async def run(self, ctx: Any) -> None:
        await ctx.emit(_frame(range(10)))
        async for batch in ctx.replies():
            frames = len(batch.frames)
            for wrong in (frames + 5, -1, 1.0, True, None):
                try:
                    batch.wrote(wrong)
                except (TypeError, ValueError) as exc:
                    self.refused.append(exc)
            self.written += frames
            batch.wrote(np.int64(frames))  # an integer of numpy's is a count too


def test_reply_batch_wrote_refuses_a_count_that_is_not_of_its_frames_and_the_books_balance():
    source = BatchWriter()
    with Controller(_config(), processor=PROCESSOR, sources=[source]) as ctl:
        drive(ctl, lambda: source.written >= 10, timeout_s=20 * UNIT_S, what="10 replies written")
    assert_books_balance(ctl)
    kinds = {type(e) for e in source.refused}
    assert kinds == {TypeError, ValueError} and len(source.refused) % 5 == 0
    assert "n counts frames of this batch's" in str(source.refused[0]) and "not bool: True" in str(source.refused[3])
    snap = ctl.stats()
    assert (snap.messages_in, snap.messages_out, snap.unanswered) == (10, 10, 0)


class DoneBatchReader:
    """Emits three messages, writes each batch of replies whole, then reads the done batch again."""

    name = "rereader"

    def __init__(self) -> None:
        self.refused: list[BaseException] = []
        self.batches = self.written = 0

    async def run(self, ctx: Any) -> None:
        await ctx.emit(_frame(range(3)))
        async for batch in ctx.replies():
            frames = len(batch.frames)
            batch.wrote(frames)
            self.batches += 1
            for name in ("frames", "positions", "answers", "deadline", "send_id"):
                try:
                    getattr(batch, name)
                except RuntimeError as exc:
                    self.refused.append(exc)
            self.written += frames


def test_a_reply_batch_read_once_written_whole_says_it_is_done():
    source = DoneBatchReader()
    with Controller(_config(), processor=PROCESSOR, sources=[source]) as ctl:
        drive(ctl, lambda: source.written >= 3, timeout_s=20 * UNIT_S, what="3 replies written")
    assert_books_balance(ctl)
    assert len(source.refused) == 5 * source.batches > 0
    assert all("this ReplyBatch is done (written whole or dropped)" in str(e) for e in source.refused)


# ---- 12: Controller.send of what is not JSON -------------------------------------------------------


def test_send_of_an_object_json_cannot_write_names_send_and_the_object_s_type():
    source = Misuser(lambda self, ctx: asyncio.sleep(0))
    with Controller(_config(), processor=PROCESSOR, sources=[source]) as ctl:
        for bad, kind in (({1, 2}, "set"), ({"x": math.nan}, "dict"), ([b"ok", object()], "object")):
            with pytest.raises(TypeError, match=rf"^send\(\) was given a {kind} that json cannot write") as info:
                ctl.send("misuser", bad)
            assert "on_connect" not in str(info.value)
        ctl.send("misuser", {"ok": 1})
        drive(ctl, lambda: source.answers == [{"ok": 1}], timeout_s=10 * UNIT_S, what="the good frame yielded")
    assert_books_balance(ctl)
    assert ctl.stats().sent_out == 1 and ctl.stats().sent_unsent == 0


# ---- a BaseException from a user's code on the IO thread (issue 54, item 10) -----------------------


class Quitter(BaseException):
    """A user's own BaseException (not an Exception)."""


class Raiser:
    """Emits one frame, then raises ``exc`` from its run, or from a task of its own (``in_task``):
    that one is not awaited by the runner, so it leaves the IO loop itself."""

    name = "raiser"

    def __init__(self, exc: BaseException, in_task: bool = False) -> None:
        self.exc = exc
        self.in_task = in_task

    async def raising(self) -> None:
        raise self.exc

    async def run(self, ctx: Any) -> None:
        await ctx.emit(_frame(range(3)))
        if self.in_task:
            await asyncio.create_task(self.raising())
        await self.raising()


@pytest.mark.parametrize("exc", [SystemExit(7), KeyboardInterrupt(), Quitter("done here")],
                         ids=["SystemExit", "KeyboardInterrupt", "own-BaseException"])
def test_a_source_whose_run_raises_a_base_exception_fails_naming_it_as_its_cause(exc):
    from forkless import FeedFatal

    ctl = Controller(_config(), processor=PROCESSOR, sources=[Raiser(exc)])
    with pytest.raises(FeedFatal) as caught:  # from start() or from a call after it: the source fails at once
        with ctl:
            drive(ctl, lambda: False, timeout_s=20 * UNIT_S, what="the source's failure")
    assert f"source 'raiser' failed: {type(exc).__name__}" in str(caught.value)
    assert caught.value.__cause__ is exc  # the process goes on: nothing exited it
    assert_books_balance(ctl)


def test_a_base_exception_that_leaves_the_io_loop_from_a_source_s_own_task_is_named_as_the_cause():
    from forkless import IOThreadError

    exc = SystemExit(7)
    ctl = Controller(_config(), processor=PROCESSOR, sources=[Raiser(exc, in_task=True)])
    with pytest.raises(IOThreadError) as caught:
        with ctl:
            drive(ctl, lambda: False, timeout_s=20 * UNIT_S, what="the IO thread's failure")
    assert "SystemExit(7)" in str(caught.value) and caught.value.__cause__ is exc
    assert_books_balance(ctl)


class Stubborn:
    """Emits one frame, then neither reads its replies nor returns, and swallows its cancellation."""

    name = "stubborn"

    def __init__(self) -> None:
        self.cancels = 0

    async def run(self, ctx: Any) -> None:
        await ctx.emit(_frame(range(3)))
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancels += 1


def test_a_source_that_swallows_its_cancellation_is_given_up_and_the_io_thread_still_ends():
    source = Stubborn()
    # a stop of 4 s: its reserve (0.5 s) leaves the abort and the source's grace room on a loaded machine
    ctl = Controller(_config(shutdown_timeout_s=4.0 * UNIT_S), processor=PROCESSOR, sources=[source])
    with ctl:
        drive(ctl, lambda: ctl.stats().processed >= 3, timeout_s=20 * UNIT_S, what="its messages processed")
    # the stop could not finish (the source never returns): its deadline aborted the IO side, which gave the
    # source up after its grace instead of waiting for it, so the thread ended and its books were closed
    assert source.cancels >= 1 and not ctl.abandoned_io
    assert_books_balance(ctl)
