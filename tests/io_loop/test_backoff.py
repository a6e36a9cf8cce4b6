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


def _following(seed: int = 1, **changes: float) -> Backoff:
    settings = dict(min_s=0.05, max_s=5.0, reset_s=5.0, jitter=0.5, follow_s=0.5, follow_ratio=0.1)
    settings.update(changes)
    return Backoff(**settings, rng=random.Random(seed))


def test_a_young_outage_is_followed_within_follow_s_whatever_the_failures() -> None:
    b = _following()
    b.connected(now=0.0)
    b.disconnected(now=100.0)  # the outage begins
    delays = []
    now = 100.0
    while now < 105.0:  # younger than follow_s / follow_ratio = 5 s: capped at 0.5 s, however many failures
        delay = b.failed(now)
        delays.append(delay)
        now += delay
    assert len(delays) > 10 and max(delays) <= 0.5
    assert delays[:3] == sorted(delays[:3]) and delays[0] <= 0.05 * 1.0 + 1e-9  # the first retries at once


def test_an_old_outage_backs_off_with_its_age_up_to_max_s() -> None:
    b = _following()
    b.disconnected(now=0.0)
    for _ in range(20):
        b.failed(1.0)
    assert 1.0 <= b.failed(now=20.0) <= 2.0  # 20 s old: cap 2 s (a tenth), jitter 0.5: at least half of it
    assert 2.5 <= b.failed(now=600.0) <= 5.0  # ten minutes: max_s


def test_without_follow_s_the_age_does_not_cap_the_delay() -> None:
    b = _backoff()
    b.disconnected(now=0.0)
    for _ in range(10):
        b.failed(now=0.1)
    assert b.failed(now=0.2) > 0.5 * 2  # min_s 0.5 doubled past 1 s: no age cap


def test_jitter_bounds_each_delay_between_its_share_and_the_cap() -> None:
    fixed = Backoff(min_s=1.0, max_s=1.0, jitter=0.0, rng=random.Random(0))
    assert {fixed.failed() for _ in range(5)} == {1.0}
    half = Backoff(min_s=0.1, max_s=8.0, jitter=0.5, rng=random.Random(0))
    for _ in range(10):
        half.failed()
    assert all(4.0 <= half.failed() <= 8.0 for _ in range(50))


def test_a_connection_that_lasted_reset_s_ends_the_outage() -> None:
    b = _following()
    b.disconnected(now=0.0)
    for _ in range(20):
        b.failed(now=1.0)
    b.connected(now=100.0)
    b.disconnected(now=106.0)  # up 6 s >= reset_s: a new outage from 106
    assert b.failures == 0 and b.failed(now=106.0) <= 0.05


def test_fresh_is_the_same_policy_with_a_count_of_its_own() -> None:
    b = _following(tries=3)
    b.failed(now=0.0)
    copy = b.fresh()
    assert copy.failures == 0 and repr(copy) == repr(b) and copy is not b
    assert b.fresh(tries=1).tries == 1


@pytest.mark.parametrize(("changes", "match"), [
    ({"min_s": 0}, "min_s is a finite number of seconds > 0"),
    ({"max_s": float("inf")}, "max_s is a finite number of seconds > 0"),
    ({"min_s": 2.0, "max_s": 1.0}, r"max_s \(1.0\) is less than its min_s \(2.0\)"),
    ({"jitter": 1.5}, "jitter is the random part of each delay, from 0 .* to 1"),
    ({"jitter": True}, "jitter is the random part"),
    ({"follow_s": -1}, "follow_s is a finite number of seconds > 0"),
    ({"tries": -1}, "tries is an int >= 0"),
    ({"reset_s": -1}, "reset_s is a finite number of seconds >= 0"),
])
def test_a_wrong_setting_is_refused_naming_what_is_right(changes, match) -> None:
    with pytest.raises(ValueError, match=match):
        Backoff(**changes)
