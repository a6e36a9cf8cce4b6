"""A lease holder in a process of its own, for tests/io_loop/connectors/jetstream/test_natsstore.py to ``kill -9``:
``python -m tests.store_holder <nats url> <lease bucket> <lease_s> <holder> <key>...`` takes the
leases of the keys (io_loop/connectors/jetstream/store.py), prints "held" and renews them until it is killed."""

from __future__ import annotations

import json
import sys
import threading

from forkless.controller.config import Config
from forkless.io_loop.connectors.jetstream.store import NatsStore


def main(url: str, lease_bucket: str, lease_s: str, holder: str, *keys: str) -> None:
    settings = Config(feeds=json.dumps([{"name": "ticks", "nats": url, "stream": "TICKS", "results": "scores"}]),
                      connect_timeout_s=2.0, reconnect_min_s=0.05, reconnect_max_s=0.3,
                      reconnect_tries=5).io_settings()
    store = NatsStore(settings.feed_specs[0], timeouts=settings.timeouts, reconnect=settings.reconnect,
                      tls=settings.tls, bucket=None, lease_bucket=lease_bucket, lease_s=float(lease_s), holder=holder)
    store.start()
    store.acquire(keys)
    print("held", flush=True)
    threading.Event().wait()  # renewing on the store's thread until killed


if __name__ == "__main__":
    main(*sys.argv[1:])
