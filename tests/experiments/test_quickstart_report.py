"""What the quickstart's report shows: its guards and its latency CDFs."""

from __future__ import annotations

import numpy as np

from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.requests import SLO, Request
from experiments.quickstart import cdf_points, guard
from serving_hooks.policies import make_policy
from tests.replay_helpers import ConstantCost


def _metrics(slo: SLO | None) -> dict:
    requests = [
        Request(f"r{i}", arrival_s=0.1 * i, prompt_tokens=8, output_tokens=4, **({"slo": slo} if slo else {}))
        for i in range(6)
    ]
    engine = ReplayEngine(make_policy("fcfs"), ConstantCost(0.01), EngineConfig(max_running=2))
    return engine.run(requests).metrics()


def test_the_worst_slo_attainment_guard_is_none_on_a_workload_without_slos():
    # Best-effort requests attain trivially, so the guard showed the served share again as an
    # SLO attainment of 1.00 on ewsjf-mixed, sagesched-mix and azure-conv.
    best_effort = _metrics(None)
    assert best_effort["slo_requests"] == 0 and guard(best_effort)[2] is None
    with_slo = _metrics(SLO(kind="latency", ttft_s=10.0, tbt_s=1.0))
    assert with_slo["slo_requests"] == 6 and guard(with_slo)[2] == 1.0


def test_a_latency_cdf_counts_the_requests_that_never_got_there():
    # Dropped requests' latencies are NaN: the curve divided by the served ones climbed to 1.
    xs, ys = cdf_points(np.array([0.3, np.nan, 0.1, np.nan]))
    assert xs.tolist() == [0.1, 0.3] and ys.tolist() == [0.25, 0.5]
