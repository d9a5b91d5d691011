"""Hand-computed engine cases and property tests of the engine's invariants under every policy."""

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.requests import SLO, Request
from serving_hooks.policies import POLICIES, make_policy, make_policy_from_spec
from tests.replay_helpers import CheckedEngine, ConstantCost


def run(requests, policy="fcfs", *, seconds=0.1, kv_tokens=1_000_000, **config):
    engine = CheckedEngine(make_policy(policy), ConstantCost(seconds, kv_tokens), EngineConfig(**config))
    result = engine.run(requests)
    assert engine.violations == []
    return engine, result


def by_id(result):
    return {r.request_id: r for r in result.records}


def test_single_request_ttft_tbt_ttlt_by_hand():
    # Step 1 prefills 10 tokens and samples token 0 at 0.1; steps 2-3 decode tokens 1-2.
    _, result = run([Request("a", 0.0, 10, 3)])
    record = by_id(result)["a"]
    assert record.first_token_s == pytest.approx(0.1)
    assert record.finish_s == pytest.approx(0.3)
    metrics = result.metrics()
    assert metrics["ttft_mean"] == pytest.approx(0.1)
    assert metrics["tbt_p50"] == pytest.approx(0.1) and metrics["tbt_p99"] == pytest.approx(0.1)
    assert metrics["ttlt_mean"] == pytest.approx(0.3)
    assert metrics["goodput_tokens"] == 13 and metrics["slo_attainment"] == 1.0


def test_chunked_prefill_shares_the_budget():
    # Budget 8: A's 10-token prompt takes 8 then 2; B (4 tokens, arrived at 0.05) joins step 2.
    _, result = run([Request("a", 0.0, 10, 2), Request("b", 0.05, 4, 1)], token_budget=8)
    records = by_id(result)
    assert records["a"].first_token_s == pytest.approx(0.2)
    assert records["b"].first_token_s == pytest.approx(0.2)
    assert records["a"].finish_s == pytest.approx(0.3)


def test_latency_goodput_counts_on_time_tokens():
    on_time = SLO(kind="latency", ttft_s=0.15, tbt_s=0.1)  # deadlines 0.15, 0.25, 0.35
    late = SLO(kind="latency", ttft_s=0.05, tbt_s=0.1)  # deadlines 0.05, 0.15, 0.25: all missed
    _, good = run([Request("a", 0.0, 10, 3, slo=on_time)])
    _, bad = run([Request("a", 0.0, 10, 3, slo=late)])
    assert good.metrics()["goodput_tokens"] == 3 and good.metrics()["slo_attainment"] == 1.0
    assert bad.metrics()["goodput_tokens"] == 0 and bad.metrics()["slo_attainment"] == 0.0


def test_tbt_only_slo_is_anchored_at_the_first_token():
    # Token times 0.1, 0.2, 0.3; TBT SLO 0.05 from the first token: only token 0 is on time.
    _, result = run([Request("a", 0.0, 10, 3, slo=SLO(kind="latency", tbt_s=0.05))])
    assert by_id(result)["a"].ontime_tokens == 1


def test_deadline_goodput_is_all_or_nothing():
    met = SLO(kind="deadline", deadline_s=0.31)
    missed = SLO(kind="deadline", deadline_s=0.25)
    _, result = run([Request("a", 0.0, 10, 3, slo=met)])
    assert result.metrics()["goodput_tokens"] == 13
    _, result = run([Request("a", 0.0, 10, 3, slo=missed)])
    assert result.metrics()["goodput_tokens"] == 0


