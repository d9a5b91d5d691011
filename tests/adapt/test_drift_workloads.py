"""The drift workloads change their mix where they say, and only there."""

import numpy as np

from adapt.workloads import WORKLOADS
from adapt.workloads.drift import long_share_at, shift_time


def _long_share(requests, low: float, high: float) -> float:
    chosen = [r for r in requests if low <= r.arrival_s < high]
    return sum(r.label == "long" for r in chosen) / len(chosen)


def test_long_share_at_steps_or_ramps():
    times = np.array([0.0, 9.9, 10.0, 15.0, 20.0, 30.0])
    assert long_share_at(times, 10.0, 0.0, 0.3).tolist() == [0.0, 0.0, 0.3, 0.3, 0.3, 0.3]
    assert np.allclose(long_share_at(times, 10.0, 10.0, 0.3), [0.0, 0.0, 0.0, 0.15, 0.3, 0.3])
    assert shift_time(12.0, 5400, 1 / 3) == 150.0


def test_abrupt_and_gradual_scenarios():
    abrupt = WORKLOADS["drift-chat-to-summaries"]
    gradual = WORKLOADS["drift-chat-to-summaries-gradual"]
    requests = abrupt.build(abrupt.rate, 5400, 0)
    assert _long_share(requests, 0, 150) == 0.0
    assert 0.25 < _long_share(requests, 150, 450) < 0.35
    assert all(1024 <= r.prompt_tokens <= 4096 for r in requests if r.label == "long")
    assert all(32 <= r.prompt_tokens <= 512 for r in requests if r.label == "short")
    ramp = gradual.build(gradual.rate, 5400, 0)
    assert _long_share(ramp, 0, 150) == 0.0
    assert 0.05 < _long_share(ramp, 150, 300) < 0.25  # rising through the middle third
    assert 0.25 < _long_share(ramp, 300, 450) < 0.35
    assert [r.prompt_tokens for r in abrupt.build(12.0, 300, 3)] == [
        r.prompt_tokens for r in abrupt.build(12.0, 300, 3)
    ]
