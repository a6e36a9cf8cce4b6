"""Embedded demo feed: a loopback WebSocket server that streams synthetic sensor data.

Without ``FORKLESS_WS_URL`` the IO thread runs a ``DemoFeed`` on its own loop and points the WebSocket client at it,
so the whole pipeline is exercised end to end, and the feed tells how well the detector caught what it planted.

Rules:
* Loopback only: ``host`` is a literal loopback address, the port the OS's, the path ``/feed``. With ``unix_socket``
  it listens there instead (a live server's socket is never taken over; the file is removed at ``stop()``) and its
  URL is ``ws://localhost/feed``.
* Wire protocol (JSON text frames): feed -> client ``{"seq": int, "stream": str, "x": [F floats]}``; client -> feed,
  one reply per message, ``{"seq", "stream", "z", "score", "anomaly"}`` or ``{"error": str, "seq": int | null}``.
* ``seq`` is global and continues across reconnections; streams take turns; the data depend only on ``seed`` and
  message counts, never on the clock, so a run is reproducible whatever the pacing.
* Pacing is a token bucket refilled at ``rate_hz``, a tick's messages in one socket write; a backlog from
  back-pressure or a stalled loop is capped, not sent as one burst.
* One client is fed at a time: a new connection takes over and the older one is closed with 1001. Replies are read
  and scored on every open connection.
* Per stream: a baseline, a slow drift and Gaussian noise clipped at +-2.5 sigma; after ``warmup + 10`` messages,
  with probability ``anomaly_rate``, a spike of 12 sigmas on two features, recorded as injected. The noise is
  clipped because the detector's short variance window would otherwise flag more false anomalies than planted ones
  at 16 features or more.
* ``DemoScore`` is pure bookkeeping; its counters are plain ints, so ``summary()`` may be read from another thread.
  Everything else is called on the feed's loop, except ``stop_sending()``, safe from any thread.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web

from forkless.io_loop.net import aiohttp_compat
from forkless.io_loop.net.appsite import Served, serve_app
from forkless.io_loop.net.netaddr import is_loopback

__all__ = ["DemoFeed", "DemoScore", "DemoSummary"]

log = logging.getLogger("forkless.demo_feed")

FEED_PATH = "/feed"

# Data shape, chosen with a numpy simulation of the detector (alpha=0.05, threshold=4, warmup=20)
# so that false flags stay a small share of flags for 8-16 features.
NOISE_CLIP_SIGMAS = 2.5
SPIKE_SIGMAS = 12.0
SPIKE_FEATURES = 2
DRIFT_MAX_SIGMAS = 1.5
DRIFT_PERIOD_RANGE = (1000.0, 4000.0)  # in messages of the stream, not seconds
NOISE_SCALE_RANGE = (0.2, 5.0)
BASELINE_RANGE = (-10.0, 10.0)
INJECT_AFTER_WARMUP = 10

# Pacing. The tick is short enough for ~10k msg/s in small batches, long enough not to
# spin at low rates; the burst cap bounds what a stall may owe.
MIN_TICK_S = 0.002
MAX_TICK_S = 0.05
MAX_BURST_S = 0.25

# A client that ignores our close frame must not hold up stop() for aiohttp's 10 s default.
CLOSE_TIMEOUT_S = 2.0
SHUTDOWN_TIMEOUT_S = 2.0


def _fmt_ratio(value: float, denominator: int) -> str:
    return f"{100.0 * value:.1f}%" if denominator else "n/a"


@dataclass(frozen=True, slots=True)
class DemoSummary:
    """Counts of one demo run.

    ``answered`` counts distinct sent messages that got a valid, non-error reply.
    ``precision = detected / (detected + false_flags)`` and
    ``recall = detected / (detected + missed)``; each is 1.0 when its denominator is 0
    (nothing was flagged / nothing injected was answered), and ``line()`` shows "n/a".
    ``duplicates`` are further replies to an already answered seq; ``invalid`` are
    frames that are not a well-formed reply to a message we sent.
    """

    sent: int
    answered: int
    errors: int
    injected: int
    detected: int
    false_flags: int
    missed: int
    precision: float
    recall: float
    duplicates: int = 0
    invalid: int = 0

    def line(self) -> str:
        extra = ""
        if self.duplicates:
            extra += f", {self.duplicates} duplicates"
        if self.invalid:
            extra += f", {self.invalid} invalid"
        recall = _fmt_ratio(self.recall, self.detected + self.missed)
        precision = _fmt_ratio(self.precision, self.detected + self.false_flags)
        return (
            f"demo feed: {self.sent} sent, {self.answered} answered, {self.errors} errors{extra}; "
            f"injected anomalies {self.injected}: detected {self.detected} (recall {recall}), "
            f"false flags {self.false_flags} (precision {precision})"
        )


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass, but `true` is not a seq.
    return isinstance(value, int) and not isinstance(value, bool)


class DemoScore:
    """Matches replies to sent messages and counts hits, misses and false flags.

    ``record_sent`` must be called with increasing seqs. Only unanswered messages are
    kept individually; sent seqs are otherwise remembered as contiguous runs, so memory
    stays flat however long the demo runs.
    """

    def __init__(self) -> None:
        self._pending: dict[int, tuple[str, bool]] = {}
        # Runs [start, end) of sent seqs, to tell a duplicate reply from a made-up seq.
        self._run_starts: list[int] = []
        self._run_ends: list[int] = []
        self._sent = 0
        self._answered = 0
        self._errors = 0
        self._duplicates = 0
        self._invalid = 0
        self._injected = 0
        self._detected = 0
        self._false_flags = 0
        self._missed = 0

    @property
    def outstanding(self) -> int:
        """Sent messages that have had no reply (valid or error) yet."""
        return len(self._pending)

    def record_sent(self, seq: int, stream: str, injected: bool) -> None:
        if self._run_ends and seq < self._run_ends[-1]:
            raise ValueError(f"seq {seq} recorded after {self._run_ends[-1] - 1}; seqs must increase")
        if self._run_ends and seq == self._run_ends[-1]:
            self._run_ends[-1] = seq + 1
        else:
            self._run_starts.append(seq)
            self._run_ends.append(seq + 1)
        self._pending[seq] = (stream, injected)
        self._sent += 1
        self._injected += int(injected)

    def record_invalid(self) -> None:
        """Count a frame that could not even be decoded into a reply object."""
        self._invalid += 1

    def record_reply(self, obj: object) -> None:
        """Score one decoded reply (normally a dict; anything else counts as invalid)."""
        if not isinstance(obj, dict):
            self._invalid += 1
            return
        seq = obj.get("seq")
        if "error" in obj:
            self._errors += 1
            # A refused message will not be answered later; stop waiting for it.
            if _is_int(seq):
                self._pending.pop(seq, None)
            return
        stream, anomaly = obj.get("stream"), obj.get("anomaly")
        if not (_is_int(seq) and isinstance(stream, str) and isinstance(anomaly, bool)):
            self._invalid += 1
            return
        entry = self._pending.get(seq)
        if entry is None:
            if self._was_sent(seq):
                self._duplicates += 1
            else:
                self._invalid += 1
            return
        sent_stream, injected = entry
        if stream != sent_stream:
            self._invalid += 1
            return
        del self._pending[seq]
        self._answered += 1
        if anomaly and injected:
            self._detected += 1
        elif anomaly:
            self._false_flags += 1
        elif injected:
            self._missed += 1

    def _was_sent(self, seq: int) -> bool:
        i = bisect.bisect_right(self._run_starts, seq) - 1
        return i >= 0 and seq < self._run_ends[i]

    def summary(self) -> DemoSummary:
        flagged = self._detected + self._false_flags
        judged = self._detected + self._missed
        return DemoSummary(
            sent=self._sent,
            answered=self._answered,
            errors=self._errors,
            injected=self._injected,
            detected=self._detected,
            false_flags=self._false_flags,
            missed=self._missed,
            precision=self._detected / flagged if flagged else 1.0,
            recall=self._detected / judged if judged else 1.0,
            duplicates=self._duplicates,
            invalid=self._invalid,
        )


@dataclass(frozen=True, slots=True)
class _Message:
    seq: int
    stream: str
    text: str
    injected: bool


class _SensorBank:
    """Deterministic synthetic sensors: the i-th message depends only on the seed and i."""

    def __init__(self, *, streams: int, features: int, warmup: int, anomaly_rate: float,
                 seed: int) -> None:
        rng = np.random.default_rng(seed)
        width = len(str(streams - 1))
        self.names = [f"sensor-{i:0{width}d}" for i in range(streams)]
        lo, hi = NOISE_SCALE_RANGE
        self._sigma = np.exp(rng.uniform(math.log(lo), math.log(hi), streams))
        self._baseline = rng.uniform(*BASELINE_RANGE, (streams, features))
        self._drift_amp = (DRIFT_MAX_SIGMAS * rng.uniform(0.0, 1.0, (streams, features))
                           * self._sigma[:, None])
        self._drift_omega = 2.0 * math.pi / rng.uniform(*DRIFT_PERIOD_RANGE, (streams, features))
        self._drift_phase = rng.uniform(0.0, 2.0 * math.pi, (streams, features))
        self._counts = [0] * streams
        self._inject_from = warmup + INJECT_AFTER_WARMUP
        self._anomaly_rate = anomaly_rate
        self._spike_features = min(SPIKE_FEATURES, features)
        self._rng = rng
        self.next_seq = 0

    def next(self) -> _Message:
        seq = self.next_seq
        s = seq % len(self.names)
        k = self._counts[s]
        rng = self._rng
        noise = np.clip(rng.standard_normal(self._baseline.shape[1]),
                        -NOISE_CLIP_SIGMAS, NOISE_CLIP_SIGMAS)
        x = (self._baseline[s]
             + self._drift_amp[s] * np.sin(self._drift_omega[s] * k + self._drift_phase[s])
             + self._sigma[s] * noise)
        injected = k >= self._inject_from and rng.random() < self._anomaly_rate
        if injected:
            idx = rng.choice(x.shape[0], size=self._spike_features, replace=False)
            signs = rng.choice((-1.0, 1.0), size=self._spike_features)
            x[idx] += signs * SPIKE_SIGMAS * self._sigma[s]
        text = json.dumps({"seq": seq, "stream": self.names[s],
                           "x": np.round(x, 6).tolist()})
        self._counts[s] = k + 1
        self.next_seq = seq + 1
        return _Message(seq, self.names[s], text, bool(injected))


@dataclass(eq=False, slots=True)
class _Connection:
    ws: web.WebSocketResponse
    sender: asyncio.Task[None] | None = None
    reading: bool = True  # False once the client side is gone


class DemoFeed:
    """Loopback WebSocket server streaming synthetic sensor data; see the module rules."""

    def __init__(self, *, rate_hz: float, streams: int, features: int, warmup: int,
                 seed: int = 0, host: str = "127.0.0.1", anomaly_rate: float = 0.005, unix_socket: str = "") -> None:
        if not is_loopback(host, literal=True):
            raise ValueError(f"demo feed host must be a literal loopback address, got {host!r}")
        if not (math.isfinite(rate_hz) and rate_hz > 0):
            raise ValueError(f"rate_hz must be positive, got {rate_hz!r}")
        if streams < 1 or features < 1 or warmup < 0:
            raise ValueError("need streams >= 1, features >= 1, warmup >= 0")
        if not 0.0 <= anomaly_rate <= 1.0:
            raise ValueError(f"anomaly_rate must be in [0, 1], got {anomaly_rate!r}")
        self._host = host
        self.unix_socket = unix_socket  # "" for loopback TCP
        self._rate = float(rate_hz)
        self._tick = min(max(1.0 / self._rate, MIN_TICK_S), MAX_TICK_S)
        self._max_credit = max(1.0, self._rate * MAX_BURST_S)
        self._bank = _SensorBank(streams=streams, features=features, warmup=warmup,
                                 anomaly_rate=anomaly_rate, seed=seed)
        self._score = DemoScore()
        # Messages whose send failed are offered first to the next connection, so a
        # dropped connection leaves no hole in the seq numbering.
        self._unsent: list[_Message] = []
        self._sending = True
        self._accepted = 0
        self._active: _Connection | None = None
        self._open: set[_Connection] = set()
        self._served: Served | None = None
        self._url: str | None = None

    @property
    def connections(self) -> int:
        """How many client connections were accepted so far."""
        return self._accepted

    @property
    def url(self) -> str | None:
        """The feed's ws URL once started, else None."""
        return self._url

    def summary(self) -> DemoSummary:
        return self._score.summary()

    async def start(self) -> str:
        """Serve on a free loopback port (or the unix-domain socket) in the running loop; return the
        ws URL (with a unix socket, ``ws://localhost/feed``: the handshake's path and Host)."""
        if self._served is not None:
            raise RuntimeError("DemoFeed.start() called twice")
        app = web.Application()
        app.router.add_get(FEED_PATH, self._handle)
        self._served = served = await serve_app(
            app, host=self._host, unix_socket=self.unix_socket, shutdown_timeout_s=SHUTDOWN_TIMEOUT_S,
            hint="a host that refuses TCP sockets? FORKLESS_DEMO_UNIX_SOCKET serves the demo feed on a unix-domain "
                 "socket")
        if self.unix_socket:
            host = "localhost"
        else:
            host = (f"[{self._host}]" if ":" in self._host else self._host) + f":{served.port}"
        self._url = f"ws://{host}{FEED_PATH}"
        log.debug("demo feed listening on %s", self._url)
        return self._url

    def stop_sending(self) -> None:
        """Stop emitting messages; replies keep being read. Safe from any thread."""
        self._sending = False

    async def wait_replies(self, timeout: float) -> bool:
        """Wait until every sent message has a reply; False if ``timeout`` ran out first.

        Meant for after ``stop_sending()``: messages lost with a dropped connection are
        never answered, hence the mandatory timeout.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._score.outstanding or self._sender_finishing():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def _sender_finishing(self) -> bool:
        # After stop_sending() a sender may still be draining its last frame, which is
        # recorded as sent only then; before that, senders never finish by design.
        return not self._sending and any(
            c.sender is not None and not c.sender.done() for c in self._open)

    async def stop(self) -> None:
        """Stop sending, close client connections (1001) and shut the server down."""
        self.stop_sending()
        senders = [c.sender for c in self._open if c.sender is not None]
        for task in senders:
            task.cancel()
        await asyncio.gather(*senders, return_exceptions=True)
        await asyncio.gather(
            *(c.ws.close(code=WSCloseCode.GOING_AWAY, message=b"demo feed stopped")
              for c in list(self._open)),
            return_exceptions=True,
        )
        if self._served is not None:
            served, self._served = self._served, None
            await served.close()
            log.debug("%s", self.summary().line())  # the program prints it once, on stdout

    async def _handle(self, request: web.Request) -> web.WebSocketResponse:
        # compress=False: deflate buys nothing on loopback, and _send_loop's accounting
        # relies on an uncompressed frame being written before send_str first yields.
        ws = web.WebSocketResponse(timeout=CLOSE_TIMEOUT_S, compress=False)
        await ws.prepare(request)
        self._accepted += 1
        conn = _Connection(ws)
        self._open.add(conn)
        self._active = conn
        sender = conn.sender = asyncio.create_task(self._send_loop(conn))
        log.info("demo feed: client connected (%d so far)", self._accepted)
        try:
            async for msg in ws:
                if msg.type is WSMsgType.TEXT:
                    self._on_text(msg.data)
                elif msg.type is WSMsgType.BINARY:
                    self._score.record_invalid()
                else:
                    break
        finally:
            # The sender notices within a tick; it may be closing a superseded socket.
            conn.reading = False
            (outcome,) = await asyncio.gather(sender, return_exceptions=True)
            if isinstance(outcome, Exception):
                log.error("demo feed sender failed", exc_info=outcome)
            self._open.discard(conn)
            if self._active is conn:
                self._active = None
            log.info("demo feed: client disconnected")
        return ws

    def _on_text(self, data: str) -> None:
        try:
            obj: Any = json.loads(data)
        except ValueError:
            self._score.record_invalid()
            return
        self._score.record_reply(obj)

    async def _send_loop(self, conn: _Connection) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        credit = 0.0
        framer = aiohttp_compat.text_frames(conn.ws)  # a tick's messages in one write
        while self._feeding(conn):
            now = loop.time()
            credit = min(credit + (now - last) * self._rate, self._max_credit)
            last = now
            while credit >= 1.0 and self._feeding(conn):
                if framer is None:
                    if not await self._send_one(conn):
                        return
                    credit -= 1.0
                    continue
                due = int(credit)
                batch, self._unsent = self._unsent[:due], self._unsent[due:]
                batch += [self._bank.next() for _ in range(due - len(batch))]
                try:
                    framer.write([msg.text for msg in batch])  # every frame handed to the transport, or none
                except (ConnectionError, RuntimeError):
                    self._unsent[:0] = batch  # none written: kept, in order, for the next client
                    return
                for msg in batch:
                    self._score.record_sent(msg.seq, msg.stream, msg.injected)
                credit -= due
                await framer.drained()
            await asyncio.sleep(self._tick)
        if self._active is not conn and conn.reading and not conn.ws.closed:
            await conn.ws.close(code=WSCloseCode.GOING_AWAY, message=b"superseded")

    async def _send_one(self, conn: _Connection) -> bool:
        """One message by aiohttp's ``send_str`` (where ``TextFrames`` is not there); False when the
        connection is gone (the message is kept for the next client)."""
        msg = self._unsent.pop(0) if self._unsent else self._bank.next()
        try:
            await conn.ws.send_str(msg.text)
        except (ConnectionError, RuntimeError):
            # aiohttp raises before writing anything: keep it for the next client.
            self._unsent.insert(0, msg)
            return False
        except asyncio.CancelledError:
            # Cancelled while draining: aiohttp had already written the frame.
            self._score.record_sent(msg.seq, msg.stream, msg.injected)
            raise
        self._score.record_sent(msg.seq, msg.stream, msg.injected)
        return True

    def _feeding(self, conn: _Connection) -> bool:
        return self._sending and self._active is conn and conn.reading and not conn.ws.closed
