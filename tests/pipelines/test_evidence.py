"""Minimum evidence before a model is registered, and sanity before it is promoted: real components,
a real sqlite store. Each case registered (and with `--promote-if-better` promoted) a junk model
before: too few steps or prompts, durations of zero or 1e300, a "0.95 bound" covering nothing."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd
import pytest

from adapt.component import ComponentError
from adapt.registry import Registry
from adapt.traces import Trace
from pipelines.cost_model import train_cost_model
from pipelines.jitserve import train_qrf_length
from pipelines.outcome import Gate, register_and_gate
from predictors.cost_model import FittedCostModel
from predictors.qrf_length import QrfLength
from tests.pipelines.test_runner import step_log
from tests.predictors.test_estimator_conformance import prompt_responses


@pytest.fixture
def registry(tmp_path):
    return Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")


def timed(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(start_s=np.arange(len(frame)) * 0.05)


def test_too_few_steps_are_refused_before_fitting(registry):
    with pytest.raises(ValueError, match="cost-model: held-out part has 6 steps; needs at least 10"):
        train_cost_model(registry, timed(step_log(0.1, n=30)))
    with pytest.raises(ValueError, match="cost-model: training part has 4 steps; needs at least 20"):
        train_cost_model(registry, timed(step_log(0.1, n=5)))
    with pytest.raises(ValueError, match="training data has 5 steps; needs at least 20"):
        FittedCostModel().fit(step_log(0.1, n=5))
    assert registry.names() == []


@pytest.mark.parametrize("duration", [0.0, 1e300])
def test_an_unphysical_cost_model_is_never_registered_or_promoted(registry, duration):
    champion = train_cost_model(registry, timed(step_log(0.1)), promote_if_better=True)
    assert champion.promoted
    junk = timed(step_log(0.1, seed=1)).assign(duration_s=duration)
    with pytest.raises(ComponentError, match=r"implausible.*candidate not registered"):
        train_cost_model(registry, junk, promote_if_better=True)
    assert [v.version for v in registry.versions("cost-model")] == [1]
    assert registry.resolve("cost-model") == 1


def test_held_out_step_times_must_be_physical():
    model = FittedCostModel().fit(step_log(0.1))
    metrics = model.evaluate(step_log(0.1, seed=1))
    model.check_metrics(metrics)  # a sane model passes
    assert 0 < metrics["predicted_min_s"] <= metrics["predicted_max_s"] < 1.0
    with pytest.raises(ComponentError, match=r"predicted 0\.\.0\.07 s"):
        model.check_metrics({**metrics, "predicted_min_s": 0.0, "predicted_max_s": 0.07})
    with pytest.raises(ComponentError, match="less than 3600 s"):
        model.check_metrics({**metrics, "predicted_max_s": 7200.0})
    with pytest.raises(ComponentError, match="not finite: mape, r2"):
        model.check_metrics({**metrics, "r2": float("nan"), "mape": float("inf")})


def alpaca_rows(instructions: int) -> list[dict]:
    from adapt.workloads import bundled

    with gzip.open(bundled("alpaca_eval_lengths.jsonl.gz"), "rt") as handle:
        rows = [json.loads(line) for line in handle]
    keep = set(sorted({r["instruction"] for r in rows})[:instructions])
    return [r for r in rows if r["instruction"] in keep]


def test_qrf_length_refuses_a_three_row_file_and_prompt_less_data(registry, tmp_path):
    three = tmp_path / "three.jsonl"
    three.write_text("".join(json.dumps(r) + "\n" for r in alpaca_rows(3)[::24][:3]))
    with pytest.raises(ValueError, match=r"qrf-length: training part has [0-3] distinct prompts; needs at"):
        train_qrf_length(registry, three, promote_if_better=True)
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps(r) + "\n" for r in alpaca_rows(6)))
    with pytest.raises(ValueError, match="distinct prompts; needs at least 10"):
        train_qrf_length(registry, few, promote_if_better=True)
    from adapt.workloads import bundled

    with pytest.raises(ValueError, match="qrf-length needs prompt texts"):
        train_qrf_length(registry, bundled("sharegpt_lengths.csv.gz"))
    lengths_only = Trace("lengths", np.full(50, 10), np.full(50, 100))
    with pytest.raises(ValueError, match="training data has 0 distinct prompts"):
        QrfLength().fit(lengths_only)
    assert registry.names() == []


def test_a_bound_far_from_its_quantile_is_refused(registry):
    small = {"n_estimators": 4, "max_depth": 4, "min_samples_leaf": 2, "prompt_features": 16}
    bound = QrfLength(**small).fit(prompt_responses())
    held_out = prompt_responses(seed=1)
    metrics = bound.evaluate(held_out)
    bound.check_metrics(metrics)  # its own kind of data: coverage near 0.95
    longer = Trace(
        "ten-times-longer",
        held_out.prompt_tokens,
        held_out.output_tokens * 10,
        prompt_text=held_out.prompt_text,
        columns={"output_text": [" ".join(["token"] * n) for n in held_out.output_tokens * 10]},
    )
    missed = bound.evaluate(longer)
    assert missed["coverage_error"] > 0.5
    gate = Gate("pinball_loss", lower_is_better=True)
    with pytest.raises(ComponentError, match=r"misses its quantile 0\.95 by 0\.9.*candidate not registered"):
        register_and_gate(registry, bound, missed, None, gate, promote_if_better=True)
    assert registry.names() == []
    assert register_and_gate(registry, bound, metrics, None, gate, promote_if_better=True).promoted


def test_a_cost_model_champion_that_cannot_be_loaded_does_not_block_its_refit(registry):
    # `train_cost_model` read the champion's KV capacity before the pipeline ran: a champion that
    # no longer loads failed every refit that could replace it.
    train_cost_model(registry, timed(step_log(0.1)), promote_if_better=True)
    registry.client.delete_model_version_tag("cost-model", "1", "adapt.manifest_sha256")
    outcome = train_cost_model(registry, timed(step_log(0.1, seed=1)), promote_if_better=True)
    assert (outcome.version, outcome.promoted) == (2, True) and registry.resolve("cost-model") == 2
