"""The mechanics the engine contract names (`adapt.mechanics`), by hand: the victim rule, admission
of whole sequences only, and async scheduling's one-step lag -- each as vLLM V1 does it."""

import pytest

from adapt.policy import Horizon, Plan, Policy
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.requests import Request
from tests.replay_helpers import CheckedEngine, ConstantCost


class Ordered(Policy):
    """Admits by arrival; runs `order` first (by id), the rest after, in admission order."""

    name = "ordered"

    def __init__(self, order=()):
        self.order = list(order)

    def on_step(self, view):
        rank = {rid: i for i, rid in enumerate(self.order)}
        running = sorted(view.running, key=lambda r: rank.get(r.id, len(rank)))
        return Plan(admit=iter(view.waiting), running_order=running)


def engine(policy, kv_tokens, **config):
    config = EngineConfig(block_size=4, kv_capacity_tokens=kv_tokens, skip_decode_runs=False, **config)
    return CheckedEngine(policy, ConstantCost(0.1), config)


def test_kv_pressure_evicts_the_last_request_of_the_running_order():
    # 6 blocks of 4 tokens. a and b (8-token prompts, 2 blocks each) are admitted at t=0 and hold 4
    # blocks; they decode into their third block at token 9 (step 2), then their fourth at token 13.
    # Step 3 needs a 4th block each with 0 free after b took the last: the last of the order goes.
    for order, victim in ((["a", "b"], "b"), (["b", "a"], "a")):
        e = engine(Ordered(order), kv_tokens=24, record_decisions=True)
        e.run([Request("a", 0.0, 8, 10), Request("b", 0.0, 8, 10)])
        assert e.violations == []
        preempted = [rid for step in e.decisions for rid in step["preempted"]]
        assert preempted[0] == victim


def test_a_request_is_admitted_only_if_its_whole_sequence_fits():
    # 4 blocks of 4 tokens; a holds 2 (an 8-token prompt). b's prompt needs 3 blocks: its first
    # 4-token chunk would fit, but vLLM (scheduler_reserve_full_isl) waits until all of it does.
    e = engine(Ordered(), kv_tokens=16, token_budget=12, record_decisions=True)
    e.run([Request("a", 0.0, 8, 3), Request("b", 0.0, 12, 2)])
    first = e.decisions[0]["scheduled"]
    assert first == {"a": 8}  # b does not start until a has finished and freed its blocks
    assert next(i for i, d in enumerate(e.decisions) if "b" in d["scheduled"]) > 2
    partial = engine(
        Ordered(), kv_tokens=16, token_budget=12, reserve_full_sequence=False, record_decisions=True
    )
    partial.run([Request("a", 0.0, 8, 3), Request("b", 0.0, 12, 2)])
    assert partial.decisions[0]["scheduled"] == {"a": 8, "b": 4}


def test_async_scheduling_delivers_a_steps_tokens_after_the_next_step_is_planned():
    # Prompt 4, 3 tokens, all the client allows, 0.1 s steps. Step 0 prefills (token 1), steps 1
    # and 2 decode (tokens 2 and 3). Under async scheduling step 1 is planned before token 1 is
    # delivered (the policy still sees 0 generated), and step 3 schedules nothing: the request's
    # max_tokens-th token is in flight.
    seen = []

    class Watching(Ordered):
        def on_step(self, view):
            seen.append([r.tokens_generated for r in view.running])
            return super().on_step(view)

    e = engine(Watching(), kv_tokens=64, async_scheduling=True, record_decisions=True)
    result = e.run([Request("a", 0.0, 4, 3, max_tokens=3), Request("b", 5.0, 4, 1, max_tokens=1)])
    assert [d["scheduled"] for d in e.decisions] == [{"a": 4}, {"a": 1}, {"a": 1}, {}, {"b": 4}, {}]
    assert seen == [[], [0], [1], [2], [], [0]]
    a = next(r for r in result.records if r.request_id == "a")
    assert a.first_token_s == pytest.approx(0.1) and a.finish_s == pytest.approx(0.3)
    assert e.decisions[3]["freed"] == []  # freed when the last step's output arrives, after it
    # Step 3's empty schedule() counts as a step in vLLM (its `current_step`), as every call does:
    # b's first step is step 4 (the replay once gave it 3, which steps-based policies read).
    assert [d["index"] for d in e.decisions] == [0, 1, 2, 3, 4, 5]


