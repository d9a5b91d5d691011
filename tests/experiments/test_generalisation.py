"""The generalisation study end to end on tiny traces: every scenario runs every policy on one
engine, the JSON has the promised shape, and the text column says what a length-only trace gives
the learned policies. The learned policies run unpinned (no registry: an empty history, no forest),
which exercises the same cells as pinned champions without training them here."""

import json

from adapt.requests import Request
from experiments import generalisation
from experiments.generalisation import CEILING, SCENARIOS, text_use
from experiments.quickstart import LEARNED, NON_ORACLE_BASELINES
from serving_hooks.policies import POLICIES, parse_policy_spec

UNPINNED = {policy: policy for policy in LEARNED}


def test_every_scenario_runs_every_policy_on_one_engine_and_the_json_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(generalisation, "champion_specs", lambda registry, fast: UNPINNED)
    out = tmp_path / "generalisation.json"
    args = ["--seeds", "1,2", "--requests", "25", "--jobs", "1", "--store", f"sqlite:///{tmp_path / 's.db'}"]
    assert generalisation.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["seeds"] == [1, 2]
    assert set(report["scenarios"]) == {s.name for s in SCENARIOS}
    for name, scenario in report["scenarios"].items():
        settings = scenario["settings"]
        assert (settings["model"], settings["gpu"], settings["tp"]) == ("llama-2-13b", "a100-80g", 2)
        assert settings["requests"] == 25
        assert set(scenario["policies"]) == {*NON_ORACLE_BASELINES, *LEARNED, CEILING}, name
        # the ceiling reads true lengths: shown beside the others, never ranked among them
        assert CEILING not in scenario["ranking"]
        ceiling, best = scenario["policies"][CEILING], scenario["policies"][scenario["best_baseline"]]
        assert scenario["ceiling_gain_vs_best_baseline"] == ceiling["ttlt_mean"] / best["ttlt_mean"] - 1.0
        # one engine for all, but for a policy that declares its own budget (vllm-v0: 4096)
        for policy, engine in settings["engine_settings_per_policy"].items():
            own = getattr(POLICIES[parse_policy_spec(policy)[0]], "token_budget", None)
            assert engine == {"token_budget": own or settings["token_budget"], "max_running": 256}, policy
        for metrics in scenario["policies"].values():
            low, high = metrics["spread"]["ttlt_mean"]
            assert low <= metrics["ttlt_mean"] <= high
            assert 0.0 <= metrics["served"] <= 1.0
        assert scenario["best_baseline"] in NON_ORACLE_BASELINES
        assert set(scenario["learned"]) == set(LEARNED)
        for learned in scenario["learned"].values():
            assert {"gain_vs_best_baseline", "text", "rank", "spec"} <= set(learned)
        # none of the scenarios' traces carries prompt text
        assert scenario["learned"]["sagesched"]["text"].startswith("no (length-only fallback")
        assert scenario["learned"]["jitserve"]["text"].startswith("no (")
        assert scenario["learned"]["ewsjf"]["text"] == "not read"


def test_the_text_column_counts_the_requests_with_text():
    with_text = [Request(f"r{i}", 0.0, 10, 5, prompt_text="hi") for i in range(3)]
    without = [Request("r9", 0.0, 10, 5)]
    assert text_use("sagesched", with_text) == "yes"
    assert text_use("sagesched", without).startswith("no (length-only fallback")
    assert text_use("sagesched", [*with_text, *without]).startswith("75% of requests")
    assert text_use("slai", with_text) == "not read"


def test_a_mean_ttlt_won_with_a_p99_ttft_above_12x_fcfss_is_flagged_as_starving():
    def row(ttlt: float, ttft_p99: float) -> dict:
        return {"ttlt_mean": ttlt, "ttft_p99": ttft_p99, "dropped": 0, "num_requests": 100}

    table = {policy: row(40.0, 10.0) for policy in (*NON_ORACLE_BASELINES, *LEARNED)}
    table["spf:victim=newest"] = row(30.0, 12.0)  # 1.2x FCFS's: at the limit, not flagged
    table["sagesched"] = row(29.0, 35.0)  # 3.5x
    result = generalisation.rank(table, UNPINNED, [Request("r", 0.0, 10, 5)])
    assert result["starving"] == {"sagesched": "P99 TTFT 3.5x FCFS's"}
    assert result["best_baseline"] == "spf:victim=newest" and result["ranking"][0] == "sagesched"
