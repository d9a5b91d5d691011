"""`ewsjf-online`: paired windows, adoption on synthetic latencies, layout switches that lose no
request, hot swaps that restart the comparison, parameter checks."""

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapt.mechanics import check_policy
from adapt.policy import EngineView, RequestState
from adapt.replay.engine import EngineConfig
from adapt.requests import SLO, Request
from predictors.ewsjf_meta import EwsjfMetaPolicy, QueueSpec
from serving_hooks.policies import make_policy, servable_policies
from serving_hooks.policies.ewsjf_online import OnlineEWSJF
from tests.replay_helpers import CheckedEngine, ConstantCost


def _meta(queues=((1, 128), (129, 4096)), **params) -> EwsjfMetaPolicy:
    meta = EwsjfMetaPolicy(**params)
    meta.queues_ = [QueueSpec(lo, hi, (lo + hi) / 2, 0.5) for lo, hi in queues]
    return meta


def _drive(policy: OnlineEWSJF, n: int, admit_p, seed: int = 0) -> None:
    """One arrival a second; after each, the oldest waiting request is admitted with probability
    `admit_p(policy)` (the arm now serving): the whole window / pair / judge loop without an
    engine, the waiting line growing by 1 - p per arrival on average."""
    rng = np.random.default_rng(seed)
    waiting: deque[RequestState] = deque()
    for i in range(n):
        now = float(i)
        request = RequestState(f"r{i}", now, int(rng.integers(20, 3000)), 16, SLO())
        policy.on_arrival(request, now)
        waiting.append(request)
        if rng.random() < admit_p(policy):
            policy.on_admit(waiting.popleft(), now)


def test_windows_alternate_incumbent_and_candidate_in_pairs():
    policy = OnlineEWSJF(_meta(), window=10, pairs=2, layout_every=0)
    arms = []
    for i in range(60):
        arms.append(policy._window.arm)
        policy.on_arrival(RequestState(f"r{i}", float(i), 50, 16, SLO()), float(i))
    # I C I C I | C I C I | ...: each candidate shares its first incumbent window with the last
    windows = [arms[k] for k in range(0, 60, 10)]
    assert windows == ["incumbent", "candidate"] * 3
    assert policy.windows_closed == 6


def test_pure_noise_is_rarely_adopted():
    """Service that does not depend on the arm (each arrival followed by an admission with
    probability 0.9): about 4% of candidates pass the one-sided test (1-7% by seed)."""
    adopted = judged = 0
    for seed in (0, 1):
        policy = OnlineEWSJF(_meta(), window=20, pairs=3, layout_every=0, seed=seed)
        _drive(policy, 20 * 7 * 70, lambda policy: 0.9, seed=seed)
        adopted, judged = adopted + len(policy.adoptions), judged + len(policy.evaluations)
    assert judged >= 150
    assert adopted / judged < 0.08


def test_a_clearly_better_candidate_is_adopted_and_becomes_the_incumbent():
    """Candidates with w_base above 2.5 keep the waiting line from growing (0 instead of 0.2 per
    arrival): one of them is adopted, Optuna was told the paired scores, and it is the incumbent."""
    champion = _meta(w_base=1.0)
    policy = OnlineEWSJF(champion, window=40, pairs=3, layout_every=0, seed=1)
    _drive(policy, 40 * 7 * 12, lambda policy: 1.0 if policy.meta.w_base > 2.5 else 0.8)
    assert policy.adoptions, policy.evaluations
    first = policy.adoptions[0]
    assert first["kind"] == "scoring" and first["score"] > first["threshold"] > 0
    assert policy.incumbent.w_base > 2.5
    assert champion.w_base == 1.0  # the champion object is never changed
    scores = [value for params, value, _ in policy.tuner.history if params["w_base"] > 2.5]
    assert scores[0] == pytest.approx(0.2, abs=0.1)  # 0.2 fewer requests left waiting per arrival


def test_a_better_layout_refit_is_adopted():
    """Every candidate a layout refitted on the recent lengths, which serves better than the
    champion's single queue: the refit is adopted, queues and all."""
    champion = _meta(((1, 4096),))
    champion.metadata["registry_version"] = 3
    policy = OnlineEWSJF(champion, window=40, pairs=3, layout_every=1)
    assert policy.describe()["meta_version"] == 3  # serving a copy of the champion, v3
    _drive(policy, 40 * 7 * 4, lambda policy: 1.0 if len(policy.meta.queues_) > 1 else 0.8)
    assert policy.adoptions and policy.adoptions[0]["kind"] == "layout"
    assert len(policy.incumbent.queues_) > 1 and len(policy.queues) > 1
    # what a live server's status shows of it (`policy_state`)
    state = policy.describe()
    assert state["adoptions"] == len(policy.adoptions) and state["last_adoption"] == policy.adoptions[-1]
    assert state["meta_version"] == "in-memory"  # adopted online: no registered version serves


