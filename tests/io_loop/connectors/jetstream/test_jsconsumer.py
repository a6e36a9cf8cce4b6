"""``Consumer`` (io_loop/connectors/jetstream/consumer.py), the JetStream feed's bookkeeping, with literal reply
subjects
and stream states: no server, no socket, no event loop. What it decides is what the feed does
against a real nats-server in tests/io_loop/connectors/jetstream/test_jetstream.py and
tests/io_loop/connectors/jetstream/test_jetstream_faults.py; here
each decision is pinned on its own: gaps, redeliveries, the position that moves only once a
message is handed over, what the stream must still hold, a partitioned feed's positions."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from forkless.io_loop.connectors.jetstream.consumer import FOREIGN_REASON, SKIP, Consumer, Drop, Take
from forkless.io_loop.connectors.jetstream.partitions import escape_stream, partition_of
from forkless.io_loop.connectors.jetstream.settings import JetStreamSpec
from forkless.io_loop.counters import SourceStats
from forkless.io_loop.crossing import Origin, PositionUnknown, Resume
from forkless.io_loop.errors import PositionLost

SPEC = JetStreamSpec(stream="TICKS", subject="ticks.>", results="scores")
PARTITIONED = JetStreamSpec(stream="TICKS", subject="ticks.{partition}.>", results="scores", partition_count=4,
                            partitions=(0, 1))


def reply(seq: int, consumer_seq: int, *, delivered: int = 1, pending: int = 5) -> bytes:
    """A delivery's reply subject, as nats-server writes it (9 tokens)."""
    return f"$JS.ACK.TICKS.c1.{delivered}.{seq}.{consumer_seq}.1764600000000000000.{pending}".encode()


def consumer(resume: Any = None, spec: JetStreamSpec = SPEC, first: int = 1, last: int = 100) -> Consumer:
    """A consumer whose first connection found the stream holding ``first``..``last``."""
    made = Consumer(spec, "feed 'ticks'", SourceStats(), resume)
    made.check_stream(first, last)
    return made


# ---- each delivery -----------------------------------------------------------------------------


def test_a_first_delivery_out_of_the_consumers_order_is_a_gap_and_a_new_consumer_counts_from_1_again():
    c = consumer()
    assert c.new_consumer() == 1
    for k in (1, 2):
        take = c.deliver(reply(k, k))
        assert take == Take(k, 5)
        c.consumed(take)
    gap = c.deliver(reply(4, 4))  # consumer sequence 3 never came
    assert gap == Drop("delivery gap at stream sequence 4 (consumer sequence 4, expected 3)")
    assert c.next == (3, 0)  # the next consumer starts at what was not handed over
    assert c.new_consumer() == 3
    assert c.deliver(reply(3, 1)) == Take(3, 5)  # its first delivery is its consumer sequence 1


def test_a_redelivery_of_what_was_consumed_is_skipped_and_of_what_was_not_drops_the_connection():
    c = consumer()
    c.new_consumer()
    c.consumed(c.deliver(reply(1, 1)))
    assert c.deliver(reply(1, 1, delivered=2)) is SKIP  # the server sent it again: applied once only
    assert c.source.skipped == 1 and c.next == (2, 0)
    assert c.deliver(reply(2, 2, delivered=2)) == Drop("stream sequence 2 redelivered before it was consumed")
    assert c.next == (2, 0)


def test_a_delivery_below_the_position_is_skipped_even_as_a_first_delivery():
    c = consumer(Origin(9, 0, True))
    assert c.new_consumer() == 10
    assert c.deliver(reply(8, 1)) is SKIP  # (a consumer made at 10 does not send it; counted if it did)
    assert c.source.skipped == 1 and c.source.fetched == 0


@pytest.mark.parametrize("subject", [b"_INBOX.abc.1", b"$JS.ACK.TICKS.c1.1.42.40.1", b"$JS.ACK.TICKS.c1.x.1.1.1.0"])
def test_a_delivery_without_jetstreams_numbers_drops_the_connection(subject):
    c = consumer()
    c.new_consumer()
    decision = c.deliver(subject)
    assert type(decision) is Drop and decision.reason.startswith("a delivery without JetStream's reply subject")


