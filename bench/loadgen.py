"""Loopback WebSocket load generator (server side) for the forkless benchmark.

Run it in its OWN process, so that it never shares a GIL with the client
under test::

    python -m bench.loadgen --host 127.0.0.1 --port 0 --mode rate \
        --rate 10000 --duration 10 --warmup-s 1

It prints ``LISTENING ws://HOST:PORT/`` (flushed) once listening (``--unix-socket PATH``: on that
unix socket instead, ``LISTENING ws+unix://...``, the address form of ``bench.unix``), serves
exactly ONE client connection (or ``--connections N``: N connections, each its
own run with its own ``--window``/``--rate``, for the several-feeds benchmark),
then prints ``RESULT <json>`` and exits. With N connections the RESULT sums the
counts and throughputs and lists each connection's own report under
``per_connection``.

Wire protocol (JSON text frames):

* sent to the client: ``{"seq": int, "stream": "s<k>", "x": [F floats]}``
* expected back: ``{"seq", "stream", "z", "score", "anomaly"}`` or
  ``{"error": str, "seq": int | null}``.

Rules: the measurement's, the same for every design (the generator in its own process):
* ``--mode rate`` (open loop). Message ``i`` is DUE at ``t0 + i / R``. The
  sender sends every message at, or as soon as possible after, its due time;
  when it falls behind it sends the backlog immediately, in bursts, and never
  skips a message. Sends happen on timer ticks (about 1 ms on Linux), each
  tick sending everything that is due.
* Latency of message ``i`` = (time its reply was received) - (its DUE time),
  both read from this process's ``time.perf_counter_ns``. Because the clock
  starts at the due time and not at the actual send, a sender (or a client
  that pushes back through TCP) that stalls cannot hide the delay: there is
  no coordinated omission. The sender's own lateness (send - due) is reported
  separately as ``send_lag_ms``; it is part of every latency and about the
  same for every client design (bounded by the ~1 ms timer tick when the
  generator keeps up). ``--spin-us N`` makes the sender busy-yield for the
  last N us before each due time: near-exact sends, at the cost of a busy
  loadgen core (off by default).
* Messages DUE within the first ``--warmup-s`` seconds are excluded from the
  latency statistics; replies received within the warm-up are excluded from
  the throughput.
* ``--mode window`` (closed loop). Exactly ``N`` messages are kept in flight:
  a new one is sent whenever a reply (result or error) arrives. The figure of
  merit is the sustained throughput, result replies per second received
  between the end of the warm-up and the end of ``--duration``. Its
  latency sample is the closed-loop round trip (reply - actual send), which
  is NOT free of coordinated omission (``latency_basis`` says which one).
* Every reply is accounted per ``seq``: a message that never gets a reply is
  ``missing``, a second reply for the same ``seq`` is a ``duplicate``, a reply
  with an unknown ``seq`` is ``unexpected``, a result whose stream does not
  match is ``mismatched``, an undecodable frame is ``malformed``. Nothing is
  dropped silently.
* After the last send the generator waits until every message sent has its reply, then
  reports: as soon as the last reply is in, at most ``--drain-s`` seconds (a bound for a
  client that lost a message or stopped answering, never a measurement window). A
  benchmark that counts on every message being answered passes a generous one
  (``bench.run``: ``DRAIN_S``), so a slow machine only makes the run end later.
* It always stops by itself: it exits if no client connects within
  ``--connect-timeout`` seconds (60 by default), and a run is capped at
  ``duration + drain_s + 30`` seconds (a SIGALRM backstop a few seconds later kills the
  process even if its event loop is wedged).

Payloads are pre-generated: a pool of frame bodies (stream name plus ``x``
vector, already JSON-encoded) is built up front, so the per-message work is
one bytes-format and one ``send_frame`` call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import queue
import signal
import subprocess
import sys
import threading
import time
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from aiohttp import WSMsgType, web

from bench.unix import start_site
from forkless.io_loop.jsontext import DECODE_ERRORS, dumps, loads

REPO_ROOT = Path(__file__).resolve().parent.parent

SAMPLE_MAX = 20_000
"""Largest number of latencies returned in ``latencies_ms_sample``."""

RUN_CAP_EXTRA_S = 30.0
"""A run is cancelled ``duration + drain_s + RUN_CAP_EXTRA_S`` seconds after connect."""

MAX_BURST = 256
"""Largest number of frames sent before yielding to the receiver."""

POOL_TARGET = 4096
"""Approximate number of distinct pre-generated frame bodies."""

_TEXT = WSMsgType.TEXT


@dataclass(frozen=True)
class Config:
    """Parsed command-line configuration of one load-generator run."""

    mode: str
    host: str
    port: int
    unix_socket: str
    rate: float
    window: int
    duration: float
    warmup_s: float
    streams: int
    features: int
    seed: int
    stream_order: str
    drain_s: float
    connect_timeout: float
    spin_us: float
    connections: int = 1


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse the command line into a :class:`Config`."""
    p = argparse.ArgumentParser(
        prog="python -m bench.loadgen",
        description="Loopback WebSocket load generator (serves one client run).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--unix-socket", default="", help="serve on this unix socket instead of TCP (bench.unix: the "
                   "LISTENING address is then ws+unix://...)")
    p.add_argument("--mode", choices=("rate", "window"), default="rate")
    p.add_argument("--rate", type=float, default=1000.0, help="msg/s (rate mode)")
    p.add_argument("--window", type=int, default=64, help="in flight (window mode)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of sending")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="seconds excluded from the stats (default: min(1, duration/5))",
    )
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-order", choices=("roundrobin", "random"), default="roundrobin")
    p.add_argument("--drain-s", type=float, default=3.0,
                   help="after the last send, wait until every reply is in, at most this long")
    p.add_argument("--connect-timeout", type=float, default=60.0)
    p.add_argument("--connections", type=int, default=1, help="serve this many connections, one run each")
    p.add_argument(
        "--spin-us",
        type=float,
        default=0.0,
        help="rate mode: busy-yield the last N us before a due time (0: timer only)",
    )
    a = p.parse_args(argv)

    warmup = min(1.0, a.duration / 5.0) if a.warmup_s is None else a.warmup_s
    if a.duration <= 0:
        p.error("--duration must be > 0")
    if not 0 <= warmup < a.duration:
        p.error("--warmup-s must be >= 0 and < --duration")
    if a.mode == "rate" and a.rate <= 0:
        p.error("--rate must be > 0")
    if a.mode == "window" and a.window < 1:
        p.error("--window must be >= 1")
    if a.streams < 1 or a.features < 1:
        p.error("--streams and --features must be >= 1")
    if a.connections < 1:
        p.error("--connections must be >= 1")
    return Config(
        mode=a.mode,
        host=a.host,
        port=a.port,
        unix_socket=a.unix_socket,
        rate=a.rate,
        window=a.window,
        duration=a.duration,
        warmup_s=warmup,
        streams=a.streams,
        features=a.features,
        seed=a.seed,
        stream_order=a.stream_order,
        drain_s=a.drain_s,
        connect_timeout=a.connect_timeout,
        spin_us=max(0.0, a.spin_us),
        connections=a.connections,
    )


