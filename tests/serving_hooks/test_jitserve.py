"""JITServe: GMAX formulas by hand, the preemption rule, sub-deadline shares, pattern-graph matching,
compound programs in the replay engine, and the compiled quantile forest against quantile-forest."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapt.policy import EngineView, RequestState
from adapt.programs import ProgramGraph, StageNode
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.replay.metrics import RecordTable, RequestRecord, _aggregate
from adapt.requests import SLO, ProgramRef, Request
from adapt.workloads.compound import generate_graphs, generate_programs, program_requests
from predictors.pattern_graph import PatternGraph
from serving_hooks.policies.gmax import bandwidth, select_batch
from serving_hooks.policies.jitserve import JITServe
from tests.replay_helpers import CheckedEngine, ConstantCost

LATENCY = SLO(kind="latency", ttft_s=2.0, tbt_s=0.1)


def state(rid="a", arrival=0.0, prompt=10, slo=None, generated=0, program=None, phase="waiting"):
    request = RequestState(rid, arrival, prompt, 10_000, slo or SLO(), program=program)
    request.tokens_generated = generated
    request.tokens_computed = prompt + generated if phase == "decode" else 0
    request.phase = phase
    return request


# ----------------------------------------------------------------- formulas
def decoding(rid="a", arrival=0.0, prompt=10, slo=None, generated=0, remaining=100, program=None):
    """A running request with nothing left to prefill and `remaining` tokens bounded to come."""
    request = state(rid, arrival, prompt, slo, generated, program, phase="decode")
    request.cache["jit_bound"] = (float(remaining), generated)
    return request


def goodput(policy, request, now, step=0.05):
    return float(policy.estimates([request], now, step)[0][0])


def test_bandwidth_is_generation_time_over_remaining_time():
    assert bandwidth(10.0, 20.0) == 0.5
    assert bandwidth(30.0, 20.0) == 1.5
    assert bandwidth(1.0, 0.0) == math.inf and bandwidth(1.0, -3.0) == math.inf


def test_on_time_tokens_by_hand():
    policy = JITServe()
    # Served from t=0 at 0.05 s/token: token i at 0.05 (i + 1) <= 2 + 0.1 i -- all 20 on time.
    assert goodput(policy, decoding("a", slo=LATENCY, remaining=20), 0.0) == 20
    # Starting at 2.5: token i arrives 2.55 + 0.05 i, due 2 + 0.1 i -> on time from i = 11: 9 of 20.
    assert goodput(policy, decoding("b", slo=LATENCY, remaining=20), 2.5) == 9
    # Slower than the TBT (0.2 s/token): slack 1.8 - 0.1 i >= 0 for i <= 18 -> 19 of 30.
    assert goodput(policy, decoding("c", slo=LATENCY, remaining=30), 0.0, step=0.2) == 19
    # TBT only, first token out at t=1, 5 generated: token 5 due 1.5 and arrives 1.05 -> all 10.
    tbt_only = decoding("d", slo=SLO(kind="latency", tbt_s=0.1), generated=5, remaining=10)
    tbt_only.first_token_s = 1.0
    assert goodput(policy, tbt_only, 1.0) == 10
    late = decoding("e", slo=SLO(kind="latency", tbt_s=0.1), generated=5, remaining=10)
    late.first_token_s = 1.0
    assert goodput(policy, late, 1.6, step=0.2) == 0  # token 5 due 1.5, slower than the TBT too
    # TTFT only: the first token is due by 2 s, the rest any time (the replay's accounting).
    assert goodput(policy, decoding("f", slo=SLO(kind="latency", ttft_s=2.0), remaining=10), 2.5) == 9


def test_the_cutoff_bandit_is_rewarded_with_the_frames_on_time_tokens_by_hand():
    """The bandit's reward counts on-time tokens one by one, as the metrics do: the tokens the
    engine counted on time (`tokens_on_time`) since the last step, credited to the frame that
    sees them; a late first token or a late tail no longer zeroes a request's whole output."""
    policy = JITServe(cutoffs=(0.8, 1.0), cutoff=0.8, frame_steps=3, explore=0.0, waiting_time_s=None)
    a = state("a", slo=SLO(kind="latency", ttft_s=0.2, tbt_s=0.1))
    policy.on_arrival(a, 0.0)
    policy.on_step(EngineView(0.0, [a], [], 0.0, 512, 8, 0.05, step_index=0))  # frame 1: cutoff 0.8
    a.phase, a.tokens_computed, a.first_token_s = "decode", 11, 0.25
    # (tokens generated, of them on time, the step that sees them): token 0 late, token 1 on time,
    # tokens 2 and 3 in one run, one of them on time
    seen = [(1, 0, 0.25), (2, 1, 0.3), (4, 2, 0.45)]
    for index, (generated, on_time, now) in enumerate(seen, start=1):
        a.tokens_generated, a.tokens_on_time = generated, on_time
        policy.on_step(EngineView(now, [], [a], 0.0, 512, 8, 0.05, step_index=index))
    assert policy._arm_value.tolist() == [2.0, 0.0] and policy.cutoff == 1.0  # the untried arm next
    a.tokens_generated, a.tokens_on_time, a.finish_s, a.phase = 6, 3, 0.62, "finished"
    policy.on_finish(a, 0.62)  # one more on time at its end
    handed_over = state("b", slo=SLO(kind="latency", ttft_s=0.2, tbt_s=0.1), generated=10, phase="decode")
    handed_over.tokens_on_time = 10  # a swap hands it over started
    policy.on_arrival(handed_over, 5.0)
    policy.on_step(EngineView(6.0, [], [handed_over], 0.0, 512, 8, 0.05, step_index=6))
    # Frame 2 closed at step 6: 1 token; b's 10 tokens from before this policy are not its to count.
    assert policy._arm_value.tolist() == [2.0, 1.0]


