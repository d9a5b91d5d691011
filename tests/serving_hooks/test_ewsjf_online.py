"""`ewsjf-online`: paired windows, adoption on synthetic latencies, layout switches that lose no
request, hot swaps that restart the comparison, parameter checks."""

import math
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapt.mechanics import check_policy
from adapt.paired import AdoptionRule, incumbent_contrasts, paired_contrasts
from adapt.policy import EngineView, RequestState
from adapt.replay.engine import EngineConfig
from adapt.requests import SLO, Request
from predictors.ewsjf_meta import EwsjfMetaPolicy, QueueSpec
from serving_hooks.policies import make_policy, servable_policies
from serving_hooks.policies.ewsjf_online import OnlineEWSJF, Window
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


# ------------------------------------------------------------------ the contrast by hand


def _serve_windows(policy: OnlineEWSJF, windows: list[tuple[list[int], int]]) -> list[Window]:
    """Serve windows of explicit arrivals: for each (prompt lengths, admitted), the prompts arrive
    one a second and, right after the first of them, the `admitted` oldest waiting requests are
    admitted -- so the window's growth is (arrivals - admitted) / arrivals. Returns the windows
    served, in order (each is the one open when its first request arrives)."""
    waiting: deque[RequestState] = deque()
    served: list[Window] = []
    now = 0.0
    for prompts, admitted in windows:
        assert len(prompts) == policy.window  # the last arrival closes the window
        served.append(policy._window)
        for j, prompt in enumerate(prompts):
            request = RequestState(f"r{now:g}", now, prompt, 16, SLO())
            policy.on_arrival(request, now)
            waiting.append(request)
            if j == 0:
                for _ in range(admitted):
                    policy.on_admit(waiting.popleft(), now)
            now += 1.0
    return served


def test_the_contrast_is_equation_5_of_the_window_minus_the_mean_of_its_neighbours():
    """R = l1 C + l2 L - l3 S - l4 U with U the waiting line's growth, then R(window) minus the
    mean of its neighbours' R. Every term differs from window to window and every weight differs,
    so a wrong sign or a swapped weight changes the value."""
    policy = OnlineEWSJF(_meta(), weights=(1.0, 2.0, 4.0, 8.0))

    def window(arm: str, growth: float, compactness: float, balance: float, proliferation: float) -> Window:
        terms = {"compactness": compactness, "balance": balance, "proliferation": proliferation}
        return Window(arm, 0, growth=growth, terms=terms)

    left = window("incumbent", 0.5, compactness=0.5, balance=1.0, proliferation=0.25)
    middle = window("candidate", -0.25, compactness=1.0, balance=0.5, proliferation=0.5)
    right = window("incumbent", 0.25, compactness=0.75, balance=0.5, proliferation=0.25)
    # R(left)   = 0.5  + 2 * 1.0 - 4 * 0.25 - 8 * 0.5    = 0.5 + 2 - 1 - 4 = -2.5
    # R(middle) = 1.0  + 2 * 0.5 - 4 * 0.5  - 8 * -0.25  = 1 + 1 - 2 + 2   =  2
    # R(right)  = 0.75 + 2 * 0.5 - 4 * 0.25 - 8 * 0.25   = 0.75 + 1 - 1 - 2 = -1.25
    # contrast  = 2 - (-2.5 + -1.25) / 2 = 2 + 1.875 = 3.875
    assert policy.contrast(middle, left, right) == pytest.approx(3.875)
    assert policy.contrast(middle, right, left) == pytest.approx(3.875)  # the neighbours' mean
    # The online default weighs the latency term alone: 0.25 - (-0.5 - 0.25) / 2 = 0.625
    assert OnlineEWSJF(_meta()).contrast(middle, left, right) == pytest.approx(0.625)