class Payloads:
    """Pre-generated frame bodies; frame ``i`` uses body ``i % size``.

    A body is everything after the seq: ``,"stream":"s3","x":[...]}``. For
    round-robin order the pool size is a multiple of the stream count, so
    message ``i`` goes to stream ``i % streams``.
    """

    def __init__(self, streams: int, features: int, seed: int, order: str) -> None:
        rng = np.random.default_rng(seed)
        size = streams * max(1, math.ceil(POOL_TARGET / streams))
        if order == "roundrobin":
            stream_idx = np.arange(size) % streams
        else:
            stream_idx = rng.integers(0, streams, size)
        xs = rng.standard_normal((size, features)).round(5)
        self.size = size
        self.stream_names: list[str] = [f"s{int(k)}" for k in stream_idx]
        self.bodies: list[bytes] = [
            b',"stream":"%s","x":%s}' % (name.encode(), dumps(x.tolist()))
            for name, x in zip(self.stream_names, xs, strict=True)
        ]

    def frame(self, seq: int) -> bytes:
        """The full JSON frame of message ``seq`` (not used on the hot path)."""
        return b'{"seq":%d%s' % (seq, self.bodies[seq % self.size])


def _zeros(n: int) -> array:
    return array("q", bytes(8 * n))


class Run:
    """State and logic of one client run (one WebSocket connection)."""

    def __init__(self, cfg: Config, payloads: Payloads) -> None:
        self.cfg = cfg
        self.payloads = payloads
        if cfg.mode == "rate":
            self.planned = max(1, math.ceil(cfg.rate * cfg.duration))
            capacity = self.planned
        else:
            self.planned = -1  # open-ended
            capacity = max(4 * cfg.window, 65_536)
        self.capacity = capacity
        # Per-seq bookkeeping. recv_ns[i] == 0 means "no reply yet".
        self.send_ns = _zeros(capacity)
        self.recv_ns = _zeros(capacity)
        self.err_flag = bytearray(capacity)
        self.t0 = 0
        self.sent = 0
        self.answered = 0  # seqs with a first reply (result or error)
        self.errors = 0  # error frames (including those with seq null)
        self.duplicates = 0
        self.unexpected = 0
        self.mismatched = 0
        self.malformed = 0
        self.sending_done = False
        self.client_closed = False
        self.send_failed: str | None = None
        self.timed_out = False
        self.end_ns = 0
        self.done = asyncio.Event()

    # -- bookkeeping -------------------------------------------------------
    def _grow(self) -> None:
        extra = self.capacity
        self.send_ns.extend(_zeros(extra))
        self.recv_ns.extend(_zeros(extra))
        self.err_flag.extend(bytes(extra))
        self.capacity += extra

    def _check_done(self) -> None:
        if self.sending_done and self.answered >= self.sent:
            self.done.set()

    # -- receiving ---------------------------------------------------------
    async def receive(self, ws: web.WebSocketResponse) -> None:
        """Read replies until the connection closes; account every one."""
        now_ns = time.perf_counter_ns
        recv_ns = self.recv_ns
        err_flag = self.err_flag
        names = self.payloads.stream_names
        size = self.payloads.size
        window = self.cfg.mode == "window"
        async for msg in ws:
            t = now_ns()
            if msg.type is not _TEXT and msg.type is not WSMsgType.BINARY:
                continue
            try:
                obj = loads(msg.data)
            except DECODE_ERRORS:
                self.malformed += 1
                continue
            if type(obj) is not dict:
                self.malformed += 1
                continue
            is_err = "error" in obj
            if is_err:
                self.errors += 1
            seq = obj.get("seq")
            if type(seq) is not int or not 0 <= seq < self.sent:
                if not (is_err and seq is None):
                    self.unexpected += 1
                continue
            if recv_ns[seq]:
                self.duplicates += 1
                continue
            recv_ns[seq] = t
            self.answered += 1
            if is_err:
                err_flag[seq] = 1
            elif obj.get("stream") != names[seq % size]:
                self.mismatched += 1
            if window and not self.sending_done and self.send_failed is None:
                await self._send_next(ws, t)
            self._check_done()
        # The loop ends only when the client closed the connection.
        self.client_closed = True
        self.done.set()

    # -- sending -----------------------------------------------------------
    async def _send_next(self, ws: web.WebSocketResponse, t: int) -> None:
        i = self.sent
        if i >= self.capacity:
            self._grow()
        self.send_ns[i] = t
        self.sent = i + 1
        try:
            await ws.send_frame(
                b'{"seq":%d%s' % (i, self.payloads.bodies[i % self.payloads.size]),
                _TEXT,
            )
        except (ConnectionError, RuntimeError) as exc:
            self.send_failed = repr(exc)

    async def send_rate(self, ws: web.WebSocketResponse) -> None:
        """Open-loop sender: message i is due at t0 + i/R; backlog is burst out."""
        rate = self.cfg.rate
        n = self.planned
        t0 = self.t0
        ns_per_msg = 1e9 / rate
        bodies = self.payloads.bodies
        size = self.payloads.size
        send_ns = self.send_ns
        send_frame = ws.send_frame
        now_ns = time.perf_counter_ns
        i = 0
        try:
            while i < n:
                now = now_ns()
                due_count = min(n, int((now - t0) / ns_per_msg) + 1, i + MAX_BURST)
                while i < due_count:
                    send_ns[i] = now_ns()
                    self.sent = i + 1
                    await send_frame(b'{"seq":%d%s' % (i, bodies[i % size]), _TEXT)
                    i += 1
                if i >= n:
                    break
                await self._sleep_until(t0 + i * ns_per_msg)
        except (ConnectionError, RuntimeError) as exc:
            self.send_failed = repr(exc)

    async def _sleep_until(self, target_ns: float) -> None:
        """Sleep until ``target_ns``; always yields to the loop at least once.

        asyncio timers wake up to ~1 ms late (epoll has ms granularity). With
        ``--spin-us S`` the timer aims S us early and the rest is spent
        yielding (``sleep(0)``), trading loadgen CPU for send precision.
        """
        spin_ns = self.cfg.spin_us * 1000.0
        now_ns = time.perf_counter_ns
        delay_ns = target_ns - now_ns()
        if delay_ns <= 0:
            await asyncio.sleep(0)
            return
        while delay_ns > 0:
            if delay_ns > spin_ns:
                await asyncio.sleep((delay_ns - spin_ns) / 1e9)
            else:
                await asyncio.sleep(0)
            delay_ns = target_ns - now_ns()

    async def send_window(self, ws: web.WebSocketResponse) -> None:
        """Closed-loop start: fill the window; the receiver keeps it full."""
        now = time.perf_counter_ns()
        for _ in range(self.cfg.window):
            if self.send_failed is not None or self.sending_done:
                break
            await self._send_next(ws, now)
        end = self.t0 + int(self.cfg.duration * 1e9)
        await asyncio.sleep(max(0.0, (end - time.perf_counter_ns()) / 1e9))

    # -- orchestration -----------------------------------------------------
    async def run(self, ws: web.WebSocketResponse) -> None:
        """Send for ``duration`` seconds, then wait up to ``drain_s`` for replies."""
        self.t0 = time.perf_counter_ns()
        receiver = asyncio.create_task(self.receive(ws))
        try:
            if self.cfg.mode == "rate":
                await self.send_rate(ws)
            else:
                await self.send_window(ws)
            self.sending_done = True
            self._check_done()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), self.cfg.drain_s)
        finally:
            self.sending_done = True
            self.end_ns = time.perf_counter_ns()
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver

    # -- report ------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Build the RESULT dictionary from the per-seq bookkeeping."""
        cfg = self.cfg
        n = self.sent
        send = np.frombuffer(self.send_ns, dtype=np.int64, count=n)
        recv = np.frombuffer(self.recv_ns, dtype=np.int64, count=n)
        err = np.frombuffer(self.err_flag, dtype=np.uint8, count=n).astype(bool)
        got = recv != 0
        ok = got & ~err
        t0 = self.t0
        warm_end = t0 + int(cfg.warmup_s * 1e9)
        meas_end = t0 + int(cfg.duration * 1e9)
        meas_s = cfg.duration - cfg.warmup_s
        ok_in_window = ok & (recv >= warm_end) & (recv < meas_end)

        result: dict[str, Any] = {
            "mode": cfg.mode,
            "sent": n,
            "answered": int(got.sum()),
            "errors": self.errors,
            "missing": int(n - got.sum()),
            "duplicates": self.duplicates,
            "unexpected": self.unexpected,
            "mismatched": self.mismatched,
            "malformed": self.malformed,
            "throughput_msg_s": float(ok_in_window.sum() / meas_s),
        }
        if cfg.mode == "rate":
            idx = np.arange(n, dtype=np.float64)
            due = t0 + (idx * (1e9 / cfg.rate)).astype(np.int64)
            measured = due >= warm_end
            lat_ms = (recv[measured & ok] - due[measured & ok]) / 1e6
            lag_ms = (send - due) / 1e6
            last_send_s = (send[-1] - t0) / 1e9 if n else 0.0
            result["latency_ms"] = _summary(lat_ms)
            result["send_lag_ms"] = _summary(lag_ms)
            result["measured"] = int(measured.sum())
            result["measured_missing"] = int((measured & ~got).sum())
            result["achieved_send_rate"] = float(n / (last_send_s + 1.0 / cfg.rate)) if n else 0.0
            result["latency_basis"] = "due"
        else:
            sent_in_window = (send >= warm_end) & (send < meas_end)
            lat_ms = (recv[ok_in_window] - send[ok_in_window]) / 1e6
            result["rtt_ms"] = _summary(lat_ms)
            result["achieved_send_rate"] = float(sent_in_window.sum() / meas_s)
            result["latency_basis"] = "send"
        result["latencies_ms_sample"] = _sample(lat_ms, cfg.seed)
        result["planned"] = self.planned if self.planned >= 0 else None
        result["elapsed_s"] = ((self.end_ns or time.perf_counter_ns()) - t0) / 1e9
        result["client_closed_early"] = self.client_closed
        result["send_failed"] = self.send_failed
        result["timed_out"] = self.timed_out
        result["config"] = asdict(cfg)
        return result


