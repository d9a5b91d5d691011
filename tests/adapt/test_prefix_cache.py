"""The replay's prefix cache against hand-worked cases of vLLM's rules (hits, the free-block order,
eviction, shared blocks), and the engine with it: a shared prompt computes only its uncached
tokens, a preempted request finds its own blocks, and with nothing to share the replay is the one
without prefix caching. Step-by-step agreement with vLLM's scheduler is checked in
tests/integration/test_scheduler_harness.py."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.replay.prefix_cache import PrefixCachingBlockPool
from adapt.requests import Request
from serving_hooks.policies import make_policy
from tests.replay_helpers import CheckedEngine, ConstantCost


def filled(pool: PrefixCachingBlockPool, request_id: str, tokens: int, keys=()) -> None:
    """A request that computed `tokens` tokens, its full blocks cached."""
    pool.register(request_id, keys)
    assert pool.try_grow(request_id, tokens)
    pool.cache(request_id, tokens)


def test_a_prompt_finds_the_blocks_another_cached_and_always_computes_its_last_token():
    pool = PrefixCachingBlockPool(10, 16)
    filled(pool, "a", 48, keys=("p0", "p1", "p2"))
    pool.register("b", ("p0", "p1", "x2"))
    assert pool.lookup("b", 60) == [0, 1]  # the third block differs
    pool.register("c", ("p0", "p1", "p2"))
    assert pool.lookup("c", 48) == [0, 1]  # 48 tokens all cached: the last block is computed again
    assert pool.lookup("c", 49) == [0, 1, 2]
    pool.register("d", ())
    assert pool.lookup("d", 100) == []  # no keys: nothing shared


def test_partial_blocks_are_not_cached_and_cache_follows_the_computed_tokens():
    pool = PrefixCachingBlockPool(10, 16)
    pool.register("a", ("p0", "p1", "p2"))
    assert pool.try_grow("a", 40)  # 3 blocks, 2 full
    pool.cache("a", 40)
    pool.register("b", ("p0", "p1", "p2"))
    assert pool.lookup("b", 100) == [0, 1]
    pool.cache("a", 48)
    assert pool.lookup("b", 100) == [0, 1, 2]


def test_freed_blocks_go_back_uncached_to_the_head_and_cached_to_the_tail_last_first():
    pool = PrefixCachingBlockPool(6, 16)
    filled(pool, "a", 40)  # blocks 0, 1 full and cached, block 2 partial
    assert list(pool._queue) == [3, 4, 5]
    pool.release("a")
    assert list(pool._queue) == [2, 3, 4, 5, 1, 0]  # reversed: 2 uncached to the head; 1, 0 to the tail
    assert pool.free_blocks == 6
    pool.register("b", ())
    assert pool.try_grow("b", 16 * 5)  # takes 2, 3, 4, 5 and then evicts 1
    pool.register("a", ())  # a comes back: only block 0 still holds its first 16 tokens
    assert pool.lookup("a", 40) == [0]


def test_a_hit_on_a_free_block_counts_against_the_room_and_shared_blocks_are_freed_once():
    pool = PrefixCachingBlockPool(4, 16)
    filled(pool, "a", 32, keys=("p0", "p1"))
    pool.release("a")  # blocks 0, 1 cached and free; 4 free in all
    pool.register("b", ("p0", "p1"))
    hits = pool.lookup("b", 40)
    assert hits == [0, 1]
    # 40 tokens: 3 blocks, 2 of them hits -- 1 new block, and both hits leave the free queue.
    assert pool.fits("b", hits, 40)
    assert pool.fits("b", hits, 64) and not pool.fits("b", hits, 65)
    pool.adopt("b", hits)
    assert pool.try_grow("b", 40) and pool.free_blocks == 1 and pool.held("b") == 3
    assert pool.hit_tokens == 32
    pool.register("c", ("p0", "p1"))
    hits = pool.lookup("c", 40)
    pool.adopt("c", hits)  # shared with b: taken from no queue
    assert pool.free_blocks == 1
    pool.release("b")
    assert pool.free_blocks == 2  # its own third block only; 0 and 1 are still c's
    pool.release("c")
    assert pool.free_blocks == 4


def test_a_shared_system_prompt_is_computed_once():
    """Three requests open with the same 64-token system prompt, one after the other: the first
    computes all 80 prompt tokens, the others only the 16 after the cached 64."""
    system = tuple(f"sys{i}" for i in range(4))
    requests = [Request(f"r{i}", 10.0 * i, 80, 4, prompt_blocks=(*system, f"own{i}")) for i in range(3)]
    engine = ReplayEngine(
        make_policy("fcfs"), ConstantCost(), EngineConfig(prefix_caching=True, record_decisions=True)
    )
    engine.run(requests)
    first_steps = {}
    for decision in engine.decisions:
        for request_id, tokens in decision["scheduled"].items():
            first_steps.setdefault(request_id, tokens)
    assert first_steps == {"r0": 80, "r1": 16, "r2": 16}
    assert engine.kv.hit_tokens == 128


def test_a_conversations_next_turn_finds_the_answer_before_it():
    """Turn 1: a 32-token prompt and a 40-token answer (blocks of 16: 2 prompt blocks, and by its
    end 2 more full of prompt and answer: 72 tokens, 4 full blocks, the last token never
    computed). Turn 2 sends all 72 tokens and 20 more: it finds the 4 blocks and computes 28 --
    only when turn 1's answer keys say what its answer blocks hold."""
    first_turn = dict(prompt_blocks=("p0", "p1"), answer_blocks=("a2", "a3"))
    second_turn = dict(prompt_blocks=("p0", "p1", "a2", "a3", "n4"))
    computed = {}
    for answer_known in (True, False):
        turn_1 = Request(
            "t1", 0.0, 32, 40, **(first_turn if answer_known else {"prompt_blocks": ("p0", "p1")})
        )
        turn_2 = Request("t2", 100.0, 92, 4, **second_turn)
        config = EngineConfig(prefix_caching=True, record_decisions=True, block_size=16)
        engine = ReplayEngine(make_policy("fcfs"), ConstantCost(), config)
        engine.run([turn_1, turn_2])
        computed[answer_known] = next(
            d["scheduled"]["t2"] for d in engine.decisions if "t2" in d["scheduled"]
        )
    assert computed == {True: 28, False: 60}


