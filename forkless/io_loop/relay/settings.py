"""The relay's settings (``forkless relay``, docs/relay.md): the NATS server(s) it publishes to, the subject, its
credentials, how its feeds number their messages and the most messages it holds; each setting declared once
(io_loop/settings.py's rules).

Rules:
- Read by the relay's publisher (io_loop/connectors/jetstream/publisher.py) and the relay's command; the feeds it
  reads are the IO side's own (FORKLESS_WS_URL, FORKLESS_FEEDS).
- One source of credentials: a user:password in ``FORKLESS_RELAY_NATS``, ``FORKLESS_RELAY_TOKEN`` or
  ``FORKLESS_RELAY_CREDS``; the token stays out of ``repr`` and errors, a URL's credentials too.
- Pure: nothing here opens a socket or imports nats-py.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from forkless.io_loop.errors import ConfigError
from forkless.io_loop.net.netaddr import is_subject, nats_urls, redact_urls
from forkless.io_loop.settings import PREFIX, choice, existing_file, integer, setting, settings_group, settings_of, text

__all__ = ["SEQ_MODES", "RelaySettings"]

# how the relay's feeds number their messages (FORKLESS_RELAY_SEQ), for counting gaps (relaystats.py)
SEQ_MODES = ("feed", "stream", "none")


def _subject(text: str) -> str:
    """The relay's subject prefix: a NATS subject without wildcards ("" stays "")."""
    text = text.strip()
    if text and not is_subject(text, wildcards=False):
        raise ValueError
    return text


@settings_group
class RelaySettings:
    """Where and how ``forkless relay`` publishes its feeds' messages."""

    nats: str = setting("RELAY_NATS", text(nats_urls, "one nats:// or tls:// URL, or several comma-separated"),
                        "forkless relay: the NATS server(s) to publish to (a user:password in the URL is never "
                        "logged); required for the relay", default="", shown=redact_urls)
    subject: str = setting("RELAY_SUBJECT", text(_subject, "a NATS subject without wildcards"), "forkless relay: "
                           "each message is published to <this>.<escaped stream name>; required for the relay",
                           default="")
    token: str = setting("RELAY_TOKEN", text(str.strip, "any text"), "forkless relay: the NATS token to connect "
                         "with; never logged", default="", secret=True)
    creds: str = setting("RELAY_CREDS", text(existing_file, "the path of an existing NATS .creds file"),
                         "forkless relay: the NATS credentials file to connect with", default="")
    seq: str = setting("RELAY_SEQ", choice(*SEQ_MODES), "forkless relay: how the feeds number their messages, for "
                       "counting gaps: feed (one seq per feed, +1 per message, as the demo feed's), stream (one seq "
                       "per stream), none (no gap counting)", default="feed")
    max_held: int = setting("RELAY_MAX_HELD", integer(1, 1_000_000), "forkless relay: the most messages it holds, "
                            "taken from the feeds and not yet acknowledged by the stream (waiting to be published, "
                            "or published and unacknowledged); at this bound it takes no more and the feeds' readers "
                            "are pushed back. A higher value keeps more publications unacknowledged at once (for a "
                            "server far away), and a kill -9 loses up to this many more", default=256)

    def validate(self) -> None:
        """One source of credentials."""
        sources = [what for what, present in (
            ("a user:password in FORKLESS_RELAY_NATS", any(urlsplit(u.strip()).username
                                                           for u in self.nats.split(",") if u.strip())),
            ("FORKLESS_RELAY_TOKEN", bool(self.token)), ("FORKLESS_RELAY_CREDS", bool(self.creds))) if present]
        if len(sources) > 1:
            raise ConfigError(PREFIX + ("RELAY_TOKEN" if self.token else "RELAY_CREDS"), "<hidden>",
                              f"one source of credentials for the relay, not {' and '.join(sources)}")

    def required(self) -> None:
        """What the relay cannot run without: ``ConfigError`` naming FORKLESS_RELAY_NATS or
        FORKLESS_RELAY_SUBJECT where it is unset."""
        for declared in settings_of(RelaySettings):
            if declared.field in ("nats", "subject") and not getattr(self, declared.field):
                raise ConfigError(declared.env, "", f"to be set for the relay: {declared.allowed}")