def test_the_engine_counts_on_time_tokens_as_the_metrics_do_however_many_steps_a_run_covers():
    """`RequestState.tokens_on_time`, which JITServe's bandit reads, is the replay recorder's
    on-time count: the same with decode runs skipped ahead as step by step (judged at the step
    that saw a token, the bandit credited a run's tokens late and the fast path diverged)."""
    from adapt.replay.cost import roofline

    rng = np.random.default_rng(1)  # 200 latency requests at 50 req/s (seed 1 diverged before)
    arrivals = np.cumsum(rng.exponential(0.02, 200))
    slo = SLO(kind="latency", ttft_s=1.0, tbt_s=0.02)
    requests = [
        Request(f"r{i}", float(t), int(rng.integers(10, 300)), int(rng.integers(10, 200)), slo=slo)
        for i, t in enumerate(arrivals)
    ]
    metrics = {}
    for skip in (True, False):
        engine = ReplayEngine(
            JITServe(batch_size=16), roofline("llama-2-7b", "a100-80g"), EngineConfig(skip_decode_runs=skip)
        )
        metrics[skip] = engine.run(requests).metrics()
    for key in ("completed", "goodput_tokens", "ttlt_mean", "dropped"):
        assert metrics[True][key] == metrics[False][key], key


def test_a_deadline_request_rewards_the_bandit_with_all_its_tokens_only_if_on_time():
    policy = JITServe(cutoffs=(0.8, 1.0), cutoff=0.8, frame_steps=1, explore=0.0, waiting_time_s=None)
    for rid, finish in (("in-time", 9.0), ("late", 11.0)):
        request = state(rid, slo=SLO(kind="deadline", deadline_s=10.0), generated=5, phase="decode")
        policy.on_arrival(request, 0.0)
        request.finish_s, request.phase = finish, "finished"
        policy.on_finish(request, finish)
        policy.on_step(EngineView(finish, [], [], 0.0, 512, 8, 0.05, step_index=int(finish)))
    # The first step only opens frame 1 (what finished before it counts toward it): 10 + 5 tokens.
    assert policy._arm_value.tolist() == [15.0, 0.0]


def test_goodput_of_each_slo_kind_by_hand():
    policy = JITServe()
    # deadline 20 s: 100 tokens * 0.05 = 5 s fits from t=0 -> prompt + output; from t=16 it does not.
    assert goodput(policy, decoding("a", slo=SLO(kind="deadline", deadline_s=20.0)), 0.0) == 110
    assert goodput(policy, decoding("b", slo=SLO(kind="deadline", deadline_s=20.0)), 16.0) == 0
    # best effort: everything counts.
    assert goodput(policy, decoding("c"), 50.0) == 110
    # compound, no pattern history: the sub-deadline is the whole deadline (40 s from start 0).
    program = ProgramRef("p", 1, parent_ids=("x",), start_s=0.0)
    compound = decoding("d", arrival=10.0, slo=SLO(kind="compound", deadline_s=40.0), program=program)
    assert policy.stage_deadline(compound) == 40.0
    assert goodput(policy, compound, 10.0) == 110
    late = decoding("e", arrival=10.0, slo=SLO(kind="compound", deadline_s=40.0), program=program)
    assert goodput(policy, late, 38.0) == 0


def test_compound_goodput_halves_past_the_sub_deadline():
    policy = JITServe()
    program = ProgramRef("p", 0, start_s=0.0)
    for rid, now, expected in (("a", 0.0, 110), ("b", 8.0, 55), ("c", 36.0, 0)):
        compound = decoding(rid, slo=SLO(kind="compound", deadline_s=40.0), program=program)
        compound.cache["stage_deadline"] = 10.0  # phi = 0.25; done at now + 5 s
        assert goodput(policy, compound, now) == expected


_SLOS = (
    LATENCY,
    SLO(kind="latency", tbt_s=0.1),
    SLO(kind="latency", ttft_s=2.0),
    SLO(kind="deadline", deadline_s=20.0),
    SLO(kind="compound", deadline_s=40.0),
    SLO(),
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, len(_SLOS) - 1), st.integers(0, 50), st.integers(1, 200)),
        min_size=1,
        max_size=8,
    ),
    now=st.floats(0.0, 30.0),
)
def test_estimates_of_a_mixed_batch_are_each_request_estimated_alone(rows, now):
    """`estimates` applies each SLO kind's rule only to the rows of that kind: a batch mixing
    kinds gets, row by row, exactly what each request gets alone."""
    policy = JITServe()
    program = ProgramRef("p", 0, start_s=0.0)
    requests = []
    for i, (slo, generated, remaining) in enumerate(rows):
        kind = _SLOS[slo].kind
        request = decoding(
            f"r{i}",
            slo=_SLOS[slo],
            generated=generated,
            remaining=remaining,
            program=program if kind == "compound" else None,
        )
        if generated:
            request.first_token_s = 1.0
        requests.append(request)
    goodputs, times = policy.estimates(requests, now, 0.05)
    for request, value, t_gen in zip(requests, goodputs, times, strict=True):
        alone_goodput, alone_time = policy.estimates([request], now, 0.05)
        assert (value, t_gen) == (alone_goodput[0], alone_time[0])