def test_the_position_moves_only_once_a_message_is_handed_over_not_when_it_is_delivered():
    c = consumer()
    c.new_consumer()
    take = c.deliver(reply(1, 1, pending=0))
    assert c.next == (1, 0) and c.source.next_seq == 1  # delivered, not handed over: a reconnect starts at 1
    assert c.source.fetched == 1 and c.source.stream_last_seq == 100
    assert c.new_consumer() == 1
    c.deliver(reply(1, 1))
    c.consumed(take)
    assert c.next == (2, 0) and c.source.next_seq == 2
    assert c.new_consumer() == 2


def test_a_restored_position_inside_a_payload_skips_its_good_elements_handed_over_before():
    c = consumer(Origin(7, 1, False))  # elements 0 and 1 of message 7 are in the restored state
    assert c.next == (7, 2) and c.from_checkpoint
    c.new_consumer()
    take = c.deliver(reply(7, 1))
    assert take == Take(7, 5, skip=2)
    c.handing_over()
    assert not c.from_checkpoint
    c.consumed(take)
    assert c.deliver(reply(8, 2)) == Take(8, 5)  # the next message whole


def test_a_survey_with_nothing_pending_and_every_delivery_handed_over_proves_the_feed_covered_the_streams_last():
    c = consumer(first=1, last=40)
    c.new_consumer()
    take = c.deliver(reply(3, 1, pending=0))
    mark = c.activity
    assert not c.surveyed(mark, 40, 0, 1, True, 1)  # delivered, not yet handed over: proves nothing
    c.consumed(take)
    assert c.surveyed(mark, 40, 0, 1, True, 1) and c.source.covered == (3, 40)
    assert c.surveyed(c.activity, 55, 0, 1, False, 1) and c.source.covered == (3, 55)
    assert c.surveyed(c.activity, 50, 0, 1, True, 1) and c.source.covered == (3, 55)  # never goes back
    assert not c.surveyed(c.activity, 70, 1, 1, True, 1)  # a message of the feed's subjects pending
    assert not c.surveyed(c.activity, 70, 0, 2, True, 1)  # the consumer delivered one not read yet
    assert not c.surveyed(mark - 1, 70, 0, 1, True, 1)  # a delivery was read while the survey ran
    assert c.source.covered == (3, 55)
    inside = consumer(Origin(7, 0, False))
    inside.new_consumer()
    assert not inside.surveyed(inside.activity, 90, 0, 0, True, 1)  # not while a message is partly handed over
    assert inside.source.covered == (0, 0)


def test_past_what_it_covered_retention_is_accepted_only_from_a_feed_caught_up_with_its_pull_waiting_since():
    """The stream's first sequence after the consumer's state: beyond what was covered, some of
    the removed messages might have been the feed's, unless it was caught up with a pull waiting
    (and nothing delivered) since it last knew itself covered."""
    idle = consumer(first=1, last=40)
    idle.new_consumer()
    idle.consumed(idle.deliver(reply(3, 1, pending=0)))  # caught up at 3, its pull still waiting
    assert idle.surveyed(idle.activity, 900, 0, 1, True, 401)  # a burst of others: nothing of ours could hide
    assert idle.source.covered == (3, 900)
    assert idle.surveyed(idle.activity, 1500, 0, 1, True, 1001)
    assert idle.source.covered == (3, 1500)

    lagging = consumer(first=1, last=40)
    lagging.new_consumer()
    lagging.consumed(lagging.deliver(reply(3, 1, pending=7)))  # more of ours were pending after 3
    assert not lagging.surveyed(lagging.activity, 900, 0, 1, True, 401)  # were some of 4..400 ours? unknown
    assert lagging.source.covered == (0, 0)
    assert lagging.surveyed(lagging.activity, 900, 0, 1, False, 4)  # nothing removed past 3: proved
    assert lagging.source.covered == (3, 900)
    assert not lagging.surveyed(lagging.activity, 1500, 0, 1, False, 1001)  # no pull waited since: unknown
    assert lagging.surveyed(lagging.activity, 1500, 0, 1, True, 901)  # within what it covered
    assert lagging.surveyed(lagging.activity, 2000, 0, 1, True, 1400)  # and from then on it waited


