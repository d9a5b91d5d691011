"""Online prediction quality windows, checked against figures worked out by hand."""

import pytest

from serving_hooks.quality import BoundWindow, RankWindow, ShareWindow, drift_alarm, held_out_coverage


def test_bound_window_coverage_and_overestimate_by_hand():
    window = BoundWindow(size=4)
    assert window.coverage is None and window.overestimate is None and window.count == 0
    for actual, bound in [(10, 20), (40, 20), (5, 5), (100, 50)]:
        window.observe(actual, bound)
    # covered: 10<=20 yes, 40<=20 no, 5<=5 yes, 100<=50 no -> 2/4
    assert window.coverage == 0.5
    # ratios 2.0, 0.5, 1.0, 0.5 -> mean 1.0
    assert window.overestimate == pytest.approx(1.0)
    window.observe(8, 16)  # slides out (10, 20): covered 2/4 still, ratios 0.5, 1.0, 0.5, 2.0
    assert window.count == 4 and window.coverage == 0.5
    assert window.overestimate == pytest.approx(1.0)
    window.observe(30, 30)  # slides out (40, 20): covered 3/4; ratios 1.0, 0.5, 2.0, 1.0 -> 1.125
    assert window.coverage == 0.75 and window.overestimate == pytest.approx(1.125)


def test_bound_window_ignores_requests_without_output():
    window = BoundWindow(size=3)
    window.observe(0, 10)
    assert window.count == 0 and window.coverage is None


def test_rank_correlation_by_hand():
    window = RankWindow(size=100)
    for i in range(1, 10):
        window.observe(i * 10, i)
    assert window.correlation() is None  # 9 pairs: too few to say
    window.observe(100, 10)
    assert window.correlation() == pytest.approx(1.0)
    reversed_window = RankWindow()
    for i in range(1, 11):
        reversed_window.observe(i, 11 - i)
    assert reversed_window.correlation() == pytest.approx(-1.0)
    # Ten pairs with two neighbours swapped twice: d = (0,0,1,-1,0,0,1,-1,0,0), sum d^2 = 4,
    # rho = 1 - 6 * 4 / (10 * 99) = 1 - 24/990.
    swapped = RankWindow()
    predicted = [1, 2, 4, 3, 5, 6, 8, 7, 9, 10]
    for actual, guess in enumerate(predicted, start=1):
        swapped.observe(actual, guess)
    assert swapped.correlation() == pytest.approx(1 - 24 / 990)


def test_constant_predictions_have_no_rank_correlation():
    window = RankWindow()
    for i in range(1, 20):
        window.observe(i, 5.0)
    assert window.correlation() is None


def test_held_out_coverage_pools_the_refinement_points():
    assert held_out_coverage({"coverage_at_0": 0.9, "coverage_at_50": 0.94, "coverage_error": 0.05}) == (
        pytest.approx(0.92)
    )
    assert held_out_coverage({"wasserstein": 3.0}) is None


def test_drift_alarm_needs_enough_requests_and_a_held_out_figure():
    window = BoundWindow(size=10)
    for actual in range(1, 11):  # bound 7: covers 1..7 -> 0.7
        window.observe(actual, 7)
    assert window.coverage == 0.7
    assert drift_alarm(window, held_out=0.9, margin=0.05, least_requests=10)  # 0.7 < 0.85
    assert not drift_alarm(window, held_out=0.74, margin=0.05, least_requests=10)  # 0.7 >= 0.69
    assert not drift_alarm(window, held_out=0.9, margin=0.05, least_requests=11)  # too few yet
    assert not drift_alarm(window, held_out=None, margin=0.05, least_requests=1)


def test_share_window_by_hand():
    window = ShareWindow(size=4)
    assert window.share is None
    for held in (True, False, True, True, False):  # the first falls out: F, T, T, F
        window.observe(held)
    assert window.count == 4 and window.share == 0.5