def test_priority_is_goodput_over_generation_time_plus_aging():
    policy = JITServe(delta=10.0, frame_steps=50)
    fresh = state(slo=SLO(kind="deadline", deadline_s=100.0))
    old = state("b", arrival=-7.5, slo=SLO(kind="deadline", deadline_s=100.0))
    for request in (fresh, old):
        request.cache["jit_bound"] = (100.0, 0)
    step = 0.05  # a frame lasts 2.5 s: `old` waited 3 frames
    prefill_s = 10 / policy.prefill_tokens_per_s
    priority = policy.priorities([fresh, old], 0.0, step)
    t_gen = prefill_s + 100 * step
    assert priority[0] == pytest.approx(110 / t_gen)
    assert priority[1] == pytest.approx((110 + 3 * 10.0) / t_gen)
    # The fairness blend, (1 - f) * priority + f * Fair(r), Fair = waited / longest wait * the
    # highest priority: `fresh` waited 0 s, `old` 7.5 s, the longest.
    blended = JITServe(delta=10.0, frame_steps=50, fairness=0.25).priorities([fresh, old], 0.0, step)
    top = (110 + 3 * 10.0) / t_gen
    assert blended[0] == pytest.approx(0.75 * 110 / t_gen + 0.25 * 0.0)
    assert blended[1] == pytest.approx(0.75 * top + 0.25 * (7.5 / 7.5) * top)


def test_window_selection_prefers_similar_lengths():
    # B = 2, cutoff 0.8: the 2nd highest is 9, so keep priorities >= 7.2 -> ids 0, 1, 3.
    # By input length: 0 (100), 3 (120), 1 (1000); windows sum 18 and 17 -> {0, 3}, not the top two.
    priority = np.array([10.0, 9.0, 1.0, 8.0, 7.0])
    lengths = [100, 1000, 50, 120, 900]
    assert sorted(select_batch(priority, lengths, 2, 0.8)) == [0, 3]
    assert sorted(select_batch(priority, lengths, 2, 1.0)) == [0, 1]  # cutoff 1: only the top two
    assert sorted(select_batch(priority, lengths, 9, 0.8)) == [0, 1, 2, 3, 4]


def _frame_view(running, waiting, kv_usage=0.95, max_running=1, step=0.05):
    return EngineView(0.0, waiting, running, kv_usage, 512, max_running, step, step_index=0)


@pytest.mark.parametrize("victim_context, preempted", [(1_000, True), (200_000, False)])
def test_preemption_only_when_gain_beats_stall(victim_context, preempted):
    # Running: a deadline request that cannot make it any more (priority ~0). Waiting: one that can.
    policy = JITServe(batch_size=1, frame_steps=50, delta=0.0, prefill_tokens_per_s=20_000.0, preempt=True)
    hopeless = state("old", arrival=-100.0, prompt=victim_context, slo=SLO(kind="deadline", deadline_s=50.0))
    hopeless.phase, hopeless.tokens_computed = "decode", victim_context
    hopeful = state("new", prompt=100, slo=SLO(kind="deadline", deadline_s=20.0))
    for request in (hopeless, hopeful):
        request.cache["jit_bound"] = (100.0, 0)
        policy.on_arrival(request, 0.0)
    policy._unscored.clear()
    # gain = priority(new) * frame (50 * 0.05 s); stall = context / 20k tok/s, times 1 / 0.05 tok/s;
    # the hopeless victim has no goodput at stake.
    gain = 200 / (100 / 20_000 + 100 * 0.05) * 2.5
    stall_cost = victim_context / 20_000 / 0.05
    assert (gain > stall_cost) == preempted
    victims = policy._plan_frame(_frame_view([hopeless], [hopeful]), 0.05)
    assert victims == ([hopeless] if preempted else [])


def test_no_preemption_of_a_request_that_still_expects_its_goodput():
    # Running: 100-token prompt, up to 2,000 tokens to go, deadline 1000 s -- priority ~21/s but
    # 2,100 tokens at stake. Waiting: priority ~220/s. The gain, (220 - 21) * 2.5 s ~ 500 tokens,
    # beats the stall (100 / 20k / 0.05 = 0.1) but not the victim's goodput: no preemption.
    policy = JITServe(batch_size=1, frame_steps=50, delta=0.0, preempt=True)
    running = state("old", prompt=100, slo=SLO(kind="deadline", deadline_s=1000.0))
    running.phase, running.tokens_computed = "decode", 100
    running.cache["jit_bound"] = (2_000.0, 0)
    waiting = state("new", prompt=1_000, slo=SLO(kind="deadline", deadline_s=20.0))
    waiting.cache["jit_bound"] = (100.0, 0)
    for request in (running, waiting):
        policy.on_arrival(request, 0.0)
    policy._unscored.clear()
    priority = policy.priorities([waiting, running], 0.0, 0.05)
    assert priority[0] > 10 * priority[1]  # the newcomer is the batch of one
    assert policy._plan_frame(_frame_view([running], [waiting]), 0.05) == []


def test_admission_control_drops_unscheduled_requests_after_waiting_time():
    policy = JITServe(waiting_time_s=5.0)
    late, recent = state("late", arrival=0.0), state("recent", arrival=4.0)
    for request in (late, recent):
        policy.on_arrival(request, request.arrival_s)
    plan = policy.on_step(EngineView(6.0, [late, recent], [], 0.0, 512, 8, 0.05))
    assert plan.drop == [late]


# ------------------------------------------------- bounds off the scheduling step
class FakeBounds:
    """A `qrf-length` stand-in: 900 tokens for an essay, 20 for anything else, minus those
    generated (>= 1); it records the prompts of each call."""

    metadata: dict = {}  # noqa: RUF012

    def __init__(self):
        self.calls: list[list[str]] = []

    def predict_bound(self, prompt_tokens, texts, generated, generated_texts, quantile=None):
        self.calls.append(list(texts))
        return np.array(
            [max(1.0, (900.0 if "essay" in t else 20.0) - g) for t, g in zip(texts, generated, strict=True)]
        )


def late_bounds(delay_s):
    from adapt.predictions import Delayed

    queues = []
    return queues, lambda fn: queues.append(Delayed(fn, delay_s=delay_s)) or queues[-1]


def asking(rid, arrival, text, slo=None, **kwargs):
    request = state(rid, arrival=arrival, slo=slo or SLO(kind="deadline", deadline_s=20.0), **kwargs)
    request.prompt_text = text
    return request


