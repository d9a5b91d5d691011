"""`qrf-length` (JITServe's length upper bound): features, fit/evaluate on real AlpacaEval
prompt/response pairs split by instruction, skops round trip and its type allow-list."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapt.component import ComponentError, read_component
from adapt.traces import MAX_TOKENS, Trace, load_trace, split_by_instruction
from predictors.qrf_length import QrfLength, response_prefixes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def alpaca_split():
    from tests.conftest import SHARED_DATA

    path = SHARED_DATA / "prompts" / "alpaca_eval_outputs.jsonl.gz"
    if not path.is_file():
        pytest.skip("../shared/data is not next to this checkout")
    trace = load_trace(path)
    keep = np.flatnonzero([hash_bucket < 120 for hash_bucket in _instruction_rank(trace.prompt_text)])
    trace = trace.take(keep)  # 120 instructions x 24 models: a few seconds to fit
    return split_by_instruction(trace, 0.3)


def _instruction_rank(texts):
    order = {text: rank for rank, text in enumerate(sorted(set(texts)))}
    return [order[t] for t in texts]


def test_prefixes_cut_after_g_tokens():
    prefixes = response_prefixes(["hello brave new world"], (0, 2, 99))
    assert prefixes[0] == [""]
    assert prefixes[2] == ["hello brave"]
    assert prefixes[99] == ["hello brave new world"]  # shorter than g: the whole response


def test_features_shape_and_generated_count():
    model = QrfLength(prompt_features=16, generated_features=8)
    rows = model.features([10, 100], ["a b", "c d e"], [0, 50], ["", "so far"])
    assert rows.shape == (2, 3 + 16 + 8)
    assert rows[1, 1] == 50 and rows[1, 2] == pytest.approx(np.log1p(50))


def test_fit_evaluate_and_tightening(alpaca_split):
    train, test = alpaca_split
    model = QrfLength(n_estimators=20).fit(train)
    metrics = model.evaluate(test)
    for g in (0, 50, 100, 200):
        assert 0.75 <= metrics[f"coverage_at_{g}"] <= 1.0
    # More text generated: on average a smaller bound on what is left.
    assert metrics["bound_mean_at_200"] < metrics["bound_mean_at_0"]
    bound = model.predict_bound([10], ["Write a haiku."], [0], [""])
    assert bound.shape == (1,) and bound[0] >= 1


def test_skops_round_trip_and_type_allow_list(alpaca_split, tmp_path, monkeypatch):
    train, _ = alpaca_split
    model = QrfLength(n_estimators=5).fit(train)
    model.save(tmp_path / "q")
    assert {p.suffix for p in (tmp_path / "q").iterdir()} == {".json", ".skops"}
    loaded = read_component(tmp_path / "q")
    args = ([20, 300], ["Tell me a joke.", "Summarise this paper"], [0, 100], ["", "The paper"])
    assert np.allclose(loaded.predict_bound(*args), model.predict_bound(*args))
    monkeypatch.setattr("predictors.qrf_length.TRUSTED_TYPES", ["sklearn.tree._tree.Tree"])
    with pytest.raises(ComponentError, match="refusing types"):
        read_component(tmp_path / "q")


@pytest.fixture(scope="module")
def small_forest():
    """A forest on 60 made-up prompts (lengths only, no response text): fitted in about a second."""
    rng = np.random.default_rng(0)
    prompts = [f"question {i} about {'code' if i % 2 else 'poems'}" for i in range(60)]
    trace = Trace(
        "made-up",
        prompt_tokens=rng.integers(5, 400, 60),
        output_tokens=rng.integers(1, 600, 60),
        prompt_text=prompts,
    )
    return QrfLength(n_estimators=5, prompt_features=16, generated_features=0, min_samples_leaf=5).fit(trace)


@pytest.mark.parametrize(
    ("prompt_tokens", "generated", "match"),
    [
        ([12, -5], [0, 0], "prompt_tokens"),
        ([12, float("nan")], [0, 0], "prompt_tokens"),
        ([12, 1e300], [0, 0], "prompt_tokens"),
        ([12, 30], [0, -1], "generated_tokens"),
        ([12, 30], [0, float("inf")], "generated_tokens"),
        ([12, 30], [0], "prompt_tokens: 2, generated_tokens: 1"),
    ],
)
def test_a_count_that_is_no_token_count_or_a_ragged_column_is_refused(prompt_tokens, generated, match):
    """log1p of -5 is NaN: such a row was a feature vector, and the bound a number, before."""
    model = QrfLength(prompt_features=16, generated_features=0)
    with pytest.raises(ValueError, match=match):
        model.features(prompt_tokens, ["a b", "c"], generated, ["", ""])


def test_no_requests_get_no_bounds(small_forest):
    assert small_forest.predict_bound([], [], [], []).shape == (0,)


def test_quantile_zero_is_asked_of_the_forest_not_replaced_by_the_default(small_forest):
    args = ([20, 300], ["question 3 about code", "question 4 about poems"], [0, 100], ["", ""])
    rows = small_forest.features(*args)
    lowest = np.maximum(1.0, small_forest.forest_.predict(rows, quantiles=0.0))
    np.testing.assert_allclose(small_forest.predict_bound(*args, quantile=0.0), lowest)
    assert (small_forest.predict_bound(*args, quantile=0.0) <= small_forest.predict_bound(*args)).all()


def test_a_quantile_outside_0_to_1_is_refused_for_one_request_or_many(small_forest):
    for count in (1, 8):  # one row: 'kth out of bounds' before; eight: numbers
        args = ([20] * count, ["question 3 about code"] * count, [0] * count, [""] * count)
        with pytest.raises(ValueError, match="quantile"):
            small_forest.predict_bound(*args, quantile=1.5)


def test_more_prompt_features_than_fitted_are_refused_not_routed_on_the_wrong_columns(small_forest):
    """A forest fitted on 16 prompt buckets asked with 48 (`set_params` on a fitted model): rows
    of 51 numbers on a 19-feature forest gave bounds before."""
    model = copy.deepcopy(small_forest).set_params(prompt_features=48)
    with pytest.raises(ValueError, match="fitted on 19 features"):
        model.predict_bound([20], ["question 3 about code"], [0], [""])


counts = st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.integers(0, 5000))


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(counts, counts, st.text(max_size=30)), max_size=10))
def test_any_counts_give_finite_bounds_of_at_least_one_or_a_value_error(small_forest, rows):
    prompt_tokens = [row[0] for row in rows]
    generated = [row[1] for row in rows]
    texts = [row[2] for row in rows]
    try:
        bounds = small_forest.predict_bound(prompt_tokens, texts, generated, [""] * len(rows))
    except ValueError:
        assert any(not 0 <= float(c) <= MAX_TOKENS for c in (*prompt_tokens, *generated))
        return
    assert bounds.shape == (len(rows),) and np.isfinite(bounds).all() and (bounds >= 1).all()