def test_async_scheduling_runs_one_more_decode_for_an_answer_a_stop_token_ends():
    # As above, but the client allows 10 tokens and the answer stops at 3 (an EOS). vLLM skips a
    # request only when the token in flight is its max_tokens-th, so step 3 decodes `a` once more
    # -- a token nobody receives -- and its KV blocks come back when token 3's stop reaches the
    # scheduler, after step 3 was planned. The record is that of the answer: 3 tokens at 0.3 s.
    e = engine(Ordered(), kv_tokens=64, async_scheduling=True, record_decisions=True)
    result = e.run([Request("a", 0.0, 4, 3, max_tokens=10)])
    assert [d["scheduled"] for d in e.decisions] == [{"a": 4}, {"a": 1}, {"a": 1}, {"a": 1}, {}]
    record = result.records[0]
    assert record.output_tokens == 3 and record.finish_s == pytest.approx(0.3)
    assert e._placeholders == {}  # the wasted token's return leaves no bookkeeping behind
    synchronous = engine(Ordered(), kv_tokens=64, record_decisions=True)
    synchronous.run([Request("a", 0.0, 4, 3, max_tokens=10)])
    assert [d["scheduled"] for d in synchronous.decisions] == [{"a": 4}, {"a": 1}, {"a": 1}]


def test_sync_and_async_agree_on_times_when_nothing_competes():
    requests = [Request(f"r{i}", 0.05 * i, 10 + i, 5 + i) for i in range(6)]
    results = []
    for asynchronous in (False, True):
        config = EngineConfig(kv_capacity_tokens=4096, async_scheduling=asynchronous, skip_decode_runs=False)
        results.append(ReplayEngine(Ordered(), ConstantCost(0.1), config).run(requests))
    sync, lagged = ({r.request_id: r.finish_s for r in res.records} for res in results)
    assert sync.keys() == lagged.keys()
    assert all(lagged[k] >= sync[k] - 1e-9 for k in sync)  # the lag can only delay, never speed up


def test_an_arrivals_intake_runs_before_the_next_step_by_hand():
    """`CostModel.arrival_overhead_s` (0.02 s per request here): the live engine takes requests in
    between steps, and their intake delays the next step; steps themselves take 0.1 s."""
    cost = ConstantCost(0.1)
    cost.arrival_overhead_s = 0.02
    config = EngineConfig(kv_capacity_tokens=4096, skip_decode_runs=False)
    requests = [Request("r0", 0.0, 10, 3), Request("r1", 0.0, 10, 3), Request("r2", 0.15, 10, 3)]
    records = {r.request_id: r for r in CheckedEngine(Ordered(), cost, config).run(requests).records}
    # t=0: r0 and r1 taken in (0.04 s); prefill 0.04-0.14; decode 0.14-0.24 (r2 not here yet at
    # 0.14); at 0.24 r2 is taken in (0.02 s); r2's prefill with two decodes 0.26-0.36.
    assert records["r0"].first_token_s == pytest.approx(0.14)
    assert records["r0"].finish_s == pytest.approx(0.36)
    assert records["r2"].first_token_s == pytest.approx(0.36)
    # Without intake time the same requests run 0.04 s and 0.06 s earlier.
    cost.arrival_overhead_s = 0.0
    records = {r.request_id: r for r in CheckedEngine(Ordered(), cost, config).run(requests).records}
    assert records["r0"].first_token_s == pytest.approx(0.1)
    assert records["r2"].first_token_s == pytest.approx(0.3)