@pytest.mark.parametrize(
    ("prompt_blocks", "answer_blocks", "complaint"),
    [
        (("p0", "p1", "p2"), (), "3 prompt block keys for 40 tokens, which fill 2 blocks of 16"),
        (("p0",), ("a2",), "one key per full prompt block (2, got 1)"),
        (("p0", "p1"), ("a2", "a3", "a4"), "at most 2 of their own (got 3)"),
    ],
)
def test_block_keys_that_do_not_fit_the_request_are_refused_when_added(
    prompt_blocks, answer_blocks, complaint
):
    """Keys from a log written with another block size, or answer keys without the prompt's."""
    request = Request("r", 0.0, 40, 30, prompt_blocks=prompt_blocks, answer_blocks=answer_blocks)
    engine = ReplayEngine(
        make_policy("fcfs"), ConstantCost(), EngineConfig(prefix_caching=True, block_size=16)
    )
    with pytest.raises(ValueError, match=re.escape(complaint)):
        engine.add(request)


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    """Two 40-token prompts with 60-token answers on 8 blocks, by hand. After step 24 each holds 4
    full (cached) blocks; at step 25 a needs a fifth and b, the last admitted, is preempted: its
    blocks go to the tail of the free queue last first (b3, b2, b1, b0). a's growth to 100 tokens
    takes b3, b2 and b1; when a finishes (step 59), b comes back with 65 tokens and finds b0:
    it computes 49 of them, against 65 without prefix caching."""
    requests = [Request("a", 0.0, 40, 60), Request("b", 0.0, 40, 60)]
    config = dict(record_decisions=True, kv_capacity_tokens=16 * 8, reserve_full_sequence=False)
    resumed = {}
    for on in (False, True):
        engine = ReplayEngine(make_policy("fcfs"), ConstantCost(), EngineConfig(prefix_caching=on, **config))
        result = engine.run(requests)
        assert len(result.records) == 2 and result.preemptions == 1
        assert next(d["index"] for d in engine.decisions if d["preempted"]) == 25
        resumed[on] = next(d["scheduled"] for d in engine.decisions if d["index"] == 60)
    assert resumed == {False: {"b": 65}, True: {"b": 49}}
    assert engine.kv.hit_tokens == 16


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_reset_that_preempts_running_requests_recomputes_them_from_scratch(async_scheduling):
    """Two 40-token prompts (blocks of 16), by hand: step 0 computes both prompts, step 1 decodes
    both; then an operator resets the cache with running requests (`preempt_running`). Both are
    preempted (the last running first) and admitted again at step 2, whose record lists them as
    preempted, each recomputing its prompt and the tokens it has -- none of it cached any more.
    Under async scheduling step 1's tokens were still in flight: they are dropped (vLLM's
    `drop_stale_output`), so each has 1 token, not 2, and computes 41 (sync: 42)."""
    requests = [Request("a", 0.0, 40, 10), Request("b", 0.0, 40, 10)]
    config = EngineConfig(
        prefix_caching=True, record_decisions=True, block_size=16, async_scheduling=async_scheduling
    )
    engine = ReplayEngine(make_policy("fcfs"), ConstantCost(), config)
    for request in requests:
        engine.add(request)
    engine.step()
    engine.step()
    assert engine.reset_prefix_cache(preempt_running=True)
    assert [state.phase for state in engine.waiting.values()] == ["preempted", "preempted"]
    assert list(engine.waiting) == ["b", "a"] and not engine.running
    engine.step()
    recomputed = 41 if async_scheduling else 42
    assert engine.decisions[2]["scheduled"] == {"a": recomputed, "b": recomputed}
    assert engine.decisions[2]["preempted"] == ["a", "b"] and not engine.decisions[3:]
    assert engine.kv.hit_tokens == 0
    while engine.has_work:
        engine.step()
    result = engine.result(0.0)
    assert sorted(r.output_tokens for r in result.records) == [10, 10] and result.preemptions == 2