def test_goodput_per_request_by_hand_and_summed_as_the_metric():
    """`goodput_tokens`: per request what the goodput metric sums -- a latency request's on-time
    tokens (3), a deadline request's prompt and output if it met its deadline (13), else 0."""
    from adapt.replay.metrics import goodput_tokens

    requests = [
        Request("lat", 0.0, 10, 3, slo=SLO(kind="latency", ttft_s=5.0, tbt_s=5.0)),
        Request("met", 0.0, 10, 3, slo=SLO(kind="deadline", deadline_s=5.0)),
        Request("missed", 0.0, 10, 3, slo=SLO(kind="deadline", deadline_s=0.05)),
    ]
    _, result = run(requests)
    per_request = dict(zip(result.table.request_ids, goodput_tokens(result.table).tolist(), strict=True))
    assert per_request == {"lat": 3, "met": 13, "missed": 0}
    assert sum(per_request.values()) == result.metrics()["goodput_tokens"]


def test_compound_program_counts_only_if_last_stage_in_time():
    from adapt.requests import ProgramRef

    slo = SLO(kind="compound", deadline_s=0.35)
    requests = [
        Request("s0", 0.0, 10, 2, slo=slo, program=ProgramRef("p", 0)),
        Request("s1", 0.0, 10, 3, slo=slo, program=ProgramRef("p", 1)),
    ]
    _, result = run(requests)
    assert result.metrics()["goodput_tokens"] == 25  # both finish by 0.3
    _, result = run(requests, max_running=1)  # serial: s1 ends at 0.5, past 0.35
    assert result.metrics()["goodput_tokens"] == 0


def test_kv_exhaustion_preempts_by_recompute_and_still_completes():
    # 4 blocks of 16 tokens: two 20-token prompts growing to 40 tokens each cannot both fit.
    requests = [Request("a", 0.0, 20, 20), Request("b", 0.0, 20, 20)]
    engine, result = run(requests, kv_tokens=64, block_size=16)
    assert result.preemptions >= 1
    assert engine.completions == {"a": 20, "b": 20}


def test_request_larger_than_kv_is_dropped_with_reason():
    _, result = run([Request("big", 0.0, 100, 10), Request("ok", 0.0, 10, 2)], kv_tokens=64)
    records = by_id(result)
    assert records["big"].dropped == "larger than the whole KV cache"
    assert records["ok"].finish_s is not None
    assert result.metrics()["dropped"] == 1


def test_prefill_first_runs_prefills_alone():
    # vLLM V0: at t=0.1 B arrives; the next step prefills B only, so A's decode waits.
    _, result = run([Request("a", 0.0, 10, 3), Request("b", 0.05, 10, 1)], policy="vllm-v0")
    records = by_id(result)
    assert records["b"].first_token_s == pytest.approx(0.2)
    assert records["a"].finish_s == pytest.approx(0.4)


def test_spf_orders_waiting_by_prompt_length():
    requests = [Request("blocker", 0.0, 10, 5), Request("long", 0.01, 50, 1), Request("short", 0.02, 5, 1)]
    _, result = run(requests, policy="spf", max_running=1)
    records = by_id(result)
    assert records["short"].first_token_s < records["long"].first_token_s
    _, result = run(requests, policy="fcfs", max_running=1)
    records = by_id(result)
    assert records["long"].first_token_s < records["short"].first_token_s


request_lists = st.lists(
    st.tuples(st.floats(0, 20), st.integers(1, 300), st.integers(1, 120), st.sampled_from(["x", "y"])),
    min_size=1,
    max_size=30,
)


