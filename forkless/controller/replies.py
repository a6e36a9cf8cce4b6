"""Replies: what each message of a stepped batch gets back, under its feed's reply policy.

Rules:
- Each message gets exactly one of: a result frame, an error frame or no frame, counted as ``no_reply`` (a reply
  declined by the policy or by ``encode_error`` returning None is also counted in ``replies_declined`` by reason
  and logged once per reason). The books balance under every policy.
- A feed's policy (``FORKLESS_REPLIES``): ``all``; ``results``, no error frames; ``none``, nothing (results still
  reach ``OnResults``, the counters and the latency). Nothing is encoded that will not be sent.
- Frames keep arrival order; a batch that mixed feeds goes back as one ``Outgoing`` per feed, bundled.
- ``latency`` is receipt -> results handed over, for every result whatever the policy, one observation per chunk.
- Main thread only; no threads, no queues, no clock (the caller passes the times).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import groupby

import numpy as np

from forkless.controller.batching import Taken
from forkless.controller.codec import ENCODE_FAILED, GuardedCodec
from forkless.controller.stats import MainStats
from forkless.io_loop.counters import observe_hops
from forkless.io_loop.crossing import OUTBOUND, Outgoing, Trace

__all__ = ["MAX_LOGGED_REASONS", "NON_FINITE_REASON", "Replies", "split_by_feed"]

log = logging.getLogger("forkless.controller")

NON_FINITE_REASON = "processing produced a non-finite result (the stream starts again)"
MAX_LOGGED_REASONS = 1000  # declined replies: reasons logged (once each), then only counted


class Replies:
    """Encodes a batch's results and assembles its frames under each feed's reply policy
    (``policies``: one per feed, in the order of ``Config.feed_specs``)."""

    def __init__(self, codec: GuardedCodec, stats: MainStats, policies: Sequence[str], max_streams: int) -> None:
        self.codec = codec
        self.stats = stats
        self.policies = tuple(policies)
        # one policy for the whole batch when every feed has the same
        self._policy = self.policies[0] if len(set(self.policies)) == 1 else None
        self.too_many = f"too many streams (FORKLESS_MAX_STREAMS={max_streams})"
        # an error reply's reason -> its errors counter's (and replies_declined's) key
        self._counted_as = {self.too_many: "too many streams", NON_FINITE_REASON: "non-finite result"}
        self._declined_logged: set[str] = set()

    def policy_of(self, taken: Taken) -> str | None:
        """The reply policy of every message of the batch, or None when its feeds' policies differ."""
        if self._policy is not None:
            return self._policy
        if not taken.feeds_mixed:
            return self.policies[taken.first_feed]
        policies = {self.policies[feed] for _, feed, _ in taken.runs}
        return policies.pop() if len(policies) == 1 else None

    def encode(self, taken: Taken, rows: Sequence[int], seq: list, stream: list, outputs: dict[str, np.ndarray],
               policy: str | None) -> tuple[Sequence[int], list, bool]:
        """Encode the results of ``rows`` whose feeds want them: ``(encoded, answered, are_results)``,
        ``encoded`` the rows encoded and ``answered`` one frame (or None) each; ``are_results``
        False when the codec failed and ``answered`` holds "encode failed" error frames."""
        encoded: Sequence[int] = rows if policy != "none" else []  # "none": nothing is encoded
        if policy is None:  # feeds with different policies: encode only for those that want results
            policies = self.policies
            encoded = [i for i in rows if policies[taken.feed[i]] != "none"]
            if len(encoded) < len(rows):
                keep = [j for j, i in enumerate(rows) if policies[taken.feed[i]] != "none"]
                seq, stream = [seq[j] for j in keep], [stream[j] for j in keep]
                outputs = {k: v[keep] for k, v in outputs.items()}
        if not encoded:
            return encoded, [], False
        answered, are_results = self.codec.encode_batch(seq, stream, outputs, errors=policy != "results")
        if not are_results:
            self.stats.errors[ENCODE_FAILED] += len(encoded)
        return encoded, answered, are_results

    def assemble(self, taken: Taken, rows: Sequence[int], encoded: Sequence[int], answered: list,
                 are_results: bool, refused: dict[int, str],
                 policy: str | None) -> tuple[list, list[int], tuple[int, ...], Sequence[int]]:
        """The batch's frames in arrival order, their messages' receive times, the positions
        of the error frames, and each frame's message (its index in ``taken``). ``rows``: the
        messages with results; ``encoded``/``answered`` as ``encode`` returned them; ``refused``:
        message index -> error reason; ``policy``: the batch's (None: each message's feed's)."""
        if (policy == "all" or (policy == "results" and are_results)) and not refused and None not in answered:
            # the common case: one reply per message
            return (answered, taken.received_ns, () if are_results else tuple(range(len(answered))),
                    range(len(answered)))
        if policy == "none":  # nothing goes back and nothing was encoded: every message declined
            if rows:
                self.decline("result", len(rows), policy)
            for why, count in Counter(refused.values()).items():
                self.decline(self._counted_as.get(why, why), count, policy)
            return [], [], (), []
        reply = dict(zip(encoded, answered))
        policies = self.policies
        frames: list[str | bytes]
        frames, received, error_at, origin = [], [], [], []
        for i in range(len(taken)):
            replies = policy or policies[taken.feed[i]]
            reason = refused.get(i)
            if reason is not None:
                frame = self.codec.encode_error(reason, taken.seq[i]) if replies == "all" else None
                if frame is None:
                    self.decline(self._counted_as.get(reason, reason), 1, replies)
                    continue
                error_at.append(len(frames))
            elif i not in reply:  # not encoded: its feed's replies are "none"
                self.decline("result", 1, replies)
                continue
            else:
                frame = reply[i]
                if not are_results and (frame is None or replies != "all"):  # an "encode failed" error reply
                    self.decline(ENCODE_FAILED, 1, replies)
                    continue
                if frame is None:
                    self.stats.no_reply += 1  # the codec's choice
                    continue
                if not are_results:
                    error_at.append(len(frames))
            frames.append(frame)
            received.append(taken.received_ns[i])
            origin.append(i)
        return frames, received, tuple(error_at), origin

    def decline(self, reason: str, count: int, replies: str) -> None:
        """``count`` messages get no frame, by the feed's reply policy (``replies``) or, under
        ``all``, because ``encode_error`` returned None: counted, each reason logged once."""
        stats = self.stats
        stats.no_reply += count
        stats.replies_declined[reason] += count
        if reason not in self._declined_logged and len(self._declined_logged) < MAX_LOGGED_REASONS:
            self._declined_logged.add(reason)
            why = f"the feed's replies are {replies!r}" if replies != "all" else \
                "the codec's encode_error returned None"
            what = "results are" if reason == "result" else f"error replies for {reason!r} are"
            log.info("%s not sent (%s); counted in replies_declined and no_reply, logged once per reason", what, why)

    def observe_latency(self, taken: Taken, rows: Sequence[int], handed_ns: int) -> None:
        """``latency``: receipt -> results handed over, for each message of ``rows``; one
        observation per chunk (its messages share a receipt time and are consecutive in a
        batch), not per message: a chunk's piece of the batch (``Taken.runs``) is one
        ``observe_each``, and so is a run of equal receipts among ``rows``."""
        latency = self.stats.latency
        if isinstance(rows, range) and len(rows) == len(taken):  # every message: the chunks' runs
            start = 0
            for end, feed, arrived in taken.runs:
                latency[feed].observe_each((handed_ns - arrived) * 1e-9, end - start)
                start = end
            return
        received, feeds = [taken.received_ns[i] for i in rows], [taken.feed[i] for i in rows]
        if not taken.feeds_mixed:
            histogram = latency[taken.first_feed]
            for arrived, run in groupby(received):
                histogram.observe_each((handed_ns - arrived) * 1e-9, _length(run))
        else:
            for (feed, arrived), same in groupby(zip(feeds, received)):
                latency[feed].observe_each((handed_ns - arrived) * 1e-9, _length(same))

    def outgoing(self, taken: Taken, frames: list, received: list[int], error_at: tuple[int, ...],
                 origin: Sequence[int], sources: list | None) -> Outgoing | None:
        """The item to hand the IO thread (None: no frame for any feed). Sampled messages whose
        feed gets no frame end their trace here (``end_traces``)."""
        traces = taken.traces
        if not frames:
            self.end_traces(traces)  # nothing goes to the IO thread: the sampled messages end here
            return None
        if not taken.feeds_mixed:
            return Outgoing(frames, received, error_at, feed=taken.first_feed, traces=traces, origin=sources)
        # several feeds in one batch: each feed's replies go back on its own connection
        parts = split_by_feed(frames, received, error_at, [taken.feed[i] for i in origin], traces, sources)
        sent = {part.feed for part in parts}
        self.end_traces([trace for trace in traces if trace.feed not in sent])
        return parts[0] if len(parts) == 1 else Outgoing([], parts=tuple(parts))

    def end_traces(self, traces: list[Trace]) -> None:
        """Sampled messages whose batch sent their feed no frame: their trace ends at ``assemble``
        (the results handed over), observed here on the main thread's own hop histograms."""
        for trace in traces:
            observe_hops(self.stats.hops, trace.hops_s(OUTBOUND))


def split_by_feed(frames: list, received: list[int], error_at: tuple[int, ...],
                  feeds: list[int], traces: list[Trace], origin: list | None = None) -> list[Outgoing]:
    """One ``Outgoing`` per feed, each keeping its frames' order (``feeds``: each frame's feed),
    the sampled messages' traces of that feed and, from replayable feeds, each frame's ``origin``."""
    errors = set(error_at)
    by_feed: dict[int, list[int]] = {}
    for j, feed in enumerate(feeds):
        by_feed.setdefault(feed, []).append(j)
    return [Outgoing([frames[j] for j in picked], [received[j] for j in picked],
                     tuple(k for k, j in enumerate(picked) if j in errors), feed=feed,
                     traces=[trace for trace in traces if trace.feed == feed],
                     origin=None if origin is None else [origin[j] for j in picked])
            for feed, picked in by_feed.items()]


def _length(run: Iterator[object]) -> int:
    """How many items a ``groupby`` run holds."""
    return sum(1 for _ in run)
