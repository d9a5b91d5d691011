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


def test_at_speed_scales_every_step_and_intake_and_leaves_the_model_as_it_was():
    model = FittedCostModel().fit(step_log())
    slow = model.at_speed(1.5)
    batch = StepBatch(tokens=100.0, sampled=1.0)
    assert slow.time(batch) == pytest.approx(1.5 * (0.002 + 1e-3), rel=1e-6)
    assert slow.arrival_overhead_s == pytest.approx(1.5 * 0.003, rel=1e-6)
    assert model.time(batch) == pytest.approx(0.002 + 1e-3, rel=1e-6)
    run = (4, 100, 50, 3)  # decodes, context sum, context max, steps
    np.testing.assert_allclose(slow.decode_run_times(*run), 1.5 * model.decode_run_times(*run))
    assert slow.kv_capacity_tokens() == model.kv_capacity_tokens()  # the engine's KV is not the CPU's
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="speed factor"):
            model.at_speed(bad)


def test_speed_factor_is_measured_time_over_modelled_time_for_the_same_batches():
    model = FittedCostModel().fit(step_log())
    log = step_log(n=50, seed=1)
    assert model.speed_factor(log) == pytest.approx(1.0, rel=1e-6)
    # two steps of the log, by hand: 2 ms + 10 us x tokens + 3 ms x arrivals each
    two = {key: values[:2] for key, values in log.items()}
    modelled = 2 * 0.002 + 1e-5 * two["tokens"].sum() + 0.003 * two[ARRIVALS].sum()
    two["duration_s"] = np.array([modelled, 0.0])  # the first step took both steps' modelled time
    assert model.speed_factor(two) == pytest.approx(1.0, rel=1e-6)
    two["duration_s"] = np.array([modelled, modelled])
    assert model.speed_factor(two) == pytest.approx(2.0, rel=1e-6)
