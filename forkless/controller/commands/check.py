"""``python app.py --check``: the preflight an operator runs first on a new box.

It shows the configuration (secrets hidden), the JAX version, backend and devices; compiles
the step for every bucket (controller/device/compiled.py, the code the controller runs) and runs
each once; checks the metrics address can be bound and makes ONE connection to the feed
(io_loop/probe.py). Every step runs even when an earlier one failed, so one run lists every
problem. Exit statuses are those of controller/errors.py: 0 everything worked; 1 JAX,
compilation or the metrics address failed; 3 the feed is unreachable, refused the
handshake, or timed out; 2 bad configuration, decided before this runs except for a
FORKLESS_DEVICES beyond the devices JAX has, which only the compile step can see.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from forkless.controller.codec import Codec, JsonCodec
from forkless.controller.config import VARIABLES, Config
from forkless.controller.ioside import feed_sources
from forkless.controller.logs import program_line
from forkless.io_loop.decoding import FrameDecoder
from forkless.io_loop.errors import EXIT_CONFIG, EXIT_CRASH, EXIT_FEED, EXIT_OK, ConfigError
from forkless.io_loop.iosettings import IOSettings
from forkless.io_loop.kinds import connector_for
from forkless.io_loop.net.netaddr import redact_url
from forkless.io_loop.probe import ProbeFailed, check_metrics_addr, probe_feed
from forkless.io_loop.settings import as_text

__all__ = ["probe_feeds", "run_check"]


class _Failure(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def run_check(config: Config, processor: Any = None, codec: Codec | None = None, *,
              out: Callable[[str], None] | None = None) -> int:
    """Run every check, printing what it finds; return the exit status (see the module doc)."""
    say = out if out is not None else _print
    failures: list[_Failure] = []

    def step(title: str, fn: Callable[[], None], code: int = EXIT_CRASH) -> bool:
        say(f"{title}:")
        try:
            fn()
            return True
        except ProbeFailed as exc:
            failure = _Failure(code, str(exc))
        except _Failure as exc:
            failure = exc
        say(f"  FAILED: {failure.reason}")
        failures.append(failure)
        return False

    codec = codec if codec is not None else JsonCodec(config.step.features,
                                                      max_frame_items=config.limits.max_frame_items)
    say("forkless --check")
    step("configuration", lambda: _show_config(config, say))
    if step("JAX", lambda: _show_jax(say)):
        step("compiling the step", lambda: _compile(config, processor, say))
    if config.run.metrics_addr:
        step("metrics address", lambda: check_metrics_addr(config.run.metrics_addr, say))
    # a feed whose results a stream stores must drop a result published again after a restart: its duplicate
    # window must cover a checkpoint interval plus a restart (the feed's probe warns when it does not)
    window_s = 2 * config.checkpoints.every_s + 60
    step("feed", lambda: probe_feeds(config.io_settings(), codec, say, dedupe_window_s=window_s), code=EXIT_FEED)

    if failures:
        reasons = "; ".join(f.reason for f in failures)
        say(f"check FAILED: {reasons}")
        program_line(reasons, fmt=config.run.log_format, label="check failed", exit_status=failures[0].code)
        return failures[0].code
    say("check passed")
    return EXIT_OK


def _print(line: str) -> None:
    print(line, flush=True)


# ---- configuration ------------------------------------------------------------------------------


def probe_feeds(settings: IOSettings, codec: FrameDecoder, say: Callable[[str], None], *,
                dedupe_window_s: float = 180.0) -> None:
    """``--check``'s feed step: each feed's source, built as a run builds it (controller/ioside.py's
    ``feed_sources``), tries itself (io_loop/probe.py's ``probe_feed``); ``ProbeFailed`` if one fails."""
    probe_feed(settings.feed_specs, feed_sources(settings), codec, say, dedupe_window_s=dedupe_window_s)


def _show_config(config: Config, say: Callable[[str], None]) -> None:
    for var in VARIABLES:
        value = getattr(config, var.keyword)
        if var.keyword == "feeds" and value:
            shown = f"{len(config.feed_specs)} feeds: " + ", ".join(
                f"{feed.name}={feed.shown_url}" for feed in config.feed_specs) + " (subscribe, headers, tokens hidden)"
        elif var.secret:
            if not value:
                shown = "(unset)"
            elif isinstance(value, tuple):
                shown = f"<hidden: {', '.join(k for k, _ in value)}>"
            else:
                shown = "<hidden>"
        elif var.keyword == "ws_url":
            shown = redact_url(value) if value else "(unset)" if config.feed_variable else \
                "(unset: the embedded demo feed)"
        else:
            shown = as_text(value) or "(unset)"
        mark = "" if value == var.default else "   (not the default)"
        say(f"  {var.env:<28} {shown}{mark}")
    say(f"  batch sizes compiled: {','.join(map(str, config.buckets))}")
    for feed in config.feed_specs:  # what each feed's connector says of itself (a partitioned feed: its partitions)
        for line in connector_for(feed).describe(config.partitioning):
            say(f"  {line}")


# ---- JAX and compilation --------------------------------------------------------------------------


def _show_jax(say: Callable[[str], None]) -> None:
    # imported here, not at the top: a missing plugin or a bad JAX_PLATFORMS must become
    # this step's FAILED line, not an import crash before the configuration is shown
    try:
        import jax
        import jaxlib

        backend = jax.default_backend()
        devices = jax.devices()
    except Exception as exc:
        raise _Failure(EXIT_CRASH, f"JAX could not start: {type(exc).__name__}: {_first_line(exc)}") from None
    say(f"  jax {jax.__version__}, jaxlib {jaxlib.__version__}")
    say(f"  JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '') or '(unset)'}")
    say(f"  backend {backend}, {len(devices)} device(s): "
        + ", ".join(f"{d} ({d.device_kind})" for d in devices))
    cache = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # JAX_COMPILATION_CACHE_DIR, or set in jax.config
    if cache:
        say(f"  persistent compilation cache: {cache}")


def _compile(config: Config, processor: Any, say: Callable[[str], None]) -> None:
    # these import JAX: only after _show_jax proved it starts (see there)
    from forkless.controller.device.compiled import compilations
    from forkless.controller.engine import compile_step
    from forkless.controller.processor import default_processor

    try:
        processor = processor if processor is not None else default_processor(config)
        before = compilations()
        t0 = time.perf_counter()
        engine = compile_step(processor, config.step, on_compiled=lambda bucket, took: say(
            f"  batch size {bucket:>6}: compiled in {took * 1000:.0f} ms"))
        total_s = time.perf_counter() - t0
        made = compilations() - before
        say(f"  {len(config.buckets)} batch sizes in {total_s:.2f} s, {made} XLA compilations, on "
            f"{engine.describe()}")
        t0 = time.perf_counter()
        names = engine.output_names()  # every batch size once, on padding
        ran_s = time.perf_counter() - t0
        again = compilations() - before - made
    except ConfigError as exc:  # FORKLESS_DEVICES asks for more devices than JAX has
        raise _Failure(EXIT_CONFIG, str(exc)) from None
    except Exception as exc:
        raise _Failure(EXIT_CRASH, f"the step failed to compile or run: {type(exc).__name__}: "
                                   f"{_first_line(exc)}") from None
    say(f"  ran every batch size once on zeros in {ran_s * 1000:.1f} ms: outputs "
        f"{', '.join(names)}; {again} compilations after warm-up")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:200] + "…"
