"""The self-tuning save interval (healer/decide/save_interval.py): Daly's optimum, the estimate that starts from the
configured interval and follows the failures seen, and the bounds, the step and the dead band of each move."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from healer.decide.save_interval import IntervalBounds, optimum, prior_mtbf, tune

pytestmark = pytest.mark.unit
HOUR = 3600.0


def test_dalys_optimum_is_youngs_where_the_stall_is_small_and_the_mtbf_where_it_is_not() -> None:
    young = math.sqrt(2 * 6.3 * 3.1 * HOUR)  # Llama 3's failure rate, a 6.3 s stall: 6.2 min
    # Daly's higher-order terms add 0.6% here, and the stall itself is taken off
    assert young - 6.3 < optimum(6.3, 3.1 * HOUR) < young
    assert optimum(100.0, 40.0) == 40.0  # a save longer than twice the MTBF: save once per failure
    assert optimum(0.0, HOUR) == 0.0
    with pytest.raises(ValueError, match="MTBF must be > 0"):
        optimum(1.0, 0.0)


def test_with_no_failure_seen_the_estimate_is_the_prior_and_the_interval_stays() -> None:
    # The configured 10 min at a 6.3 s stall is Young's optimum for M0 = 600^2 / 12.6 = 7.9 h.
    assert prior_mtbf(600, 6.3) == pytest.approx(600 * 600 / 12.6)
    assert tune(600, configured_s=600, stall_s=6.3, failures_at=[], trained_s=0.0, bounds=IntervalBounds()) is None


def test_failures_more_often_than_the_prior_says_shorten_the_interval_by_at_most_the_step() -> None:
    failures = [i * 0.5 * HOUR for i in range(1, 49)]  # one every 30 min for a day
    change = tune(600, configured_s=600, stall_s=6.3, failures_at=failures, trained_s=24 * HOUR,
                  bounds=IntervalBounds())
    assert change is not None and change.failures == 48
    assert change.mtbf_s == pytest.approx((24 * HOUR + prior_mtbf(600, 6.3)) / 49)
    assert change.optimum_s == pytest.approx(optimum(6.3, change.mtbf_s))
    assert change.interval_s == pytest.approx(max(change.optimum_s, 300))  # half at most in one move
    assert "48 failure(s)" in change.reason and "10.0 min ->" in change.reason


def test_a_quiet_week_lengthens_it_up_to_the_bound_and_old_failures_are_forgotten() -> None:
    bounds = IntervalBounds(most=timedelta(minutes=30), window=timedelta(days=7))
    old = [i * HOUR for i in range(1, 25)]  # a bad first day, then three quiet weeks
    current = 600.0
    for _ in range(5):
        change = tune(current, configured_s=600, stall_s=6.3, failures_at=old, trained_s=22 * 24 * HOUR,
                      bounds=bounds)
        if change is None:
            break
        assert change.failures == 0 and change.interval_s <= 2 * current
        current = change.interval_s
    assert current == 1800.0


def test_a_small_difference_is_not_a_move_and_bad_bounds_are_refused() -> None:
    best = optimum(6.3, prior_mtbf(600, 6.3))
    assert tune(best * 1.05, configured_s=600, stall_s=6.3, failures_at=[], trained_s=0.0,
                bounds=IntervalBounds()) is None
    assert tune(600, configured_s=600, stall_s=0.0, failures_at=[HOUR], trained_s=2 * HOUR,
                bounds=IntervalBounds()) is None, "no stall measured: nothing to trade"
    with pytest.raises(ValueError, match="least <= most"):
        IntervalBounds(least=timedelta(hours=1), most=timedelta(minutes=1))
    with pytest.raises(ValueError, match="step must be > 1"):
        IntervalBounds(step=1.0)