lengths = st.lists(st.integers(1, 5000), min_size=1, max_size=120)


@settings(max_examples=40, deadline=None)
@given(prompts=lengths, window=st.integers(2, 8), admitted=st.integers(0, 3))
def test_no_waiting_request_is_lost_across_layout_switches(prompts, window, admitted):
    """Arrivals, a few admitted now and then, windows switching between the incumbent's layout
    and refitted ones: the policy's order always lists exactly the requests still waiting."""
    policy = OnlineEWSJF(_meta(), window=window, pairs=1, layout_every=1, refit_windows=2)
    relayouts, kinds = [], []
    relayout, propose = policy.relayout, policy._propose
    policy.relayout = lambda specs: (relayouts.append(len(specs)), relayout(specs))
    policy._propose = lambda: (candidate := propose(), kinds.append(candidate.kind))[0]
    waiting: dict[str, RequestState] = {}
    for i, prompt in enumerate(prompts):
        request = RequestState(f"r{i}", float(i), prompt, 8, SLO())
        policy.on_arrival(request, float(i))
        waiting[request.id] = request
        plan = policy.on_step(EngineView(float(i), list(waiting.values()), [], 0.0, 512, 256, 0.02))
        order = [r.id for r in plan.admit or []]
        assert sorted(order) == sorted(waiting)
        for rid in order[:admitted]:
            policy.on_admit(waiting.pop(rid), float(i))
    if "layout" in kinds:
        assert relayouts  # a layout candidate served a window: the waiting requests moved


@settings(max_examples=5, deadline=None)
@given(prompts=st.lists(st.integers(1, 3000), min_size=20, max_size=50), seed=st.integers(0, 5))
def test_every_arrival_is_served_in_replay_across_layout_switches(prompts, seed):
    requests = [Request(f"r{i}", 0.05 * i, p, 4) for i, p in enumerate(prompts)]
    policy = OnlineEWSJF(_meta(), window=4, pairs=1, layout_every=1, refit_windows=2, seed=seed)
    engine = CheckedEngine(policy, ConstantCost(0.05), EngineConfig(max_running=4, token_budget=4096))
    result = engine.run(requests)
    assert engine.violations == []
    assert result.metrics()["completed"] == len(requests)
    assert result.policy_params == policy.describe()  # what the run logs with its MLflow run


def test_a_hot_swapped_champion_becomes_the_incumbent_and_restarts_the_comparison():
    policy = OnlineEWSJF(_meta(), window=5, pairs=2, layout_every=0)
    for i in range(12):  # into the second candidate window
        policy.on_arrival(RequestState(f"r{i}", float(i), 50 + 300 * (i % 3), 8, SLO()), float(i))
    new = _meta(((1, 64), (65, 700), (701, 4096)), w_base=2.0)
    policy.use_component("meta", new)
    assert policy.incumbent is not new and policy.incumbent.w_base == 2.0
    assert [(q.low, q.high) for q in policy.queues] == [(1, 64), (65, 700), (701, 4096)]
    assert policy._window.arm == "incumbent" and policy._candidate is None and not policy._pending
    assert sum(len(q.items) for q in policy.queues) == 12  # every waiting request re-routed
    assert policy.tuner.restarts == 1


def test_servable_with_clear_errors_for_bad_parameters():
    assert "ewsjf-online" in servable_policies()
    assert check_policy(make_policy("ewsjf-online"), "vllm") == []
    for params, message in (
        ({"window": 0}, r"window: expected an integer in \[1, inf\), got 0"),
        ({"pairs": 2.5}, r"pairs: expected an integer in \[1, inf\), got 2.5"),
        ({"z": 0}, r"z: expected a finite number in \(0, inf\), got 0"),
        ({"layout_every": -1}, r"layout_every: expected an integer in \[0, inf\), got -1"),
    ):
        with pytest.raises(ValueError, match=message):
            make_policy("ewsjf-online", **params)
    with pytest.raises(ValueError, match="window: expected an integer >= 1"):
        OnlineEWSJF(window=0)