# ---- at a connection: where it starts, what the stream must still hold -------------------------------


def test_without_a_position_it_starts_per_start_and_says_so():
    fresh = Consumer(SPEC, "feed 'ticks'", SourceStats())
    notes = fresh.check_stream(5, 9)
    assert fresh.next == (5, 0) and fresh.source.next_seq == 5 and fresh.source.stream_last_seq == 9
    assert notes == [(logging.INFO, "feed 'ticks': no recorded position; starting at stream sequence 5 "
                                    "(\"start\": 'first')")]
    new = Consumer(JetStreamSpec(stream="TICKS", start="new"), "feed 'ticks'", SourceStats())
    new.check_stream(5, 9)
    assert new.next == (10, 0)


def test_a_restored_position_resumes_and_says_whose_it_is():
    c = Consumer(SPEC, "feed 'ticks'", SourceStats(), Resume(Origin(9, 1, False), "2026-12-01T12:00:00+00:00"))
    assert c.recorded_created == "2026-12-01T12:00:00+00:00"
    assert c.check_stream(3, 12) == [(logging.INFO, "feed 'ticks': resuming at stream sequence 9, after its first "
                                                    "2 elements (the checkpoint's position)")]


def test_retention_of_other_subjects_messages_loses_nothing_of_the_feeds_but_of_its_own_is_position_lost():
    c = consumer(first=1, last=40)
    c.new_consumer()
    c.consumed(c.deliver(reply(10, 1, pending=0)))
    assert c.surveyed(c.activity, 40, 0, 1, True, 1)  # handed over to 10; nothing of ours up to 40
    c.check_stream(41, 60)  # retention removed 1-40: none of them was ours, and 41 is the next needed
    with pytest.raises(PositionLost, match=r"its first sequence is 42, this run recorded 10 as the last applied "
                                           r"\(the next needed is 11, and none of its subjects' up to 40\)"):
        c.check_stream(42, 60)


def test_a_stream_that_ends_before_the_position_was_made_again():
    c = consumer(Origin(30, 0, True), last=40)
    with pytest.raises(PositionLost, match="ends at sequence 20, but the checkpoint recorded 30 as the last"):
        c.check_stream(1, 20)


def test_with_every_checkpoint_damaged_it_starts_fresh_only_where_the_stream_holds_everything_and_warns():
    c = Consumer(SPEC, "feed 'ticks'", SourceStats(), PositionUnknown("every checkpoint in /c is damaged"))
    notes = c.check_stream(1, 40)
    assert [level for level, _ in notes] == [logging.WARNING, logging.INFO]
    assert "every checkpoint in /c is damaged, but stream 'TICKS' holds every message from sequence 1" in notes[0][1]
    assert c.next == (1, 0)
    lost = Consumer(SPEC, "feed 'ticks'", SourceStats(), PositionUnknown("every checkpoint in /c is damaged"))
    with pytest.raises(PositionLost, match=r"may be gone from stream 'TICKS' \(its first sequence is 2\)"):
        lost.check_stream(2, 40)


# ---- a partitioned feed ---------------------------------------------------------------------------