def make_requests(rows):
    rows = sorted(rows, key=lambda r: r[0])
    slos = {"x": SLO(kind="latency", ttft_s=1.0, tbt_s=0.2), "y": SLO(kind="deadline", deadline_s=10.0)}
    return [Request(f"r{i}", t, p, o, slo=slos[c], label=c) for i, (t, p, o, c) in enumerate(rows)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Regression: a decode run used to step past FastServe's quantum boundary (horizon floored at 1).
@example(
    rows=[(9.0, 1, 1, "x"), (8.625, 1, 34, "x")], policy="fastserve", budget=16, max_running=1, kv_blocks=30
)
# Regression: a decode run stepped one step past a JITServe frame (its horizon counted the step
# just planned), so the fast path admitted in the old frame's order.
@example(
    rows=[(0.0, 1, 1, "x"), (0.0, 1, 16, "x"), (0.0, 1, 66, "x")],
    policy="jitserve-oracle",
    budget=16,
    max_running=1,
    kv_blocks=30,
)
# Regression: at a 1-token budget a prefill chunk of 1 token looked like a decode step, and the
# fast path advanced it as a decode run (tokens generated from a prompt not yet computed).
@example(rows=[(0.0, 5, 4, "x"), (0.0, 3, 6, "x")], policy="fcfs", budget=1, max_running=2, kv_blocks=30)
# Regression: a request finishing in a step left only a 1-token prefill running, which the fast
# path then advanced as a decode run (the running count matched what the step had scheduled).
@example(
    rows=[(0.0, 68, 20, "x"), (0.0, 8, 27, "x"), (0.0, 96, 26, "y")],
    policy="slai",
    budget=1,
    max_running=2,
    kv_blocks=67,
)
# Regression: a decode run right after a request finished, though the finish freed a slot that
# SLAI's next plan fills with an admission instead of the deferred decode.
@example(
    rows=[(0.0, 20, 2, "x"), (0.0, 5, 4, "x"), (0.0, 100, 10, "y"), (7.877, 56, 37, "y")],
    policy="slai",
    budget=2,
    max_running=2,
    kv_blocks=53,
)
# Regression: SLAI's critical decode stops being critical once its token is out, so the next
# plan differs (it reserves the budget for an admission); the fast path repeated the old one.
@example(
    rows=[(0.0, 49, 5, "y"), (0.0, 48, 1, "y"), (0.0, 5, 40, "x"), (0.0, 61, 6, "x")],
    policy="slai",
    budget=1,
    max_running=2,
    kv_blocks=80,
)
# Regression: two requests finishing in the last step of a decode run left in the running order
# of the run's first step; TRAIL's order had changed by then (remaining lengths floor at 1).
@example(
    rows=[
        (0.0, 1, 1, "x"),
        (0.0, 1, 1, "x"),
        (0.0, 1, 51, "x"),
        (0.0, 1, 51, "x"),
        (1.0, 1, 73, "x"),
        (1.0, 1, 73, "x"),
    ],
    policy="trail",
    budget=2,
    max_running=2,
    kv_blocks=30,
)
# Regression: a decode run stepped past the time JITServe's admission control drops a request that
# waited too long, so the drop came at the run's end instead of at the first step after it.
@example(
    rows=[(0.0, 1, 2, "x"), (0.0, 4, 10, "y"), (2.0, 275, 120, "y"), (0.0, 131, 120, "y")],
    policy="jitserve-oracle",
    budget=2,
    max_running=1,
    kv_blocks=30,
)
# Regression: requests finishing in the same step of a decode run left in admission order, not in
# the plan's running order as they do one step at a time (a policy learning online saw them swapped).
@example(
    rows=[
        (5.0, 68, 115, "x"),
        (6.0, 2, 1, "x"),
        (5.0, 161, 28, "x"),
        (5.0, 233, 4, "y"),
        (4.53125, 157, 42, "y"),
        (8.421875, 191, 3, "y"),
    ],
    policy="slai",
    budget=3,
    max_running=3,
    kv_blocks=36,
)
@given(
    rows=request_lists,
    policy=st.sampled_from((*POLICIES, "sagesched:victim=newest", "spf:victim=newest")),
    budget=st.one_of(st.integers(1, 3), st.integers(16, 512)),
    max_running=st.integers(1, 12),
    kv_blocks=st.integers(30, 80),
)
def test_engine_invariants_and_fast_path_agree(rows, policy, budget, max_running, kv_blocks):
    from adapt.replay.cost import roofline

    requests = make_requests(rows)
    cost = roofline("llama-2-7b", "a100-80g")
    results, lifecycles = [], []
    for skip in (True, False):
        config = EngineConfig(
            token_budget=budget,
            max_running=max_running,
            kv_capacity_tokens=kv_blocks * 16,
            skip_decode_runs=skip,
        )
        scheduler = make_policy_from_spec(policy)
        lifecycles.append(_log_lifecycle(scheduler))
        engine = CheckedEngine(scheduler, cost, config)
        result = engine.run(requests)
        assert engine.violations == []
        records = by_id(result)
        for request in requests:
            record = records[request.request_id]
            if record.dropped is None:
                # Completed exactly once, with exactly its output tokens.
                assert engine.completions[request.request_id] == request.output_tokens
                assert request.arrival_s <= record.first_token_s <= record.finish_s
            elif record.dropped != "admission control":  # jitserve's, by design (never silent)
                assert request.prompt_tokens + request.output_tokens > kv_blocks * 16
        assert len(records) == len(requests)
        results.append(result.metrics())
    # The policy sees the same arrivals, admissions, preemptions and finishes, in the same order
    # at the same times (SageSched learns from finished requests in order).
    assert lifecycles[0] == lifecycles[1]
    fast, slow = results
    for key in ("completed", "goodput_tokens", "goodput_requests", "preemptions"):
        assert fast[key] == slow[key], key
    for key in ("ttft_mean", "ttlt_mean", "ttlt_p99", "tbt_p50", "tbt_p99", "makespan_s"):
        if slow[key] is None:
            assert fast[key] is None, key
        else:
            assert fast[key] == pytest.approx(slow[key], rel=1e-9, abs=1e-9), key


def _log_lifecycle(policy) -> list[tuple[str, str, float]]:
    """Record each lifecycle call the engine makes to `policy`: (callback, request, time)."""
    calls: list[tuple[str, str, float]] = []

    def logging(name: str):
        method = getattr(policy, name)

        def logged(request, now):
            calls.append((name, request.id, now))
            return method(request, now)

        return logged

    for name in ("on_arrival", "on_admit", "on_preempt", "on_finish"):
        setattr(policy, name, logging(name))
    return calls


class _VectorisedOnly:
    """The roofline without `decode_step_timer`: every decode run takes the vectorised path."""

    def __init__(self, cost) -> None:
        self.time, self.decode_run_times = cost.time, cost.decode_run_times
        self.kv_capacity_tokens = cost.kv_capacity_tokens
        self.arrival_overhead_s = cost.arrival_overhead_s


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=request_lists,
    policy=st.sampled_from(("fcfs", "slai", "sagesched", "ewsjf", "jitserve")),
    block_size=st.sampled_from([1, 2, 16]),
    kv_blocks=st.integers(30, 200),
)
def test_short_decode_runs_in_python_are_the_vectorised_runs(rows, policy, block_size, kv_blocks):
    """`_short_run` (plain Python, runs of up to SHORT_RUN_STEPS) gives the very same replay as the
    vectorised decode run: the same floats, steps, KV timeline and TBT samples."""
    from adapt.replay.cost import roofline

    requests = make_requests(rows)
    config = EngineConfig(
        max_running=8, block_size=block_size, kv_capacity_tokens=kv_blocks * 16, keep_token_times=True
    )
    runs = []
    for cost in (roofline("llama-2-7b", "a100-80g"), _VectorisedOnly(roofline("llama-2-7b", "a100-80g"))):
        engine = ReplayEngine(make_policy(policy), cost, config)
        result = engine.run(requests)
        metrics = result.metrics()
        metrics.pop("sim_wall_s")
        samples = {k: [(v.tolist(), w) for v, w in c] for k, c in result.tbt_samples.items()}
        timeline = [a.tolist() for a in result.kv_timeline]
        runs.append((metrics, samples, timeline, engine.now, engine.step_index, engine.mean_batch_time))
    assert runs[0] == runs[1]


