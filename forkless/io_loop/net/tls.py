"""The TLS context a connection is verified with (``TlsSettings``: FORKLESS_CA_FILE, FORKLESS_TLS_INSECURE): a
``wss://`` WebSocket feed's (io_loop/connectors/websocket/connect.py) and a ``tls://`` NATS server's
(io_loop/connectors/jetstream/transport.py) are made here alike.

Rules:
- The system trust store, plus the CA file if one is given; verification is off only where asked for.
- Made once where a connection needs one, never at import: a CA file OpenSSL refuses fails the caller that made it.
"""

from __future__ import annotations

import ssl

from forkless.io_loop.settings import TlsSettings

__all__ = ["make_ssl_context"]


def make_ssl_context(tls: TlsSettings) -> ssl.SSLContext:
    """System trust store, plus ``ca_file`` if given; verification off only if asked."""
    ctx = ssl.create_default_context()
    if tls.ca_file:
        ctx.load_verify_locations(cafile=tls.ca_file)
    if tls.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