arrivals = st.lists(
    st.tuples(st.floats(0, 5), st.integers(1, 300), st.integers(1, 60)), min_size=1, max_size=30
)


@settings(max_examples=40, deadline=None)
@given(arrivals=arrivals, policy=st.sampled_from(["fcfs", "spf", "sarathi"]))
def test_with_nothing_to_share_and_room_for_all_prefix_caching_changes_nothing(arrivals, policy):
    """No shared keys and a KV cache large enough that nothing is preempted: no hit is possible,
    so every request is served exactly as without prefix caching."""
    requests = [
        Request(f"r{i}", at, prompt, output) for i, (at, prompt, output) in enumerate(sorted(arrivals))
    ]
    engines = [
        CheckedEngine(make_policy(policy), ConstantCost(), EngineConfig(prefix_caching=on))
        for on in (False, True)
    ]
    results = [engine.run(requests) for engine in engines]
    assert not engines[1].violations and not results[1].preemptions and engines[1].kv.hit_tokens == 0
    off, on = ({r.request_id: (r.first_token_s, r.finish_s) for r in result.records} for result in results)
    assert off == on


def _served(requests, policy: str, kv_blocks: int, max_running: int, skip_decode_runs: bool):
    """What a prefix-caching replay with or without its fast paths did: each request's times
    and drop, its preemptions, cached tokens found, and free blocks at the end."""
    config = EngineConfig(
        prefix_caching=True,
        kv_capacity_tokens=kv_blocks * 16,
        max_running=max_running,
        skip_decode_runs=skip_decode_runs,
    )
    engine = ReplayEngine(make_policy(policy), ConstantCost(0.01), config)
    result = engine.run(requests)
    records = {r.request_id: (r.first_token_s, r.finish_s, r.dropped) for r in result.records}
    return records, result.preemptions, engine.kv.hit_tokens, engine.kv.free_blocks


