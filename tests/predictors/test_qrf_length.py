"""`qrf-length` (JITServe's length upper bound): features, fit/evaluate on real AlpacaEval
prompt/response pairs split by instruction, skops round trip and its type allow-list."""

from __future__ import annotations

import numpy as np
import pytest

from adapt.component import ComponentError, read_component
from adapt.traces import load_trace, split_by_instruction
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