@pytest.mark.parametrize(("victim", "evicted"), [("priority", "long"), ("newest", "short")])
def test_a_priority_policy_evicts_its_largest_key_or_with_victim_newest_the_last_admitted(victim, evicted):
    # 5 blocks of 4 tokens. "long" (8-token prompt) is admitted alone at t=0; "short" (4 tokens)
    # arrives at 0.05 and is admitted next. When their decodes need more blocks than are left, SPF
    # evicts the longest prompt (its largest key: vLLM's priority rule), which has computed the
    # most; with victim="newest" it keeps admission order and the last admitted goes (vLLM's FCFS
    # rule, the fewest tokens lost to the recompute).
    from serving_hooks.policies import make_policy

    e = engine(make_policy("spf", victim=victim), kv_tokens=20, record_decisions=True)
    e.run([Request("long", 0.0, 8, 12), Request("short", 0.05, 4, 12)])
    assert e.violations == []
    assert next(rid for step in e.decisions for rid in step["preempted"]) == evicted


class PreemptsAndReadmits(Policy):
    """Runs everything; at step `at` preempts `victim` and lists it first for admission again,
    logging the hooks it hears."""

    name = "preempts-and-readmits"

    def __init__(self, victim, at):
        self.victim, self.at, self.heard = victim, at, []

    def on_admit(self, request, now):
        self.heard.append(("admit", request.id))

    def on_preempt(self, request, now):
        self.heard.append(("preempt", request.id))

    def on_step(self, view):
        if view.step_index != self.at:
            return Plan(admit=iter(view.waiting))
        victim = next(r for r in view.running if r.id == self.victim)
        self.heard.append(("step", view.step_index))
        return Plan(admit=[victim, *view.waiting], preempt=[victim])


def test_a_request_preempted_by_the_plan_sits_out_the_step_and_is_told_after_its_admissions():
    """As vLLM's adapter does: it learns of a step's admissions and preemptions when vLLM's
    schedule() returns, admissions first, and holds the plan's victims out of that step (vLLM would
    otherwise re-admit one at once and the policy would never hear of either)."""
    policy = PreemptsAndReadmits("a", at=2)
    e = engine(policy, kv_tokens=400, record_decisions=True)
    e.run([Request("a", 0.0, 8, 6), Request("b", 0.15, 4, 3)])
    assert e.violations == []
    step = e.decisions[2]
    assert step["preempted"] == ["a"] and "a" not in step["scheduled"] and step["scheduled"]["b"] == 4
    assert "a" in e.decisions[3]["scheduled"]  # back the next step
    told = policy.heard[policy.heard.index(("step", 2)) :]
    assert told[:3] == [("step", 2), ("admit", "b"), ("preempt", "a")]


def test_a_plan_that_drops_a_running_request_is_refused():
    """Drops are admission control: vLLM would abort a running request after it streamed tokens,
    so both engines refuse the plan (the live adapter runs that step as FCFS and counts an error)."""
    from adapt.replay.engine import PolicyError

    class DropsRunning(Ordered):
        def on_step(self, view):
            plan = super().on_step(view)
            plan.drop = list(view.running[:1])
            return plan

    with pytest.raises(PolicyError, match="dropped request 'a', which is running"):
        engine(DropsRunning(), kv_tokens=400).run([Request("a", 0.0, 8, 6)])


def test_a_dropped_request_is_finished_when_its_policy_hears_of_it():
    class DropsWaiting(Ordered):
        def __init__(self):
            super().__init__()
            self.phases = {}

        def on_step(self, view):
            return Plan(admit=iter(view.waiting[:1]), drop=list(view.waiting[1:]))

        def on_finish(self, request, now):
            self.phases[request.id] = request.phase

    policy = DropsWaiting()
    engine(policy, kv_tokens=400).run([Request("a", 0.0, 8, 2), Request("b", 0.0, 8, 2)])
    assert policy.phases == {"b": "finished", "a": "finished"}


