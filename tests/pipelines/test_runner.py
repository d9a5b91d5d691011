"""The pipeline runner's contract, on the real `cost-model` component and a real sqlite registry:
steps recorded, a failing step registers nothing, a candidate that wins offline but schedules worse
in replay is registered and not promoted."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from adapt.registry import Registry
from adapt.steplog import STEP_FIELDS
from pipelines.runner import PipelineSpec, Split, run_pipeline
from predictors.cost_model import FittedCostModel


def step_log(noise: float, seed: int = 0, n: int = 400) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 2048, n).astype(float)
    frame = pd.DataFrame({name: np.zeros(n) for name in STEP_FIELDS})  # prefills of nothing cached
    frame["tokens"], frame["sampled"] = tokens, np.ones(n)
    frame["duration_s"] = (0.004 + 3e-5 * tokens) * (1 + noise * rng.random(n))
    return frame


def by_time(frame: pd.DataFrame) -> Split:
    cut = int(len(frame) * 0.8)
    return Split(frame.iloc[:cut], frame.iloc[cut:], {"source": "test", "train_steps": cut})


def spec(**overrides) -> PipelineSpec:
    return PipelineSpec(
        "cost-model", "mape", lower_is_better=True, build=FittedCostModel, split=by_time, **overrides
    )


@pytest.fixture
def registry(tmp_path):
    return Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")


def test_steps_are_timed_and_recorded_on_the_version(registry, capsys):
    outcome = run_pipeline(spec(), registry, step_log(0.1), promote_if_better=True)
    assert outcome.version == 1 and outcome.promoted
    for step in ("split", "fit", "evaluate"):
        assert outcome.metrics[f"seconds_{step}"] >= 0
    err = capsys.readouterr().err
    assert "[cost-model] fit done in" in err and "[cost-model] evaluate done in" in err
    run = registry.client.get_run(registry.versions("cost-model")[0].run_id)
    assert "seconds_fit" in run.data.metrics and run.data.tags["adapt.data_window"]


def test_a_failing_step_registers_nothing_and_keeps_the_champion(registry):
    run_pipeline(spec(), registry, step_log(0.1), promote_if_better=True)

    def broken(model, test):
        raise RuntimeError("scoring failed")

    with pytest.raises(RuntimeError, match="scoring failed"):
        run_pipeline(spec(evaluate=broken), registry, step_log(0.0, seed=1), promote_if_better=True)
    assert [v.version for v in registry.versions("cost-model")] == [1]
    assert registry.resolve("cost-model") == 1


def replay_scores(candidate: float, champion: float):
    """A replay check returning `candidate` on its first call and `champion` on its second (the
    runner replays the candidate first), each given the split's held-out part."""
    calls = []

    def replay(registry, model, held_out):
        assert held_out is not None
        calls.append(model)
        return candidate if len(calls) == 1 else champion

    return replay


def test_a_replay_regression_blocks_promotion(registry, capsys):
    def checked(candidate: float, champion: float) -> PipelineSpec:
        return spec(replay=replay_scores(candidate, champion), replay_metric="replay_goodput_tokens")

    run_pipeline(checked(100.0, 100.0), registry, step_log(0.5), promote_if_better=True, replay=True)
    outcome = run_pipeline(
        checked(90.0, 100.0), registry, step_log(0.0, 2), promote_if_better=True, replay=True
    )
    assert outcome.metrics["mape"] < outcome.champion_metrics["mape"]  # better offline ...
    assert outcome.version == 2 and not outcome.promoted  # ... but 10% worse in replay
    assert registry.resolve("cost-model") == 1
    assert "is worse than the champion's" in capsys.readouterr().err
    tolerated = run_pipeline(
        checked(99.0, 100.0), registry, step_log(0.0, 3), promote_if_better=True, replay=True
    )
    assert tolerated.promoted  # 1% worse is within the default 2% tolerance


def test_unchanged_data_is_skipped(registry):
    frame = step_log(0.1)
    assert run_pipeline(spec(), registry, frame, skip_unchanged=True).version == 1
    assert run_pipeline(spec(), registry, frame, skip_unchanged=True).version is None