@settings(max_examples=15, deadline=None)
@given(rows=request_lists, policy=st.sampled_from(tuple(POLICIES)))
def test_same_seed_same_result(rows, policy):
    from adapt.replay.cost import roofline

    requests = make_requests(rows)
    first = ReplayEngine(make_policy(policy), roofline("mistral-7b", "a40")).run(requests).metrics()
    again = ReplayEngine(make_policy(policy), roofline("mistral-7b", "a40")).run(requests).metrics()
    first.pop("sim_wall_s"), again.pop("sim_wall_s")
    assert first == again


def test_fast_path_advances_whole_decode_runs():
    requests = [Request("a", 0.0, 10, 200), Request("b", 0.0, 30, 150)]
    counts = []
    for skip in (True, False):
        engine = CheckedEngine(make_policy("fcfs"), ConstantCost(0.01), EngineConfig(skip_decode_runs=skip))
        calls = 0
        while engine.has_work or calls == 0:
            if calls == 0:
                for r in requests:
                    engine.add(r)
            engine.step()
            calls += 1
        counts.append(calls)
        assert engine.violations == []
        assert engine.completions == {"a": 200, "b": 150}
    fast, slow = counts
    assert slow >= 200 and fast <= 5


def test_prefill_first_admits_when_the_decodes_alone_fill_the_budget():
    """vLLM V0 admits prefills before the decodes, with the whole budget: a step whose running
    decodes alone would fill the budget still admits (regression: the fast path took it for a
    step of plain decodes and ran the decodes instead)."""
    from serving_hooks.policies.baselines import VllmV0

    class TightV0(VllmV0):
        token_budget = 2

    requests = [Request("a", 0.0, 4, 100), Request("b", 0.0, 4, 100), Request("c", 0.5, 4, 5)]
    lifecycles = []
    for skip in (True, False):
        policy = TightV0()
        lifecycles.append(_log_lifecycle(policy))
        config = EngineConfig(max_running=4, skip_decode_runs=skip)
        ReplayEngine(policy, ConstantCost(0.01), config).run(requests)
    assert lifecycles[0] == lifecycles[1]
    assert ("on_admit", "c", pytest.approx(0.5, abs=0.011)) in lifecycles[0]


