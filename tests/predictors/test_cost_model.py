"""`cost-model` (`predictors.cost_model`): the fit recovers known constants, including the intake
time per arrival that the replay engine charges between steps."""

import json

import numpy as np
import pytest

from adapt.steplog import ARRIVALS, StepBatch
from predictors.cost_model import FEATURES, FittedCostModel


def step_log(n: int = 400, seed: int = 0) -> dict[str, np.ndarray]:
    """Steps whose duration is 2 ms + 10 us per token + 3 ms per arriving request, exactly."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 2048, n).astype(float)
    arrivals = rng.integers(0, 3, n).astype(float)
    return {
        "tokens": tokens,
        "sampled": np.ones(n),
        ARRIVALS: arrivals,
        "duration_s": 0.002 + 1e-5 * tokens + 0.003 * arrivals,
    }


def test_fit_recovers_the_intake_time_per_arrival_and_keeps_it_out_of_the_step():
    model = FittedCostModel().fit(step_log())
    assert model.arrival_overhead_s == pytest.approx(0.003, rel=1e-6)
    # A step's own time has no intake in it: the engine charges that per arrival, between steps.
    assert model.time(StepBatch(tokens=100.0, sampled=1.0)) == pytest.approx(0.002 + 1e-3, rel=1e-6)


def test_a_log_without_arrivals_fits_no_intake_time():
    log = step_log()
    log["duration_s"] = log["duration_s"] - 0.003 * log.pop(ARRIVALS)
    assert FittedCostModel().fit(log).arrival_overhead_s == 0.0


def test_coefficients_saved_before_arrivals_were_logged_still_load(tmp_path):
    old = {"features": list(FEATURES[:-1]), "coef": [0.002, 1e-5, 0.0, 0.0, 0.0, 0.0]}
    (tmp_path / "coefficients.json").write_text(json.dumps(old))
    model = FittedCostModel()
    model.load_state(tmp_path)
    assert model.arrival_overhead_s == 0.0
    assert model.time(StepBatch(tokens=100.0, sampled=1.0)) == pytest.approx(0.003)
