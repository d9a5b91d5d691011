"""SLAI: last schedulable time, critical marking, batch order, the offset switch (hand-made cases)."""

import pytest

from adapt.policy import EngineView, RequestState
from adapt.replay.engine import EngineConfig
from adapt.requests import SLO, Request
from predictors.slai_offset import SlaiOffset
from serving_hooks.policies import make_policy
from serving_hooks.policies.slai import SLAI, last_schedulable_time
from tests.replay_helpers import CheckedEngine, ConstantCost


def state(rid, prompt=10, tbt=None, last=None, phase="decode", arrival=0.0):
    s = RequestState(rid, arrival, prompt, 1000, SLO(kind="latency", tbt_s=tbt) if tbt else SLO())
    s.phase = phase
    s.last_token_s = last
    return s


def test_lst_formula_by_hand():
    # LST = t_prev + TBT - offset * mean batch time = 10.0 + 0.5 - 5 * 0.02 = 10.4
    assert last_schedulable_time(state("a", tbt=0.5, last=10.0), 5, 0.02) == pytest.approx(10.4)
    assert last_schedulable_time(state("b", tbt=None, last=10.0), 5, 0.02) == float("inf")
    # Without a target, best effort: 2 batch times after the last token = 10.0 + 2 * 0.02
    assert last_schedulable_time(state("b", tbt=None, last=10.0), 5, 0.02, 2.0) == pytest.approx(10.04)
    assert last_schedulable_time(state("c", tbt=0.5, last=None), 5, 0.02) == float("inf")


def test_offset_switch_paper_rule_and_validation():
    rule = SlaiOffset()
    assert rule(0.50) == 5 and rule(0.9599) == 5 and rule(0.96) == 10 and rule(1.0) == 10
    finer = SlaiOffset([0.5, 0.9], [2, 6, 12])
    assert [finer(u) for u in (0.1, 0.5, 0.7, 0.95)] == [2, 6, 6, 12]
    finer.validate()
    from adapt.component import ComponentError

    with pytest.raises(ComponentError, match="one more level"):
        SlaiOffset([0.5], [1.0]).validate()
    with pytest.raises(ComponentError, match="ascending"):
        SlaiOffset([0.9, 0.5], [1, 2, 3]).validate()


def test_critical_marking_and_batch_order():
    policy = SLAI(offset=5.0, prefill_order="spf", best_effort_batches=None)  # the paper's rule
    d1 = state("d1", tbt=0.1, last=0.9)  # LST 0.9 -> critical at 1.0
    d2 = state("d2", tbt=0.5, last=0.95)  # LST 1.35 -> not critical
    d3 = state("d3", tbt=0.1, last=0.95)  # LST 0.95 -> critical
    d4 = state("d4", tbt=None, last=0.5)  # no TBT target: never critical
    p1 = state("p1", phase="prefill")
    long, short = state("long", prompt=100, phase="waiting"), state("short", prompt=10, phase="waiting")
    policy.on_arrival(long, 0.0)
    policy.on_arrival(short, 0.1)
    view = EngineView(1.0, [long, short], [d1, d2, p1, d3, d4], 0.5, 512, 256, 0.02)
    plan = policy.on_step(view)
    # critical by LST, the started prefill, then the non-critical decodes by LST (the budget is ample)
    assert [r.id for r in plan.running_order] == ["d1", "d3", "p1", "d2", "d4"]
    assert [r.id for r in plan.admit] == ["short", "long"]
    # a tight budget: what the two admissions (10 + 100 tokens) need is reserved first, one decode fits
    tight = 2 + p1.tokens_to_compute + 110 + 1
    view = EngineView(1.0, [long, short], [d1, d2, p1, d3, d4], 0.5, tight, 256, 0.02)
    assert [r.id for r in policy.on_step(view).running_order] == ["d1", "d3", "p1", "d2"]
    # under KV pressure nothing is reserved: the decodes that free memory run
    view = EngineView(1.0, [long, short], [d1, d2, p1, d3, d4], 0.95, tight, 256, 0.02)
    assert [r.id for r in policy.on_step(view).running_order] == ["d1", "d3", "p1", "d2", "d4"]
    fcfs = SLAI(offset=5.0, prefill_order="fcfs", best_effort_batches=None)
    fcfs.on_arrival(long, 0.0)
    fcfs.on_arrival(short, 0.1)
    assert [r.id for r in fcfs.on_step(view).admit] == ["long", "short"]


