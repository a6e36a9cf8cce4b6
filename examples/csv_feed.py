"""A tiny CSV WebSocket feed to try the README's CSV embedding example against.

    python examples/csv_feed.py            serves ws://127.0.0.1:8765/feed
    python examples/csv_feed.py 9000       another port

Every connection gets ``stream,seq,x1,x2`` lines (two streams, ten per second) and the
replies are printed. Loopback only; stop it with Ctrl-C.
"""

from __future__ import annotations

import asyncio
import random
import sys

from aiohttp import WSMsgType, web


async def feed(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse()
    await ws.prepare(request)

    async def send() -> None:
        rng = random.Random(0)
        seq = 0
        while not ws.closed:
            stream = "ab"[seq % 2]
            await ws.send_str(f"{stream},{seq},{rng.uniform(-3, 3):.3f},{rng.uniform(-3, 3):.3f}")
            seq += 1
            await asyncio.sleep(0.1)

    sender = asyncio.create_task(send())
    try:
        async for msg in ws:
            if msg.type is WSMsgType.TEXT:
                print("reply:", msg.data, flush=True)
    finally:
        sender.cancel()
    return ws


def main(port: int = 8765) -> None:
    app = web.Application()
    app.router.add_get("/feed", feed)
    print(f"CSV feed on ws://127.0.0.1:{port}/feed", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8765)