class _StepCounting(CheckedEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def step(self, trace=None):
        self.calls += 1
        super().step(trace)


def test_fcfs_runs_go_past_arrivals_behind_a_blocked_head():
    """A long request holds the KV cache; the next one (the head) cannot be admitted until it
    finishes, so the arrivals behind the head change nothing FCFS does: its decode runs go past
    them (`Horizon.past_arrivals`), in fewer engine calls, with the same replay to the bit as
    stepping one at a time and as runs that stop at every arrival."""
    from adapt.policy import FOREVER
    from adapt.replay.cost import roofline
    from serving_hooks.policies.baselines import FCFS

    class StopAtArrivals(FCFS):
        def horizon(self, view):
            return FOREVER

    requests = [Request("long", 0.0, 100, 200), Request("head", 0.01, 250, 10)]
    requests += [Request(f"r{i}", 0.02 + 0.013 * i, 20 + i, 5) for i in range(40)]
    runs = []
    for policy, skip in ((FCFS(), True), (StopAtArrivals(), True), (FCFS(), False)):
        lifecycle = _log_lifecycle(policy)
        config = EngineConfig(kv_capacity_tokens=20 * 16, skip_decode_runs=skip)
        engine = _StepCounting(policy, roofline("llama-2-7b", "a100-80g"), config)
        metrics = engine.run(requests).metrics()
        assert engine.violations == [] and metrics["completed"] == len(requests)
        metrics.pop("sim_wall_s", None)
        runs.append((engine.calls, lifecycle, metrics))
    (passing, *same), (stopping, *stopped), (one_by_one, *stepped) = runs
    assert passing < stopping < one_by_one
    assert same[0] == stopped[0] == stepped[0]  # arrivals, admissions, finishes: same order, same times
    for key in ("completed", "preemptions", "steps", "ttft_mean", "ttlt_mean", "makespan_s"):
        assert same[1][key] == stepped[1][key], key
        assert same[1][key] == stopped[1][key], key


def test_an_intake_delay_is_charged_to_latency_and_slos_from_the_arrival():
    """`adapt serve --embed-prompts` holds a request in the API server before the engine sees
    it: the policy sees it from then on (as the live adapter stamps it), its client counts from
    its arrival. One request, 0.1 s steps, a 0.05 s hold: tokens at 0.15 / 0.25 / 0.35."""
    seen = []
    policy = make_policy("fcfs")
    on_arrival = policy.on_arrival
    policy.on_arrival = lambda state, now: seen.append((state.arrival_s, now)) or on_arrival(state, now)
    slo = SLO(kind="latency", ttft_s=0.12, tbt_s=0.1)  # due 0.12 / 0.22 / 0.32 from the arrival
    engine = CheckedEngine(policy, ConstantCost(0.1), EngineConfig(intake_delay_s=0.05))
    result = engine.run([Request("a", 0.0, 10, 3, slo=slo)])
    record = by_id(result)["a"]
    assert seen == [(pytest.approx(0.05), pytest.approx(0.05))]
    assert record.arrival_s == 0.0
    assert (record.first_token_s, record.finish_s) == (pytest.approx(0.15), pytest.approx(0.35))
    metrics = result.metrics()
    assert metrics["ttft_mean"] == pytest.approx(0.15) and metrics["ttlt_mean"] == pytest.approx(0.35)
    assert metrics["goodput_tokens"] == 0  # every token is late counted from the arrival
    _, undelayed = run([Request("a", 0.0, 10, 3, slo=slo)])
    assert undelayed.metrics()["goodput_tokens"] == 3  # ...and on time without the hold
    with pytest.raises(ValueError, match="intake_delay_s"):
        EngineConfig(intake_delay_s=-0.01)


@settings(max_examples=40, deadline=None)
@given(
    arrivals=st.lists(st.integers(0, 640), min_size=1, max_size=25),
    lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 60)), min_size=25, max_size=25),
    policy=st.sampled_from(("fcfs", "spf", "sarathi", "ewsjf")),
    kv_blocks=st.integers(30, 80),
)
def test_an_intake_delay_shifts_every_request_by_exactly_that_and_decides_the_same(
    arrivals, lengths, policy, kv_blocks
):
    """The engine sees the same trace later: the same steps, preemptions and drops, every token
    `intake_delay_s` later (times on a 1/64 s grid and 1/8 s steps: exact in floating point)."""
    requests = [
        Request(f"r{i}", t / 64, p, o)
        for i, (t, (p, o)) in enumerate(zip(sorted(arrivals), lengths, strict=False))
    ]
    runs = []
    for delay in (0.0, 0.25):
        config = EngineConfig(
            token_budget=64, max_running=6, kv_capacity_tokens=kv_blocks * 16, intake_delay_s=delay
        )
        engine = CheckedEngine(make_policy(policy), ConstantCost(0.125), config)
        result = engine.run(requests)
        assert engine.violations == []
        runs.append((delay, by_id(result), engine.step_index))
    (_, plain, steps), (delay, delayed, delayed_steps) = runs
    assert delayed_steps == steps
    for request in requests:
        before, after = plain[request.request_id], delayed[request.request_id]
        assert after.arrival_s == before.arrival_s == request.arrival_s
        assert (after.preemptions, after.dropped) == (before.preemptions, before.dropped)
        if before.first_token_s is not None:
            assert after.first_token_s == before.first_token_s + delay
            assert after.finish_s == before.finish_s + delay
