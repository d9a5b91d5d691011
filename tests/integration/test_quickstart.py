"""The quickstart leaderboard: best per workload, and drops shown next to latency headlines."""

from experiments.quickstart import HEADLINES, format_front_page, format_leaderboard, guard


def test_leaderboard_bolds_the_best_and_flags_policies_that_dropped_requests():
    board = {
        "azure-conv": {"fcfs": 33.8, "sarathi": 7.5, "jitserve": 7.2},
        "jitserve-mix": {"fcfs": 1.2e6, "sarathi": 2.1e6, "jitserve": 2.2e6},
    }
    dropped = {"azure-conv": {"jitserve": 0.41}, "jitserve-mix": {"jitserve": 0.3}}
    rows = {line.split("|")[1].strip(): line for line in format_leaderboard(board, dropped).splitlines()[2:]}
    # jitserve's lower TTLT averages only what it served: flagged, and sarathi is the best.
    assert "7.200 (41% dropped)" in rows["jitserve"] and "**7.500**" in rows["sarathi"]
    # Goodput counts drops as zero already: higher is better and jitserve may win it.
    assert "**2.200 (30% dropped)**" in rows["jitserve"]


def test_guard_reports_served_share_and_the_worst_class_by_hand():
    metrics = {
        "completed": 3,
        "num_requests": 4,
        "by_class": {
            "short": {"ttft_p99": 1.0, "slo_attainment": 0.9, "slo_requests": 2},
            "long": {"ttft_p99": 40.0, "slo_attainment": 0.5, "slo_requests": 2},
        },
    }
    assert guard(metrics) == (0.75, 40.0, 0.5)
    # a class of best-effort requests attains trivially: no SLO to guard there
    metrics["by_class"]["long"]["slo_requests"] = 0
    assert guard(metrics) == (0.75, 40.0, 0.9)
    assert guard({"completed": 2, "num_requests": 2, "ttft_p99": 3.0, "slo_attainment": None}) == (
        1.0,
        3.0,
        None,
    )


def _run(long_p99: float, tps: float, paying_tbt: float = 0.05, dropped: int = 0) -> dict:
    return {
        "dropped": dropped,
        "num_requests": 10,
        "throughput_tps": tps,
        "by_class": {
            "long": {"ttft_p99": long_p99},
            "paying": {"tbt_p99": paying_tbt},
            "free": {"tbt_p99": 0.2},
        },
    }


def test_guards_bar_starving_long_requests_and_missing_tbt_slos():
    fcfs = _run(long_p99=10.0, tps=100.0)
    ewsjf, slai = HEADLINES["ewsjf-mixed"], HEADLINES["slai-tiers"]
    assert ewsjf.barred(_run(12.0, 100.0), fcfs) is None  # 1.2x FCFS's long P99: allowed
    assert ewsjf.barred(_run(12.1, 100.0), fcfs) == "starves long requests"
    assert ewsjf.barred(_run(5.0, 99.0), fcfs) is None  # throughput is own_workload's target, not a guard
    assert ewsjf.barred(_run(5.0, 100.0, dropped=1), fcfs) == "10% dropped"
    assert slai.barred(_run(1.0, 1.0, paying_tbt=0.1), fcfs) is None  # at the 0.1 s SLO: met
    assert slai.barred(_run(1.0, 1.0, paying_tbt=0.11), fcfs) == "misses the paying TBT SLO"
    assert HEADLINES["jitserve-mix"].barred(_run(1.0, 1.0, dropped=5), fcfs) is None  # goodput


def test_a_barred_value_is_never_bold_and_says_why():
    board = {"slai-tiers": {"fcfs": 0.40, "vllm-v0": 0.20, "slai": 0.25}}
    barred = {"slai-tiers": {"vllm-v0": "misses the paying TBT SLO"}}
    text = format_leaderboard(board, {}, barred)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()[2:] if line.startswith("|")}
    assert "0.200 †" in rows["vllm-v0"] and "**" not in rows["vllm-v0"]
    assert "**0.250**" in rows["slai"]
    assert "slai-tiers: vllm-v0 (misses the paying TBT SLO)" in text


def test_front_page_compares_the_learned_policy_with_the_best_eligible_baseline():
    def run(value: float, completed: int = 10) -> dict:
        return {"ttlt_mean": value, "completed": completed, "num_requests": 10}

    everything = {
        "sagesched-mix": {
            "engine": {"token_budget": 512},
            "policies": {
                "fcfs": run(40.0),
                "spf": run(30.0),
                "fastserve": run(20.0),
                "sagesched": run(24.0, 9),
            },
        }
    }
    barred = {"sagesched-mix": {"fastserve": "starves someone"}}
    row = format_front_page(everything, barred).splitlines()[2]
    # fastserve is barred, so spf is the baseline: 24 vs 30 is -20%; sagesched served 9 of 10.
    assert "| spf 30.000 | sagesched 24.000 | -20.0% (better) | 90% |" in row


def test_load_plots_draw_the_learned_policy_the_baseline_and_the_oracle(tmp_path, monkeypatch):
    from adapt.replay.runner import ReplaySetup, replay_policy
    from adapt.workloads import WORKLOADS
    from experiments import quickstart
    from serving_hooks.policies import PolicySpec

    monkeypatch.setattr(quickstart, "SIZES", {"slai-tiers": {False: (1.0, 40), True: (1.0, 40)}})
    spec = WORKLOADS["slai-tiers"]
    setup = ReplaySetup(spec.build(1.0, 40, 0), {}, spec.model, spec.gpu, spec.tp)
    metrics = {
        p: replay_policy(setup, PolicySpec(p), label=p, config=spec.engine_config()).metrics()
        for p in ("fcfs", "spf", "slai", "sjf-oracle")
    }
    everything = {"slai-tiers": {"engine": {"token_budget": 512}, "policies": metrics}}
    paths = quickstart.load_plots(everything, {"slai-tiers": {}}, {}, jobs=1, out=tmp_path)
    assert [p.name for p in paths] == ["slai-tiers_vs_load.png"] and paths[0].stat().st_size > 0
    # an oracle the main run did not serve gets its 1x point replayed here
    monkeypatch.setattr(quickstart, "PLOT_ORACLE", {"slai-tiers": "sagesched:true_lengths=all"})
    replayed = []
    real_cells = quickstart.replay_cells

    def recording(cells, jobs):
        replayed.extend(cells)
        return real_cells(cells, jobs=jobs)

    monkeypatch.setattr(quickstart, "replay_cells", recording)
    quickstart.load_plots(everything, {"slai-tiers": {}}, {}, jobs=1, out=tmp_path)
    keys = sorted(cell.key for cell in replayed)
    assert ("slai-tiers", 1.0, "sagesched:true_lengths=all") in keys
    assert not any(scale == 1.0 and policy != "sagesched:true_lengths=all" for _, scale, policy in keys)
