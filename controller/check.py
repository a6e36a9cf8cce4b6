"""``python app.py --check``: the preflight an operator runs first on a new box.

It shows the configuration (secrets hidden), the JAX version, backend and devices; compiles
the step for every bucket and runs each once; checks the metrics address can be bound; makes
ONE connection to the feed (or to the embedded demo feed) with the configured TLS, headers,
token and timeouts, waits briefly for a first frame, and closes it with 1000. Every step runs
even when an earlier one failed, so one run lists every problem.

Exit status (as ``app.py``): 0 everything worked; 1 JAX, compilation or the metrics address
failed; 3 the feed is unreachable, refused the handshake, or timed out. (2, bad
configuration, is decided by ``app.py`` before this runs.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from controller.codec import Codec, JsonCodec
from controller.config import VARIABLES, Config, _as_text

__all__ = ["EXIT_FAILED", "EXIT_FEED", "EXIT_OK", "run_check"]

EXIT_OK, EXIT_FAILED, EXIT_FEED = 0, 1, 3
FIRST_FRAME_WAIT_S = 2.0


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

    def step(title: str, fn: Callable[[], None]) -> bool:
        say(f"{title}:")
        try:
            fn()
            return True
        except _Failure as exc:
            say(f"  FAILED: {exc.reason}")
            failures.append(exc)
            return False

    codec = codec if codec is not None else JsonCodec(config.features, max_frame_items=config.max_frame_items)
    say("forkless --check")
    step("configuration", lambda: _show_config(config, say))
    if step("JAX", lambda: _show_jax(say)):
        step("compiling the step", lambda: _compile(config, processor, say))
    if config.metrics_addr:
        step("metrics address", lambda: _check_metrics_addr(config.metrics_addr, say))
    step("feed", lambda: asyncio.run(_probe_feed(config, codec, say)))

    if failures:
        reasons = "; ".join(f.reason for f in failures)
        say(f"check FAILED: {reasons}")
        print(f"forkless: check failed: {reasons}", file=sys.stderr, flush=True)
        return failures[0].code
    say("check passed")
    return EXIT_OK


def _print(line: str) -> None:
    print(line, flush=True)


# ---- configuration ------------------------------------------------------------------------------


def _show_config(config: Config, say: Callable[[str], None]) -> None:
    from io_loop.client import redact_url

    defaults = Config()
    for var in VARIABLES:
        value = getattr(config, var.field)
        if var.secret:
            if not value:
                shown = "(unset)"
            elif isinstance(value, tuple):
                shown = f"<hidden: {', '.join(k for k, _ in value)}>"
            else:
                shown = "<hidden>"
        elif var.field == "ws_url":
            shown = redact_url(value) if value else "(unset: the embedded demo feed)"
        else:
            shown = _as_text(value) or "(unset)"
        mark = "" if value == getattr(defaults, var.field) else "   (not the default)"
        say(f"  {var.env:<28} {shown}{mark}")
    say(f"  batch sizes compiled: {','.join(map(str, config.buckets))}")


# ---- JAX and compilation --------------------------------------------------------------------------


def _show_jax(say: Callable[[str], None]) -> None:
    try:
        import jax
        import jaxlib

        backend = jax.default_backend()
        devices = jax.devices()
    except Exception as exc:  # a missing plugin or a bad JAX_PLATFORMS surfaces here
        raise _Failure(EXIT_FAILED, f"JAX could not start: {type(exc).__name__}: {_first_line(exc)}") from None
    say(f"  jax {jax.__version__}, jaxlib {jaxlib.__version__}")
    say(f"  JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '') or '(unset)'}")
    say(f"  backend {backend}, {len(devices)} device(s): "
        + ", ".join(f"{d} ({d.device_kind})" for d in devices))
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if cache:
        say(f"  persistent compilation cache: {cache}")


def _compile(config: Config, processor: Any, say: Callable[[str], None]) -> None:
    import jax
    import numpy as np

    from controller.batching import pad_batch
    from controller.loop import compilations
    from controller.processor import default_processor

    try:
        processor = processor if processor is not None else default_processor(config)
        state = jax.device_put(processor.init(config))
        jitted = jax.jit(processor.step)
        before = compilations()
        total_s = 0.0
        compiled = {}
        for bucket in config.buckets:
            example = pad_batch(np.zeros((0, config.features), np.float32), np.zeros(0, np.int32),
                                bucket, config.max_streams)
            t0 = time.perf_counter()
            compiled[bucket] = (jitted.lower(state, example).compile(), example)
            took = time.perf_counter() - t0
            total_s += took
            say(f"  batch size {bucket:>6}: compiled in {took * 1000:.0f} ms")
        made = compilations() - before
        say(f"  {len(config.buckets)} batch sizes in {total_s:.2f} s, {made} XLA compilations")
        t0 = time.perf_counter()
        for fn, example in compiled.values():
            _, outputs = fn(state, example)
            jax.block_until_ready(outputs)
        ran_s = time.perf_counter() - t0
        again = compilations() - before - made
    except Exception as exc:
        raise _Failure(EXIT_FAILED, f"the step failed to compile or run: {type(exc).__name__}: "
                                    f"{_first_line(exc)}") from None
    say(f"  ran every batch size once on zeros in {ran_s * 1000:.1f} ms: outputs "
        f"{', '.join(sorted(outputs))}; {again} compilations after warm-up")


# ---- the metrics address --------------------------------------------------------------------------


def _check_metrics_addr(addr: str, say: Callable[[str], None]) -> None:
    from io_loop.http import MetricsServerError, parse_addr

    try:
        host, port = parse_addr(addr)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except (OSError, MetricsServerError) as exc:
        raise _Failure(EXIT_FAILED, f"cannot listen on FORKLESS_METRICS_ADDR={addr}: "
                                    f"{getattr(exc, 'strerror', None) or exc}") from None
    say(f"  {addr}: free; /metrics, /healthz and /readyz will be served there")


# ---- the feed -------------------------------------------------------------------------------------


async def _probe_feed(config: Config, codec: Codec, say: Callable[[str], None]) -> None:
    demo = None
    url = config.ws_url
    try:
        if config.uses_demo_feed:
            from io_loop.demo_feed import DemoFeed

            # its per-connection INFO lines would only clutter the check's own report
            logging.getLogger(DemoFeed.__module__).setLevel(logging.WARNING)
            demo = DemoFeed(rate_hz=config.demo_rate, streams=config.demo_streams,
                            features=config.features, warmup=config.warmup)
            url = await demo.start()
            say(f"  FORKLESS_WS_URL is unset: started the embedded demo feed on {url}")
        await _connect_once(config, codec, url, say)
    finally:
        if demo is not None:
            await demo.stop()


async def _connect_once(config: Config, codec: Codec, url: str, say: Callable[[str], None]) -> None:
    import aiohttp

    from io_loop.client import make_ssl_context, redact_url

    shown = redact_url(url)
    headers = dict(config.headers)
    if config.auth_token:
        headers["Authorization"] = f"Bearer {config.auth_token}"
    if headers:
        say(f"  handshake headers: {', '.join(sorted(headers))} (values hidden)")
    ssl_ctx = make_ssl_context(config) if url.startswith("wss:") else None
    if ssl_ctx is not None:
        say(f"  TLS: system trust store{' + ' + config.ca_file if config.ca_file else ''}"
            f"{', verification OFF (FORKLESS_TLS_INSECURE=1)' if config.tls_insecure else ''}")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with aiohttp.ClientSession() as session:
        try:
            async with asyncio.timeout(config.connect_timeout_s):
                ws = await session.ws_connect(url, headers=headers, ssl=ssl_ctx if ssl_ctx is not None else True,
                                              max_msg_size=config.max_msg_bytes, autoping=True)
        except aiohttp.WSServerHandshakeError as exc:
            raise _Failure(EXIT_FEED, f"{shown} refused the WebSocket handshake with HTTP {exc.status}"
                                      f"{_handshake_hint(exc.status)}") from None
        except aiohttp.ClientConnectorCertificateError as exc:
            raise _Failure(EXIT_FEED, f"{shown}: TLS certificate verification failed: "
                                      f"{exc.certificate_error} (FORKLESS_CA_FILE adds a CA bundle)") from None
        except TimeoutError:
            raise _Failure(EXIT_FEED, f"{shown}: no connection and handshake within "
                                      f"FORKLESS_CONNECT_TIMEOUT_S={config.connect_timeout_s}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise _Failure(EXIT_FEED, f"cannot connect to {shown}: {_connect_error(exc)}") from None
        took_ms = (loop.time() - t0) * 1000
        try:
            say(f"  connected to {shown} in {took_ms:.1f} ms (HTTP 101"
                f"{', subprotocol ' + ws.protocol if ws.protocol else ''})")
            if config.subscribe:
                await ws.send_str(config.subscribe)
                say(f"  sent FORKLESS_SUBSCRIBE ({len(config.subscribe)} characters)")
            wait_s = min(FIRST_FRAME_WAIT_S, config.connect_timeout_s)
            try:
                msg = await asyncio.wait_for(ws.receive(), wait_s)
            except TimeoutError:
                say(f"  no frame within {wait_s:g}s (a quiet feed is not an error)")
            else:
                _describe_frame(msg, codec, loop.time() - t0, say)
        finally:
            await ws.close(code=aiohttp.WSCloseCode.OK, message=b"forkless --check done")
        say("  closed the connection (code 1000)")


def _describe_frame(msg: Any, codec: Codec, after_s: float, say: Callable[[str], None]) -> None:
    import aiohttp

    if msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
        say(f"  the feed ended the connection before any frame: {msg.type.name}"
            f"{f' (code {msg.data})' if isinstance(msg.data, int) else ''}")
        return
    decoded = codec.decode(msg.data)
    found = f"{len(decoded)} good message(s)"
    if len(decoded):
        found += f", first stream {decoded.stream[0]!r}"
    if decoded.errors:
        reasons = sorted({reason for reason, _ in decoded.errors})
        found += f", {len(decoded.errors)} the controller would refuse ({'; '.join(reasons)})"
    say(f"  first frame after {after_s * 1000:.0f} ms, {len(msg.data)} bytes: {found}")


def _connect_error(exc: BaseException) -> str:
    """'Connection refused (errno 111)' rather than aiohttp's wrapper text."""
    os_error = getattr(exc, "os_error", exc)
    errno = getattr(os_error, "errno", None)
    if isinstance(os_error, socket.gaierror):
        return f"cannot resolve the host name: {os_error.strerror}"
    if isinstance(os_error, OSError) and errno:
        return f"{os.strerror(errno)} (errno {errno})"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _handshake_hint(status: int) -> str:
    hints = {401: "unauthorised: check FORKLESS_AUTH_TOKEN",
             403: "forbidden: check FORKLESS_AUTH_TOKEN / FORKLESS_HEADERS",
             404: "not found: check the path in FORKLESS_WS_URL"}
    hint = hints.get(status)
    return f" ({hint})" if hint else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:200] + "…"
