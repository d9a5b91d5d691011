"""`experiments.length_bounds --json`: the figures it prints, written as JSON, from a real forest."""

from __future__ import annotations

import json

import pytest

from adapt.traces import TraceError, load_trace, split_by_instruction
from adapt.workloads import bundled
from experiments import length_bounds
from predictors.qrf_length import QrfLength


def test_json_holds_the_printed_figures_of_each_predictor(tmp_path, monkeypatch, capsys):
    data = bundled("alpaca_eval_lengths.jsonl.gz")
    # one real forest (count features only: fast), not the network, whose embeddings take minutes
    monkeypatch.setattr(
        length_bounds,
        "fit_predictors",
        lambda train: {"qrf-length (count only)": (QrfLength(generated_features=0).fit(train), 1.5)},
    )
    out = tmp_path / "bounds.json"
    length_bounds.main(["--data", str(data), "--no-replay", "--json", str(out)])

    report = json.loads(out.read_text())
    train, test = split_by_instruction(load_trace(str(data)), 0.3)
    assert (report["train"], report["held_out"]) == (len(train), len(test))
    assert report["goodput"] is None  # --no-replay
    figures = report["predictors"]["qrf-length (count only)"]
    assert figures["fit_s"] == 1.5
    for g in length_bounds.POINTS:
        assert 0.0 <= figures[f"coverage_at_{g}"] <= 1.0
        assert figures[f"bound_mean_at_{g}"] >= 1.0
    assert figures["new_prompt_ms"] > 0 and figures["refresh_ms"] > 0 and figures["per_request_ms"] > 0
    printed = capsys.readouterr().out
    assert f"| qrf-length (count only) | 1.5 | {figures['coverage_at_0']:.3f} / " in printed
    assert f"{figures['per_request_ms']:.4f} |" in printed


def test_a_missing_data_file_is_named_before_anything_is_fitted(tmp_path, monkeypatch):
    monkeypatch.setattr(length_bounds, "fit_predictors", lambda train: pytest.fail("fitted without data"))
    with pytest.raises(TraceError, match=r"absent\.jsonl: no such file"):
        length_bounds.main(["--data", str(tmp_path / "absent.jsonl"), "--no-replay"])