def test_a_partitioned_feed_starts_at_its_lowest_position_and_skips_per_partition_what_each_holds():
    c = Consumer(PARTITIONED, "feed 'ticks'", SourceStats(), {0: Origin(10, 0, True), 1: Origin(4, 0, True)})
    assert c.next is None and c.from_checkpoint
    c.check_stream(1, 20)
    assert c.next == (5, 0) and c.floors_end == 12
    assert c.new_consumer() == 5
    in_state = c.deliver(reply(6, 1), b"ticks.0.a")  # partition 0's state holds up to 10
    assert in_state == Take(6, 5, partition=0, in_state=True) and c.source.skipped == 1
    c.consumed(in_state)
    assert c.next == (7, 0)
    assert c.deliver(reply(7, 2), b"ticks.1.b") == Take(7, 5, partition=1)  # partition 1 is past its position
    assert c.deliver(reply(11, 3), b"ticks.0.a") == Take(11, 5, partition=0)
    assert c.floors is not None
    assert c.deliver(reply(12, 4), b"ticks.1.b") == Take(12, 5, partition=1)
    assert c.floors is None  # past every partition's position: no more checks


def test_a_partition_without_a_recorded_position_starts_per_start():
    c = Consumer(PARTITIONED, "feed 'ticks'", SourceStats(), {0: Origin(10, 0, True)})
    c.check_stream(3, 20)
    assert c.floors == {0: (11, 0), 1: (3, 0)} and c.next == (3, 0)


def test_a_restored_position_inside_a_partitions_payload_skips_its_elements():
    c = Consumer(PARTITIONED, "feed 'ticks'", SourceStats(), {0: Origin(5, 0, False), 1: Origin(2, 0, True)})
    c.check_stream(1, 20)
    c.new_consumer()
    assert c.deliver(reply(3, 1), b"ticks.1.x") == Take(3, 5, partition=1)
    assert c.deliver(reply(5, 2), b"ticks.0.y") == Take(5, 5, partition=0, skip=1)


