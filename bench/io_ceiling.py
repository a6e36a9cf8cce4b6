"""The "io-ceiling" design: the fastest possible forkless-shaped client.

It connects with ``aiohttp.ClientSession.ws_connect`` and answers every
message straight from its event loop: decode the JSON frame, reply a
result-shaped frame ``{"seq", "stream", "z": [0.0] * F, "score": 0.0,
"anomaly": false}`` at once. No queue, no thread hop, no JAX. Whatever
latency and throughput it reaches against ``bench.loadgen`` is the ceiling
that the I/O path alone allows; any real design can only be slower.

It validates the frame the way a real client would (seq an int, stream a
string, ``x`` a list of F numbers) and answers ``{"error": ..., "seq": ...}``
otherwise, so protocol mismatches show up as counted errors.

Usage::

    python -m bench.io_ceiling --url ws://127.0.0.1:PORT/ [--features 8]

It returns (exit code 0) when the server closes the connection. Memory is
measured from outside (psutil), so this stays a plain process.

Rules:
- No queue, no thread, no JAX: every answer is made on the event loop; a malformed frame gets an error
  reply, never silence.
- A plain process: its memory is measured from outside.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from aiohttp import WSMsgType

from bench.unix import client_session, handshake_url
from forkless.io_loop.jsontext import DECODE_ERRORS, dumps, loads


def make_reply(data: bytes | str, features: int, zeros: list[float]) -> bytes:
    """Answer one incoming frame with a result-shaped (or error) JSON frame."""
    try:
        msg: Any = loads(data)
    except DECODE_ERRORS:
        return b'{"error":"invalid json","seq":null}'
    if type(msg) is not dict:
        return b'{"error":"not an object","seq":null}'
    seq = msg.get("seq")
    if type(seq) is not int:
        return b'{"error":"missing or bad seq","seq":null}'
    stream = msg.get("stream")
    x = msg.get("x")
    if type(stream) is not str:
        return dumps({"error": "missing or bad stream", "seq": seq})
    if type(x) is not list or len(x) != features:
        return dumps({"error": f"x must be a list of {features} numbers", "seq": seq})
    return dumps({"seq": seq, "stream": stream, "z": zeros, "score": 0.0, "anomaly": False})


async def run_io_ceiling(url: str, features: int = 8) -> None:
    """Answer messages from ``url`` until the server closes the connection."""
    zeros = [0.0] * features
    text = WSMsgType.TEXT
    async with (
        client_session(url) as session,  # a UnixConnector for a unix address (bench.unix)
        session.ws_connect(handshake_url(url), autoping=True, heartbeat=None, compress=0, decode_text=False) as ws,
    ):
        send_frame = ws.send_frame
        async for msg in ws:
            if msg.type is text or msg.type is WSMsgType.BINARY:
                await send_frame(make_reply(msg.data, features, zeros), text)
            elif msg.type is WSMsgType.ERROR:
                raise ConnectionError(f"websocket error: {ws.exception()!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.io_ceiling",
        description="io-ceiling client: reply from the event loop, no queue, no JAX.",
    )
    p.add_argument("--url", required=True, help="ws:// (or ws+unix://) address printed by bench.loadgen")
    p.add_argument("--features", type=int, default=8)
    a = p.parse_args(argv)
    asyncio.run(run_io_ceiling(a.url, a.features))
    return 0


if __name__ == "__main__":
    sys.exit(main())
