"""A policy that raises inside vLLM's real V1 scheduler (the GPU-free harness of
`experiments.bench_scheduler`): the step runs as FCFS and the engine serves on -- no request is
scheduled twice or stranded, vLLM's running cap holds -- and the policy's drops are counted and
logged once, for the requests actually dropped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from adapt.policy import EngineView, Plan, RequestState
from serving_hooks.policies.baselines import FCFS, SPF

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from serving_hooks.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _scheduler(tiny_model, monkeypatch, policy, max_num_seqs: int, num_blocks: int):
    from experiments.bench_scheduler import make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, max_num_seqs, num_blocks, prefix_caching=False)
    scheduler._switch_policy(policy)
    return scheduler


def _run(scheduler, steps: int = 2000) -> None:
    """Step until every request left (or `steps`), checking vLLM's running cap after each."""
    from experiments.bench_scheduler import step

    for _ in range(steps):
        if not scheduler.requests:
            return
        step(scheduler)
        assert len(scheduler.running) <= scheduler.max_num_running_reqs


class PreemptThenRaise(FCFS):
    """Preempts the newest running request once, then its plan's admissions raise."""

    name = "preempt-then-raise"

    def __init__(self) -> None:
        super().__init__()
        self.victim: str | None = None
        self.told: list[str] = []

    def on_preempt(self, request: RequestState, now: float) -> None:
        self.told.append(request.id)
        super().on_preempt(request, now)

    def on_step(self, view: EngineView) -> Plan:
        plan = super().on_step(view)
        if self.victim is None and len(view.running) >= 2 and len(view.waiting) >= 1:
            self.victim = view.running[-1].id
            plan.preempt = [view.running[-1]]
            plan.admit = self._raising()
        return plan

    @staticmethod
    def _raising() -> Iterator[RequestState]:
        raise RuntimeError("a policy bug")
        yield


def test_a_plan_that_preempts_then_raises_leaves_its_victim_waiting_once(tiny_model, monkeypatch):
    """Before the fix the fallback put the plan's victim back in `running` while vLLM had queued
    it: scheduled twice, a phantom slot, and the policy never heard of its preemption."""
    from experiments.bench_scheduler import make_requests, step

    policy = PreemptThenRaise()
    scheduler = _scheduler(tiny_model, monkeypatch, policy, 4, 200)
    requests = make_requests(4, 0, seed=1, max_tokens=20)
    for request in requests[:2]:
        scheduler.add_request(request)
    step(scheduler)
    for request in requests[2:]:
        scheduler.add_request(request)
    step(scheduler)
    running = [r.request_id for r in scheduler.running]
    waiting = [r.request_id for r in scheduler.waiting]
    assert sorted(running + waiting) == [r.request_id for r in requests]
    assert policy.victim in waiting and policy.told == [policy.victim]
    assert scheduler.policy_errors == 1
    _run(scheduler)
    assert not scheduler.requests


class PreemptFailsOnce(SPF):
    """Shortest prompt first, whose first `on_preempt` raises (the request never reaches its queue)."""

    name = "preempt-fails-once"

    def __init__(self) -> None:
        super().__init__()
        self.raised = False

    def on_preempt(self, request: RequestState, now: float) -> None:
        if not self.raised:
            self.raised = True
            raise RuntimeError("a policy bug")
        super().on_preempt(request, now)


def test_a_request_whose_on_preempt_raised_is_admitted_again(tiny_model, monkeypatch):
    """20 KV blocks for 6 requests of 64 + 120 tokens force preemptions. Before the fix the
    request whose `on_preempt` raised waited forever: no plan listed it again."""
    from experiments.bench_scheduler import make_requests

    policy = PreemptFailsOnce()
    scheduler = _scheduler(tiny_model, monkeypatch, policy, 16, 20)
    for request in make_requests(6, 0, seed=7, max_tokens=120):
        scheduler.add_request(request)
    _run(scheduler)
    assert policy.raised and scheduler.policy_errors == 1
    assert not scheduler.requests