@dataclass
class _Decoded:
    seq: list[Any]
    stream: list[str]
    x: Any
    errors: list[tuple[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seq)


def test_an_element_of_another_partition_is_an_error_reply_before_the_decoders_own():
    c = consumer(spec=PARTITIONED)
    names = [f"s{i}" for i in range(12)]
    mine = [n for n in names if partition_of(escape_stream(n), 4) == 1]
    other = [n for n in names if partition_of(escape_stream(n), 4) != 1]
    streams = [mine[0], other[0], mine[1], other[1]]
    decoded = _Decoded([1, 2, 3, 4], streams, np.arange(8.0).reshape(4, 2), [("bad input", 9)])
    out = c.own_partition(decoded, 1)
    assert (out.seq, out.stream) == ([1, 3], [mine[0], mine[1]])
    assert np.array_equal(out.x, [[0.0, 1.0], [4.0, 5.0]])
    assert out.errors == [(FOREIGN_REASON, 2), (FOREIGN_REASON, 4), ("bad input", 9)]
    assert decoded.seq == [1, 2, 3, 4]  # the decoder's own object is left as it was
    whole = _Decoded([1], [mine[0]], np.zeros((1, 2)))
    assert c.own_partition(whole, 1) is whole


def test_a_partitioned_feeds_positions_in_a_resume_carry_the_recorded_created_time():
    c = Consumer(PARTITIONED, "feed 'ticks'", SourceStats(),
                 Resume({0: Origin(10, 0, True), 1: Origin(4, 0, True)}, "2026-12-01T12:00:00+00:00"))
    assert c.recorded_created == "2026-12-01T12:00:00+00:00" and c.from_checkpoint
    c.check_stream(1, 20)
    assert c.floors == {0: (11, 0), 1: (5, 0)} and c.next == (5, 0)


# ---- a restart behind the stream's first sequence (issue 54, item 11) ----------------------------------

FILTERED = JetStreamSpec(stream="TICKS", subject="ticks.a.>", results="scores")


def behind(spec: JetStreamSpec) -> Consumer:
    """A consumer restored at sequence 10 (the next needed: 11) of a stream that now holds 61..110."""
    return Consumer(spec, "feed 'ticks'", SourceStats(), Origin(10, 0, True))


def test_a_feed_of_the_whole_stream_behind_its_first_sequence_is_refused_retention_removed_its_messages():
    from forkless.io_loop.connectors.jetstream.consumer import Retention

    with pytest.raises(PositionLost, match="retention removed them"):
        behind(SPEC).check_stream(61, 110, retention=Retention(("ticks.>",)))
    whole = behind(JetStreamSpec(stream="TICKS", results="scores"))
    with pytest.raises(PositionLost, match="retention removed them"):  # no filter: every subject is the feed's
        whole.check_stream(61, 110)
    assert not whole.filtered_behind(61, 110)  # nothing the stream could say changes it


def test_a_filtered_feed_behind_the_first_sequence_says_what_is_known_until_the_stream_says_more():
    from forkless.io_loop.connectors.jetstream.consumer import Retention

    c = behind(FILTERED)
    with pytest.raises(PositionLost) as lost:
        c.check_stream(61, 110)
    assert c.filtered_behind(61, 110)  # the pump may read what the stream can tell, and ask again
    text = str(lost.value)
    for words in ("may have removed messages of 'ticks.a.>'", "the stream holds from sequence 61",
                  "its first sequence is 61, the checkpoint recorded 10 as the last applied",
                  "per-subject limits (max_msgs_per_subject)", "FORKLESS_CHECKPOINT_RESTORE=never"):
        assert words in text, text
    # stream-wide limits: the stream cannot tell more, the same refusal
    with pytest.raises(PositionLost, match=r"may have removed messages of 'ticks\.a\.>'"):
        c.check_stream(61, 110, retention=Retention(("ticks.>",)))


def test_a_stream_that_removes_by_subject_only_resumes_a_feed_none_of_whose_subjects_holds_its_limit():
    from forkless.io_loop.connectors.jetstream.consumer import Retention

    c = behind(FILTERED)
    notes = c.check_stream(61, 110, retention=Retention(("ticks.>",), True, 20, {"ticks.a.x": 3}))
    assert c.next == (11, 0)  # resumes at its position: the stream's next of ours comes after 61
    assert [level for level, _ in notes] == [logging.WARNING, logging.INFO]
    assert "retention removed only other subjects' messages" in notes[0][1]
    assert "resuming at stream sequence 11" in notes[1][1]


def test_a_subject_at_its_limit_on_a_stream_that_removes_by_subject_only_is_refused_naming_it():
    from forkless.io_loop.connectors.jetstream.consumer import Retention

    with pytest.raises(PositionLost) as lost:
        behind(FILTERED).check_stream(61, 110, retention=Retention(
            ("ticks.>",), True, 20, {"ticks.a.x": 3, "ticks.a.z": 20}, {"ticks.a.z": 91}))
    text = str(lost.value)
    assert "subject ticks.a.z holds its limit of 20 messages (max_msgs_per_subject), from sequence 91" in text, text
    assert "ticks.a.x" not in text and "FORKLESS_CHECKPOINT_RESTORE=never" in text, text
    with pytest.raises(PositionLost, match="may have removed"):  # its subjects' counts not read: not known
        behind(FILTERED).check_stream(61, 110, retention=Retention(("ticks.>",), True, 20, None))


@pytest.mark.parametrize(("pattern", "subject", "expected"), [
    ("ticks.>", "ticks.>", True), ("ticks.>", "ticks.a.b", True), ("ticks.>", "ticks", False),
    ("ticks.a.>", "ticks.>", False), ("ticks.*", "ticks.a", True), ("ticks.*", "ticks.*", True),
    ("ticks.a", "ticks.*", False), ("ticks.*", "ticks.>", False), (">", "anything.at.all", True),
    ("ticks.a", "ticks.a", True), ("ticks.a", "ticks.b", False),
])
def test_a_filter_covers_a_stream_subject_when_it_matches_everything_that_subject_does(pattern, subject, expected):
    from forkless.io_loop.connectors.jetstream.consumer import covers

    assert covers(pattern, subject) is expected
