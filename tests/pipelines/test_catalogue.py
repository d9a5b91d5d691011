"""The component catalogue is the one list of components: the CLI, the retrain loop, the quickstart
and the registry's entry points all agree with it."""

from adapt.component import component_class, known_components
from adapt.registry import Registry
from adapt.steplog import STEP_FIELDS
from experiments.quickstart import TRAINING
from pipelines.catalogue import CATALOGUE, TrainOptions, entry, evaluable, retrainers
from pipelines.outcome import Gate


def test_every_catalogue_component_is_loadable_by_name():
    assert set(CATALOGUE) == set(known_components()) - {"policy-config"}
    for name in CATALOGUE:
        assert component_class(name).name == name


def test_the_quickstart_trains_catalogue_components_in_catalogue_order():
    assert list(TRAINING) == [name for name in CATALOGUE if name in TRAINING]


def test_cli_choices_come_from_the_catalogue():
    from adapt.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["train", "pattern-graph"]).component == "pattern-graph"
    assert evaluable() == ["semantic-history", "qrf-length", "neural-length", "pattern-graph"]
    assert set(retrainers()) == {
        "cost-model",
        "ewsjf-meta-policy",
        "semantic-history",
        "qrf-length",
        "neural-length",
        "pattern-graph",
    }


def test_unknown_component_is_a_clear_error():
    import pytest

    with pytest.raises(ValueError, match="unknown component 'nope'; expected one of cost-model, slai-offset"):
        entry("nope")


def test_cost_model_requires_data_through_the_cli(tmp_path, capsys):
    from adapt.cli import main

    code = main(["--tracking-uri", f"sqlite:///{tmp_path / 'r.db'}", "train", "cost-model"])
    assert code == 2
    assert "cost-model: --data is required (a step log" in capsys.readouterr().err


def test_train_options_reach_the_pipeline(tmp_path):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 2048, 200)
    frame = pd.DataFrame({name: 0 for name in STEP_FIELDS}, index=range(200))  # prefills, none cached
    frame["tokens"], frame["sampled"], frame["duration_s"] = tokens, 1, 0.004 + 1e-5 * tokens
    path = tmp_path / "steps.csv"
    frame.to_csv(path, index=False)
    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "cache")
    outcome = entry("cost-model").train(registry, TrainOptions(data=str(path), promote_if_better=True))
    assert outcome.version == 1 and outcome.promoted and outcome.metrics["mape"] < 0.01


def test_gate_rule_by_hand():
    lower = Gate("mape", lower_is_better=True, margin=0.1)
    assert lower.passes({"mape": 0.089}, {"mape": 0.1})
    assert not lower.passes({"mape": 0.091}, {"mape": 0.1})
    assert lower.passes({"mape": 5.0}, None)
    higher = Gate("reward", lower_is_better=False, margin=0.1)
    assert higher.passes({"reward": -0.89}, {"reward": -1.0})  # relative to |champion|
    assert not higher.passes({"reward": 1.09}, {"reward": 1.0})
    feasible = Gate("ttft_p50", lower_is_better=True, feasible="feasible")
    assert not feasible.passes({"ttft_p50": 0.1, "feasible": False}, None)
    assert feasible.passes({"ttft_p50": 9.0, "feasible": True}, {"ttft_p50": 0.1, "feasible": False})