def test_a_request_is_on_its_fallback_bound_until_the_forests_comes_then_re_ranked():
    qrf = FakeBounds()
    policy = JITServe(qrf=qrf, waiting_time_s=None)
    queues, factory = late_bounds(0.5)
    policy.use_predictions(factory)
    essay, short = asking("essay", 0.0, "write an essay"), asking("short", 0.1, "say hi")
    policy.on_arrival(essay, 0.0)
    policy.on_arrival(short, 0.1)

    def step(now, index):
        view = EngineView(now, [essay, short], [], 0.0, 2048, 8, 0.03, step_index=index)
        return [r.id for r in policy.on_step(view).admit], policy.horizon(view)

    # No forest bound yet: both on the online quantile (1,024 tokens: 31 s, past the 20 s
    # deadline), so equal priorities, arrival order.
    order, horizon = step(0.1, 0)
    assert order == ["essay", "short"]
    assert essay.cache["jit_prior"] and short.cache["jit_prior"]
    assert essay.cache["jit_bound"] == (1024.0, 0) and policy.length_bound(essay) == (
        "online-quantile",
        1024.0,
    )
    assert horizon.until_s == 0.5  # asked on arrival: the essay's bound re-ranks it then
    # The forest's bounds come (computed in one call for both): 20 tokens fit the deadline, 900 do not.
    order, horizon = step(0.6, 1)
    assert qrf.calls == [["write an essay", "say hi"]]
    assert order == ["short", "essay"] and not essay.cache["jit_prior"] and not short.cache["jit_prior"]
    assert essay.cache["jit_bound"] == (900.0, 0) and policy.length_bound(essay) == ("qrf-length", 900.0)
    assert horizon.until_s == math.inf
    assert queues[0].stats.summary()["share_on_prior"] == 1.0
    # The same prompt again: from the memo, at once, no model call.
    again = asking("again", 0.7, "write an essay")
    policy.on_arrival(again, 0.7)
    step(0.7, 2)
    assert again.cache["jit_bound"] == (900.0, 0) and not again.cache["jit_prior"] and len(qrf.calls) == 1


def test_the_live_worker_readies_the_length_model_before_the_first_request():
    """A worker's `warm_up` (run as the engine starts) loads what the policy's length model
    computes with -- the network's embedding model -- instead of the first requests waiting on it."""

    class Warming(FakeBounds):
        warmed = 0

        def warm_up(self):
            self.warmed += 1

    from adapt.predictions import Delayed

    qrf = Warming()
    policy = JITServe(qrf=qrf)
    functions = []
    policy.use_predictions(lambda function: functions.append(function) or Delayed(function))
    functions[0].warm_up()
    assert qrf.warmed == 1
    JITServe().use_predictions(lambda function: function.warm_up() or Delayed(function))  # no model


def test_a_running_request_counts_its_old_bound_down_until_the_refreshed_one_comes():
    policy = JITServe(qrf=FakeBounds(), frame_steps=2, waiting_time_s=None)
    _, factory = late_bounds(0.5)
    policy.use_predictions(factory)
    running = asking("essay", 0.0, "write an essay", phase="decode")
    policy.on_arrival(running, 0.0)

    def step(now, index):
        policy.on_step(EngineView(now, [], [running], 0.0, 2048, 8, 0.03, step_index=index))

    step(0.0, 0)
    policy.on_admit(running, 0.0)
    step(0.6, 1)
    assert running.cache["jit_bound"] == (900.0, 0) and not running.cache["jit_prior"]
    running.tokens_generated = 60  # stale (refined every 50): the next frame asks for g = 50
    step(0.7, 2)
    assert running.cache["jit_bound"] == (900.0, 0) and running.cache["jit_prior"]
    assert policy.length_bound(running) == ("qrf-length", 900.0)  # the forest's, counted down
    step(1.2, 3)
    assert running.cache["jit_bound"] == (850.0, 50) and not running.cache["jit_prior"]


def test_a_request_that_leaves_before_its_bound_gets_nothing():
    qrf = FakeBounds()
    policy = JITServe(qrf=qrf, waiting_time_s=None)
    queues, factory = late_bounds(0.5)
    policy.use_predictions(factory)
    gone, stays = asking("gone", 0.0, "write an essay"), asking("stays", 0.0, "say hi")
    for request in (gone, stays):
        policy.on_arrival(request, 0.0)
    policy.on_step(EngineView(0.1, [gone, stays], [], 0.0, 2048, 8, 0.03))
    policy.on_finish(gone, 0.2)  # dropped: it leaves without finishing
    policy.on_step(EngineView(0.6, [stays], [], 0.0, 2048, 8, 0.03, step_index=1))
    assert qrf.calls == [["write an essay", "say hi"]]  # computed, but never handed over
    assert gone.cache["jit_prior"] and "jit_qrf_at" not in gone.cache and "gone" not in str(policy._asked)
    assert stays.cache["jit_bound"] == (20.0, 0)
    assert (
        not queues[0].awaited
        and policy.horizon(EngineView(0.6, [stays], [], 0.0, 2048, 8, 0.03)).until_s == math.inf
    )


def test_bounds_asked_before_a_new_queue_are_asked_again_there():
    """A live engine hands the policy a new queue (a policy swap): no asked bound is lost."""
    policy = JITServe(qrf=FakeBounds(), waiting_time_s=None)
    _, slow = late_bounds(60.0)
    policy.use_predictions(slow)
    essay = asking("essay", 0.0, "write an essay")
    policy.on_arrival(essay, 0.0)
    policy.on_step(EngineView(0.1, [essay], [], 0.0, 2048, 8, 0.03))
    assert essay.cache["jit_prior"]
    queues, quick = late_bounds(0.0)
    policy.use_predictions(quick)
    policy.on_step(EngineView(0.2, [essay], [], 0.0, 2048, 8, 0.03, step_index=1))
    assert essay.cache["jit_bound"] == (900.0, 0) and not essay.cache["jit_prior"]
    assert queues[0].stats.delivered == 1


