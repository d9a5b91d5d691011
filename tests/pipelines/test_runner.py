"""The pipeline runner's contract, on the real `cost-model` component and a real sqlite registry:
steps recorded, a failing step registers nothing, a candidate that wins offline but schedules worse
in replay is registered and not promoted, a promotion lost after registering is done by the next
pass, a champion that cannot be loaded is replaced."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from adapt.registry import Registry, StoreLocked
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


def test_a_promotion_lost_after_registering_is_done_by_the_next_pass_on_the_same_data(registry, monkeypatch):
    """The store's aliases lock busy past its wait (or MLflow unreachable, or the job killed) after
    the version was registered: the next pass found the data unchanged and skipped, for ever."""
    frame = step_log(0.1)

    def busy(*args, **kwargs):
        raise StoreLocked("aliases lock busy: a rollback was running")

    with monkeypatch.context() as patch:
        patch.setattr(Registry, "promote", busy)
        with pytest.raises(StoreLocked):
            run_pipeline(spec(), registry, frame, promote_if_better=True, skip_unchanged=True)
    assert registry.resolve("cost-model", missing_ok=True) is None
    again = run_pipeline(spec(), registry, frame, promote_if_better=True, skip_unchanged=True)
    assert (again.version, again.promoted, registry.resolve("cost-model", missing_ok=True)) == (1, True, 1)
    assert "promoted now" in again.note and "gate_promote" not in again.metrics
    assert [v.version for v in registry.versions("cost-model")] == [1]  # not registered again
    assert run_pipeline(spec(), registry, frame, promote_if_better=True, skip_unchanged=True).version is None


def test_unchanged_data_promotes_neither_a_rolled_back_version_nor_one_logged_before_the_gates_decision(
    registry,
):
    """A version promoted and then rolled back, and one registered before versions recorded their
    gate's decision (whose promotion, if any, cannot be told from a rollback), stay as they are."""
    noisy, clean, third = step_log(0.5), step_log(0.0, seed=1), step_log(0.2, seed=2)
    run_pipeline(spec(), registry, noisy, promote_if_better=True, skip_unchanged=True)
    assert run_pipeline(spec(), registry, clean, promote_if_better=True, skip_unchanged=True).promoted
    assert registry.rollback("cost-model") == 1
    assert run_pipeline(spec(), registry, clean, promote_if_better=True, skip_unchanged=True).version is None
    legacy = FittedCostModel().fit(by_time(third).train)
    assert registry.log(legacy, metrics={"mape": 0.01}) == 3  # as versions were logged before
    assert run_pipeline(spec(), registry, third, promote_if_better=True, skip_unchanged=True).version is None
    assert registry.resolve("cost-model") == 1


def _drop_checksum(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    registry.client.delete_model_version_tag("cost-model", "1", "adapt.manifest_sha256")


def _bump_schema(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """A code upgrade that changed the component's format: the old champion no longer reads."""
    monkeypatch.setattr(FittedCostModel, "schema_version", FittedCostModel.schema_version + 1)


@pytest.mark.parametrize(
    ("breaks", "error"),
    [(_drop_checksum, "BrokenVersion"), (_bump_schema, "ComponentError")],
    ids=["no-checksum", "new-schema"],
)
def test_a_champion_that_cannot_be_loaded_is_replaced(registry, monkeypatch, breaks, error):
    """Servers refuse such a champion; held against every candidate, it failed each retrain that
    could replace it. The candidate is compared with nothing, and the outcome says why."""
    run_pipeline(spec(), registry, step_log(0.0), promote_if_better=True)
    breaks(registry, monkeypatch)
    outcome = run_pipeline(spec(), registry, step_log(0.5, seed=1), promote_if_better=True)
    assert (outcome.version, outcome.promoted, outcome.champion_metrics) == (2, True, None)
    assert outcome.note.startswith(f"the cost-model champion cannot be loaded ({error}: ")
    assert outcome.note.endswith(": compared with nothing")
    assert registry.resolve("cost-model") == 2