def test_a_candidate_window_is_scored_against_its_neighbours_from_the_requests_it_served():
    """I0 C1 I1 of four arrivals each, a two-queue layout (1-128, 129-4096) of at most 4 queues,
    the paper's weights: the layout terms come from the prompt lengths each window routed, U from
    the waiting line, and the candidate's paired score is its one contrast."""
    policy = OnlineEWSJF(_meta(max_queues=4), window=4, pairs=1, layout_every=0, weights=(1.0, 1.0, 1.0, 1.0))
    i0, c1, i1 = _serve_windows(
        policy,
        [
            ([10, 30, 200, 200], 1),  # waiting 0 -> 3
            ([50, 50, 50, 1000], 3),  # waiting 3 -> 4
            ([100, 100, 300, 500], 2),  # waiting 4 -> 6
        ],
    )
    assert (i0.arm, c1.arm, i1.arm) == ("incumbent", "candidate", "incumbent")
    # I0: short queue {10, 30}: mean 20, sd 10, cv 0.5; long queue {200, 200}: cv 0.
    #     C = 1 - (0.5 + 0) / 2 = 0.75; loads 2, 2: L = 1 / (1 + 0) = 1; S = 2 / 4; U = 3 / 4.
    # C1: {50, 50, 50}: cv 0; {1000} alone has no spread and is left out: C = 1.
    #     loads 3, 1: mean 2, sd 1, cv 0.5: L = 1 / 1.5 = 2/3; S = 1/2; U = (4 - 3) / 4 = 1/4.
    # I1: {100, 100}: cv 0; {300, 500}: mean 400, sd 100, cv 0.25: C = 1 - 0.125 = 0.875.
    #     L = 1; S = 1/2; U = (6 - 4) / 4 = 1/2.
    expected = [
        ({"compactness": 0.75, "balance": 1.0, "proliferation": 0.5}, 0.75),
        ({"compactness": 1.0, "balance": 2 / 3, "proliferation": 0.5}, 0.25),
        ({"compactness": 0.875, "balance": 1.0, "proliferation": 0.5}, 0.5),
    ]
    for window, (terms, growth) in zip((i0, c1, i1), expected, strict=True):
        assert window.terms is not None
        assert {key: window.terms[key] for key in terms} == pytest.approx(terms)
        assert window.growth == pytest.approx(growth)
    # R = C + L - S - U:  R(I0) = 0.75 + 1 - 0.5 - 0.75 = 1/2;  R(C1) = 1 + 2/3 - 1/2 - 1/4 = 11/12;
    # R(I1) = 0.875 + 1 - 0.5 - 0.5 = 7/8;  contrast = 11/12 - (1/2 + 7/8) / 2 = 11/12 - 11/16 = 11/48.
    assert policy.contrast(c1, i0, i1) == pytest.approx(11 / 48)
    # Judged as I1 closed: one pair, no incumbent contrast yet (that needs three incumbent
    # windows), so the threshold is infinite and nothing is adopted.
    (evaluation,) = policy.evaluations
    assert evaluation["score"] == pytest.approx(11 / 48)
    assert (evaluation["pairs"], evaluation["noise_samples"]) == (1, 0)
    assert evaluation["threshold"] == math.inf and not evaluation["adopted"]


def test_drift_cancels_in_the_paired_scores_and_the_noise_decides_adoption_by_hand():
    """Nine windows of 8 arrivals, one prompt length (the layout terms are the same in every
    window), the latency term alone (R = -U), pairs=1: I0 C1 I1 C2 I2 C3 I3 C4 I4. The incumbent's
    growth drifts down (1, 0.75, 0.25, 0.25, 0: the load easing, with noise); C1 and C2 lie on the
    line between their neighbours, C3 and C4 do better."""
    policy = OnlineEWSJF(_meta(), window=8, pairs=1, layout_every=0)
    growths = [1.0, 0.875, 0.75, 0.5, 0.25, 0.0, 0.25, -0.375, 0.0]  # I0 C1 I1 C2 I2 C3 I3 C4 I4
    windows = _serve_windows(policy, [([50] * 8, int(8 * (1 - u))) for u in growths])
    assert [w.growth for w in windows] == growths  # (8 - admitted) / 8: exact in binary
    # Paired: d_i = -U(C_i) + (U(I_{i-1}) + U(I_i)) / 2
    #   d1 = -0.875 + (1 + 0.75) / 2 = 0;        d2 = -0.5 + (0.75 + 0.25) / 2 = 0
    #   d3 = -0 + (0.25 + 0.25) / 2 = 0.25;      d4 = 0.375 + (0.25 + 0) / 2 = 0.5
    # (against I0, as the earlier tuner scored, the drift alone would give C1 0.125 and C2 0.5.)
    # Noise, one incumbent contrast as each of I2, I3, I4 closes, before the judging:
    #   e1 = -0.75 + (1 + 0.25) / 2 = -0.125;  e2 = -0.25 + (0.75 + 0.25) / 2 = 0.25;
    #   e3 = -0.25 + (0.25 + 0) / 2 = -0.125
    assert list(policy._noise) == pytest.approx([-0.125, 0.25, -0.125])
    # C1-C3 are judged with fewer than 3 incumbent contrasts (threshold inf). C4 with all three:
    # rms = sqrt((1/64 + 1/16 + 1/64) / 3) = sqrt(1/32) = 0.17678; one pair, factor
    # sqrt((2 - 1/2) / (3/2)) = 1; threshold = 2 * 0.17678 = 0.35355 < 0.5: adopted.
    assert [e["score"] for e in policy.evaluations] == pytest.approx([0.0, 0.0, 0.25, 0.5])
    assert [e["noise_samples"] for e in policy.evaluations] == [0, 1, 2, 3]
    assert [e["threshold"] for e in policy.evaluations[:3]] == [math.inf] * 3
    assert policy.evaluations[3]["noise_rms"] == pytest.approx(math.sqrt(1 / 32))
    assert policy.evaluations[3]["threshold"] == pytest.approx(2 * math.sqrt(1 / 32))
    assert [e["adopted"] for e in policy.evaluations] == [False, False, False, True]
    assert len(policy.adoptions) == 1 and policy.adoptions[0]["score"] == pytest.approx(0.5)
    # The same verdict from the paired functions on the windows themselves.
    incumbent, candidate = windows[0::2], windows[1::2]
    assert paired_contrasts(candidate, incumbent, policy.contrast) == pytest.approx([0.0, 0.0, 0.25, 0.5])
    assert incumbent_contrasts(incumbent, policy.contrast) == pytest.approx([-0.125, 0.25, -0.125])
    verdict = AdoptionRule().judge([0.25], list(policy._noise))  # C3's 0.25 with the noise known
    assert not verdict.adopt and verdict.threshold == pytest.approx(0.35355, abs=1e-5)