@pytest.mark.parametrize("asynchronous, seen", [(False, [0.0, 0.1, 0.1]), (True, [0.0, 0.0, 0.1])])
def test_a_steps_duration_joins_the_mean_step_time_when_its_output_comes(asynchronous, seen):
    """As the live adapter keeps it: a step that ran tokens counts once its output reached the
    scheduler -- at its end, or under async scheduling after the next step is planned."""

    class Watches(Ordered):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_step(self, view):
            self.seen.append(round(view.mean_batch_time_s, 9))
            return super().on_step(view)

    policy = Watches()
    engine(policy, kv_tokens=400, async_scheduling=asynchronous).run([Request("a", 0.0, 4, 6)])
    assert policy.seen[:3] == seen


def test_a_component_swapped_in_serves_from_the_next_plan_after_that_steps_intake():
    # `adapt serve` applies a swap at the start of vLLM's schedule(): requests that came while the
    # last step ran were told to the policy under the old version. b arrives during step 0 (0.1 s).
    class Versioned(Ordered):
        def __init__(self):
            super().__init__()
            self.model, self.seen = "v1", []

        def on_arrival(self, request, now):
            self.seen.append((request.id, self.model))

        def on_step(self, view):
            self.seen.append((view.step_index, self.model))
            return super().on_step(view)

    policy = Versioned()
    e = engine(policy, kv_tokens=64)
    e.add(Request("a", 0.0, 4, 3))
    e.add(Request("b", 0.05, 4, 1))
    e.step()
    e.use_component("model", "v2")
    e.step()
    assert policy.seen == [("a", "v1"), (0, "v1"), ("b", "v1"), (1, "v2")]


class AdmitsTwice(Ordered):
    """Lists every waiting request twice in its admission order."""

    def on_step(self, view):
        return Plan(admit=[r for r in view.waiting for _ in range(2)])


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_plan_that_lists_a_request_twice_admits_it_once(asynchronous):
    # vLLM's adapter admits it once (the scheduler harness checks it live); the replay charged its
    # tokens and blocks twice and then failed taking it off the waiting queue a second time.
    e = engine(AdmitsTwice(), kv_tokens=64, async_scheduling=asynchronous, record_decisions=True)
    result = e.run([Request("a", 0.0, 8, 2), Request("b", 0.0, 4, 2)])
    assert e.decisions[0]["scheduled"] == {"a": 8, "b": 4}
    assert e.violations == [] and sorted(r.request_id for r in result.records) == ["a", "b"]


class HoldsUntilTwoWait(Ordered):
    """Admits nothing before t=5 unless two requests wait (a batching policy's wake-up time)."""

    def on_step(self, view):
        if len(view.waiting) < 2 and view.now < 5.0:
            return Plan(admit=[])
        return super().on_step(view)

    def horizon(self, view):
        return Horizon(until_s=5.0)


def test_a_replica_of_a_cluster_does_not_sleep_past_an_arrival_routed_to_it():
    # Alone, the engine sees b arrive at t=2 and admits both then. In a cluster, arrivals are
    # routed one at a time, so the idle replica does not know of b yet: it used to sleep to the
    # policy's wake-up time (t=5) and serve both at 5.1; a live engine re-plans as b arrives.
    from adapt.replay.cluster import Cluster, make_router

    requests = [Request("a", 1.0, 4, 1), Request("b", 2.0, 4, 1)]
    alone = engine(HoldsUntilTwoWait(), kv_tokens=64).run(requests)
    clustered = Cluster([engine(HoldsUntilTwoWait(), kv_tokens=64)], make_router("round-robin")).run(requests)
    first = {r.request_id: r.first_token_s for r in alone.records}
    assert first == pytest.approx({"a": 2.1, "b": 2.1})
    assert {r.request_id: r.first_token_s for r in clustered.records} == pytest.approx(first)
