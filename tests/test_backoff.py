"""Pure tests of the reconnect policy (io_loop/backoff.py): seeded rng, the caller's clock."""

from __future__ import annotations

import random

import pytest
from forkless.io_loop.backoff import Backoff


def _backoff(tries: int = 0, seed: int = 1) -> Backoff:
    return Backoff(min_s=0.5, max_s=30.0, reset_s=5.0, tries=tries, rng=random.Random(seed))


def test_delays_stay_within_the_growing_cap_and_never_below_the_minimum() -> None:
    b = _backoff()
    for k in range(1, 40):
        delay = b.failed()
        assert delay is not None
        cap = min(30.0, 0.5 * 2 ** (k - 1))
        assert 0.5 <= delay <= cap


def test_delays_are_jittered_not_fixed() -> None:
    b = _backoff(seed=7)
    for _ in range(8):  # reach the 30 s cap
        b.failed()
    delays = [b.failed() for _ in range(50)]
    assert len(set(delays)) == 50
    assert min(delays) < 15.0 < max(delays)


def test_same_seed_gives_the_same_delays() -> None:
    a, b = _backoff(seed=3), _backoff(seed=3)
    assert [a.failed() for _ in range(10)] == [b.failed() for _ in range(10)]


def test_a_connection_that_drops_at_once_does_not_reset_the_backoff() -> None:
    b = _backoff()
    for _ in range(6):
        b.failed()
    b.connected(now=100.0)
    b.disconnected(now=100.1)  # accepted, then closed at once
    assert b.failed() is not None
    assert b.failures == 7


def test_a_connection_that_stayed_up_reset_s_resets_the_backoff() -> None:
    b = _backoff()
    for _ in range(6):
        b.failed()
    b.connected(now=100.0)
    b.disconnected(now=105.0)
    delay = b.failed()
    assert b.failures == 1
    assert delay == 0.5  # the first delay after a reset is the minimum


def test_tries_gives_up_on_the_tries_th_failure_in_a_row() -> None:
    b = _backoff(tries=3)
    assert b.failed() is not None
    assert b.failed() is not None
    assert b.failed() is None


def test_tries_counts_only_failures_in_a_row() -> None:
    b = _backoff(tries=2)
    assert b.failed() is not None
    b.connected(now=0.0)
    b.disconnected(now=10.0)
    assert b.failed() is not None
    assert b.failed() is None


def test_tries_one_gives_up_on_the_first_failure() -> None:
    assert _backoff(tries=1).failed() is None


def test_zero_tries_retries_forever() -> None:
    b = _backoff(tries=0)
    assert all(b.failed() is not None for _ in range(10_000))


@pytest.mark.parametrize("failures", [60, 2000])
def test_huge_failure_counts_do_not_overflow(failures: int) -> None:
    b = _backoff()
    for _ in range(failures):
        delay = b.failed()
    assert delay is not None and 0.5 <= delay <= 30.0


def test_min_equal_to_max_gives_a_fixed_delay() -> None:
    b = Backoff(min_s=0.2, max_s=0.2, reset_s=1.0, rng=random.Random(0))
    assert {b.failed() for _ in range(5)} == {0.2}