class DeferWithFailedArrivals(FCFS):
    """Whose `on_arrival` raises for r4-r6, and whose second plan defers two running requests."""

    name = "defer-with-failed-arrivals"

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def on_arrival(self, request: RequestState, now: float) -> None:
        if request.id in ("r4", "r5", "r6"):
            raise RuntimeError("a policy bug")
        super().on_arrival(request, now)

    def on_step(self, view: EngineView) -> Plan:
        self.steps += 1
        plan = super().on_step(view)
        if self.steps == 2:
            plan.defer = set(view.running[:2])
        return plan


def test_requests_the_policy_cannot_plan_wait_for_a_free_slot(tiny_model, monkeypatch):
    """4 running (the cap), 3 unplanned arrivals, 2 running deferred: before the fix vLLM admitted
    the unplanned ones into the deferred requests' slots and its next step failed its cap assert."""
    from experiments.bench_scheduler import make_requests, step

    scheduler = _scheduler(tiny_model, monkeypatch, DeferWithFailedArrivals(), 4, 400)
    requests = make_requests(7, 0, seed=3, max_tokens=30)
    for request in requests[:4]:
        scheduler.add_request(request)
    step(scheduler)
    for request in requests[4:]:
        scheduler.add_request(request)
    _run(scheduler)
    assert scheduler.policy_errors == 3
    assert not scheduler.requests


class ExtraDrops(FCFS):
    """FCFS whose next plan also drops `self.drops` (as given: repeated, or for requests gone)."""

    name = "extra-drops"

    def __init__(self) -> None:
        super().__init__()
        self.drops: list[RequestState] = []

    def on_step(self, view: EngineView) -> Plan:
        plan = super().on_step(view)
        plan.drop, self.drops = [*plan.drop, *self.drops], []
        return plan


def _value(scheduler, name: str, **labels: str) -> float:
    scheduler.metrics.flush()
    return scheduler.metrics.registry.get_sample_value(name, labels) or 0.0


def _dropped_outcomes(scheduler) -> float:
    labels = {"slo_class": "best_effort", "tier": "none", "outcome": "dropped"}
    return _value(scheduler, "adapt_slo_requests_total", **labels)


def test_a_request_the_plan_drops_twice_counts_once(tiny_model, monkeypatch):
    from experiments.bench_scheduler import make_requests, step

    monkeypatch.setenv("ADAPT_METRICS", "1")
    policy = ExtraDrops()
    scheduler = _scheduler(tiny_model, monkeypatch, policy, 4, 400)
    for request in make_requests(2, 0, seed=5, max_tokens=4):
        scheduler.add_request(request)
    policy.drops = [scheduler._states["r1"]] * 2
    step(scheduler)
    _run(scheduler)
    assert _value(scheduler, "adapt_requests_dropped_total", reason="admission_control") == 1
    assert _dropped_outcomes(scheduler) == 1 and not scheduler.policy_errors


def test_a_drop_of_a_request_that_left_marks_no_later_one(tiny_model, monkeypatch):
    """A plan may drop a request that already left (a policy's stale state): before the fix its id
    stayed marked, and a later request under the same id was logged as dropped when it finished."""
    from experiments.bench_scheduler import make_requests

    monkeypatch.setenv("ADAPT_METRICS", "1")
    policy = ExtraDrops()
    scheduler = _scheduler(tiny_model, monkeypatch, policy, 4, 400)
    scheduler.add_request(make_requests(1, 0, seed=5, max_tokens=4)[0])
    gone = scheduler._states["r0"]
    _run(scheduler)
    policy.drops = [gone]
    scheduler.add_request(make_requests(1, 1, seed=6, max_tokens=4)[0])
    _run(scheduler)
    scheduler.add_request(make_requests(1, 0, seed=7, max_tokens=4)[0])  # r0 again
    _run(scheduler)
    assert not scheduler.requests and not scheduler.policy_errors
    assert _value(scheduler, "adapt_requests_dropped_total", reason="admission_control") == 0
    assert _dropped_outcomes(scheduler) == 0
