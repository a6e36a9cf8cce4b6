"""The root of forkless's exceptions, and those the IO side ends a run with.

Rules:
- ``ForklessError`` is the root of every exception forkless raises on purpose; it lives here, in the leaf, so both
  sides can use it (the controller's own subclasses are in controller/errors.py). A caller has them as
  ``forkless.X``; each keeps the built-in base callers catch it by (``RuntimeError``, ``ValueError``).
- Each class states how the ``forkless`` program ends when it ends a run (``exit_status``, ``exit_label``,
  ``exit_meaning``); the statuses' numbers are stated here, once (``EXIT_*``).
- ``IOThread.raise_if_failed`` re-raises ``FeedFatal``, ``MetricsServerError`` and ``PositionLost`` as they are;
  anything else that killed the IO thread becomes ``IOThreadError`` with it as cause.
- ``ConfigError`` is raised where a value is refused: a settings group, a variable read, a rule between groups.
- ``LeaseHeld`` and ``LeaseLost`` are raised to the thread that called the store, not through the IO thread.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "ACCEPT_LOSS",
    "EXIT_CONFIG",
    "EXIT_CRASH",
    "EXIT_FEED",
    "EXIT_INTERRUPTED",
    "EXIT_LOSSY_STOP",
    "EXIT_OK",
    "ConfigError",
    "DeploymentMismatch",
    "FeedFatal",
    "ForklessError",
    "IOThreadError",
    "LeaseHeld",
    "LeaseLost",
    "MetricsServerError",
    "ObjectDamaged",
    "PositionLost",
    "StopRequested",
    "StoreError",
    "ValueProblem",
]

EXIT_OK, EXIT_CRASH, EXIT_CONFIG, EXIT_FEED = 0, 1, 2, 3
EXIT_LOSSY_STOP = 4  # an orderly stop that lost messages (FORKLESS_LOSSY_STOP_EXIT chooses another)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C
# how a PositionLost says the loss can be accepted (every refusal of a recorded position ends with it)
ACCEPT_LOSS = ("start with FORKLESS_CHECKPOINT_RESTORE=never to accept the loss (the state starts empty and "
               "the feed at its \"start\")")


class ForklessError(Exception):
    """The root of every exception forkless raises on purpose: ``except ForklessError`` catches them all.

    Class attributes, for the ``forkless`` program when one ends a run: ``exit_status`` (1, a
    crash, unless a class says otherwise), ``exit_label`` (the words before the message on its
    line on stderr, ``forkless: <label>: <message>``; none: ``forkless: <message>``, and for
    status 1 the traceback after it) and ``exit_meaning`` (the README's exit status table's
    line; none: the class ends a run only as any crash does)."""

    exit_status: ClassVar[int] = EXIT_CRASH
    exit_label: ClassVar[str] = ""
    exit_meaning: ClassVar[str] = ""


class ConfigError(ForklessError, ValueError):
    """A setting's value is invalid (io_loop/settings.py: a group made with it, a variable read); the message
    names the variable, the value and what is allowed: exit status 2."""

    exit_status = EXIT_CONFIG
    exit_label = "configuration error"
    exit_meaning = ("a variable's value is not allowed, one line naming the variable, the value and what is allowed "
                    "(or FORKLESS_DEVICES asks for more devices than there are)")

    def __init__(self, variable: str, value: str, allowed: str) -> None:
        self.variable = variable
        self.value = value
        self.allowed = allowed
        super().__init__(f"{variable}={value!r} is invalid: expected {allowed}")


class ValueProblem(ValueError):
    """A value's refusal with a detail fit to show (never a secret), by a setting's rule: appended to what
    the setting allows in the ``ConfigError``."""


class FeedFatal(ForklessError):
    """The feed cannot be used (4xx handshake, tries used up): exit status 3."""

    exit_status = EXIT_FEED
    exit_label = "feed error"
    exit_meaning = ("the feed cannot be used: handshake refused with a 4xx, or reconnect tries used up; with several "
                    "feeds, every feed (or one, with FORKLESS_FEED_FATAL=any)")


class PositionLost(ForklessError):
    """A JetStream stream no longer holds the messages the recorded position needs (retention
    removed them, or the stream was made again): the state cannot be continued exactly.
    Exit status 2; ``FORKLESS_CHECKPOINT_RESTORE=never`` accepts the loss."""

    exit_status = EXIT_CONFIG
    exit_label = "checkpoint error"
    exit_meaning = ("a JetStream stream that no longer holds the messages the checkpoint needs, was made again, or "
                    "whose position every checkpoint lost by being damaged")


class LeaseHeld(ForklessError):
    """Another live instance holds partitions we claim: it renewed their leases while we waited
    (or took them first). ``keys``: the lease keys still held by others, sorted; ``holder``: who
    holds them (several holders joined by ", "). The message names both. Exit status 2."""

    exit_status = EXIT_CONFIG
    exit_label = "partitions held by another instance"
    exit_meaning = "partitions whose lease another live instance holds"

    def __init__(self, keys: list[str], holder: str, message: str = "") -> None:
        super().__init__(message or f"the leases of {', '.join(keys)} are held by {holder!r}, which is alive")
        self.keys = list(keys)
        self.holder = holder

    def __reduce__(self) -> tuple:  # the default would call __init__ with the message only
        return type(self), (self.keys, self.holder, str(self))


class LeaseLost(ForklessError):
    """A partition lease of ours could not be renewed before it expired, or someone else took
    it: the partitions may have a new owner, so nothing more is written for them; the instance
    stops with exit status 3."""

    exit_status = EXIT_FEED
    exit_label = "feed error"
    exit_meaning = "a partition's lease lost (not renewed in time, or taken by another instance)"

class DeploymentMismatch(ForklessError):
    """Live instances sharing this partitioned stream were started with another partition count
    or number of instances (``FORKLESS_INSTANCES``), as the lease bucket's deployment record says:
    together the two layouts would leave partitions without an owner, or with two. ``recorded``
    and ``ours`` are the two layouts ({"partition_count": P, "instances": N}); the message names
    both. Exit status 2."""

    exit_status = EXIT_CONFIG
    exit_label = "configuration error"
    exit_meaning = "live instances of the stream started with another FORKLESS_INSTANCES or partition_count"

    def __init__(self, recorded: dict, ours: dict, message: str = "") -> None:
        super().__init__(message or f"the live instances run with {recorded}, this one with {ours}")
        self.recorded = dict(recorded)
        self.ours = dict(ours)

    def __reduce__(self) -> tuple:
        return type(self), (self.recorded, self.ours, str(self))


class StoreError(ForklessError):
    """An operation on the checkpoint and lease store (io_loop/connectors/jetstream/store.py) failed: server
    unreachable, an answer refused or late. The store stays usable and the next call tries
    again; raised to the thread that called the store (a partitioned instance's start, its
    checkpoints), it ends a run as a crash does."""


class ObjectDamaged(StoreError):
    """A checkpoint object's content does not match its meta (size, SHA-256, a chunk missing, the meta
    unreadable): use an older one (io_loop/connectors/jetstream/objects.py raises it; a partitioned instance's
    checkpoints, controller/partitions/partitioned.py, skip it)."""


class StopRequested(Exception):
    """The caller's stop was requested while the partition store waited for it (its connection
    retries, a dead holder's lease): what the call had taken is released. Not an error: the
    controller's start ends there, and the run stops cleanly (exit status 0)."""


class MetricsServerError(ForklessError, RuntimeError):
    """``FORKLESS_METRICS_ADDR`` cannot be served (bad address, port in use): exit status 2."""

    exit_status = EXIT_CONFIG
    exit_label = "configuration error"
    exit_meaning = "a FORKLESS_METRICS_ADDR that cannot be served (the port is taken, say)"


class IOThreadError(ForklessError, RuntimeError):
    """The IO thread died of something unexpected; ``__cause__`` is what killed it: exit status 1."""

    exit_meaning = ("the IO thread died of something unexpected (or did not start in time): what killed it, "
                    "with its traceback")
