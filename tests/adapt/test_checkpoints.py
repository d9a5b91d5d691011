"""A replay paused at checkpoints replays the same as one that is not, and pauses on time."""

import pytest

from adapt.replay.checkpoints import checkpoint_times, run_with_checkpoints
from adapt.replay.cost import roofline
from adapt.replay.engine import ReplayEngine
from adapt.workloads import WORKLOADS
from serving_hooks.policies import make_policy


def _engine(policy: str) -> ReplayEngine:
    spec = WORKLOADS["drift-chat-to-summaries"]
    return ReplayEngine(make_policy(policy), roofline(spec.model, spec.gpu, tp=spec.tp), spec.engine_config())


@pytest.mark.parametrize("policy", ["fcfs", "ewsjf"])
def test_checkpoints_change_nothing_and_come_on_time(policy):
    spec = WORKLOADS["drift-chat-to-summaries"]
    requests = spec.build(spec.rate, 600, 0)  # 50 s; the shift at ~17 s
    plain = _engine(policy).run(requests).metrics()
    engine = _engine(policy)
    calls: list[tuple[float, float]] = []
    times = checkpoint_times(5.0, 50.0)
    result = run_with_checkpoints(engine, requests, times, lambda t: calls.append((t, engine.now)))
    paused = result.metrics()
    for key in ("ttft_mean", "ttlt_mean", "completed", "preemptions", "makespan_s"):
        assert paused[key] == plain[key], key
    assert [t for t, _ in calls] == times[: len(calls)] and len(calls) >= 9
    for at, now in calls:
        assert at <= now < at + 0.5  # called between steps, at most a step late


def test_checkpoint_times():
    assert checkpoint_times(10.0, 30.0) == [10.0, 20.0, 30.0]
    assert checkpoint_times(10.0, 29.0) == [10.0, 20.0]
    with pytest.raises(ValueError):
        checkpoint_times(0.0, 10.0)
