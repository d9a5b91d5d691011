"""Every servable policy inside vLLM's real V1 scheduler (the GPU-free harness of
`experiments.bench_scheduler`: vLLM's scheduler and KV block accounting, no model run): every
request finishes or is dropped with a reason the engine reports, none is stranded, no policy
error; and the policies that need true lengths are the ones refused."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from serving_hooks.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_servable_policies_are_all_but_the_oracle_ones():
    from serving_hooks.policies import POLICIES, servable_policies

    refused = set(POLICIES) - set(servable_policies())
    assert refused == {"sjf-oracle", "jitserve-oracle", "ltr", "trail"}


def test_every_servable_policy_serves_every_request(tiny_model, monkeypatch):
    from vllm.v1.request import RequestStatus

    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.policies import servable_policies
    from serving_hooks.vllm_adapter import PolicyScheduler

    problems = {}
    for policy in servable_policies():
        monkeypatch.setenv("ADAPT_POLICY", policy)
        scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000)
        requests = make_requests(40, 0, seed=1, max_tokens=24)
        for request in requests:
            scheduler.add_request(request)
        for _ in range(20_000):
            if not scheduler.requests:
                break
            step(scheduler)
        finished = [r for r in requests if r.status == RequestStatus.FINISHED_LENGTH_CAPPED]
        dropped = [r for r in requests if r.status == RequestStatus.FINISHED_ABORTED]
        if scheduler.requests or scheduler.policy_errors or len(finished) + len(dropped) != len(requests):
            problems[policy] = (len(scheduler.requests), scheduler.policy_errors, len(finished), len(dropped))
    assert not problems, problems
