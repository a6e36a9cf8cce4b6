"""How the tests run the program and wait on it: in process (``drive``) or as a subprocess
(``AppProcess``, ``run_app``), every wait bounded by a scaled timeout.

Rules:
- Timeouts are a unit: ``UNIT_S`` is one second times ``FORKLESS_TEST_TIMEOUT_SCALE``
  (default 1), as the websockets project does it, so a slow machine raises one number
  instead of flaking. A bound that is itself the behaviour under test (a shutdown
  deadline, "exits within 2 s") is written as ``n * UNIT_S`` too: the same at scale 1.
- Wait on an event where there is one (``LoopbackServer.wait_for``, ``AppProcess.wait_for_line``);
  ``drive`` must poll, because the main thread is what makes the controller progress;
  ``wait_until`` is for the few conditions with no event to wait on (stats of another thread).
- Every wait fails with a message that says what it waited for and what it saw.
- The app always runs with ``JAX_PLATFORMS=cpu`` and with only the ``FORKLESS_*`` variables
  the test gives it: the caller's own are removed, so a developer's shell cannot change a test.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "BACKOFF_SEED",
    "KILLED_EXIT_S",
    "ROOT",
    "TIMEOUT_SCALE",
    "UNIT_S",
    "AppProcess",
    "AppResult",
    "app_env",
    "drive",
    "run_app",
    "wait_until",
]

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_SCALE = float(os.environ.get("FORKLESS_TEST_TIMEOUT_SCALE", "1"))
UNIT_S = 1.0 * TIMEOUT_SCALE
# how long a process sent SIGKILL is waited for: it always exits, so this only bounds a hang; on a
# saturated machine a killed JAX process took over 10 s to be reaped (one core, 2026-12-04)
KILLED_EXIT_S = 60 * UNIT_S
BACKOFF_SEED = 0  # the seed of every Backoff built without an rng in a test (conftest.seeded_backoff)
# a persistent JAX compilation cache shared by every app subprocess of the session (set by
# conftest.shared_jax_cache): the same steps are compiled once instead of in every subprocess.
# None: no shared cache. A test that sets JAX_COMPILATION_CACHE_DIR itself keeps its own.
SHARED_JAX_CACHE: str | None = None
# its size bound: far above what a run writes (~7 MB); that there is one makes JAX lock the
# directory around each read and write (conftest.shared_jax_cache)
SHARED_JAX_CACHE_BYTES = 2**30 if importlib.util.find_spec("filelock") else -1  # -1: no bound, no lock


# ---- waiting --------------------------------------------------------------------------------------


def drive(ctl: Any, until: Callable[[], bool], *, timeout_s: float, what: str, step_s: float = 0.05) -> None:
    """Call ``ctl.process_pending(timeout=step_s)`` in this (the main) thread until ``until()``
    holds; fail naming ``what`` (and the controller's stats) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.1f}s: {what}; stats: {ctl.stats()}")
        ctl.process_pending(timeout=step_s)


def wait_until(condition: Callable[[], bool], *, timeout_s: float, what: str, poll_s: float = 0.01) -> None:
    """Poll ``condition()`` until it holds; for conditions no event announces."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.1f}s: {what}")
        time.sleep(poll_s)


# ---- the app as a subprocess ---------------------------------------------------------------------


def app_env(overrides: Mapping[str, str] | None = None, *, shared_cache: bool = True) -> dict[str, str]:
    """This process's environment without any ``FORKLESS_*`` variable, with
    ``JAX_PLATFORMS=cpu`` (and ``JAX_COMPILATION_CACHE_DIR=SHARED_JAX_CACHE`` where set and
    ``shared_cache``), then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKLESS_")}
    env["JAX_PLATFORMS"] = "cpu"
    if shared_cache and SHARED_JAX_CACHE and "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = SHARED_JAX_CACHE
        env["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(SHARED_JAX_CACHE_BYTES)
    env.update(overrides or {})
    return env


class AppResult(NamedTuple):
    """How a run ended (the attribute names of ``subprocess.CompletedProcess``)."""

    returncode: int
    stdout: str
    stderr: str
    exited_at: float  # time.monotonic() when the exit was seen


@contextlib.contextmanager
def _hangup_default() -> Iterator[None]:
    """The app starts with SIGHUP at its default, as under a terminal or a service manager, even where
    the suite itself runs under ``nohup`` (an ignored signal stays ignored across exec, and the app then
    leaves SIGHUP ignored, as documented: tests/program/test_signals.py). Main thread only, as
    signal.signal; elsewhere the child inherits what this process has."""
    hup = getattr(signal, "SIGHUP", None)
    if hup is None or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(hup) is not signal.SIG_IGN:
        yield
        return
    signal.signal(hup, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(hup, signal.SIG_IGN)


class AppProcess:
    """``python app.py ARGS`` (or ``python PROGRAM…``) as a subprocess in the repository root.

    Threads read stdout and stderr line by line as they come, so a test can wait for a line
    (``wait_for_line``) while the app runs, then signal it, then ``finish``. Use it as a context
    manager (or the ``app`` fixture): a process still running at the end is killed.
    """

    def __init__(self, *args: str, env: Mapping[str, str] | None = None,
                 program: Sequence[str] = ("app.py",)) -> None:
        self.argv = [sys.executable, *program, *args]
        # the benchmark manages its own caches (a cold start is one of its figures)
        bench = len(program) > 1 and program[0] == "-m" and program[1].startswith("bench.")
        self.env = app_env(env, shared_cache=not bench)
        self.proc: subprocess.Popen[str] | None = None
        self._lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._cond = threading.Condition()
        self._readers: list[threading.Thread] = []

    def start(self) -> AppProcess:
        with _hangup_default():
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
        for name, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            reader = threading.Thread(target=self._read, args=(name, pipe), name=f"app-{name}", daemon=True)
            reader.start()
            self._readers.append(reader)
        return self

    def __enter__(self) -> AppProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def _read(self, name: str, pipe: Any) -> None:
        for line in pipe:
            with self._cond:
                self._lines[name].append(line)
                self._cond.notify_all()
        with self._cond:
            self._lines[name].append("")  # end of stream
            self._cond.notify_all()

    @property
    def stdout(self) -> str:
        with self._cond:
            return "".join(self._lines["stdout"])

    @property
    def stderr(self) -> str:
        with self._cond:
            return "".join(self._lines["stderr"])

    def wait_for_line(self, pattern: str | re.Pattern[str], *, stream: str = "stdout", timeout_s: float) -> str:
        """The first line of ``stream`` matching ``pattern`` (``re.search``), waiting for it;
        fails at once if the stream ends first, or after ``timeout_s``."""
        regex = re.compile(pattern)
        lines = self._lines[stream]
        found: list[str] = []

        def seen() -> bool:
            found[:] = [line for line in lines if line and regex.search(line)][:1]
            return bool(found) or (bool(lines) and lines[-1] == "")

        with self._cond:
            self._cond.wait_for(seen, timeout_s)
        if not found:
            how = "the app closed its " + stream if lines and lines[-1] == "" else f"not within {timeout_s:.1f}s"
            raise AssertionError(f"no line matching {regex.pattern!r} on {stream} ({how})\n"
                                 f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}")
        return found[0]

    def signal(self, sig: int) -> float:
        """Send ``sig``; returns when it was sent (time.monotonic())."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        return time.monotonic()

    def finish(self, timeout_s: float) -> AppResult:
        """Wait for the exit and all output; on timeout kill it and fail with its output."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the app did not exit within {timeout_s:.1f}s\n"
                                 f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}") from None
        exited_at = time.monotonic()
        for reader in self._readers:
            reader.join(timeout_s)
        return AppResult(code, self.stdout, self.stderr, exited_at)

    def kill(self) -> None:
        """Kill it if it still runs; callable more than once."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for reader in self._readers:
            reader.join(5)


def run_app(*args: str, env: Mapping[str, str] | None = None, program: Sequence[str] = ("app.py",),
            timeout_s: float = 180 * UNIT_S) -> AppResult:
    """Run the app to its end (see ``AppProcess``); fails if it runs past ``timeout_s`` (a backstop
    for a hang, set for a loaded machine: a start-up there has taken 50 s)."""
    with AppProcess(*args, env=env, program=program) as app:
        return app.finish(timeout_s)


def quick_config(**changes: Any) -> Any:
    """A ``Config`` for the in-process tests of a feed or a source: 4 features, small tables and
    queues, no heartbeat or status line, quick reconnects and a 5 s stop; ``changes`` on top."""
    from forkless import Config

    base: dict[str, Any] = dict(features=4, max_batch=16, max_streams=64, max_wait_ms=1.0, queue_size=64,
                                heartbeat_s=0.0, connect_timeout_s=2.0, reconnect_min_s=0.05, reconnect_max_s=0.2,
                                shutdown_timeout_s=5.0, status_s=0.0)
    base.update(changes)
    return Config(**base)


def assert_books_balance(ctl: Any) -> None:
    """Every received message is accounted for, exactly (call after the controller stopped):
    ``messages_in = results + error replies + no reply + dropped``, nothing left unanswered."""
    s = ctl.stats()
    assert s.unanswered == 0 and s.messages_in == s.messages_out + s.answer_errors_out + s.no_reply + s.dropped_total, (
        f"the books do not balance: in {s.messages_in} = results {s.messages_out} + error replies "
        f"{s.answer_errors_out} + no reply {s.no_reply} + dropped {s.dropped_total} {s.dropped} "
        f"+ unanswered {s.unanswered}")
