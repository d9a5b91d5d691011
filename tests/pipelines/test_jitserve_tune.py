"""`adapt tune jitserve`: the fairness-constrained score by hand, the parameter mapping, and a
small study end to end (a policy-config registered, every class within 10 points of EDF's)."""

from __future__ import annotations

import pytest

from adapt.cli import main
from adapt.registry import Registry
from pipelines.jitserve_tune import FAIRNESS_POINTS, JitserveObjective, policy_params, score

EDF = {
    "goodput_tokens": 1000.0,
    "by_class": {"latency": {"slo_attainment": 1.0}, "deadline": {"slo_attainment": 0.8}},
}


def metrics(goodput: float, latency: float, deadline: float, dropped: int = 0) -> dict:
    return {
        "goodput_tokens": goodput,
        "dropped": dropped,
        "by_class": {"latency": {"slo_attainment": latency}, "deadline": {"slo_attainment": deadline}},
    }


def test_a_fair_trial_scores_minus_its_goodput_share_of_edfs():
    value, record = score(metrics(1200.0, 0.95, 0.70), EDF)  # 0.95 >= 0.90 and 0.70 >= 0.70: fair
    assert value == pytest.approx(-1.2)
    assert record["fair"] and record["shortfall"] == 0.0
    assert record["latency_attainment_edf"] == 1.0 and record["deadline_attainment"] == 0.70


def test_an_unfair_trial_scores_its_shortfall_and_loses_to_any_fair_one():
    # latency 0.44 is 0.46 short of 0.90; deadline 0.55 is 0.15 short of 0.70
    value, record = score(metrics(2500.0, 0.44, 0.55, dropped=900), EDF)
    assert value == pytest.approx(0.46 + 0.15)
    assert not record["fair"] and record["dropped"] == 900
    fair, _ = score(metrics(10.0, 1.0, 1.0), EDF)
    assert fair < 0 < value


def test_a_class_missing_from_the_trial_counts_as_attaining_nothing():
    value, _ = score({"goodput_tokens": 1.0, "dropped": 0, "by_class": {}}, EDF)
    assert value == pytest.approx((1.0 - FAIRNESS_POINTS) + (0.8 - FAIRNESS_POINTS))


def test_policy_params_scale_the_batch_share_to_the_running_cap():
    point = {"batch_share": 48 / 256, "waiting_time_s": 5.0, "fairness": 0.1, "delta": 8.0}
    assert policy_params(point, 256) == {
        "batch_size": 48,
        "waiting_time_s": 5.0,
        "fairness": 0.1,
        "delta": 8.0,
    }
    assert policy_params({**point, "batch_share": 0.001}, 256)["batch_size"] == 1


def test_objective_replays_jitserve_against_edf_at_each_rate_and_keeps_the_worse():
    objective = JitserveObjective(rates=(2.0, 3.0), num_requests=60, seed=3)
    no_cap = {"batch_share": 1.0, "waiting_time_s": 60.0, "fairness": 0.0, "delta": 8.0}
    value, record = objective(no_cap)
    for rate in ("2", "3"):
        assert record[f"latency_attainment_edf_at_{rate}"] >= 0.0 and record[f"goodput_tokens_at_{rate}"] > 0
    assert record["shortfall"] == record["shortfall_at_2"] + record["shortfall_at_3"]
    assert record["goodput_vs_edf"] == min(record["goodput_vs_edf_at_2"], record["goodput_vs_edf_at_3"])
    assert value == (record["shortfall"] if record["shortfall"] > 0 else -record["goodput_vs_edf"])


@pytest.mark.slow
def test_tune_jitserve_registers_a_policy_config(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'j.db'}"
    assert main(["--tracking-uri", uri, "tune", "jitserve", "--trials", "4", "--num-requests", "120"]) == 0
    out = capsys.readouterr().out
    assert "policy-config: registered version 1 (not promoted)" in out
    registry = Registry(uri, cache_dir=tmp_path / "c")
    assert registry.resolve("policy-config", missing_ok=True) is None  # the operator promotes it
    policy = registry.load("policy-config", version=1).build()
    assert policy.name == "jitserve" and 1 <= policy.batch_size <= 256


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        (["jitserve", "--storage", "sqlite:////tmp/never.db"], "--storage"),
        (["slai", "--storage", "sqlite:////tmp/never.db"], "--storage"),  # was accepted and ignored
        (["ewsjf", "--overlap", "step"], "--overlap"),
        (["ewsjf", "--online", "--trials", "3"], "--trials"),
        (["ewsjf", "--online", "--storage", "sqlite:////tmp/never.db"], "--storage"),
        (["slai", "--online"], "--online"),
    ],
)
def test_tune_refuses_an_option_the_tuner_would_not_use(capsys, args, refused):
    assert main(["tune", *args]) == 2
    assert refused in capsys.readouterr().err
