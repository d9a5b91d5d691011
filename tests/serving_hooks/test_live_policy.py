"""A whole policy swapped live inside vLLM's scheduler: `PolicyScheduler` following the
`policy-config` champion (`adapt serve --follow-policy-config`), in the GPU-free scheduler harness
of `experiments.bench_scheduler` (vLLM's real scheduler objects, no model run)."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.slow


def _logging_scheduler(tmp_path, monkeypatch, **environment: str):
    """vLLM's scheduler with `PolicyScheduler` on a tiny model (4 running, 2,000 tokens a step, no
    prefix caching) as `adapt serve` configures it through `environment`, logging its decisions."""
    from experiments.bench_scheduler import make_scheduler
    from serving_hooks.tiny_model import make_tiny_model
    from serving_hooks.vllm_adapter import PolicyScheduler

    environment = {"ADAPT_LOG_DIR": str(tmp_path / "logs"), "ADAPT_LOG_DECISIONS": "1", **environment}
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    return make_scheduler(make_tiny_model(tmp_path / "tiny"), PolicyScheduler, 4, 2000, prefix_caching=False)


def _conformance_run(tmp_path) -> dict:
    """`adapt conformance` on the decision log (it must find every step identical): its one run."""
    from adapt.cli import main

    report = tmp_path / "conformance.json"
    assert main(["conformance", "--log-dir", str(tmp_path / "logs"), "--json", str(report)]) == 0
    (run,) = json.loads(report.read_text())["runs"]
    return run


def test_scheduler_follows_the_policy_config_champion(tmp_path, monkeypatch):
    from adapt.registry import Registry
    from experiments.bench_scheduler import make_requests, step
    from serving_hooks.policies.config import PolicyConfig

    registry = Registry(cache_dir=tmp_path / "cache")  # the test's own sqlite store (conftest)
    registry.promote("policy-config", registry.log(PolicyConfig("spf")))
    status = tmp_path / "status.json"
    scheduler = _logging_scheduler(
        tmp_path,
        monkeypatch,
        ADAPT_POLICY="fcfs",
        ADAPT_WATCH_INTERVAL="0.2",
        ADAPT_FOLLOW_POLICY_CONFIG="1",
        ADAPT_STATUS_FILE=str(status),
    )
    try:
        assert scheduler.adapt_policy.name == "spf"  # the champion config, not --policy, serves
        requests = make_requests(12, 0, 0)
        for request in requests:
            scheduler.add_request(request)
        for _ in range(3):
            step(scheduler)
        registry.promote(
            "policy-config", registry.log(PolicyConfig("sarathi", {"order": "spf", "token_budget": 48}))
        )
        deadline = time.time() + 30
        while scheduler.adapt_policy.name != "sarathi" and time.time() < deadline:
            time.sleep(0.1)
            step(scheduler)
        assert scheduler.adapt_policy.name == "sarathi" and scheduler.adapt_policy.token_budget == 48
        for _ in range(5000):  # every request finishes under the new policy: none lost in the swap
            if not scheduler.requests:
                break
            step(scheduler)
        assert not scheduler.requests and scheduler.policy_errors == 0
        published = json.loads(status.read_text())
        assert published["policy"] == "sarathi" and published["policy_config"] == 2
        assert published["policy_swaps"] == 2 and published["failed_swaps"] == 0

        # The decision log names the policy serving at the start and the one swapped in, so the
        # replay hands the same requests over at the same step, with the new 48-token budget (below
        # the 4 x 64 prompt tokens a step could take): identical across the swap.
        run = _conformance_run(tmp_path)
        assert run["policy"] == "policy-config@v1" and list(run["switches"].values()) == ["policy-config@v2"]
        assert run["steps"] == run["identical"] > 10
    finally:
        scheduler.live.stop()


def test_a_policy_config_alias_is_served_and_logged_as_the_version_it_named_at_start(tmp_path, monkeypatch):
    """`adapt serve --policy policy-config@champion` without following: the alias is read once as
    the engine starts. The policy, its slots and the decision log all name that version, so a
    promotion afterwards changes neither what serves nor what `adapt conformance` replays."""
    from adapt.registry import Registry
    from experiments.bench_scheduler import make_requests, step
    from serving_hooks.policies.config import PolicyConfig

    registry = Registry(cache_dir=tmp_path / "cache")
    registry.promote(
        "policy-config", registry.log(PolicyConfig("sarathi", {"order": "spf", "token_budget": 48}))
    )
    scheduler = _logging_scheduler(tmp_path, monkeypatch, ADAPT_POLICY="policy-config@champion")
    assert scheduler.adapt_policy.name == "sarathi" and scheduler.adapt_policy.token_budget == 48
    registry.promote("policy-config", registry.log(PolicyConfig("fcfs")))  # after the engine started
    for request in make_requests(12, 0, 0):
        scheduler.add_request(request)
    for _ in range(5000):
        if not scheduler.requests:
            break
        step(scheduler)
    assert not scheduler.requests and scheduler.adapt_policy.token_budget == 48

    run = _conformance_run(tmp_path)
    assert run["policy"] == "policy-config@v1"  # not the alias, which names v2 by now
    assert run["steps"] == run["identical"] > 10
