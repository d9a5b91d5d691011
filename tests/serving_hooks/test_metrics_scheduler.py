"""`PolicyScheduler`'s metrics in the GPU-free harness of `experiments.bench_scheduler` (vLLM's
real scheduler, no model run): preemptions by cause match vLLM's own count, a policy that raises
is a fallback step and a policy error, and with metrics off the scheduler holds no recorder."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from serving_hooks.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _value(scheduler, name, **labels):
    scheduler.metrics.flush()
    return scheduler.metrics.registry.get_sample_value(name, labels) or 0.0


def test_kv_pressure_preemptions_and_a_failing_policy_are_counted(tiny_model, monkeypatch):
    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    monkeypatch.setenv("ADAPT_METRICS", "1")
    # 8 running requests of 64 + 96 tokens need 80 blocks of 16; 40 force vLLM to preempt.
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 40)
    requests = make_requests(12, 0, seed=4, max_tokens=96)
    for request in requests:
        scheduler.add_request(request)
    on_step = scheduler.adapt_policy.on_step
    calls = iter(range(10**6))

    def fails_once(view):
        if next(calls) == 5:
            raise RuntimeError("a policy bug")
        return on_step(view)

    scheduler.adapt_policy.on_step = fails_once
    for _ in range(5000):
        if not scheduler.requests:
            break
        step(scheduler)
    assert not scheduler.requests
    preemptions = sum(r.num_preemptions for r in requests)
    assert preemptions > 0
    assert _value(scheduler, "adapt_requests_preempted_total", cause="kv_pressure") == preemptions
    assert _value(scheduler, "adapt_requests_preempted_total", cause="policy") == 0
    assert _value(scheduler, "adapt_requests_admitted_total") == len(requests) + preemptions
    assert _value(scheduler, "adapt_fallback_steps_total") == 1
    assert _value(scheduler, "adapt_policy_errors_total") == 1 == scheduler.policy_errors
    assert (
        _value(scheduler, "adapt_slo_requests_total", slo_class="best_effort", tier="none", outcome="met")
        == 12
    )


def test_metrics_off_means_no_recorder(tiny_model, monkeypatch):
    from experiments.bench_scheduler import make_scheduler
    from serving_hooks.server import server_command
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    monkeypatch.setenv("ADAPT_METRICS", "0")
    assert make_scheduler(tiny_model, PolicyScheduler, 4, 100).metrics is None
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    _, env = server_command(str(tiny_model), "fcfs", metrics=False)
    assert env["ADAPT_METRICS"] == "0" and "PROMETHEUS_MULTIPROC_DIR" not in env
