"""Events-only controllers: the user's own sources hand the main loop events, and no processor runs.

Rules:
- Chosen explicitly, ``Controller(config, processor=forkless.EVENTS_ONLY, sources=[...], on_event=...)``, never
  guessed: nothing is compiled, no processor built, no device state exists, no demo feed's settings checked.
- What contradicts it is refused when the controller is built (``ValueError`` naming the argument or variable):
  sinks, no sources, a configured feed, checkpoints.
- Messages a source hands over anyway are never lost silently: counted in ``dropped`` ("no processor (events
  only)"), the first logged as an error naming the source and the fix.
- Nothing process-wide is changed for it: the switch interval is a step's need (bench/docs/exchange-session-cost.md).
- Handed what it checks, never the whole ``Config``; pure, no JAX. It is the "no processor" object the loop calls
  instead of ``BatchStep``: the loop never asks which one it has.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from forkless.controller.batching import Taken
from forkless.controller.settings.groups import CheckpointSettings
from forkless.controller.stats import MainStats

__all__ = ["EVENTS_ONLY_DROPPED", "NO_WEIGHTS", "DroppedMessages", "check_events_only"]

log = logging.getLogger("forkless.controller")

EVENTS_ONLY_DROPPED = "no processor (events only)"  # the reason in ``dropped``
EVENTS_ONLY = "processor=forkless.EVENTS_ONLY"  # how the choice is written, in the messages that name it
NO_WEIGHTS = ("set_weights(): an events-only controller runs no processor: the model your own loop runs takes its "
              "new weights itself (docs/embedding/weights.md)")


def check_events_only(checkpoints: CheckpointSettings, feed_variable: str, *, sinks: Sequence[Any],
                      sources: Sequence[Any], store: Any, bucket: str = "") -> None:
    """``ValueError`` naming what contradicts ``processor=forkless.EVENTS_ONLY`` (module rules), else nothing.
    ``feed_variable``: the variable that configures a feed (``Config.feed_variable``; "": none); ``bucket``: a
    partitioned feed's checkpoints' (FORKLESS_CHECKPOINT_BUCKET; "": none)."""
    fix = "give a processor (or leave processor out for the default detector) to run one"
    if sinks:
        raise ValueError(f"{EVENTS_ONLY} runs no processor, so there are no results for sinks=[...]: hand the "
                         f"events to on_event and leave sinks out, or {fix}")
    if not sources:
        raise ValueError(f"{EVENTS_ONLY} needs sources=[...]: the user's own sources hand over the events "
                         "(ctx.emit_event); without them the demo feed's messages would need a processor")
    if feed_variable:
        raise ValueError(f"{EVENTS_ONLY} runs only the user's own sources, and {feed_variable} configures a feed "
                         f"whose messages need a processor: unset {feed_variable}, or {fix}")
    if checkpoints.on or bucket or store is not None:
        which = ("Runtime(checkpoint_store=...)" if store is not None else
                 "FORKLESS_CHECKPOINT_DIR" if checkpoints.dir else "FORKLESS_CHECKPOINT_BUCKET")
        raise ValueError(f"{EVENTS_ONLY} keeps no state to checkpoint, and {which} is set: unset it, or {fix}")


class DroppedMessages:
    """The step of an events-only controller (module rules): a batch of messages is counted as
    dropped and the first is logged, naming its source; called as ``BatchStep`` is."""

    def __init__(self, stats: MainStats, names: Sequence[str]) -> None:
        self.stats = stats
        self.names = names  # each feed's name, by index
        self._logged = False

    def __call__(self, taken: Taken, deadline: float | None = None) -> None:
        n = len(taken)
        self.stats.dropped[EVENTS_ONLY_DROPPED] += n
        if not self._logged:
            self._logged = True
            sources = sorted({self.names[feed] for _, feed, _ in taken.runs})
            log.error("source %s handed over %d message(s) (ctx.emit, ctx.emit_rows), but the controller is events "
                      "only (processor=forkless.EVENTS_ONLY) and runs no processor: they are dropped, counted in "
                      "dropped (%r). Hand objects over with ctx.emit_event, or give the controller a processor "
                      "(logged once)",
                      ", ".join(map(repr, sources)), n, EVENTS_ONLY_DROPPED)
