"""The registry of the ``FORKLESS_*`` variables: each declared once in ``VARIABLES``, with its
``Config`` field, its rule (how its text is parsed and a value given in code checked), what it
allows and what it means (pure).

Rules:
- ``--help``, the variables table of the documents and ``Config.from_env`` are all drawn from
  ``VARIABLES``, so they cannot disagree; a variable's default is its ``Config`` field's.
- Secrets (``SUBSCRIBE``, ``AUTH_TOKEN``, ``HEADERS``, ``FEEDS``, ``RELAY_TOKEN``) are marked
  ``secret`` and never appear in ``repr``, errors or ``--help``.
- JAX's own variables (``JAX_PLATFORMS``, ``JAX_COMPILATION_CACHE_DIR`` …) are not declared
  here; they pass through to JAX untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from forkless.controller.settings.feedspec import feeds_text
from forkless.controller.settings.values import (
    MAX_PARTITIONS,
    Rule,
    address,
    boolean,
    bucket,
    checkpoint_dir,
    choice,
    device_count,
    existing_file,
    header_pairs,
    in_flight,
    integer,
    json_text,
    listen_socket,
    nats_urls,
    number,
    optional,
    optional_text,
    pem_file,
    relay_subject,
    text_rule,
    unix_socket,
    ws_url,
)
from forkless.io_loop.settings import REPLY_POLICIES, SEQ_MODES

__all__ = ["LOG_LEVELS", "PREFIX", "VARIABLES", "Variable", "as_text", "variable"]

PREFIX = "FORKLESS_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class Variable:
    """One ``FORKLESS_*`` variable: its field, its rule and what it means."""

    name: str  # without the prefix
    field: str
    rule: Rule
    allowed: str
    help: str
    secret: bool = False

    @property
    def env(self) -> str:
        return PREFIX + self.name

    def parse(self, text: str) -> Any:
        """The variable's text as its field's value; ``ValueError`` (``TypeError``, ``OSError``) if not allowed."""
        return self.rule(text)

    def check(self, value: Any) -> None:
        """A value given in code, checked by its type and bounds as it is; ``ValueError`` if not allowed."""
        self.rule.check(value)


VARIABLES: tuple[Variable, ...] = (
    # -- the feed
    Variable("WS_URL", "ws_url", text_rule(ws_url), "a ws:// or wss:// URL (port 1-65535), or empty",
             "WebSocket feed to connect to; empty starts the embedded demo feed"),
    Variable("WS_UNIX_SOCKET", "ws_unix_socket", text_rule(unix_socket),
             "an absolute path of at most 107 bytes, or empty",
             "connect to WS_URL's feed through this unix-domain socket instead of TCP: the handshake's path and"
             " Host (and, for wss://, TLS's server name) still come from WS_URL, e.g. ws://localhost/feed; needs"
             ' WS_URL (a FORKLESS_FEEDS entry takes "unix_socket")'),
    Variable("SUBSCRIBE", "subscribe", text_rule(json_text), "a JSON text or @path to a file holding one",
             "message sent first on every new connection (empty: none); never logged, as it"
             " often holds credentials", secret=True),
    Variable("AUTH_TOKEN", "auth_token", text_rule(str.strip), "any text",
             "sent as 'Authorization: Bearer <token>'; never logged", secret=True),
    Variable("HEADERS", "headers", header_pairs, "a JSON object of string values",
             "extra handshake headers; never logged", secret=True),
    Variable("FEEDS", "feeds", text_rule(feeds_text),
             'a JSON list of {"url", "unix_socket", "subscribe", "headers", "name", "required", "replies", "overflow",'
             ' "buffer"} objects (WebSocket feeds)'
             ' and {"nats", "stream", "subject", "results", "start", …} objects (JetStream feeds), or @path to a file'
             " holding one; not together with WS_URL or SUBSCRIBE",
             "several feeds in one process, each its own connection (docs/feeds.md, docs/jetstream.md); never"
             " logged", secret=True),
    Variable("SHARED_STREAMS", "shared_streams", boolean, "0 or 1",
             "with several feeds: 1 makes a stream name the same stream on every feed (one state);"
             " 0 keeps feed:stream apart"),
    Variable("FEED_FATAL", "feed_fatal", choice("all", "any"), "all or any",
             "with several feeds: exit 3 when every feed has given up (all) or when one has (any)"),
    Variable("REPLIES", "replies", choice(*REPLY_POLICIES), "all, results or none",
             "what the feed is sent back: all (results and error replies), results (no error frames), none"
             " (nothing but SUBSCRIBE; results still reach the sinks, the counters and the latency); a"
             ' FORKLESS_FEEDS entry\'s "replies" overrides it for that feed'),
    Variable("CA_FILE", "ca_file", text_rule(pem_file), "the path of an existing PEM file of CA certificates",
             "extra CA bundle for wss:// (the system store is always used)"),
    Variable("TLS_INSECURE", "tls_insecure", boolean, "0 or 1",
             "1 turns certificate verification off (logs a warning at every connect)"),
    # -- the model and protocol
    Variable("FEATURES", "features", integer(1, 65536), "an integer from 1 to 65536",
             "length F of every message's vector x"),
    Variable("ALPHA", "alpha", number(0.0, 1.0, lo_open=True), "a number in (0, 1]",
             "the default detector's EWMA smoothing factor"),
    Variable("THRESHOLD", "threshold", number(0.0, lo_open=True), "a number > 0",
             "the default detector flags a message whose largest abs(z) exceeds this"),
    Variable("WARMUP", "warmup", integer(0), "an integer >= 0",
             "messages a stream must have had before the default detector can flag it"),
    Variable("MAX_STREAMS", "max_streams", integer(1, 10_000_000), "an integer from 1 to 10000000",
             "state slots; a new stream past this gets an error reply (unless STREAM_IDLE_S frees one)"),
    Variable("STREAM_IDLE_S", "stream_idle_s", optional(number(0.0)), "a number of seconds >= 0, or empty",
             "when every slot is taken, a stream silent for longer than this gives its slot to a new"
             " stream (least recently seen first; its state is reset); empty: slots are never reused"),
    Variable("DEVICES", "devices", device_count, "all, or an integer from 1 to 4096",
             "local JAX devices to use: the stream table is sharded over them by stream (new streams spread"
             " evenly) and each runs its streams' messages; more than the process has exits 2"),
    # -- batching and queues
    Variable("MAX_BATCH", "max_batch", integer(1, 65536), "an integer from 1 to 65536",
             "largest micro-batch (batches are padded to powers of four up to this)"),
    Variable("MAX_WAIT_MS", "max_wait_ms", number(0.0, 10_000.0), "a number from 0 to 10000",
             "longest a batch keeps collecting messages that are arriving; never waits on an empty queue (while"
             " steps are in flight, a batch joins them once full or collecting this long)"),
    Variable("STEPS_IN_FLIGHT", "steps_in_flight", in_flight, "auto, or an integer from 1 to 64",
             "steps dispatched to the device before the oldest one's results are handed over: the next batch's"
             " step (a closed batch's: full, or collecting for MAX_WAIT_MS) starts while earlier ones run and"
             " their results are copied to the host (results, their order,"
             " checkpoints and replays unchanged; docs/performance.md). 1: one step at a time; auto: 1 on the CPU,"
             " 2 on an accelerator"),
    Variable("HANDOFF", "handoff", choice("auto", "park", "spin"), "auto, park or spin",
             "how the threads wait for each other: park sleeps until woken; spin keeps the IO loop awake"
             " while a step is in flight and 2 ms after (it yields its core between looks, the GIL released;"
             " under the GIL the main thread blocks on the step meanwhile, without one it spins too): replies"
             " are taken without waking a sleeping loop, for a busy core (docs/performance.md); auto: spin on"
             " an accelerator, park on the CPU"),
    Variable("QUEUE_SIZE", "queue_size", integer(1, 1_000_000), "an integer from 1 to 1000000",
             "bound of each queue: inbound chunks (frames read together, at most MAX_BATCH messages"
             " or one frame), outbound batches"),
    Variable("OVERFLOW", "overflow", choice("block", "drop_oldest"), "block or drop_oldest",
             "a source's own buffer full (SOURCE_BUFFER): block stops reading the socket; drop_oldest drops the"
             " source's own oldest messages and events, counted under its name (never a replayable source's)"),
    Variable("SOURCE_BUFFER", "source_buffer", integer(0, 10_000_000), "an integer from 0 to 10000000",
             "messages and events each source may hold while the inbound queue is full (a stalled main loop),"
             " its reader not waiting; then OVERFLOW applies. 0: the queue's bound alone"),
    Variable("MAX_MSG_BYTES", "max_msg_bytes", integer(64, 1 << 30), "an integer from 64 to 1073741824",
             "largest frame accepted; a larger one closes the connection with 1009 and reconnects. A JetStream"
             " feed's payload over it is not decoded: one error reply (message too large), counted, acknowledged"),
    Variable("MAX_FRAME_ITEMS", "max_frame_items", integer(1, 1_000_000), "an integer from 1 to 1000000",
             "most messages in one JSON-array frame"),
    # -- connection management
    Variable("HEARTBEAT_S", "heartbeat_s", number(0.0), "a number >= 0 (0 = off)",
             "ping interval; no pong within half of it drops and reconnects"),
    Variable("STALE_S", "stale_s", number(0.0), "a number >= 0 (0 = off)",
             "reconnect when no frame has arrived for this long"),
    Variable("CONNECT_TIMEOUT_S", "connect_timeout_s", number(0.0, lo_open=True), "a number > 0",
             "limit on connecting plus the opening handshake"),
    Variable("RECONNECT_MIN_S", "reconnect_min_s", number(0.0, lo_open=True), "a number > 0",
             "smallest delay between connection attempts"),
    Variable("RECONNECT_MAX_S", "reconnect_max_s", number(0.0), "a number >= RECONNECT_MIN_S",
             "largest delay between connection attempts"),
    Variable("RECONNECT_RESET_S", "reconnect_reset_s", number(0.0), "a number >= 0",
             "a connection must stay up this long before the backoff starts again from the minimum"),
    Variable("RECONNECT_TRIES", "reconnect_tries", integer(0), "an integer >= 0",
             "failed attempts in a row before giving up with exit status 3 (0 = forever)"),
    # -- running
    Variable("DURATION", "duration_s", optional(number(0.0, lo_open=True)), "a number of seconds > 0, or empty",
             "stop after this long (a stop requested then: SHUTDOWN_TIMEOUT_S bounds it from there, as from a "
             "SIGTERM); empty runs until SIGINT/SIGTERM/SIGHUP"),
    Variable("SHUTDOWN_TIMEOUT_S", "shutdown_timeout_s", number(0.0, lo_open=True), "a number > 0",
             "longest an orderly stop may take before giving up on unsent results"),
    Variable("LOSSY_STOP_EXIT", "lossy_stop_exit", integer(0, 125), "an integer from 0 to 125",
             "exit status of an orderly stop that lost messages (dropped, unanswered; 0: exit as a clean stop)"),
    Variable("STATUS_S", "status_s", number(0.0), "a number >= 0 (0 = off)",
             "seconds between status lines"),
    Variable("LOG_LEVEL", "log_level", choice(*LOG_LEVELS, upper=True), "one of " + ", ".join(LOG_LEVELS),
             "logging level"),
    Variable("LOG_FORMAT", "log_format", choice("text", "json"), "text or json",
             "json writes one JSON object per log line"),
    Variable("METRICS_ADDR", "metrics_addr", text_rule(address),
             "host:port, or unix:/path (an absolute path in an existing writable directory), or empty",
             "serve /metrics, /healthz, /readyz, /startedz there (empty: off); unix:/path serves them on a unix-domain"
             " socket, made at the start and removed at the stop"),
    # -- the demo feed
    Variable("DEMO_RATE", "demo_rate", number(0.0, 100_000.0, lo_open=True), "a number in (0, 100000]",
             "demo feed messages per second (all streams together)"),
    Variable("DEMO_STREAMS", "demo_streams", integer(1, 100_000), "an integer from 1 to 100000",
             "number of demo feed streams"),
    Variable("DEMO_UNIX_SOCKET", "demo_unix_socket", text_rule(listen_socket),
             "an absolute path of at most 107 bytes in an existing writable directory, or empty",
             "the embedded demo feed serves on this unix-domain socket (made at the start, removed at the stop)"
             " and is read through it, instead of a loopback TCP port: no TCP socket is opened; only with the demo"
             " feed (WS_URL and FEEDS unset)"),
    # -- checkpoints
    Variable("CHECKPOINT_DIR", "checkpoint_dir", text_rule(checkpoint_dir),
             "a writable directory path (created if missing), or empty",
             "keep checkpoints of the state and the stream table here (empty: off)"),
    Variable("CHECKPOINT_BUCKET", "checkpoint_bucket", text_rule(optional_text(bucket)),
             "1-64 letters, digits, '_' or '-', or empty",
             "a partitioned JetStream feed's checkpoints: one object per partition in this JetStream object-store"
             " bucket on the feed's server (created if missing), restored by whichever instance owns the partition;"
             " turns checkpoints on like CHECKPOINT_DIR (not both; the only kind a partitioned feed has)"),
    Variable("CHECKPOINT_S", "checkpoint_s", number(0.0, lo_open=True), "a number > 0",
             "seconds between checkpoints; one more is written at every orderly stop"),
    Variable("CHECKPOINT_KEEP", "checkpoint_keep", integer(1, 1000), "an integer from 1 to 1000",
             "newest checkpoints kept; older ones are deleted after each successful write"),
    Variable("CHECKPOINT_RESTORE", "checkpoint_restore", choice("auto", "never"), "auto or never",
             "auto: start from the newest complete checkpoint (a damaged one is skipped; one written with"
             " other FEATURES/MAX_STREAMS/processor exits 2; every one damaged: a JetStream feed exits 2 unless"
             ' its "start" is "first" and its stream still holds every message from sequence 1, which it then'
             " consumes again); never: start empty (the explicit way to accept a lost checkpoint or position)"),
    Variable("CHECKPOINT_PRIORITY", "checkpoint_priority", choice("idle", "normal"), "idle or normal",
             "idle: the periodic checkpoints are written at the OS's idle priority (Linux SCHED_IDLE), never"
             " taking a core from the steps, but slowed or skipped on a host whose cores other processes keep"
             " busy; normal: at the process's own priority. The stop's checkpoint is written at normal priority"),
    # -- partitioned instances (a JetStream feed with "partition_count")
    Variable("INSTANCE", "instance", optional(integer(0, MAX_PARTITIONS - 1)), "an integer >= 0, or empty",
             "this instance's number i (0-based; a StatefulSet pod's ordinal) among INSTANCES: it owns the"
             " contiguous share [i*P/N, (i+1)*P/N) of the partitioned feed's partition_count P, in place of the"
             ' entry\'s "partitions" (not both); set together with INSTANCES'),
    Variable("INSTANCES", "instances", optional(integer(1, MAX_PARTITIONS)), "an integer from 1 to 65536, or empty",
             "N, the number of instances sharing the partitioned feed's partitions (at most its partition_count);"
             " set together with INSTANCE"),
    Variable("LEASE_S", "lease_s", number(0.0, lo_open=True), "a number > 0",
             "a partitioned feed's lease on each partition it owns: renewed while it runs, released at an orderly"
             " stop, expired this long after its holder died (a new owner waits for that)"),
    Variable("LEASE_BUCKET", "lease_bucket", text_rule(bucket), "1-64 letters, digits, '_' or '-'",
             "the JetStream KV bucket on the partitioned feed's server that holds the partitions' leases (created"
             " if missing)"),
    # -- the relay (forkless relay: docs/relay.md)
    Variable("RELAY_NATS", "relay_nats", text_rule(nats_urls), "one nats:// or tls:// URL, or several comma-separated",
             "forkless relay: the NATS server(s) to publish to (a user:password in the URL is never logged);"
             " required for the relay"),
    Variable("RELAY_SUBJECT", "relay_subject", text_rule(relay_subject), "a NATS subject without wildcards",
             "forkless relay: each message is published to <this>.<escaped stream name>; required for the relay"),
    Variable("RELAY_TOKEN", "relay_token", text_rule(str.strip), "any text",
             "forkless relay: the NATS token to connect with; never logged", secret=True),
    Variable("RELAY_CREDS", "relay_creds", text_rule(existing_file), "the path of an existing NATS .creds file",
             "forkless relay: the NATS credentials file to connect with"),
    Variable("RELAY_SEQ", "relay_seq", choice(*SEQ_MODES), "feed, stream or none",
             "forkless relay: how the feeds number their messages, for counting gaps: feed (one seq per feed, +1"
             " per message, as the demo feed's), stream (one seq per stream), none (no gap counting)"),
    Variable("RELAY_MAX_HELD", "relay_max_held", integer(1, 1_000_000), "an integer from 1 to 1000000",
             "forkless relay: the most messages it holds, taken from the feeds and not yet acknowledged by the"
             " stream (waiting to be published, or published and unacknowledged); at this bound it takes no more"
             " and the feeds' readers are pushed back. A higher value keeps more publications unacknowledged at"
             " once (for a server far away), and a kill -9 loses up to this many more"),
)


def variable(name: str) -> Variable:
    """The variable named ``name`` (without the prefix)."""
    return next(var for var in VARIABLES if var.name == name)


def as_text(value: Any) -> str:
    """A field's value as its variable would be written (``None`` empty, a bool ``1``/``0``,
    header pairs a JSON object): what ``--help``, ``--check`` and a ``ConfigError`` show."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return json.dumps(dict(value))
    return str(value)
