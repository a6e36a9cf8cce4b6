"""A number is a number (io_loop/seconds.py): every call of the IO side that takes seconds or a count
takes any ``numbers.Real`` (numpy's scalars, ``Fraction``) and refuses a bad one where it is given."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from forkless.io_loop.backoff import Backoff
from forkless.io_loop.capabilities import declarations
from forkless.io_loop.portal import IOPortal, RestartPolicy
from forkless.io_loop.relogin import Relogin
from forkless.io_loop.seconds import seconds, whole
from forkless.io_loop.sends import checked_max_age

NUMBERS = [np.float32(0.5), np.float64(0.5), np.int64(2), np.int32(2), np.float16(0.5), Fraction(1, 2), 2, 0.5]
IDS = ["float32", "float64", "int64", "int32", "float16", "Fraction", "int", "float"]


@pytest.mark.parametrize("value", NUMBERS, ids=IDS)
def test_any_real_number_is_a_number_of_seconds(value):
    assert seconds(value, "x") == float(value) and type(seconds(value, "x")) is float
    assert checked_max_age(value, "send(max_age_s=)") == float(value)  # Controller.send's and from_main.put's


@pytest.mark.parametrize("value", NUMBERS, ids=IDS)
def test_every_call_that_takes_seconds_takes_any_real_number(value):
    backoff = Backoff(min_s=value, max_s=value * 4, reset_s=value, follow_s=value, jitter=Fraction(1, 2))
    assert backoff.min_s == float(value) and type(backoff.max_s) is float
    policy = RestartPolicy(backoff=backoff, tries=np.int64(3))
    assert policy.tries == 3
    Relogin(lambda n: None, lambda c: None, hold_s=value, connect_timeout_s=value, tries=np.int32(2))
    portal = IOPortal(lambda to_main, from_main: None, stop_timeout_s=value, start_timeout_s=value,
                      queue_size=np.int64(4))
    assert portal.stop_timeout_s == float(value) and portal.queue_size == 4

    class Source:
        name = "s"
        send_max_age_s = value

    assert declarations(Source(), "s").send_max_age_s == value


@pytest.mark.parametrize("value", [True, "0.5", None, [0.5], complex(0.5, 0)], ids=["bool", "str", "None", "list",
                                                                                      "complex"])
def test_what_is_no_number_is_a_type_error_naming_it(value):
    with pytest.raises(TypeError, match=rf"Backoff's min_s is a number of seconds, not a {type(value).__name__}"):
        Backoff(min_s=value)
    with pytest.raises(TypeError, match="is an int >= 0"):
        whole(value, "tries")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, -1, np.float32("nan"), Fraction(-1, 2), 10**400,
                                   Fraction(10**400)])
def test_a_number_out_of_range_is_a_value_error_where_it_is_given(value):
    with pytest.raises(ValueError, match="is a finite number of seconds > 0"):
        Backoff(max_s=value)
    with pytest.raises(ValueError, match="is a finite number of seconds > 0"):
        checked_max_age(value, "send(max_age_s=)")


@pytest.mark.parametrize("field", ["min_s", "max_s", "reset_s", "follow_s"])
def test_a_restart_policy_with_an_infinite_or_nan_backoff_is_refused_when_it_is_made(field):
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError, match=rf"Backoff's {field} is a finite number of seconds"):
            RestartPolicy(backoff=Backoff(**{field: bad}))


def test_a_count_takes_numpy_integers_and_refuses_fractions():
    assert whole(np.int64(3), "tries") == 3 and type(whole(np.int64(3), "tries")) is int
    with pytest.raises(TypeError, match=r"tries is an int >= 0 \(0: never give up\), not a float: 2.0"):
        whole(2.0, "tries", means_zero="never give up")
    with pytest.raises(ValueError, match="tries is an int >= 0, not -1"):
        whole(-1, "tries")


@pytest.mark.parametrize("keyword", ["max_s", "reset_s"])
def test_an_infinite_restart_setting_is_refused_where_it_is_given_never_at_the_first_restart(keyword):
    # the old keyword (deprecated: it names RestartPolicy(backoff=Backoff(...))), its value checked as the Backoff's
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=keyword):
        RestartPolicy(**{keyword: math.inf})
