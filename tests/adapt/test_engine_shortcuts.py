"""The replay engine's hot-path shortcuts compute exactly what the plain forms compute: bulk-counted
decodes and `step_batch`, `BlockPool.try_grow`/`grow_many` and `can_grow`/`grow`, the roofline on one
step's scalars and on arrays (and a decode run's steps one by one), the vectorised on-time limits
and the per-token ones."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from adapt.policy import RequestState
from adapt.replay.cost import roofline
from adapt.replay.engine import _with_decodes
from adapt.replay.kv import BlockPool
from adapt.replay.metrics import _on_time_limits
from adapt.requests import SLO
from adapt.steplog import StepBatch, step_batch

work_items = st.lists(
    st.tuples(st.integers(1, 4096), st.integers(0, 100_000), st.booleans(), st.booleans()), max_size=40
)


@given(work=work_items)
def test_bulk_decodes_match_step_batch(work):
    decodes = [(1, p, True, sampled) for n, p, is_decode, sampled in work if is_decode]
    others = [(n, p, False, sampled) for n, p, is_decode, sampled in work if not is_decode]
    contexts = [p for _, p, _, _ in decodes]
    bulk = _with_decodes(
        step_batch(others),
        len(decodes),
        sum(sampled for *_, sampled in decodes),
        sum(contexts),
        max(contexts, default=0),
    )
    assert bulk == step_batch(others + decodes)


@given(
    grows=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 200)), max_size=30),
    blocks=st.integers(1, 40),
)
def test_try_grow_is_can_grow_then_grow(grows, blocks):
    fast, plain = BlockPool(blocks, 16), BlockPool(blocks, 16)
    for request, tokens in grows:
        rid = str(request)
        fits = plain.can_grow(rid, tokens)
        if fits:
            plain.grow(rid, tokens)
        assert fast.try_grow(rid, tokens) == fits
        assert (fast.free_blocks, fast.held(rid)) == (plain.free_blocks, plain.held(rid))


@given(tokens=st.lists(st.integers(1, 300), min_size=1, max_size=20), step=st.integers(0, 40))
def test_grow_many_is_grow_each(tokens, step):
    ids = [str(i) for i in range(len(tokens))]
    fast, plain = BlockPool(10_000, 16), BlockPool(10_000, 16)
    for pool in (fast, plain):
        for rid, n in zip(ids, tokens, strict=True):
            pool.grow(rid, n)
    fast.grow_many(ids, fast.held_many(ids), np.asarray(tokens) + step)
    for rid, n in zip(ids, tokens, strict=True):
        plain.grow(rid, n + step)
    assert fast.free_blocks == plain.free_blocks
    assert fast.held_many(ids).tolist() == [plain.held(r) for r in ids]


@settings(max_examples=50)
@given(
    tokens=st.integers(1, 4096),
    sampled=st.integers(0, 256),
    attn=st.integers(0, 10**9),
    kv_read=st.integers(0, 10**6),
    decodes=st.integers(0, 256),
    context=st.integers(0, 10**6),
    overlap=st.sampled_from(["operator", "step"]),
    tp=st.sampled_from([1, 2]),
)
def test_roofline_scalars_match_arrays(tokens, sampled, attn, kv_read, decodes, context, overlap, tp):
    model = roofline("llama-2-13b", "a100-80g", tp=tp, overlap=overlap)
    fields = (tokens, sampled, attn / 2, float(kv_read), decodes, float(context), context)
    one = model.time(StepBatch(*fields))
    many = model.time(StepBatch(*(np.full(3, float(f)) for f in fields)))
    assert [float(one)] * 3 == many.tolist()


@settings(max_examples=50)
@given(
    decodes=st.integers(1, 256),
    context=st.integers(0, 10**6),
    steps=st.integers(1, 40),
    overlap=st.sampled_from(["operator", "step"]),
    tp=st.sampled_from([1, 2]),
    attention=st.sampled_from(["sum", "max"]),
)
def test_roofline_decode_step_timer_gives_the_run_times_elements(
    decodes, context, steps, overlap, tp, attention
):
    model = roofline("llama-2-13b", "a100-80g", tp=tp, overlap=overlap, decode_attention=attention)
    context_sum, context_max = context * decodes, context + decodes
    run = model.decode_run_times(decodes, context_sum, context_max, steps).tolist()
    step_time = model.decode_step_timer(decodes, context_sum, context_max)
    assert [step_time(i) for i in range(steps)] == run


@given(
    ttft=st.one_of(st.none(), st.floats(0.01, 5)),
    tbt=st.one_of(st.none(), st.floats(0.001, 0.5)),
    first_token=st.one_of(st.none(), st.floats(0, 100)),
    first=st.integers(0, 50),
    intake_delay=st.sampled_from([0.0, 0.009, 0.5]),
)
def test_on_time_limits_match_per_token(ttft, tbt, first_token, first, intake_delay):
    if ttft is None and tbt is None:
        tbt = 0.1
    state = RequestState("r", 3.25, 10, 100, SLO(kind="latency", ttft_s=ttft, tbt_s=tbt))
    state.first_token_s = first_token
    expected = [state.token_due_s(first + j, intake_delay) for j in range(7)]
    got = _on_time_limits(state, first, 7, intake_delay).tolist()
    assert [math.isinf(x) for x in got] == [math.isinf(x) for x in expected]
    assert [x for x in got if not math.isinf(x)] == [x for x in expected if not math.isinf(x)]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(0, 400), max_size=4))
def test_step_log_since_a_step_is_the_whole_log_from_it(seed, cuts):
    """`step_log(since=k)` joins only the chunks it needs (decode runs are logged as one chunk of
    many steps) and is the whole log's rows from the k-th on, past the end included."""
    from adapt.replay.engine import EngineConfig, ReplayEngine
    from adapt.requests import Request
    from serving_hooks.policies import make_policy

    rng = np.random.default_rng(seed)
    requests = [
        Request(f"r{i}", i * 0.2, int(rng.integers(20, 600)), int(rng.integers(1, 120))) for i in range(20)
    ]
    engine = ReplayEngine(
        make_policy("fcfs"), roofline("llama-2-7b", "a100-80g"), EngineConfig(record_steps=True)
    )
    engine.run(requests)
    whole = engine.recorder.step_log()
    for since in [*cuts, 0, len(whole["duration_s"])]:
        part = engine.recorder.step_log(since=since)
        assert part.keys() == whole.keys()
        for name, column in whole.items():
            np.testing.assert_array_equal(part[name], column[since:])
