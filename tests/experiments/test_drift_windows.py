"""The drift study's window and recovery arithmetic, on hand-computed cases."""

import math

import numpy as np
import pytest

from experiments.drift_windows import mean_after, mean_before, recovery_s, window_means, within


def test_window_means_assign_requests_by_arrival():
    arrival = np.array([0.0, 5.0, 9.99, 10.0, 25.0, 29.0])
    values = np.array([1.0, 3.0, 5.0, 7.0, 2.0, np.nan])
    # windows of 10 s: [0, 10) -> 1, 3, 5; [10, 20) -> 7; [20, 30) -> 2 (the NaN is left out); [30, 40) empty
    means = window_means(arrival, values, 10.0, 4)
    assert means[:3] == [3.0, 7.0, 2.0]
    assert math.isnan(means[3])
    with pytest.raises(ValueError):
        window_means(arrival, values, 0.0, 1)


def test_pooled_means_split_at_the_shift():
    arrival = np.array([0.0, 10.0, 20.0, 30.0])
    values = np.array([1.0, 2.0, 4.0, 8.0])
    assert mean_before(arrival, values, 20.0) == 1.5  # (1 + 2) / 2
    assert mean_after(arrival, values, 20.0) == 6.0  # (4 + 8) / 2: a request at the shift is after it
    assert math.isnan(mean_after(arrival, values, 40.0))


def test_within_is_relative_and_directed():
    assert within(1.05, 1.0, 0.05, higher_is_better=False)  # 5% worse: still within
    assert not within(1.06, 1.0, 0.05, higher_is_better=False)
    assert within(0.5, 1.0, 0.05, higher_is_better=False)  # better than the oracle counts
    assert within(95.0, 100.0, 0.05, higher_is_better=True)
    assert not within(94.0, 100.0, 0.05, higher_is_better=True)


def test_recovery_is_the_first_window_after_the_shift_within_tolerance():
    # 10 s windows, shift at 20 s: windows 0 and 1 are before it and never count.
    oracle = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    loop = [1.0, 1.0, 2.0, 1.5, 1.04, 1.2]
    assert recovery_s(loop, oracle, 10.0, 20.0) == 20.0  # window 4 starts at 40 s
    # sustained: window 5 falls behind again, so no window from which all later ones are within
    assert recovery_s(loop, oracle, 10.0, 20.0, sustained=True) is None
    loop[5] = 1.0
    assert recovery_s(loop, oracle, 10.0, 20.0, sustained=True) == 20.0
    assert recovery_s([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], 10.0, 0.0) == 0.0
    assert recovery_s([2.0, 2.0], [1.0, 1.0], 10.0, 0.0) is None


def test_recovery_with_a_higher_is_better_headline_and_gaps():
    oracle = [100.0, 100.0, math.nan, 100.0]
    loop = [100.0, 80.0, 100.0, 96.0]
    # shift at 5 s: window 0 starts before it; window 1 is 20% short; window 2 has no oracle value
    assert recovery_s(loop, oracle, 10.0, 5.0, higher_is_better=True) == 25.0  # window 3 at 30 s
    assert recovery_s(loop, oracle, 10.0, 5.0, higher_is_better=True, sustained=True) == 25.0