SUMMED = ("sent", "answered", "errors", "missing", "duplicates", "unexpected", "mismatched", "malformed",
          "throughput_msg_s")


def _combined(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The RESULT of several connections: counts and throughputs summed, each report kept
    (without its latency sample) under ``per_connection``."""
    out: dict[str, Any] = {"mode": reports[0].get("mode"), "connections": len(reports)}
    for key in SUMMED:
        out[key] = sum(r.get(key, 0) for r in reports)
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        out["error"] = "; ".join(errors)
    out["per_connection"] = [{k: v for k, v in r.items() if k != "latencies_ms_sample"} for r in reports]
    return out


def _summary(ms: np.ndarray) -> dict[str, float | None]:
    if ms.size == 0:
        return {"p50": None, "p99": None, "p999": None, "max": None, "mean": None}
    p50, p99, p999 = np.percentile(ms, [50.0, 99.0, 99.9])
    return {
        "p50": round(float(p50), 4),
        "p99": round(float(p99), 4),
        "p999": round(float(p999), 4),
        "max": round(float(ms.max()), 4),
        "mean": round(float(ms.mean()), 4),
    }


def _sample(ms: np.ndarray, seed: int) -> list[float]:
    """Up to SAMPLE_MAX latencies, a seeded random subset kept in seq order."""
    if ms.size > SAMPLE_MAX:
        rng = np.random.default_rng(seed)
        ms = ms[np.sort(rng.choice(ms.size, SAMPLE_MAX, replace=False))]
    return [round(float(v), 4) for v in ms]


class LoadgenServer:
    """aiohttp server that accepts ``cfg.connections`` WebSocket clients (one by default) and
    runs one :class:`Run` on each; ``result`` is set when every run has reported."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.payloads = Payloads(cfg.streams, cfg.features, cfg.seed, cfg.stream_order)
        self.connected = asyncio.Event()
        self.result: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._taken = 0
        self._reports: list[dict[str, Any]] = []

    def _report(self, report: dict[str, Any]) -> None:
        self._reports.append(report)
        if len(self._reports) == self.cfg.connections and not self.result.done():
            self.result.set_result(report if self.cfg.connections == 1 else _combined(self._reports))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self._taken >= self.cfg.connections:
            return web.Response(status=409, text="load generator already serving a run\n")
        self._taken += 1
        ws = web.WebSocketResponse(
            compress=False,
            autoping=True,
            heartbeat=None,
            timeout=2.0,
            decode_text=False,
        )
        await ws.prepare(request)
        if self._taken == self.cfg.connections:
            self.connected.set()
        cap_s = self.cfg.duration + self.cfg.drain_s + RUN_CAP_EXTRA_S
        _arm_alarm(cap_s + 10.0)
        run = Run(self.cfg, self.payloads)
        gc.collect()
        gc.freeze()
        gc.disable()  # no collector pauses inside the measurement
        try:
            await asyncio.wait_for(run.run(ws), cap_s)
        except TimeoutError:
            run.timed_out = True
        except Exception as exc:  # report it; never leave the orchestrator hanging
            if not self.result.done():
                self.result.set_result({"mode": self.cfg.mode, "error": repr(exc)})
        finally:
            if len(self._reports) + 1 == self.cfg.connections:
                gc.enable()
        self._report(run.report())
        with contextlib.suppress(Exception):
            await ws.close()
        return ws


def _arm_alarm(seconds: float) -> None:
    """Backstop: SIGALRM (default action: terminate) if the loop gets wedged."""
    if hasattr(signal, "alarm"):
        signal.alarm(max(1, math.ceil(seconds)))


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def serve(cfg: Config) -> int:
    """Listen, serve one run, print LISTENING and RESULT lines; return exit code."""
    server = LoadgenServer(cfg)
    app = web.Application()
    app.router.add_get("/", server.handle)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    if cfg.unix_socket:
        address = await start_site(runner, cfg.host, cfg.unix_socket)
    else:
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        port = runner.addresses[0][1]
        address = f"ws://{f'[{cfg.host}]' if ':' in cfg.host else cfg.host}:{port}/"
    _arm_alarm(cfg.connect_timeout + 10.0)
    _emit(f"LISTENING {address}")
    rc = 0
    try:
        try:
            await asyncio.wait_for(server.connected.wait(), cfg.connect_timeout)
        except TimeoutError:
            result: dict[str, Any] = {
                "mode": cfg.mode,
                "error": f"no client connected within {cfg.connect_timeout:g} s",
            }
            rc = 2
        else:
            result = await server.result
            if "error" in result:
                rc = 1
        _emit("RESULT " + dumps(result).decode())
    finally:
        await runner.cleanup()
    return rc


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    return asyncio.run(serve(cfg))


# -- helpers for the orchestrator / tests -----------------------------------


class LoadgenProcess(subprocess.Popen):  # type: ignore[type-arg]
    """A Popen whose stdout lines are pumped into ``lines`` by a daemon thread."""

    lines: queue.Queue[str | None]


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)  # EOF


