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


def test_requests_the_policy_drops_are_reported_to_their_client(tiny_model, monkeypatch):
    """jitserve's admission control drops what waited too long; vLLM only reports aborts the client
    started, so the adapter must emit the finished output itself (before the fix a dropped
    request's client waited forever)."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.outputs import ModelRunnerOutput

    from experiments.bench_scheduler import make_requests, make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "jitserve:waiting_time_s=0.0:batch_size=4")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000)
    requests = make_requests(20, 0, seed=2, max_tokens=8)
    for request in requests:
        scheduler.add_request(request)
    reported: dict[str, FinishReason] = {}
    for _ in range(500):
        if not scheduler.requests:
            break
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        sampled = [
            [7]
            if scheduler.requests[i].num_computed_tokens >= scheduler.requests[i].num_prompt_tokens
            else []
            for i in ids
        ]
        runner = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: n for n, r in enumerate(ids)}, sampled_token_ids=sampled
        )
        for engine_outputs in scheduler.update_from_output(output, runner).values():
            for out in engine_outputs.outputs:
                if out.finish_reason is not None:
                    reported[out.request_id] = out.finish_reason
    assert sorted(reported) == sorted(r.request_id for r in requests)  # every client hears back
    assert FinishReason.ABORT in reported.values()  # waited longer than 0 s: dropped, and told so
