"""`cost-model` (`predictors.cost_model`): the fit recovers known constants, including the intake
time per arrival that the replay engine charges between steps."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapt.steplog import ARRIVALS, STEP_FIELDS, StepBatch
from predictors.cost_model import FEATURES, FittedCostModel


def step_log(n: int = 400, seed: int = 0) -> dict[str, np.ndarray]:
    """Steps whose duration is 2 ms + 10 us per token + 3 ms per arriving request, exactly."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 2048, n).astype(float)
    arrivals = rng.integers(0, 3, n).astype(float)
    return {
        **{name: np.zeros(n) for name in STEP_FIELDS},  # prefills of nothing cached, no decodes
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


def test_r2_on_steps_of_one_duration_is_1_only_for_an_exact_model_as_scikit_learn_says():
    from sklearn.metrics import r2_score

    model = FittedCostModel().fit(step_log())
    flat = step_log(n=32, seed=2)
    flat["duration_s"] = np.full(32, 2.0**-7)  # every step took 7.8 ms (a mean exact in binary)
    assert model.evaluate(flat)["r2"] == r2_score(flat["duration_s"], model.predict(flat)) == 0.0
    exact = step_log(n=30, seed=2)
    exact["tokens"] = np.full(30, 500.0)
    exact[ARRIVALS] = np.zeros(30)
    exact["duration_s"] = model.predict(exact)  # constant, and predicted exactly
    assert model.evaluate(exact)["r2"] == 1.0


def test_evaluating_no_steps_is_a_clear_error():
    model = FittedCostModel().fit(step_log())
    empty = {key: values[:0] for key, values in step_log().items()}
    with pytest.raises(ValueError, match="no steps to evaluate"):
        model.evaluate(empty)


@pytest.mark.parametrize("missing", STEP_FIELDS)
def test_a_missing_step_column_is_an_error_not_zeros(missing):
    log = step_log()
    del log[missing]
    with pytest.raises(ValueError, match=f"step column.*{missing} missing"):
        FittedCostModel().fit(log)
    model = FittedCostModel().fit(step_log())
    with pytest.raises(ValueError, match=f"{missing} missing"):
        model.predict(log)


def test_a_misspelt_or_unknown_column_is_refused_by_predict_but_a_logs_notes_are_not_read():
    model = FittedCostModel().fit(step_log())
    log = step_log(n=30, seed=3)
    misspelt = {("arrival" if key == ARRIVALS else key): values for key, values in log.items()}
    with pytest.raises(ValueError, match=r"unknown step column.*arrival"):
        model.predict(misspelt)
    noted = {**log, "gpu": ["H100"] * 30, "eager_s": np.ones(30)}  # as the bundled H100 logs
    assert model.evaluate(noted) == model.evaluate(log)
    assert model.speed_factor(noted) == model.speed_factor(log)
    FittedCostModel().fit(noted)


@pytest.mark.parametrize("column", [*STEP_FIELDS, ARRIVALS])
def test_a_negative_or_nan_count_is_refused(column):
    model = FittedCostModel().fit(step_log())
    for bad in (-1.0, float("nan")):
        log = step_log(n=30, seed=4)
        log[column] = log[column].copy()
        log[column][3] = bad
        with pytest.raises(ValueError, match=f"{column}: expected counts >= 0"):
            model.predict(log)
        with pytest.raises(ValueError, match=f"{column}: expected counts >= 0"):
            FittedCostModel().fit(log)


FITTED = FittedCostModel().fit(step_log())
COUNTS = st.one_of(st.integers(0, 10**6), st.floats(0, 1e9), st.floats())  # NaN, inf, negatives


@settings(max_examples=200, deadline=None)
@given(
    logged=st.fixed_dictionaries(
        {name: COUNTS for name in STEP_FIELDS}, optional={ARRIVALS: COUNTS, "start_s": st.floats()}
    ),
    dropped=st.sets(st.sampled_from(STEP_FIELDS), max_size=2),
    misspelt=st.sets(st.sampled_from(["arrival", "decode_ctx", "Tokens"]), max_size=1),
)
def test_any_step_columns_give_one_non_negative_time_or_a_value_error(logged, dropped, misspelt):
    """One step's columns, some dropped, some misspelt, any value: a time only with every step
    column, no unknown key and every count >= 0; else a ValueError, never a time from zeros."""
    columns = {key: value for key, value in logged.items() if key not in dropped}
    columns |= {key: 1.0 for key in misspelt}
    counts = [value for key, value in columns.items() if key in (*STEP_FIELDS, ARRIVALS)]
    if dropped or misspelt or not all(value >= 0 for value in counts):
        with pytest.raises(ValueError, match="cost-model"):
            FITTED.predict(columns)
        return
    times = FITTED.predict(columns)
    assert times.shape == (1,) and np.isfinite(times).all() and times[0] >= FITTED.coef_[0]


@pytest.mark.parametrize("capacity", ["50000", 0, 2.5, True])
def test_a_kv_capacity_that_is_no_token_count_is_refused_at_fit_and_at_load(capacity, tmp_path):
    """It was never checked: saved as a string, it loaded as one, to fail inside the replay engine."""
    message = f"kv_capacity: expected a whole number of tokens >= 1, got {capacity!r}"
    with pytest.raises(ValueError, match=message):
        FittedCostModel(kv_capacity=capacity).fit(step_log())
    FittedCostModel().fit(step_log()).save_state(tmp_path)
    with pytest.raises(ValueError, match=message):
        FittedCostModel(kv_capacity=capacity).load_state(tmp_path)
