"""The own-workload verdict by hand: who may win, and what the ceiling says."""

from __future__ import annotations

import pytest

from experiments.own_workload import TARGETS, verdict

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
