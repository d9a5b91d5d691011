"""The paired, drift-corrected comparison of `adapt.paired`: contrasts and the adoption rule by
hand, and its error rates on synthetic windows (stationary noise, drift, a real effect)."""

import math

import numpy as np
import pytest

from adapt.paired import AdoptionRule, incumbent_contrasts, linear, paired_contrasts


def test_paired_contrasts_by_hand():
    # I0 C1 I1 C2 I2 = 4 6 6 9 8: C1 - (4 + 6) / 2 = 1, C2 - (6 + 8) / 2 = 2.
    assert paired_contrasts([6.0, 9.0], [4.0, 6.0, 8.0], linear) == [1.0, 2.0]
    with pytest.raises(ValueError, match="2 candidate windows need 3 incumbent neighbours, got 2"):
        paired_contrasts([6.0, 9.0], [4.0, 6.0], linear)


def test_linear_drift_cancels_in_the_pairs_but_not_against_the_first_window():
    """Load rising by 0.5 a window: every contrast is the true effect (0.25), while scoring
    against the first window, as the earlier tuner did, reports the drift as an effect."""
    t = np.arange(7, dtype=float)
    values = 10 + 0.5 * t + np.where(t % 2 == 1, 0.25, 0.0)  # I C I C I C I
    incumbent, candidate = values[0::2].tolist(), values[1::2].tolist()
    assert paired_contrasts(candidate, incumbent, linear) == pytest.approx([0.25] * 3)
    assert incumbent_contrasts(incumbent, linear) == pytest.approx([0.0, 0.0])
    assert [c - values[0] for c in candidate] == pytest.approx([0.75, 1.75, 2.75])


def test_incumbent_contrasts_by_hand():
    # 2 - (1 + 3) / 2 = 0;  3 - (2 + 5) / 2 = -0.5
    assert incumbent_contrasts([1.0, 2.0, 3.0, 5.0], linear) == [0.0, -0.5]
    assert incumbent_contrasts([1.0, 2.0], linear) == []


def test_adoption_rule_by_hand():
    rule = AdoptionRule(z=2.0, min_noise=3)
    noise = [0.1, -0.1, 0.1, -0.1]  # rms 0.1
    verdict = rule.judge([0.5, 0.7, 0.6], noise)
    assert verdict.score == pytest.approx(0.6)
    assert verdict.noise_rms == pytest.approx(0.1)
    # sd of the mean of 3 pair contrasts: sqrt(5.5 / 13.5) = 0.638 sds of an incumbent contrast
    assert verdict.threshold == pytest.approx(2 * 0.1 * math.sqrt(5.5 / 13.5))  # 0.1277
    assert verdict.adopt
    assert not rule.judge([0.12, 0.12, 0.12], noise).adopt  # 0.12 < 0.1277
    assert rule.judge([0.3], noise).threshold == pytest.approx(0.2)  # one pair: z * rms
    assert not rule.judge([0.1, 0.1, 0.1], [-0.1] * 4).adopt  # a negative contrast is noise too
    unknown = rule.judge([5.0, 5.0, 5.0], [0.1, -0.1])  # too few incumbent contrasts yet
    assert unknown.threshold == math.inf and not unknown.adopt
    with pytest.raises(ValueError, match="z: expected a finite number > 0"):
        AdoptionRule(z=0.0)


def _adoption_rate(effect: float, drift: float, seed: int, candidates: int = 400, pairs: int = 3) -> float:
    """Windows I C I C ... with N(0, 1) noise, a linear drift per window, and `effect` added to
    candidate windows; the noise from the run's incumbent windows so far."""
    rng = np.random.default_rng(seed)
    rule = AdoptionRule()
    adopted = 0
    incumbent: list[float] = []
    t = 0
    for _ in range(candidates):
        mine: list[float] = []
        neighbours = [incumbent[-1]] if incumbent else []
        if not incumbent:
            incumbent.append(rng.normal() + drift * t)
            neighbours.append(incumbent[-1])
            t += 1
        for _ in range(pairs):
            mine.append(rng.normal() + drift * t + effect)
            incumbent.append(rng.normal() + drift * (t + 1))
            neighbours.append(incumbent[-1])
            t += 2
        verdict = rule.judge(
            paired_contrasts(mine, neighbours, linear), incumbent_contrasts(incumbent, linear)
        )
        adopted += verdict.adopt
    return adopted / candidates


def test_pure_noise_is_rarely_adopted_even_under_drift():
    """A one-sided z-test at 2: about 2.3% false adoptions; slightly more with a noisy noise
    estimate, far from the ~50% of a rule without a threshold. A steep drift changes nothing."""
    for seed in range(3):
        assert _adoption_rate(0.0, 0.0, seed) < 0.06
        assert _adoption_rate(0.0, 3.0, seed) < 0.06


def test_a_clearly_better_candidate_is_adopted():
    # An effect of 2 window-noise sds over 3 pairs: threshold 2 * sqrt(1.5) * 0.638 = 1.56.
    assert _adoption_rate(2.0, 0.0, 0) > 0.7
    assert _adoption_rate(4.0, 1.0, 1) > 0.99
