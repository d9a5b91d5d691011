"""EWSJF: each Refine-and-Prune stage, bubble queues, the score formula, starvation freedom."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapt.policy import RequestState
from adapt.replay.engine import EngineConfig
from adapt.requests import SLO, Request
from predictors.ewsjf_meta import (
    EwsjfMetaPolicy,
    QueueSpec,
    _gap_split,
    _prune,
    kmeans_1d,
    refine_and_prune,
    utility,
)
from serving_hooks.policies import make_policy
from serving_hooks.policies.ewsjf import EWSJF
from tests.replay_helpers import CheckedEngine, ConstantCost


def test_stage1_kmeans_finds_three_regimes():
    values = np.array([10, 11, 12, 500, 505, 510, 3000, 3010], dtype=float)
    clusters = kmeans_1d(values, 3)
    assert [c.tolist() for c in clusters] == [[10, 11, 12], [500, 505, 510], [3000, 3010]]


def test_stage2_splits_at_significant_gap_only():
    # Distinct gaps 1,1,1,100,1,1 (mean 17.5): 100 > 3 * 17.5 splits; the halves have no big gap.
    values = np.array([1, 2, 3, 4, 104, 105, 106], dtype=float)
    parts = _gap_split(values, alpha=3.0, min_width=1.0)
    assert [p.tolist() for p in parts] == [[1, 2, 3, 4], [104, 105, 106]]
    # Same data with alpha 10: 100 < 10 * 17.5, no split.
    assert len(_gap_split(values, alpha=10.0, min_width=1.0)) == 1
    # Minimum width: neither side may be narrower than 5 tokens, so no split.
    assert len(_gap_split(values, alpha=3.0, min_width=5.0)) == 1


def test_stage3_merges_lowest_utility_pair():
    a, b, c = np.array([10.0, 12.0]), np.array([20.0, 22.0]), np.array([1000.0, 1002.0])
    total = 6
    # U(a,b) = (2/6 + 2/6) / 10 = 0.0667; U(b,c) = (2/6 + 2/6) / 980 = 0.00068 -> merge b and c.
    assert utility(a, b, total) == pytest.approx((4 / 6) / (10 + 1e-6))
    merged = _prune([a, b, c], max_queues=2, total=total)
    assert [m.tolist() for m in merged] == [[10.0, 12.0], [20.0, 22.0, 1000.0, 1002.0]]


def test_refine_and_prune_respects_max_queues_and_contiguity():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(32, 512, 800), rng.integers(1024, 4096, 200)])
    meta = EwsjfMetaPolicy(alpha=2.0, max_queues=8).fit(lengths)
    assert 1 <= len(meta.queues_) <= 8
    meta.validate()
    assert sum(q.share for q in meta.queues_) == pytest.approx(1.0)
    assert len(refine_and_prune(lengths, 2.0, 16.0, 8)) == len(meta.queues_)


def _policy(queues, **meta):
    m = EwsjfMetaPolicy(**meta)
    m.queues_ = [QueueSpec(lo, hi, (lo + hi) / 2, 0.5) for lo, hi in queues]
    return EWSJF(m)


def req(rid, prompt, arrival=0.0):
    return RequestState(rid, arrival, prompt, 100, __import__("adapt.requests").requests.SLO())


def test_bubble_queue_placement_algorithm_2():
    policy = _policy([(10, 100), (1000, 2000)], bubble_width=64)
    policy.on_arrival(req("in", 50), 0)  # inside queue 1
    policy.on_arrival(req("near-left", 108), 0)  # <= 100 * 1.1 -> queue 1
    policy.on_arrival(req("near-right", 905), 0)  # >= 1000 * 0.9 -> queue 2
    policy.on_arrival(req("gap", 500), 0)  # true gap -> bubble [468, 532]
    lows = [(q.low, q.high, q.bubble) for q in policy.queues]
    assert lows == [(10, 100, False), (468, 532, True), (1000, 2000, False)]
    assert list(policy.queues[0].items) == ["in", "near-left"]
    assert list(policy.queues[2].items) == ["near-right"]
    assert policy.bubbles_created == 1
    # A narrow gap: the bubble is clipped to the available range.
    narrow = _policy([(10, 100), (200, 300)], bubble_width=500)
    narrow.on_arrival(req("g", 150), 0)
    assert (narrow.queues[1].low, narrow.queues[1].high) == (100, 200)
    # That bubble begins where queue 1 ends (100, inclusive there): a length of exactly 100 is
    # queue 1's, not the bubble's (it went to the bubble, its queue index and score doubled).
    narrow.on_arrival(req("edge", 100), 0)
    assert "edge" in narrow.queues[0].items and narrow.queues[1].items.keys() == {"g"}


def test_score_formula_by_hand():
    policy = _policy([(1, 100)], w_base=1.0, a_u=0.0, b_u=2.0, a_f=0.0, b_f=0.5)
    policy.prefill_base_s, policy.prefill_per_token_s = 0.01, 0.001
    r = req("r", 99, arrival=0.0)
    # b = 99: qf = 1/100; cs = 2.0 / (0.01 + 0.099) ; score = qf * (1 + 2 * cs + 0.5 * ln 100)
    expected = (1 / 100) * (1.0 + 2.0 * (2.0 / 0.109) + 0.5 * math.log(100))
    assert policy.score(r, 1, 50.0, now=2.0) == pytest.approx(expected)
    # The meta-policy maps mean length to weights: w_urg(b) = a_u * b + b_u.
    meta = EwsjfMetaPolicy(a_u=0.01, b_u=1.0, a_f=-0.001, b_f=0.5)
    assert meta.w_urg(100) == pytest.approx(2.0) and meta.w_fair(100) == pytest.approx(0.4)
    assert meta.w_fair(1000) == 0.0  # clipped at zero


def test_best_queue_fills_first_then_neighbours():
    policy = _policy([(1, 10), (11, 100), (101, 1000)])
    for rid, prompt, t in [("a", 5, 0.0), ("b", 50, 0.0), ("c", 500, 0.0), ("d", 60, 0.0)]:
        policy.on_arrival(req(rid, prompt, t), t)
    from adapt.policy import EngineView

    plan = policy.on_step(EngineView(1.0, [], [], 0.0, 512, 256, 0.02))
    order = [r.id for r in plan.admit]
    scores = {
        i: policy.score(next(iter(q.items.values())), i + 1, q.mean, 1.0) for i, q in enumerate(policy.queues)
    }
    best = max(scores, key=scores.get)
    first_queue = [r for r in policy.queues[best].items]
    assert order[: len(first_queue)] == first_queue
    assert sorted(order) == ["a", "b", "c", "d"]


def test_empty_queues_are_pruned_after_threshold():
    policy = _policy([(1, 10), (11, 100)], empty_threshold=3)
    from adapt.policy import EngineView

    def view(step):
        return EngineView(0.0, [], [], 0.0, 512, 256, 0.02, step_index=step)

    for step in range(3):
        policy.on_step(view(step))
    assert len(policy.queues) == 2
    policy.on_step(view(3))
    assert policy.queues == []
    policy.on_arrival(req("late", 42), 0)  # an empty layout grows a bubble for the newcomer
    assert len(policy.queues) == 1 and policy.bubbles_created == 1


def _short_stream(n_short: int, long_prompt: int):
    # Each short request takes 2 steps of 0.1 s; one arrives every 0.2 s with one already queued,
    # so a short request is always waiting when the single running slot frees.
    shorts = [Request(f"s{i}", max(0.0, 0.2 * (i - 1)), 8, 2) for i in range(n_short)]
    long = Request("long", 0.05, long_prompt, 2)
    return sorted([*shorts, long], key=lambda r: r.arrival_s)


@settings(max_examples=10, deadline=None)
@given(n_short=st.integers(500, 700), long_prompt=st.integers(64, 1024))
def test_no_starvation_under_a_sustained_short_stream(n_short, long_prompt):
    """The long request's score grows with its wait without bound while the short head's stays
    bounded, so it wins within a bounded time (~71 s for 1,024 tokens with these weights: the
    equation-4 crossover), long before a 100+ s stream ends; SPF serves it only after the stream."""
    requests = _short_stream(n_short, long_prompt)
    last_arrival = requests[-1].arrival_s

    def long_first_token(policy):
        engine = CheckedEngine(policy, ConstantCost(0.1), EngineConfig(max_running=1, token_budget=2048))
        result = engine.run(requests)
        assert engine.violations == []
        return next(r for r in result.records if r.request_id == "long").first_token_s

    ewsjf = _policy([(1, 32), (33, 2048)])
    assert long_first_token(ewsjf) < 80.0 < last_arrival  # served while the stream is still going
    assert long_first_token(make_policy("spf")) > last_arrival  # SPF starves it until the stream ends


def test_component_round_trip(tmp_path):
    meta = EwsjfMetaPolicy(alpha=2.5, max_queues=6).fit(np.arange(1, 2000, 3))
    loaded = EwsjfMetaPolicy.load(meta.save(tmp_path / "m"))
    assert loaded.queues_ == meta.queues_ and loaded.get_params() == meta.get_params()


def test_a_new_meta_policy_re_routes_every_waiting_request():
    """A live swap of `ewsjf-meta-policy` replaces the queue layout; the requests already waiting
    move into the new queues, oldest first, and none is lost."""
    from adapt.policy import EngineView

    policy = _policy([(1, 10), (11, 100), (101, 1000)])
    assert policy.components == {"meta": "ewsjf-meta-policy"}
    lengths = [5, 50, 500, 60, 7, 900]
    for i, prompt in enumerate(lengths):
        policy.on_arrival(req(f"r{i}", prompt, float(i)), float(i))
    new = _policy([(1, 80), (81, 2000)]).meta
    policy.use_component("meta", new)
    assert policy.meta is new and [(q.low, q.high) for q in policy.queues] == [(1, 80), (81, 2000)]
    assert [list(q.items) for q in policy.queues] == [["r0", "r1", "r3", "r4"], ["r2", "r5"]]
    plan = policy.on_step(EngineView(10.0, [], [], 0.0, 512, 256, 0.02))
    assert sorted(r.id for r in plan.admit) == [f"r{i}" for i in range(len(lengths))]


def test_horizon_holds_while_nothing_waiting_can_be_admitted():
    """While something waits that might be admitted, the plan is made afresh at once (here the best
    head fits) -- unless no waiting request can be admitted whatever the order: the running cap
    is reached, or even the smallest first chunk needs more KV blocks than are free."""
    from adapt.policy import FOREVER, EngineView, Horizon

    policy = EWSJF()
    running = [RequestState("run", 0.0, 10, 100, SLO())]

    def view(free_blocks, max_running=8, budget=2048):
        return EngineView(1.0, [], running, 0.9, budget, max_running, 0.02, 5, free_blocks, 16)

    assert policy.horizon(view(0)) == FOREVER  # nothing waits
    for rid, prompt in (("a", 300), ("b", 40)):  # the smallest needs 3 blocks of 16
        policy.on_arrival(RequestState(rid, 0.5, prompt, 100, SLO()), 0.5)
    assert policy.horizon(view(3)) == Horizon(steps=0)  # "b" fits
    assert policy.horizon(view(2)) == FOREVER  # nothing fits in 2 blocks
    assert policy.horizon(view(3, max_running=1)) == FOREVER  # no slot
    assert policy.horizon(view(2, budget=17)) == Horizon(steps=0)  # a 16-token first chunk fits
    policy.on_admit(policy._where["b"].items["b"], 1.0)
    assert policy.horizon(view(3)) == FOREVER  # "a" needs 19 blocks


def test_horizon_runs_until_a_head_that_fits_overtakes_the_blocked_best():
    """Equation 4 is linear in the wait. When the best queue's head does not fit, nothing is
    admitted until the head of a queue that fits scores above it: hand-computed crossing of
    small (b=40, queue 1, arrived 10.0) and big (b=500, queue 2, arrived 0.0), default weights
    (w_base 1, w_urg 1, w_fair 0.1, C_prefill(b) = 0.01 + 5e-5 b)."""
    from adapt.policy import FOREVER, EngineView

    policy = _policy([(1, 100), (101, 1000)])
    policy.on_arrival(req("big", 500, 0.0), 0.0)
    policy.on_arrival(req("small", 40, 10.0), 10.0)

    def view(now, free_blocks):
        return EngineView(now, [], [], 0.9, 2048, 8, 0.02, 5, free_blocks, 16)

    def line(b, q, arrival):  # (score at t = 0 extrapolated, slope)
        qf, cost = q / (b + 1), 0.01 + 5e-5 * b
        return qf * (1 - arrival / cost + 0.1 * math.log(b + 1)), qf / cost

    (a_big, s_big), (a_small, s_small) = line(500, 2, 0.0), line(40, 1, 10.0)
    crossing = (a_big - a_small) / (s_small - s_big)
    assert crossing == pytest.approx(10.5805, abs=1e-4)
    assert next(iter(policy.on_step(view(10.1, 10)).admit)).id == "big"  # 32 blocks: it does not fit
    horizon = policy.horizon(view(10.1, 10))  # small needs 3 blocks: it will be admitted
    assert crossing - 1e-6 < horizon.until_s < crossing and horizon.steps == math.inf
    assert next(iter(policy.on_step(view(horizon.until_s, 10)).admit)).id == "big"
    assert next(iter(policy.on_step(view(crossing + 1e-6, 10)).admit)).id == "small"
    assert policy.horizon(view(10.1, 2)) == FOREVER  # neither fits in 2 blocks: no order admits
    assert policy.horizon(view(crossing + 1e-6, 10)).steps == 0  # the best head fits: re-plan


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.floats(0, 5), st.integers(1, 700), st.integers(1, 200)), min_size=2, max_size=30
    ),
    kv_blocks=st.integers(50, 120),
    max_running=st.integers(2, 8),
)
def test_decode_runs_past_a_blocked_head_admit_as_step_by_step(rows, kv_blocks, max_running):
    """Runs that go on while the best head does not fit (until a fitting head overtakes it)
    admit the same requests at the same times as planning every step."""
    from adapt.replay.cost import roofline

    requests = [Request(f"r{i}", t, p, o) for i, (t, p, o) in enumerate(sorted(rows))]
    runs = []
    for skip in (True, False):
        policy = _policy([(1, 50), (51, 150), (151, 400), (401, 700)])
        admitted = []
        original = policy.on_admit
        policy.on_admit = lambda request, now, original=original, admitted=admitted: (
            admitted.append((request.id, now)),
            original(request, now),
        )
        config = EngineConfig(
            max_running=max_running, kv_capacity_tokens=kv_blocks * 16, skip_decode_runs=skip
        )
        engine = CheckedEngine(policy, roofline("llama-2-7b", "a100-80g"), config)
        result = engine.run(requests)
        assert engine.violations == [] and len(result.records) == len(requests)
        runs.append((admitted, result.metrics()["ttlt_mean"]))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("blocked_waiting", [False, True])
def test_decode_runs_stop_where_an_empty_queue_is_pruned(blocked_waiting):
    """A queue empty for `empty_threshold` steps is pruned at that step, and the next arrival is
    routed by the queues as they are then: a decode run must not carry the pruned queue past it
    (regression: with nothing waiting, or nothing admissible, runs went on and the late arrivals
    were routed into the stale queue, changing who was admitted first)."""
    from adapt.replay.cost import roofline

    requests = [Request("r0", 0.0, 100, 3000)]
    if blocked_waiting:
        requests.append(Request("w", 0.01, 100, 5))  # waits behind the running cap all along
    requests += [Request("big", 30.0, 1500, 5), Request("mid", 30.0, 300, 5)]
    admissions = []
    for skip in (True, False):
        policy = EWSJF()
        admitted = []
        original = policy.on_admit
        policy.on_admit = lambda request, now, original=original, admitted=admitted: (
            admitted.append(request.id),
            original(request, now),
        )
        config = EngineConfig(max_running=1, skip_decode_runs=skip)
        CheckedEngine(policy, roofline("llama-2-7b", "a100-80g"), config).run(requests)
        admissions.append(admitted)
    assert admissions[0] == admissions[1]