def test_a_policy_swapped_in_asks_again_for_a_bound_never_received_and_keeps_one_received():
    """jitserve -> jitserve with two requests in flight: the old policy got `short`'s bound, not
    yet `essay`'s. The new policy keeps `short`'s (no model call) and asks for `essay`'s again: the
    old queue never hands it over. Before, the request's cache said "asked" and the new policy
    left `essay` on its fallback bound until `refine_every` more tokens."""
    old = JITServe(qrf=FakeBounds(), waiting_time_s=None)
    _, slow = late_bounds(60.0)
    old.use_predictions(slow)
    short = asking("short", 0.0, "say hi")
    short.cache.update(jit_bound=(20.0, 0), jit_qrf_at=0, jit_asked=0, jit_prior=False)  # received
    essay = asking("essay", 0.0, "write an essay")
    old.on_arrival(essay, 0.0)
    old.on_step(EngineView(0.1, [essay, short], [], 0.0, 2048, 8, 0.03))
    assert essay.cache["jit_prior"]
    new = JITServe(qrf=FakeBounds(), waiting_time_s=None)
    queues, quick = late_bounds(0.0)
    new.use_predictions(quick)
    for request in (essay, short):
        new.on_arrival(request, request.arrival_s)
    new.on_step(EngineView(0.2, [essay, short], [], 0.0, 2048, 8, 0.03, step_index=1))
    assert essay.cache["jit_bound"] == (900.0, 0) and not essay.cache["jit_prior"]
    assert short.cache["jit_bound"] == (20.0, 0) and new.qrf.calls == [["write an essay"]]
    assert queues[0].stats.submitted == 1


def test_replay_results_unchanged_with_bounds_ready_at_the_next_step():
    """The replay default (delay 0): every bound is there before the step that asked plans, so the
    replay is the one of a forest called inside the step (as before bounds moved off it)."""

    class InStep(JITServe):
        def _ask_bound(self, request, now):
            g = request.tokens_generated - request.tokens_generated % self.refine_every
            if g > request.cache.get("jit_asked", -1):
                request.cache["jit_asked"] = g
                bound = self.qrf.predict_bound(
                    [request.prompt_tokens], [request.prompt_text or ""], [g], [""]
                )
                self._use_bound(request, float(bound[0]), g)

    deadline = SLO(kind="deadline", deadline_s=5.0)  # 20 tokens fit, 900 or 1,024 do not
    requests = [
        Request(
            f"r{i}",
            0.05 * i,
            10 + 7 * i,
            5 + (i * 37) % 120,
            slo=LATENCY if i % 2 else deadline,
            prompt_text="write an essay" if i % 3 else "say hi",
        )
        for i in range(40)
    ]
    records = []
    for policy in (JITServe(qrf=FakeBounds(), frame_steps=3), InStep(qrf=FakeBounds(), frame_steps=3)):
        result, _ = run_engine(requests, policy, max_running=2)
        records.append(sorted(map(repr, result.values())))
    assert records[0] == records[1]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), delay=st.sampled_from([0.0, 0.05, 0.3, 5.0]), running=st.integers(1, 6))
