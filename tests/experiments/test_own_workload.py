"""The own-workload verdict by hand: who may win, and what the ceiling says."""

from __future__ import annotations

from typing import Any

import pytest

from adapt.workloads import WORKLOADS
from experiments.own_workload import TARGETS, barred_in_any_seed, engine_settings, mean_metrics, verdict

SAGESCHED = next(t for t in TARGETS if t.workload == "sagesched-mix")
JITSERVE = next(t for t in TARGETS if t.workload == "jitserve-mix")


def run(ttlt: float, dropped: int = 0) -> dict[str, float]:
    return {"ttlt_mean": ttlt, "dropped": dropped, "num_requests": 100}


def table(learned: float, ceiling: float) -> dict[str, dict[str, float]]:
    return {
        "fcfs": run(40.0),
        "spf:victim=newest": run(36.0),
        "fastserve": run(30.0, dropped=5),  # lowest, but it dropped requests: may not win
        "sagesched": run(learned),
        SAGESCHED.ceiling: run(ceiling),
    }


def test_the_ceiling_never_wins_and_says_how_much_of_its_lead_the_policy_reached():
    outcome = verdict(SAGESCHED, table(learned=35.0, ceiling=32.0))
    assert outcome["winner"] == "sagesched" and outcome["met"]  # the ceiling (32 s) is not a contender
    assert outcome["best_baseline"] == "spf:victim=newest"
    assert outcome["ceiling"] == 32.0
    assert outcome["ceiling_gain"] == pytest.approx(32.0 / 36.0 - 1.0)
    assert outcome["ceiling_share_reached"] == pytest.approx((36.0 - 35.0) / (36.0 - 32.0))


def test_a_tie_with_the_baseline_misses_and_reaches_none_of_the_ceiling():
    outcome = verdict(SAGESCHED, table(learned=36.5, ceiling=36.0))
    assert outcome["winner"] == "spf:victim=newest" and not outcome["met"]
    assert outcome["ceiling_gain"] == 0.0 and outcome["ceiling_share_reached"] is None


def test_jitserve_needs_085_of_its_oracle_up_to_15x_and_080_from_3x():
    def goodput(value: float, dropped: int = 0) -> dict[str, float]:
        return {"goodput_tokens": value, "dropped": dropped, "num_requests": 100}

    table = {
        "fcfs": goodput(100.0),
        "spf:victim=newest": goodput(300.0),
        "jitserve": goodput(820.0, dropped=70),  # drops count against goodput, not eligibility
        "jitserve-oracle": goodput(1000.0, dropped=67),
    }
    assert [verdict(JITSERVE, table, scale)["met"] for scale in (1.0, 1.5, 3.0, 4.0)] == [
        False,
        False,
        True,
        True,
    ]
    assert verdict(JITSERVE, table, 3.0)["of_oracle"] == pytest.approx(0.82)


SLAI = next(t for t in TARGETS if t.workload == "slai-tiers")


def slai_run(ttft_p50: float, paying_tbt_p99: float | None) -> dict[str, Any]:
    tiers = {"paying": {"tbt_p99": paying_tbt_p99}, "free": {"tbt_p99": 0.2}}
    return {"ttft_p50": ttft_p50, "dropped": 0, "num_requests": 100, "by_class": tiers}


def test_a_tbt_slo_missed_in_one_seed_bars_slai_though_the_seeds_mean_meets_it():
    """Paying P99 TBT 0.13, 0.08, 0.08 s against its 0.1 s SLO: the mean (0.097) would pass."""
    seeds = {
        "fcfs": [slai_run(1.0, 0.05)] * 3,
        "sarathi": [slai_run(1.0, 0.05)] * 3,
        "slai": [slai_run(0.5, 0.13), slai_run(0.5, 0.08), slai_run(0.5, 0.08)],
    }
    table = {name: mean_metrics(runs) for name, runs in seeds.items()}
    assert table["slai"]["by_class"]["paying"]["tbt_p99"] == pytest.approx(0.29 / 3)
    assert verdict(SLAI, table)["met"]  # on the means alone it would pass
    barred = {name: barred_in_any_seed(SLAI.headline, runs, seeds["fcfs"]) for name, runs in seeds.items()}
    assert barred["slai"] == "misses the paying TBT SLO"
    outcome = verdict(SLAI, table, barred=barred)
    assert not outcome["met"] and not outcome["learned_eligible"]


def test_a_tier_with_no_p99_tbt_cannot_show_its_slo_met():
    missing = slai_run(0.5, None)
    assert barred_in_any_seed(SLAI.headline, [missing], [slai_run(1.0, 0.05)]) == "misses the paying TBT SLO"
    assert mean_metrics([slai_run(0.5, 0.05), missing])["by_class"]["paying"]["tbt_p99"] is None


def test_the_engine_settings_are_the_workloads_and_a_policy_with_its_own_is_named():
    config = WORKLOADS["jitserve-mix"].engine_config()
    same = {"token_budget": config.token_budget, "max_running": config.max_running}
    table = {
        "fcfs": dict(same),
        "jitserve": dict(same),
        "vllm-v0": {"token_budget": 4096, "max_running": config.max_running},
    }
    settings = engine_settings(JITSERVE, table)
    assert settings["engine_settings"] == same
    assert settings["own_engine_settings"] == {
        "vllm-v0": {"token_budget": 4096, "max_running": config.max_running}
    }


def test_attainment_by_class_lists_each_class_with_an_slo():
    from experiments.own_workload import attainment_by_class

    metrics = {
        "by_class": {
            "latency": {"slo_attainment": 0.46, "slo_requests": 10},
            "best": {"slo_attainment": None},
            "x": {},
            # a class of best-effort requests attains trivially: its "attainment" is its served share
            "short": {"slo_attainment": 1.0, "slo_requests": 0},
        }
    }
    assert attainment_by_class(metrics) == {"latency": 0.46}
    assert attainment_by_class({}) == {}
