"""The image's HEALTHCHECK: GET /healthz where FORKLESS_METRICS_ADDR serves it; exit 0 on 200, else 1.

/healthz answers 200 from the first second while the process and its IO loop (or, during the
compile, its start-up thread) are alive (docs/metrics.md). A wildcard host (0.0.0.0, [::]) is asked
on loopback; unix:/path through that socket. Standard library only: it runs in the image's Python.
"""

from __future__ import annotations

import http.client
import os
import socket
import sys

TIMEOUT_S = 4.0  # under the HEALTHCHECK's --timeout


class UnixConnection(http.client.HTTPConnection):
    """HTTP over the unix-domain socket at ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=TIMEOUT_S)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT_S)
        self.sock.connect(self.path)


def connection(addr: str) -> http.client.HTTPConnection:
    """A connection to where ``addr`` (FORKLESS_METRICS_ADDR's value) serves."""
    if addr.startswith("unix:"):
        return UnixConnection(addr[len("unix:"):])
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)


def main() -> int:
    addr = os.environ.get("FORKLESS_METRICS_ADDR", "")
    if not addr:
        print("healthcheck: FORKLESS_METRICS_ADDR is unset: no /healthz to ask", file=sys.stderr)
        return 1
    try:
        conn = connection(addr)
        conn.request("GET", "/healthz")
        status = conn.getresponse().status
    except (OSError, ValueError, http.client.HTTPException) as exc:
        print(f"healthcheck: /healthz on {addr}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"healthcheck: /healthz on {addr} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
