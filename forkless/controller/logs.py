"""Logging set-up: text or one JSON object per line, and a flood guard for repeated warnings.

Rules:
- Standard ``logging`` only; everything goes to stderr (status lines go to stdout).
- ``RateLimitFilter`` lets the same message (logger, level, text) through once per ``window_s`` and counts the
  repeats, which the next one let through reports. Every thread's warnings pass through it before the handler's
  lock is taken: its memory is behind a lock of its own, re-entrant because a signal handler logs too. Records
  below WARNING never take it.
- Context such as the connection id travels as ``extra={"connection": n}``, a field in JSON lines; every JSON line
  carries forkless's ``version``.
- The program's own lines outside logging go through ``program_line``, so that in JSON mode every line on stderr
  is JSON.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from forkless import __version__

__all__ = ["JsonFormatter", "RateLimitFilter", "flush_log_repeats", "program_line", "setup_logging"]

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, logger, message, forkless's version, and any context fields."""

    converter = staticmethod(time.gmtime)  # the timestamp says Z: UTC

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "timestamp": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "version": __version__,
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                obj[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            obj["traceback"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False)


class RateLimitFilter(logging.Filter):
    """Lets the same WARNING-or-worse message through once per ``window_s`` (see module rules)."""

    def __init__(self, window_s: float = 10.0, max_keys: int = 1024) -> None:
        super().__init__()
        self.window_s = window_s
        self.max_keys = max_keys
        # key -> [when let through, repeats held back since, the first record's context fields], under _lock:
        # every thread's warnings count and forget keys here (tests/controller/test_thread_safety.py)
        self._seen: OrderedDict[tuple, list[Any]] = OrderedDict()
        self._lock = threading.RLock()

    def flush(self) -> list[tuple[tuple, int, dict[str, Any]]]:
        """Repeats still held back, as ``(key, count, context)`` (the context fields of the line they
        repeat: its feed and connection, say); the counts are reset."""
        with self._lock:
            held = [(key, int(entry[1]), entry[2]) for key, entry in self._seen.items() if entry[1]]
            for key, _, _ in held:
                self._seen[key][1] = 0
        return held

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.exc_info:
            return True
        key = (record.name, record.levelno, record.getMessage())
        with self._lock:
            now = time.monotonic()
            entry = self._seen.get(key)
            if entry is None:
                context = {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}
                self._seen[key] = [now, 0, context]
                if len(self._seen) > self.max_keys:
                    self._seen.popitem(last=False)
                return True
            self._seen.move_to_end(key)
            if now - entry[0] < self.window_s:
                entry[1] += 1
                return False
            suppressed = int(entry[1])
            entry[0], entry[1] = now, 0
        if suppressed:
            record.msg = f"{record.getMessage()} (repeated {suppressed} more times in the last {self.window_s:g}s)"
            record.args = ()
            record.repeated = suppressed
        return True


def setup_logging(level: str = "INFO", fmt: str = "text", stream: Any = None) -> logging.Handler:
    """Configure the root logger once for the program; returns the handler it installed."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RateLimitFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # third-party chatter stays at WARNING unless we debug. JAX's logger is not given a level before
    # JAX is imported (JAX would add a handler of its own and print each record twice): a filter on
    # our handler quiets it instead.
    for name in ("aiohttp", "asyncio"):
        logging.getLogger(name).setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)
    if level != "DEBUG":
        handler.addFilter(_below_warning_from(("jax", "jaxlib")))
    return handler


def program_line(message: str, *, fmt: str, level: int = logging.ERROR, label: str = "",
                 traceback: str = "", stream: Any = None, **fields: Any) -> None:
    """Write one of the program's own lines to stderr (module rules): ``forkless: <label>: <message>`` (``label``
    and its colon left out when empty) and ``traceback`` after it as text; with ``fmt="json"`` one JSON object
    (``JsonFormatter``'s, logger "forkless"), its message ``<label>: <message>``, ``traceback`` and ``fields``
    (the exit status, say) as fields."""
    out = stream or sys.stderr
    text = f"{label}: {message}" if label else message
    if fmt == "json":
        record = logging.LogRecord("forkless", level, "", 0, text, (), None)
        record.__dict__.update(fields)
        if traceback:
            record.__dict__["traceback"] = traceback
        print(JsonFormatter().format(record), file=out, flush=True)
        return
    print(f"forkless: {text}", file=out, flush=True)
    if traceback:
        print(traceback, end="" if traceback.endswith("\n") else "\n", file=out, flush=True)


def _below_warning_from(prefixes: tuple[str, ...]) -> Callable[[logging.LogRecord], bool]:
    def keep(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        name = record.name
        return not any(name == p or name.startswith(p + ".") for p in prefixes)

    return keep


def flush_log_repeats() -> None:
    """At the stop: say how many repeats of each held-back warning were never shown."""
    for handler in logging.getLogger().handlers:
        for flt in handler.filters:
            if isinstance(flt, RateLimitFilter):
                for (name, level, message), count, context in flt.flush():
                    logging.getLogger(name).log(level, "%s (repeated %d more times before the stop)",
                                                message, count, extra={**context, "repeated": count})