def test_a_decode_without_a_target_is_owed_best_effort():
    d1 = state("d1", tbt=0.1, last=0.95)  # LST 0.95: critical at 1.0
    d4 = state("d4", tbt=None, last=0.5)  # no target
    d5 = state("d5", tbt=None, last=0.99)  # no target, just served
    view = EngineView(1.0, [], [d1, d4, d5], 0.5, 512, 256, 0.02)
    # Default (0 batch times): critical from its last token on, ordered by that moment.
    plan = SLAI(offset=5.0).on_step(view)
    assert [r.id for r in plan.running_order] == ["d4", "d1", "d5"]
    # 2 batch times: d4 (LST 0.54) is critical, d5 (LST 1.03) may wait until then.
    policy = SLAI(offset=5.0, best_effort_batches=2.0)
    assert [r.id for r in policy.on_step(view).running_order] == ["d4", "d1", "d5"]
    budget = 2  # room for the critical two only
    view = EngineView(1.0, [], [d1, d4, d5], 0.5, budget, 256, 0.02)
    assert [r.id for r in policy.on_step(view).running_order] == ["d4", "d1"]
    # d4 and d1 have slack: once their tokens are out they are not critical, so this plan holds
    # for no further step (the replay engine re-plans instead of repeating it).
    assert policy.horizon(view).steps == 0
    # Nothing critical: the plan holds until the first deferred decode becomes critical.
    alone = EngineView(1.0, [], [d5], 0.5, 512, 256, 0.02)
    policy.on_step(alone)
    assert policy.horizon(alone).steps == 1 and policy.horizon(alone).until_s == pytest.approx(1.03)


def test_decode_limit_and_active_cap():
    policy = SLAI(offset=5.0, decode_limit=2, max_active=3)
    running = [state(f"c{i}", tbt=0.1, last=0.0) for i in range(2)] + [state("n", tbt=5.0, last=0.9)]
    waiting = [state(f"w{i}", phase="waiting") for i in range(3)]
    for w in waiting:
        policy.on_arrival(w, 0.0)
    plan = policy.on_step(EngineView(1.0, waiting, running, 0.1, 512, 256, 0.02))
    assert len(plan.running_order) == 2  # the decode limit is reached by the critical decodes
    assert len(list(plan.admit)) == 0  # 3 active already


def test_paying_tier_first():
    policy = SLAI(offset=5.0, paying_first=True)
    free = RequestState("free", 0.0, 5, 100, SLO(kind="latency", tbt_s=0.5, tier="free"))
    paying = RequestState("paying", 1.0, 50, 100, SLO(kind="latency", tbt_s=0.1, tier="paying"))
    policy.on_arrival(free, 0.0)
    policy.on_arrival(paying, 1.0)
    plan = policy.on_step(EngineView(1.0, [free, paying], [], 0.0, 512, 256, 0.02))
    assert [r.id for r in plan.admit] == ["paying", "free"]


def test_noncritical_decode_yields_budget_to_a_new_prefill_in_the_engine():
    # Constant 0.1 s steps, budget 8. A (TBT 10 s) decodes; B (8-token prompt) arrives at 0.15.
    # Step 3 gives B the whole budget, so A's token 2 waits for step 4: a 0.2 s gap. Sarathi
    # (decodes first) would emit it at 0.3.
    requests = [
        Request("a", 0.0, 4, 4, slo=SLO(kind="latency", tbt_s=10.0)),
        Request("b", 0.15, 8, 2),
    ]

    def token_gaps(policy):
        engine = CheckedEngine(
            policy, ConstantCost(0.1), EngineConfig(token_budget=8, skip_decode_runs=False)
        )
        result = engine.run(requests)
        assert engine.violations == []
        return {r.request_id: r for r in result.records}, result

    records, _ = token_gaps(SLAI(offset=5.0, token_budget=8))
    assert records["b"].first_token_s == pytest.approx(0.3)
    assert records["a"].finish_s == pytest.approx(0.5)
    records, _ = token_gaps(make_policy("sarathi", token_budget=8))
    assert records["a"].finish_s == pytest.approx(0.4)