shared_prompts = st.lists(
    st.tuples(
        st.floats(0, 3),  # arrival
        st.integers(1, 400),  # prompt tokens
        st.integers(1, 80),  # output tokens
        st.sampled_from([None, 0, 1, 2]),  # the system prompt it opens with, if any
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(
    rows=shared_prompts,
    policy=st.sampled_from(["fcfs", "spf", "sarathi", "slai", "fastserve"]),
    kv_blocks=st.integers(30, 80),
    max_running=st.integers(1, 12),
)
def test_decode_runs_with_prefix_caching_serve_as_step_by_step(rows, policy, kv_blocks, max_running):
    """The replay's fast paths (a decode run's blocks taken at once, its blocks cached at its end,
    bulk decode steps) serve every request as stepping one by one does, with shared system
    prompts (3, 6 and 12 blocks) and a KV cache small enough to preempt."""
    system_blocks = {0: 3, 1: 6, 2: 12}
    requests = [
        Request(
            f"r{i}",
            at,
            prompt,
            output,
            prompt_blocks=()
            if group is None
            else tuple(f"s{group}-{b}" for b in range(min(system_blocks[group], prompt // 16))),
        )
        for i, (at, prompt, output, group) in enumerate(sorted(rows, key=lambda row: row[0]))
    ]
    outcomes = [_served(requests, policy, kv_blocks, max_running, skip) for skip in (True, False)]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][3] == kv_blocks  # every block free at the end


conversations = st.lists(
    st.tuples(
        st.floats(0, 3),  # arrival
        st.integers(1, 200),  # its own message's tokens
        st.integers(1, 60),  # output tokens
        st.one_of(st.none(), st.integers(0, 1_000)),  # the earlier request it is the next turn of
    ),
    min_size=1,
    max_size=30,
)


def conversation_requests(rows) -> list[Request]:
    """Requests in arrival order, some the next turn of an earlier one: its prompt is that one's
    prompt and answer (the same block keys, answer keys included) and its own message. A next turn
    may arrive before the turn it continues has finished: no client does, but it puts a hit on an
    answer block in the very step that fills it."""
    requests, keys_of = [], []
    for i, (at, own, output, follows) in enumerate(sorted(rows, key=lambda row: row[0])):
        inherited, history = (), 0
        if follows is not None and i:
            earlier = requests[follows % i]
            inherited, history = keys_of[follows % i], earlier.prompt_tokens + earlier.output_tokens
        prompt = history + own
        prompt_keys = inherited + tuple(f"r{i}-{b}" for b in range(len(inherited), prompt // 16))
        answer_keys = tuple(f"r{i}-{b}" for b in range(prompt // 16, (prompt + output) // 16))
        requests.append(
            Request(f"r{i}", at, prompt, output, prompt_blocks=prompt_keys, answer_blocks=answer_keys)
        )
        keys_of.append(prompt_keys + answer_keys)
    return requests


@settings(max_examples=60, deadline=None)
@given(
    rows=conversations,
    policy=st.sampled_from(["fcfs", "spf", "sarathi", "slai", "fastserve"]),
    kv_blocks=st.integers(30, 80),
    max_running=st.integers(1, 12),
)
def test_decode_runs_with_conversations_serve_as_step_by_step(rows, policy, kv_blocks, max_running):
    """As above, with next turns whose prompts hold earlier answers: the fast paths cache a
    decode's blocks when vLLM does (as it is scheduled, before the step's admissions look up
    theirs), so a next turn finds the same blocks either way."""
    requests = conversation_requests(rows)
    outcomes = [_served(requests, policy, kv_blocks, max_running, skip) for skip in (True, False)]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][3] == kv_blocks
