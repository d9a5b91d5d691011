import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapt.requests import SLO
from adapt.traces import Trace
from adapt.workloads.builders import (
    SLOClass,
    build_requests,
    gamma_arrivals,
    mix_traces,
    poisson_arrivals,
    scale_to_rate,
)


@settings(max_examples=40, deadline=None)
@given(rate=st.floats(0.1, 200.0), cv=st.sampled_from([1.0, 2.0, 4.0]), seed=st.integers(0, 2**32 - 1))
def test_generated_rate_within_tolerance_and_reproducible(rate, cv, seed):
    n = 20000
    first = gamma_arrivals(n, rate, cv, np.random.default_rng(seed))
    again = gamma_arrivals(n, rate, cv, np.random.default_rng(seed))
    assert np.array_equal(first, again)
    assert np.all(np.diff(first) >= 0) and first[0] == 0.0
    measured = (n - 1) / first[-1]
    # The mean of n-1 gamma gaps has relative std cv / sqrt(n-1): allow 5 standard deviations.
    assert measured == pytest.approx(rate, rel=5 * cv / np.sqrt(n - 1))


@settings(max_examples=30, deadline=None)
@given(target=st.floats(0.05, 500.0), seed=st.integers(0, 1000))
def test_scaling_hits_the_target_rate_and_keeps_order(target, seed):
    arrivals = np.sort(np.random.default_rng(seed).uniform(0, 100, size=200))
    scaled = scale_to_rate(arrivals, target)
    assert (len(scaled) - 1) / scaled[-1] == pytest.approx(target, rel=1e-9)
    assert np.all(np.diff(scaled) >= 0)
    # Burstiness is kept: gaps are scaled by one factor.
    ratio = np.diff(scaled)[np.diff(arrivals) > 0] / np.diff(arrivals)[np.diff(arrivals) > 0]
    assert np.allclose(ratio, ratio[0])


def test_poisson_is_gamma_with_cv_one():
    a = poisson_arrivals(100, 3.0, np.random.default_rng(1))
    b = gamma_arrivals(100, 3.0, 1.0, np.random.default_rng(1))
    assert np.array_equal(a, b)


def test_bad_arguments_are_rejected():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(10, 0.0, rng)
    with pytest.raises(ValueError, match="cv"):
        gamma_arrivals(10, 1.0, -1.0, rng)
    with pytest.raises(ValueError, match="one timestamp"):
        scale_to_rate(np.zeros(5), 1.0)


def _trace(name, prompts, outputs, text=None):
    return Trace(name, np.asarray(prompts), np.asarray(outputs), prompt_text=text)


@settings(max_examples=25, deadline=None)
@given(weight=st.floats(0.05, 0.95), seed=st.integers(0, 1000))
def test_mixing_follows_weights_and_labels_sources(weight, seed):
    a = _trace("a", [10] * 5, [1] * 5)
    b = _trace("b", [99] * 5, [2] * 5)
    mixed, labels = mix_traces([(a, weight), (b, 1 - weight)], 4000, np.random.default_rng(seed))
    share = labels.count("a") / len(labels)
    assert share == pytest.approx(weight, abs=5 * np.sqrt(weight * (1 - weight) / 4000))
    for label, prompt in zip(labels, mixed.prompt_tokens, strict=True):
        assert prompt == (10 if label == "a" else 99)


def test_slo_classes_by_ratio_are_seeded():
    trace = _trace("t", [5] * 1000, [3] * 1000)
    classes = [
        SLOClass("paying", 0.05, SLO(kind="latency", tbt_s=0.1, tier="paying")),
        SLOClass("free", 0.95, SLO(kind="latency", tbt_s=0.5, tier="free")),
    ]
    arrivals = np.arange(1000, dtype=float)
    first = build_requests(trace, arrivals, classes=classes, rng=np.random.default_rng(7))
    again = build_requests(trace, arrivals, classes=classes, rng=np.random.default_rng(7))
    assert first == again
    paying = sum(r.label == "paying" for r in first)
    assert 20 <= paying <= 90
    assert all(r.slo.tier == r.label for r in first)


def test_build_requests_caps_total_length():
    trace = _trace("t", [8000, 100], [500, 50])
    requests = build_requests(trace, np.array([0.0, 1.0]), max_total_tokens=8192)
    assert requests[0].prompt_tokens + requests[0].output_tokens <= 8192
    assert requests[1].output_tokens == 50
    with pytest.raises(ValueError, match="no timestamps"):
        build_requests(trace)