def _next_line(proc: LoadgenProcess, prefix: str, deadline: float) -> str:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"loadgen: no {prefix!r} line in time")
        try:
            line = proc.lines.get(timeout=remaining)
        except queue.Empty:
            raise TimeoutError(f"loadgen: no {prefix!r} line in time") from None
        if line is None:
            rc = proc.wait()
            raise RuntimeError(f"loadgen exited (rc={rc}) before printing {prefix!r}")
        if line.startswith(prefix):
            return line[len(prefix) :].strip()


def start_loadgen(args: list[str], timeout: float = 30.0) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    """Start ``python -m bench.loadgen ARGS`` in its own process.

    Returns ``(proc, ws_url)`` once the LISTENING line has been read. Pass
    ``--port 0`` (the default) to get a free port.
    """
    proc = LoadgenProcess(
        [sys.executable, "-m", "bench.loadgen", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    proc.lines = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=_pump, args=(proc.stdout, proc.lines), daemon=True).start()
    try:
        url = _next_line(proc, "LISTENING ", time.monotonic() + timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


def wait_result(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:  # type: ignore[type-arg]
    """Read the RESULT line of a process from :func:`start_loadgen`; reap it.

    Raises TimeoutError (after killing the process) if none comes in time.
    """
    if not isinstance(proc, LoadgenProcess):
        raise TypeError("wait_result needs a process started by start_loadgen")
    try:
        payload = _next_line(proc, "RESULT ", time.monotonic() + timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    result: dict[str, Any] = loads(payload)
    return result


if __name__ == "__main__":
    sys.exit(main())