def test_no_request_lost_when_bounds_come_late(seed, delay, running):
    """However late the forest's bounds come (some after their request finished), every request
    -- single or compound call -- completes with all its tokens or is dropped with a reason."""
    rng = np.random.default_rng(seed)
    requests = [
        Request(
            f"r{i}",
            float(0.02 * i),
            int(rng.integers(5, 60)),
            int(rng.integers(1, 130)),
            slo=LATENCY if i % 2 else SLO(kind="deadline", deadline_s=3.0),
            prompt_text=("write an essay" if i % 3 else "say hi") if i % 5 else None,
        )
        for i in range(25)
    ]
    for pid, stages in generate_programs(2, seed):
        shrunk = [
            type(s)(calls=tuple((max(1, p // 100), max(1, o // 100)) for p, o in s.calls), tool_s=s.tool_s)
            for s in stages
        ]
        requests.extend(program_requests(pid, shrunk, start_s=0.1))
    requests.sort(key=lambda r: r.arrival_s)
    _, factory = late_bounds(delay)
    engine = CheckedEngine(
        JITServe(qrf=FakeBounds(), frame_steps=3, waiting_time_s=None),
        ConstantCost(0.01),
        EngineConfig(max_running=running, kv_capacity_tokens=4000),
        predictions=factory,
    )
    result = engine.run(requests)
    assert engine.violations == []
    records = {r.request_id: r for r in result.records}
    assert set(records) == {r.request_id for r in requests}
    for request in requests:
        record = records[request.request_id]
        if record.dropped is None:
            assert engine.completions[request.request_id] == request.output_tokens
        else:
            assert record.dropped == "parent dropped" and request.program is not None


# ------------------------------------------------------------- pattern graph
def _graph(pid, *stages):
    return ProgramGraph(pid, tuple(stages))


LLM = dict(kind="llm", identity="llm")


def test_stage_shares_are_accumulated_duration_over_total():
    graph = _graph(
        "g",
        StageNode(**LLM, duration_s=1.0),
        StageNode("tool", "tool", duration_s=1.0),
        StageNode(**LLM, duration_s=2.0),
    )
    assert graph.shares().tolist() == [0.25, 0.5, 1.0]


def test_pattern_graph_prunes_diverging_prefixes_and_gives_the_sub_deadline():
    short = _graph(
        "short",
        StageNode(**LLM, input_tokens=100, output_tokens=100, duration_s=1.0),
        StageNode(**LLM, input_tokens=100, output_tokens=100, duration_s=3.0),
    )
    tooled = _graph(
        "tooled",
        StageNode(**LLM, input_tokens=100, output_tokens=100, duration_s=1.0),
        StageNode("tool", "tool", duration_s=1.0),
        StageNode(**LLM, input_tokens=100, duration_s=2.0),
    )
    patterns = PatternGraph(neighbors=1).fit([short, tooled])
    first = short.stages[0]
    # After one LLM stage, a second LLM stage only matches `short`: phi(1) = 1.
    assert patterns.stage_share([first], StageNode(**LLM, input_tokens=100)) == 1.0
    # A tool stage next only matches `tooled`: phi(1) = 0.5 -> with D = 60 s the sub-deadline is 30 s.
    assert patterns.stage_share([first], StageNode("tool", "tool")) == 0.5
    # A program with a model nobody used before matches nothing.
    assert patterns.stage_share([], StageNode("llm", "other-model")) is None


def test_pattern_graph_clusters_with_k_medoids_and_decays(tmp_path):
    graphs = generate_graphs(120, seed=3)
    patterns = PatternGraph(max_graphs=20).fit(graphs)
    assert len(patterns) == 20 and patterns.graphs_["weight"].sum() == 120  # cluster sizes
    before = patterns.graphs_["weight"].copy()
    patterns.observe(generate_graphs(1, seed=4)[0], now_s=2 * 3600.0)
    assert np.allclose(np.sort(patterns.graphs_["weight"])[-5:], np.sort(before * 0.81)[-5:], atol=1.0)
    reloaded = PatternGraph.load(patterns.save(tmp_path / "pg"))
    assert reloaded.evaluate(graphs[:30]) == patterns.evaluate(graphs[:30])


def test_share_error_falls_as_stages_unfold():
    patterns = PatternGraph().fit(generate_graphs(1500, seed=10))
    metrics = patterns.evaluate(generate_graphs(200, seed=11))
    assert metrics["match_rate"] == 1.0
    assert metrics["share_error_after_1"] < metrics["share_error_after_0"]


# ------------------------------------------------------- compound programs
def run_engine(requests, policy, **config):
    engine = CheckedEngine(policy, ConstantCost(0.1), EngineConfig(**config))
    result = engine.run(requests)
    assert engine.violations == []
    return {r.request_id: r for r in result.records}, result


def test_dependants_arrive_after_parents_plus_tool_time():
    from serving_hooks.policies import make_policy

    slo = SLO(kind="compound", deadline_s=100.0)
    requests = [
        Request("p.s0.c0", 1.0, 10, 2, slo=slo, program=ProgramRef("p", 0, start_s=1.0)),
        Request("p.s0.c1", 1.0, 10, 3, slo=slo, program=ProgramRef("p", 0, start_s=1.0)),
        Request(
            "p.s2.c0",
            1.0,
            10,
            1,
            slo=slo,
            program=ProgramRef("p", 2, parent_ids=("p.s0.c0", "p.s0.c1"), start_s=1.0, after_parents_s=2.0),
        ),
    ]
    records, result = run_engine(requests, make_policy("fcfs"))
    # Both stage-0 calls prefill together (1.1), c1 finishes at 1.3; the stage-2 call arrives 3.3.
    assert records["p.s0.c1"].finish_s == pytest.approx(1.3)
    assert records["p.s2.c0"].arrival_s == pytest.approx(3.3)
    assert result.metrics()["goodput_tokens"] == 20 + 2 + 3 + 10 + 1


def test_dropped_parent_drops_its_dependants_with_a_reason():
    slo = SLO(kind="compound", deadline_s=100.0)
    requests = [
        Request("blocker", 0.0, 10, 200),
        Request("p.s0", 0.5, 10, 2, slo=slo, program=ProgramRef("p", 0, start_s=0.5)),
        Request("p.s1", 0.5, 10, 2, slo=slo, program=ProgramRef("p", 1, parent_ids=("p.s0",), start_s=0.5)),
    ]
    records, result = run_engine(requests, JITServe(waiting_time_s=1.0), max_running=1)
    assert records["p.s0"].dropped == "admission control"
    assert records["p.s1"].dropped == "parent p.s0 dropped"
    assert result.metrics()["num_requests"] == 3


def test_unknown_parent_is_rejected():
    from serving_hooks.policies import make_policy

    orphan = Request("x", 0.0, 10, 1, program=ProgramRef("p", 1, parent_ids=("nobody",)))
    with pytest.raises(ValueError, match="nobody"):
        run_engine([orphan], make_policy("fcfs"))


def test_compound_goodput_counts_only_programs_done_by_their_deadline():
    def record(rid, pid, finish, start=0.0):
        return RequestRecord(
            rid, "compound", "compound", start, 10, 5, finish - 1, finish, program_id=pid, deadline_s=10.0
        )

    records = [
        record("a0", "a", 4.0),
        record("a1", "a", 9.0, start=5.0),  # program a: done at 9 <= 10
        record("b0", "b", 4.0),
        record("b1", "b", 11.0, start=5.0),
    ]  # program b: 11 > 10
    metrics = _aggregate(RecordTable.from_records(records), lambda q: None, 11.0)
    assert metrics["goodput_tokens"] == 30 and metrics["goodput_requests"] == 2


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), waiting=st.sampled_from([None, 0.5, 3.0]), running=st.integers(1, 6))
def test_no_request_lost_with_programs(seed, waiting, running):
    """Every call of every program -- released, dropped with its parent, or never reached --
    leaves exactly one record, under JITServe and its oracle."""
    from serving_hooks.policies.jitserve import JITServeOracle

    requests = []
    for i, (pid, stages) in enumerate(generate_programs(4, seed)):
        shrunk = [
            type(s)(calls=tuple((max(1, p // 100), max(1, o // 100)) for p, o in s.calls), tool_s=s.tool_s)
            for s in stages
        ]
        requests.extend(program_requests(pid, shrunk, start_s=0.3 * i))
    requests.append(Request("single", 0.2, 8, 4, slo=LATENCY))
    requests.sort(key=lambda r: r.arrival_s)  # stable: a program's calls keep their order
    for policy in (
        JITServe(waiting_time_s=waiting, frame_steps=3, preempt=True),
        JITServeOracle(waiting_time_s=waiting),
    ):
        records, _ = run_engine(requests, policy, max_running=running)
        assert set(records) == {r.request_id for r in requests}
        for r in records.values():
            assert (r.dropped is None) == (r.finish_s is not None)


def test_jitserve_mix_workload_shape():
    from adapt.workloads import jitserve_mix

    requests = jitserve_mix(2.0, 300, seed=1)
    assert requests == jitserve_mix(2.0, 300, seed=1)
    jobs = [r for r in requests if r.program is None or r.program.stage == 0]
    programs = {r.program.program_id for r in requests if r.program is not None}
    kinds = [r.label for r in requests if r.program is None] + ["compound"] * len(programs)
    assert len(kinds) == 300 and 70 < kinds.count("latency") < 130 and 70 < kinds.count("deadline") < 130
    assert all(r.slo.kind == "compound" and r.program.start_s is not None for r in requests if r.program)
    assert len(jobs) >= 300
    assert any(r.program.parent_ids and r.program.after_parents_s > 0 for r in requests if r.program)


def test_jitserve_mix_over_other_answers_keeps_arrivals_slos_and_programs():
    """`answers=`: the same mix (arrivals, classes, SLOs, compound programs) whose latency and
    deadline requests are another model's answers (here Yi-34B-Chat's on held-out instructions)."""
    import dataclasses

    from adapt.traces import load_trace, split_by_instruction
    from adapt.workloads import bundled, jitserve_mix

    _, test = split_by_instruction(load_trace(bundled("alpaca_eval_lengths.jsonl.gz")))
    verbose = test.take(np.flatnonzero(np.asarray(test.columns["generator"]) == "Yi-34B-Chat"))
    before, after = jitserve_mix(2.0, 120, seed=4), jitserve_mix(2.0, 120, seed=4, answers=verbose)
    pairs = set(zip(verbose.prompt_text, verbose.output_tokens.tolist(), strict=True))
    for old, new in zip(before, after, strict=True):
        assert (new.request_id, new.arrival_s, new.label, new.slo) == (
            old.request_id,
            old.arrival_s,
            old.label,
            old.slo,
        )
        if new.program is None:
            assert (new.prompt_text, new.output_tokens) in pairs
        else:  # a compound program's calls are not AlpacaEval answers
            assert new == old
    lengths_only = dataclasses.replace(verbose, prompt_text=None)
    with pytest.raises(ValueError, match="has no prompt texts"):
        jitserve_mix(2.0, 10, seed=4, answers=lengths_only)
    # an empty answer (a request log can hold one) is never drawn: a request needs a token
    some_empty = dataclasses.replace(
        verbose, output_tokens=np.where(np.arange(len(verbose)) % 2, verbose.output_tokens, 0)
    )
    assert all(r.output_tokens > 0 for r in jitserve_mix(2.0, 120, seed=4, answers=some_empty))
    with pytest.raises(ValueError, match="no answer of one token or more"):
        jitserve_mix(
            2.0, 10, seed=4, answers=dataclasses.replace(verbose, output_tokens=0 * verbose.output_tokens)
        )


# ------------------------------------------------------------ compiled QRF
def fitted_forest(rng: np.random.Generator, rows: int, features: int, trees: int, depth: int):
    """A quantile forest fitted on `rows` normal rows (lengths log-normal in the first feature),
    and its compiled form."""
    from quantile_forest import RandomForestQuantileRegressor

    from predictors.compiled_forest import CompiledQuantileForest

    X = rng.normal(size=(rows, features)).astype(np.float32)
    y = np.exp(X[:, 0] + rng.normal(scale=0.5, size=rows)) * 100
    forest = RandomForestQuantileRegressor(
        n_estimators=trees, max_depth=depth, min_samples_leaf=5, random_state=0
    )
    forest.fit(X, y)
    return forest, CompiledQuantileForest(forest)


def test_compiled_forest_equals_quantile_forest():
    rng = np.random.default_rng(0)
    forest, compiled = fitted_forest(rng, rows=600, features=5, trees=8, depth=6)
    X_test = rng.normal(size=(50, 5)).astype(np.float32)
    for q in (0.5, 0.95):
        expected = forest.predict(X_test, quantiles=q)
        assert np.allclose(compiled.predict(X_test, q), expected)  # the vectorised search
        assert np.allclose([compiled.predict(X_test[i : i + 1], q)[0] for i in range(5)], expected[:5])


@pytest.fixture(scope="module")
def three_feature_forest():
    """A small fitted forest on 3 features and its compiled form (fitted once for the module)."""
    return fitted_forest(np.random.default_rng(1), rows=300, features=3, trees=4, depth=5)


def test_the_compiled_forest_refuses_rows_of_another_width_and_quantiles_outside_0_to_1(
    three_feature_forest,
):
    """A bound predictor whose feature count changed since the fit (`QrfLength.set_params`) must
    fail, not route its rows on the wrong columns to a plausible number."""
    _, compiled = three_feature_forest
    for X in (np.ones((2, 5)), np.ones((8, 5)), np.ones((2, 2)), np.ones(3)):
        with pytest.raises(ValueError, match="fitted on 3 features"):
            compiled.predict(X, 0.95)
    for quantile in (1.5, -0.1, float("nan")):
        for rows in (1, 8):  # the gathering path and the vectorised search
            with pytest.raises(ValueError, match="quantile"):
                compiled.predict(np.zeros((rows, 3)), quantile)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.lists(st.one_of(st.floats(-3, 3), st.floats()), min_size=3, max_size=3), min_size=1, max_size=8
    ),
    quantile=st.floats(0, 1),
)
def test_the_compiled_forest_answers_finite_rows_as_the_library_and_refuses_the_rest(
    three_feature_forest, rows, quantile
):
    """Any row of finite float32 values: the library's prediction; any NaN or infinity (a float64
    too large for float32 included): a ValueError, never a number."""
    forest, compiled = three_feature_forest
    X = np.asarray(rows, dtype=np.float64)
    with np.errstate(over="ignore"):
        finite = np.isfinite(X.astype(np.float32)).all()
    if finite:
        expected = forest.predict(X, quantiles=quantile)
        np.testing.assert_allclose(compiled.predict(X, quantile), expected, rtol=1e-9)
    else:
        with pytest.raises(ValueError, match="Input X contains"):
            compiled.predict(X, quantile)


def test_prompt_text_is_asked_of_the_engine_only_when_the_bound_reads_it():
    """vLLM detokenises prompts for a policy that says it needs them (a cost per arrival): JITServe
    needs them exactly when its length bound reads words, so live and replay bound alike."""
    from predictors.neural_length import NeuralLength
    from predictors.qrf_length import QrfLength

    assert not JITServe().needs_prompt_text  # online quantile only
    assert JITServe(qrf=QrfLength(prompt_features=16, generated_features=0)).needs_prompt_text
    assert not JITServe(qrf=QrfLength(prompt_features=0, generated_features=0)).needs_prompt_text
    assert JITServe(qrf=NeuralLength()).needs_prompt_text
    policy = JITServe()
    policy.use_component("qrf", QrfLength(prompt_features=16, generated_features=0))  # a live swap
    assert policy.needs_prompt_text


def test_a_forest_that_reads_the_generated_text_is_refused_as_a_bound():
    """The scheduler has no generated text: asked with blank text at every refinement, such a
    forest bounded held-out AlpacaEval answers 14% higher at 100 tokens than with the real text."""
    from predictors.qrf_length import QrfLength

    with pytest.raises(ValueError, match="reads the generated text"):
        JITServe(qrf=QrfLength())  # generated_features=32, the estimator's default
    policy = JITServe(qrf=QrfLength(generated_features=0))
    with pytest.raises(ValueError, match="generated_features=0"):
        policy.use_component("qrf", QrfLength(generated_features=8))


def test_the_fallback_bound_is_the_quantile_of_completed_lengths_above_what_was_generated():
    """Before a forest bound comes (or without a forest): the `quantile` of the completed lengths
    above `generated`, minus `generated`; with fewer than 20 of them, max(1024, 2 g) - g."""
    policy = JITServe(quantile=0.9)
    assert policy._fallback_bound(0) == 1024.0 and policy._fallback_bound(700) == 700.0
    for length in range(1, 101):  # 1..100 completed
        policy._remember_length(length)
    # Above 50: 51..100 (50 lengths); index 50 + int(0.9 * 49) = 94 -> length 95; 95 - 50 = 45.
    assert policy._fallback_bound(50) == 45.0
    assert policy._fallback_bound(85) == 1024.0 - 85  # only 15 above 85: too few to trust


def test_pattern_matching_weights_each_stored_graph_by_its_stage_kernels_by_hand():
    """JITServe's phi(s) and per-call bound: the stored graphs whose prefix matches, each weighted
    by the product of Gaussian kernels on its stages' log lengths (output and input for a finished
    LLM stage, input only for the stage about to run), exp(-d^2 / (2 bandwidth^2)); phi and the
    bound are their weighted means."""

    def llm(prompt: int, output: int, seconds: float) -> StageNode:
        return StageNode(
            "llm",
            "m",
            input_tokens=prompt,
            output_tokens=output,
            max_output_tokens=output,
            duration_s=seconds,
        )

    same = ProgramGraph("a", (llm(100, 50, 1.0), llm(200, 80, 3.0), llm(300, 10, 4.0)))  # phi(1) = 4 / 8
    other = ProgramGraph("b", (llm(100, 150, 1.0), llm(400, 40, 1.0), llm(300, 10, 6.0)))  # phi(1) = 2 / 8
    patterns = PatternGraph(bandwidth=0.5, neighbors=2).fit([same, other])
    seen, current = (llm(100, 50, 1.0),), llm(200, 0, 0.0)
    d2 = (math.log1p(50) - math.log1p(150)) ** 2 + (math.log1p(200) - math.log1p(400)) ** 2
    weight = math.exp(-d2 / (2 * 0.5**2))  # ~0.0365; the identical graph's is 1
    index, weights = patterns.match(seen, current)
    assert index.tolist() == [0, 1] and weights == pytest.approx([1.0, weight])
    assert patterns.stage_share(seen, current) == pytest.approx((0.5 + weight * 0.25) / (1 + weight))
    # The per-call output bound of the stage about to run: the same weights on its longest calls.
    assert patterns.stage_output_bound(seen, current) == pytest.approx((80 + weight * 40) / (1 + weight))
    assert PatternGraph(bandwidth=0.5, neighbors=1).fit([same, other]).stage_share(seen, current) == 0.5


@pytest.mark.parametrize("waiting_time_s", [None, 0.5])
def test_a_long_run_keeps_no_request_it_has_finished_with(waiting_time_s):
    # With admission control off, every arrival stayed in the queue it reads: a server kept every
    # request (its text, its cache) for good.
    slo = SLO(ttft_s=1.0, tbt_s=0.1)
    requests = [
        Request(f"r{i}", arrival_s=i * 0.01, prompt_tokens=20, output_tokens=5, slo=slo) for i in range(300)
    ]
    policy = JITServe(frame_steps=2, waiting_time_s=waiting_time_s)
    engine = CheckedEngine(policy, ConstantCost(0.01), EngineConfig(max_running=8, kv_capacity_tokens=4000))
    engine.run(requests)
    assert engine.violations == [] and not policy._requests
    assert len(policy._arrivals) <= (0 if waiting_time_s is None else 0.5 / 0.01 + 1)
