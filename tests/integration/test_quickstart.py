"""The quickstart leaderboard: best per workload, and drops shown next to latency headlines."""

from experiments.quickstart import format_leaderboard, guard


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
            "short": {"ttft_p99": 1.0, "slo_attainment": 0.9},
            "long": {"ttft_p99": 40.0, "slo_attainment": 0.5},
        },
    }
    assert guard(metrics) == (0.75, 40.0, 0.5)
    assert guard({"completed": 2, "num_requests": 2, "ttft_p99": 3.0, "slo_attainment": None}) == (
        1.0,
        3.0,
        None,
    )