def test_the_offset_is_a_swappable_component_and_the_fixed_variant_has_none():
    policy = SLAI()
    assert policy.components == {"offset": "slai-offset"} and policy.current_offset(0.99) == 10
    policy.use_component("offset", SlaiOffset([0.5], [1.0, 3.0]))  # what a live swap does
    assert policy.current_offset(0.4) == 1.0 and policy.current_offset(0.99) == 3.0
    assert make_policy("slai-fixed").components == {}


def test_study_headline_compares_at_sarathis_largest_sustained_rate():
    """The issue's target is read at the largest rate Sarathi (FCFS) sustains; a rate sustained
    after an unsustained one still counts (capacity is the largest sustained rate)."""
    from experiments.slai_study import capacity, headline

    def cell(ttft, sustained, tbt_free=0.3, ratio=1.0):  # what `summarise` reports (free SLO 0.5 s)
        return {
            "ttft_p50": ttft,
            "sustained": sustained,
            "free_tbt_p99": tbt_free,
            "tbt_within_slo": tbt_free <= 0.5,
            "throughput_ratio": ratio,
            "keeps_up": ratio >= 0.95,
        }

    table = {
        "sarathi-fcfs": {1.0: cell(0.3, True), 2.0: cell(0.45, True), 3.0: cell(0.9, False)},
        "slai(tuned)": {1.0: cell(0.2, True), 2.0: cell(0.3, True), 3.0: cell(0.48, True)},
        "slai(paper rule)": {
            1.0: cell(0.2, True),
            2.0: cell(0.36, False, ratio=0.9),
            3.0: cell(0.7, False, 0.6),
        },
    }
    assert capacity(table["sarathi-fcfs"]) == 2.0
    h = headline(0, table)
    assert h["sarathi_capacity"] == 2.0 and h["sarathi_ttft_p50"] == 0.45
    assert h["slai(tuned)"]["change"] == pytest.approx(0.3 / 0.45 - 1)
    assert h["slai(tuned)"]["capacity"] == 3.0
    assert h["slai(tuned)"]["tbt_within_slo"] and h["slai(tuned)"]["keeps_up"]
    paper = h["slai(paper rule)"]
    assert paper["tbt_within_slo"] and not paper["keeps_up"] and paper["capacity"] == 1.0
    table["sarathi-fcfs"] = {r: cell(1.0, False) for r in (1.0, 2.0, 3.0)}
    assert headline(0, table) == {"seed": 0, "sarathi_capacity": 0.0}


def test_horizon_holds_for_zero_slack_decodes_without_targets():
    """Decodes without a TBT target at zero best-effort batches are critical from their last
    token on and advance together: the plan holds until an arrival or a completion. One TBT
    target (its slack moves with the batch time) or a prefill brings back re-planning every step."""
    policy = SLAI()

    def horizon(*running):
        view = EngineView(1.0, [], list(running), 0.5, 2048, 256, 0.02, 3, 1000, 16)
        policy.on_step(view)
        return policy.horizon(view)

    plain = [state("a", last=1.0), state("b", last=1.0)]
    assert horizon(*plain).steps == float("inf")
    assert horizon(*plain, state("c", tbt=0.5, last=1.0)).steps == 1
    assert horizon(*plain, state("d", phase="prefill")).steps == 1
    assert SLAI(best_effort_batches=2.0).horizon(EngineView(1.0, [], plain, 0.5, 2048, 256, 0.02)).steps == 1
