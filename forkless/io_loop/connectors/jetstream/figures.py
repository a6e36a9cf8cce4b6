"""A JetStream feed's metric families (docs/jetstream.md, "Figures"), declared here in the room they describe:
each one's name, type, help and the figure it reads of a replayable feed's position (controller/stats.py's
``SourceFigures``); controller/metrics.py renders them, one sample per JetStream feed (none without one). Pure."""

from __future__ import annotations

from forkless.io_loop.connectors.connector import FigureFamily

__all__ = ["JETSTREAM_FAMILIES"]

JETSTREAM_FAMILIES: tuple[FigureFamily, ...] = (
    FigureFamily("forkless_jetstream_fetched", "counter", "Stream messages a JetStream feed fetched (a replay's "
                 "included).", "fetched"),
    FigureFamily("forkless_jetstream_applied", "counter", "Messages of a JetStream feed run through the step in this "
                 "process.", "applied"),
    FigureFamily("forkless_jetstream_applied_sequence", "gauge", "The last stream sequence whose every element the "
                 "state holds (a checkpoint records it).", "applied_seq"),
    FigureFamily("forkless_jetstream_confirmed_sequence", "gauge", "The stream sequence of the last reply the results "
                 "stream acknowledged.", "confirmed_seq"),
    FigureFamily("forkless_jetstream_lag", "gauge", "Stream messages not yet applied: the stream's last sequence "
                 "minus the last applied.", "lag"),
    FigureFamily("forkless_jetstream_skipped", "counter", "Deliveries at or below the position already consumed, not "
                 "applied again.", "skipped"),
    FigureFamily("forkless_jetstream_duplicate_replies", "counter", "Replies the results stream dropped as "
                 "duplicates (published again after a replay).", "duplicates"),
)
