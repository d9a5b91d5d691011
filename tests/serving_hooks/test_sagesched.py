"""SageSched: length distributions and their scores, the semantic history window, the Gittins
index (against brute force), the cost models, and the policy in the replay engine."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapt.component import read_component
from adapt.policy import EngineView, Plan, RequestState
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.requests import SLO, Request
from adapt.traces import instruction_split, prompt_hash
from predictors.length_distribution import LengthDistribution, bucket_overlap, crps, wasserstein
from predictors.length_neighbours import nearest_by_ratio
from predictors.semantic_history import SemanticHistory
from serving_hooks.policies import make_policy
from serving_hooks.policies.sagesched import (
    SageSched,
    gittins_index,
    gittins_index_one,
    mean_remaining,
    service_cost,
)
from tests.replay_helpers import CheckedEngine, ConstantCost

# ---------------------------------------------------------------- distributions and scores


@given(st.lists(st.integers(1, 60), min_size=1, max_size=120), st.integers(1, 40))
def test_from_samples_small_supports_are_numpy_unique(samples, max_support):
    values = np.sort(np.asarray(samples, dtype=np.float64))
    support, counts = np.unique(values, return_counts=True)
    if support.size <= max_support:
        result = LengthDistribution.from_samples(np.asarray(samples), max_support)
        assert result.support.tolist() == support.tolist()
        assert result.probs.tolist() == (counts / values.size).tolist()


def test_from_samples_keeps_small_supports_and_the_mean_of_large_ones():
    small = LengthDistribution.from_samples(np.array([10, 10, 30]))
    assert small.support.tolist() == [10, 30] and small.probs.tolist() == pytest.approx([2 / 3, 1 / 3])
    samples = np.arange(1, 1001)
    large = LengthDistribution.from_samples(samples, max_support=8)
    assert large.support.size == 8 and large.mean == pytest.approx(samples.mean())
    assert large.probs.sum() == pytest.approx(1.0)


def test_scores_by_hand():
    point = LengthDistribution.point(100)
    observed = np.array([100, 200])
    assert wasserstein(point, observed) == pytest.approx(50.0, rel=0.02)
    assert crps(point, observed) == pytest.approx(50.0)  # E|X - y| = 50, spread 0
    # Two points 0 and 100 at 1/2: E|X - X'| = 50, so CRPS at y = 0 is 50 - 25 = 25.
    two = LengthDistribution(np.array([0.0, 100.0]), np.array([0.5, 0.5]))
    assert crps(two, np.array([0.0])) == pytest.approx(25.0)
    # A point at 150 (bucket 100-199) hits half of {120, 250}: the paper's "bucket hit".
    assert bucket_overlap(LengthDistribution.point(150), np.array([120, 250])) == pytest.approx(0.5)
    assert bucket_overlap(LengthDistribution.from_samples(observed), observed) == pytest.approx(1.0)


def test_uniform_mix_weights():
    mixed = LengthDistribution.point(10).mix(LengthDistribution.uniform(1, 4, points=4), 0.2)
    assert mixed.probs.sum() == pytest.approx(1.0)
    assert mixed.mean == pytest.approx(0.8 * 10 + 0.2 * 2.5)
    assert np.all(np.diff(mixed.support) >= 0)


# ------------------------------------------------------------------------- Gittins index


def brute_force_gittins(support, probs, attained):
    """The definition, budget by budget:
    min over s_j > a of E[min(S, s_j) - a | S > a] / P(S <= s_j | S > a)."""
    alive = [(s, p) for s, p in zip(support, probs, strict=True) if s > attained and p > 0]
    if not alive:
        return np.inf
    survive = sum(p for _, p in alive)
    best = np.inf
    for budget, _ in alive:
        work = sum(p * (min(s, budget) - attained) for s, p in alive) / survive
        done = sum(p for s, p in alive if s <= budget) / survive
        best = min(best, work / done)
    return best


def test_gittins_by_hand():
    costs = np.array([[1.0, 10.0]])
    probs = np.array([[0.5, 0.5]])
    # a = 0: budget 1 gives 1 / 0.5 = 2, budget 10 gives 5.5 / 1; the index is 2.
    assert gittins_index(costs, probs, np.array([0.0]))[0] == pytest.approx(2.0)
    # a = 1, having survived the short outcome: only 10 is left, (10 - 1) / 1.
    assert gittins_index(costs, probs, np.array([1.0]))[0] == pytest.approx(9.0)
    assert mean_remaining(costs, probs, np.array([0.0]))[0] == pytest.approx(5.5)
    assert gittins_index(costs, probs, np.array([10.0]))[0] == np.inf


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 500), st.floats(0.01, 1.0)), min_size=1, max_size=12),
    st.floats(0, 500),
)
def test_gittins_matches_brute_force(points, attained):
    points = sorted(dict(points).items())
    support = np.array([s for s, _ in points], dtype=float)
    probs = np.array([p for _, p in points])
    probs /= probs.sum()
    width = 16  # padded, as the policy pads a batch to its widest distribution
    costs = np.full((1, width), np.inf)
    padded = np.zeros((1, width))
    costs[0, : support.size], padded[0, : support.size] = support, probs
    expected = brute_force_gittins(support, probs, attained)
    got = gittins_index(costs, padded, np.array([attained]))[0]
    assert got == pytest.approx(expected, rel=1e-9) if np.isfinite(expected) else got == np.inf


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1, 1e7), st.floats(0.0, 1.0)), min_size=1, max_size=40),
    st.floats(0, 1e7),
)
def test_gittins_of_one_request_is_the_vectorised_value_exactly(points, attained):
    """The policy's one-request refresh runs in Python floats; the index must be the very same
    float as the vectorised pass gives (zero probabilities included)."""
    costs = np.sort(np.array([c for c, _ in points]))
    probs = np.array([p for _, p in points])
    expected = gittins_index(costs[None, :], probs[None, :], np.array([attained]))[0]
    assert gittins_index_one(costs.tolist(), probs.tolist(), attained) == expected


@pytest.mark.parametrize("cost", ["kv", "output", "weighted"])
def test_one_request_refresh_matches_the_batch_refresh(cost):
    rng = np.random.default_rng(5)
    policy = SageSched(history={}, cost=cost, bucket=7)
    requests = []
    for i in range(30):
        request = RequestState(f"r{i}", 0.0, int(rng.integers(1, 3000)), 4096, SLO())
        request.tokens_generated = int(rng.integers(0, 400))
        samples = rng.integers(1, 500, size=int(rng.integers(1, 60)))
        request.cache["sage_distribution"] = LengthDistribution.from_samples(samples)
        requests.append(request)
    policy._refresh(requests)
    batch = [r.cache["sage_index"] for r in requests]
    for request in requests:
        policy._refresh([request])
    assert [r.cache["sage_index"] for r in requests] == batch


def test_service_costs_by_hand():
    assert service_cost(100, 10, "kv") == pytest.approx(100 * 10 + 10 * 10 / 2)
    assert service_cost(100, 10, "output") == 10
    assert service_cost(100, 10, "weighted", memory_weight=0.01) == pytest.approx(10 + 10.5)
    with pytest.raises(ValueError, match="cost"):
        service_cost(1, 1, "flops")


# ----------------------------------------------------------------------- semantic history


def unit(vector):
    vector = np.asarray(vector, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def basis(i, dim=384):
    v = np.zeros(dim, dtype=np.float32)
    v[i] = 1.0
    return v


def test_threshold_neighbours_then_fallback_then_length():
    history = SemanticHistory(threshold=0.8, min_neighbors=2, fallback_neighbors=3, max_support=64)
    embeddings = np.vstack([basis(0), basis(0), basis(0), basis(1), basis(1)])
    history.observe([10] * 5, [100, 110, 120, 900, 950], embeddings, [True] * 5)
    close = history.predict_embedded([10], unit(basis(0) + 0.1 * basis(1))[None], [True])[0]
    assert sorted(close.support.tolist()) == [100, 110, 120]  # three neighbours above 0.8
    # Halfway between both groups: cosine 0.707 < 0.8 with all, so the 3 most similar serve.
    far = history.predict_embedded([10], unit(basis(0) + basis(1))[None], [True])[0]
    assert far.support.size == 3
    queries = np.vstack([unit(basis(0) + 0.1 * basis(1)), unit(basis(0) + basis(1))])
    _, matched = history.predict_with_matches([10, 10], queries, [True, True])
    assert matched.tolist() == [True, False]  # enough close neighbours; only the fallback
    # No text: neighbours by prompt length.
    history.observe([1000], [7], np.zeros((1, 384), np.float32), [False])
    by_length = history.predict_embedded([1000], np.zeros((1, 384), np.float32), [False])[0]
    assert 7 in by_length.support.tolist()


def test_a_swapped_in_history_predicts_in_its_own_mode_as_when_the_policy_is_built_with_it():
    """Replay builds SageSched with the champion's history; a live server builds it empty and swaps
    the champion in. Both must predict in the champion's mode (a length-only champion stayed
    semantic live), and an explicit `history_mode` holds across every swap in both."""
    champion = SemanticHistory(mode="length", min_neighbors=1, fallback_neighbors=2)
    champion.observe([10, 20], [100, 200], np.vstack([basis(0), basis(1)]), [True, True])
    built_with = SageSched(history=champion)
    swapped_in = SageSched()
    swapped_in.use_component("history", champion)
    assert built_with.history.mode == swapped_in.history.mode == "length"
    assert champion.mode == "length" and built_with.history is not champion  # the policy's own copy
    query = (np.array([10]), unit(basis(1))[None], [True])  # similar to the 200, close in length to the 100
    assert (
        built_with.history.predict_embedded(*query)[0].support.tolist()
        == swapped_in.history.predict_embedded(*query)[0].support.tolist()
    )

    ablation = SageSched(history_mode="point")
    ablation.use_component("history", champion)
    assert ablation.history.mode == SageSched(history=champion, history_mode="point").history.mode == "point"


def test_a_search_leaves_the_callers_openmp_thread_count_as_it_was():
    """OpenMP's count is per thread and shared with torch: a lookup must not leave it at 1."""
    import faiss

    history = SemanticHistory(threshold=0.8, min_neighbors=1, fallback_neighbors=1)
    history.observe([10, 10], [100, 900], np.vstack([basis(0), basis(1)]), [True, True])
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(3)  # neither 1 (a small search) nor the core count (the old large one)
    try:
        for queries in (1, 25):  # a search of few queries and one past FAISS's parallel threshold
            history.predict_embedded([10] * queries, np.tile(basis(0), (queries, 1)), [True] * queries)
            assert faiss.omp_get_max_threads() == 3
    finally:
        faiss.omp_set_num_threads(before)


def test_fifo_window_evicts_oldest_and_index_stays_bounded():
    history = SemanticHistory(window=8, min_neighbors=1, fallback_neighbors=8)
    for i in range(40):
        history.observe([10], [i + 1], basis(0)[None], [True])
    assert history.size == 8
    assert history.index_.ntotal <= 8 + history._slack
    prediction = history.predict_embedded([10], basis(0)[None], [True])[0]
    assert sorted(prediction.support.tolist()) == list(range(33, 41))  # only the newest 8


def _nearest_by_ratio_reference(ids: np.ndarray, prompts: np.ndarray, target: int, count: int) -> set[int]:
    """The `count` ids nearest `target` by exact ratio (fractions), equally near ones newest first
    (largest id)."""
    ranked = sorted(
        zip(ids.tolist(), prompts.tolist(), strict=True),
        key=lambda pair: (Fraction(max(pair[1], target), min(pair[1], target)), -pair[0]),
    )
    return {entry for entry, _ in ranked[:count]}


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(1, 60),
    neighbours=st.integers(1, 12),
    batches=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=70), min_size=1, max_size=25),
    targets=st.lists(st.integers(1, 50), min_size=1, max_size=4),
)
def test_length_fallback_is_the_nearest_by_ratio_newest_first(window, neighbours, batches, targets):
    """`_by_length` keeps the window's entries by length as they come and go (batches longer than
    the window included); its neighbours must be the exact reference's -- nearest by prompt-length
    ratio, equally near ones newest first -- and so must the scan's, with and without an
    excluded prompt, and a copy's."""
    history = SemanticHistory(window=window, fallback_neighbors=neighbours)
    for number, batch in enumerate(batches):
        hashes = [1 + length % 3 for length in batch]
        history.observe(
            batch, [number + 1] * len(batch), np.zeros((len(batch), 384)), [False] * len(batch), hashes
        )
        if number % 3 == 2:
            history = history.copy()
        ids = history._live_ids()
        prompts = history.prompt_tokens_[ids % len(history.prompt_tokens_)]
        for target in targets:
            expected = _nearest_by_ratio_reference(ids, prompts, target, neighbours)
            assert sorted(history._by_length(target).tolist()) == sorted(expected)
            assert set(nearest_by_ratio(prompts, ids, target, neighbours).tolist()) == expected
            kept = history.prompt_hash_[ids % len(history.prompt_hash_)] != 2
            excluded = _nearest_by_ratio_reference(ids[kept], prompts[kept], target, neighbours)
            assert set(history._by_length(target, exclude_hash=2).tolist()) == excluded


def test_a_window_lowered_after_fitting_takes_effect_on_the_length_neighbours():
    """`set_params(window=...)` on a fitted history: the entries it leaves out are out of the
    length index too (queried, then observed past)."""
    history = SemanticHistory(window=8, fallback_neighbors=3)
    history.observe(list(range(1, 9)), [1] * 8, np.zeros((8, 384)), [False] * 8)
    history.set_params(window=4)
    assert set(history._by_length(1).tolist()) <= set(range(4, 8))
    history.observe([5], [1], np.zeros((1, 384)), [False])
    ids = history._live_ids()
    prompts = history.prompt_tokens_[ids % len(history.prompt_tokens_)]
    assert set(history._by_length(5).tolist()) == _nearest_by_ratio_reference(ids, prompts, 5, 3)


def test_a_length_that_is_not_a_number_changes_nothing():
    history = SemanticHistory(window=8, fallback_neighbors=3)
    history.observe([4, 6], [1, 2], np.zeros((2, 384)), [False] * 2)
    with pytest.raises(ValueError):
        history.observe([float("nan")], [1], np.zeros((1, 384)), [False])
    assert history.size == 2 and sorted(history._by_length(5).tolist()) == [0, 1]


def _window_state(history: SemanticHistory) -> tuple:
    """Everything `observe` may change, comparable with ==."""
    return (
        history.next_id_,
        history.length_floor_,
        history.index_floor_,
        history.index_.ntotal,
        history.prompt_tokens_.tolist(),
        history.output_tokens_.tolist(),
        history.prompt_hash_.tolist(),
        history.has_text_.tolist(),
        list(history.by_length_._lengths),
        {length: list(ids) for length, ids in history.by_length_._ids.items()},
    )


def _full_window() -> SemanticHistory:
    """64 entries in a window of 64: the next entry evicts one from the length index first."""
    history = SemanticHistory(window=64, fallback_neighbors=3)
    history.observe(list(range(1, 65)), [1] * 64, np.zeros((64, 384)), [False] * 64, list(range(1, 65)))
    return history


@pytest.mark.parametrize(
    ("prompts", "outputs", "hashes", "match"),
    [
        ([2**70], [10], None, "prompt_tokens"),  # OverflowError after the length index lost an entry
        ([-1], [3], None, "prompt_tokens"),
        ([1.5], [3], None, "prompt_tokens"),
        ([1, 2], [10], None, "output_tokens: expected 2"),  # broadcast over both before
        ([5], [0], None, "output_tokens"),  # saved into a window that did not load back
        ([5], [-3], None, "output_tokens"),
        ([5], [3], [2**64 - 1], "prompt_hashes"),
        ([5, 6], [3, 4], [1], "prompt_hashes"),
    ],
)
def test_a_batch_with_a_bad_column_is_refused_and_changes_nothing(prompts, outputs, hashes, match):
    history = _full_window()
    before = _window_state(history)
    with pytest.raises(ValueError, match=match):
        history.observe(prompts, outputs, np.zeros((len(prompts), 384)), [False] * len(prompts), hashes)
    assert _window_state(history) == before
    for embeddings, has_text in ((np.zeros((2, 384)), [True]), (np.zeros((1, 8)), [True])):
        with pytest.raises(ValueError, match=r"has_text|embeddings"):
            history.observe([5], [3], embeddings, has_text)
    assert _window_state(history) == before


hostile_counts = st.one_of(  # plain counts three times in five: some batches are kept
    st.integers(0, 50),
    st.integers(50, 2_000),
    st.sampled_from([1, 7, 512]),
    st.integers(-(2**80), 2**80),
    st.floats(),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(hostile_counts, hostile_counts), min_size=1, max_size=4))
def test_any_observed_batch_is_refused_whole_or_kept_in_a_window_that_loads_back(rows, tmp_path_factory):
    prompts, outputs = [prompt for prompt, _ in rows], [output for _, output in rows]
    history = _full_window()
    before = _window_state(history)
    try:
        history.observe(prompts, outputs, np.zeros((len(prompts), 384)), [False] * len(prompts))
    except ValueError:
        assert _window_state(history) == before
        return
    assert history.next_id_ == 64 + len(prompts)
    directory = tmp_path_factory.mktemp("window")
    history.save_state(directory)
    loaded = SemanticHistory(window=64, fallback_neighbors=3)
    loaded.load_state(directory)
    loaded.validate()
    assert loaded.output_tokens_[loaded._live_ids() % len(loaded.output_tokens_)].min() >= 1


def test_a_support_of_no_points_is_refused_before_a_window_is_built():
    """max_support = 0 made every prediction from the window a distribution of no points."""
    history = SemanticHistory(max_support=0)  # scikit-learn's convention: stored unchecked
    with pytest.raises(ValueError, match="max_support: expected at least 1 support point, got 0"):
        history.fit(None)  # before the data is read, let alone embedded
    with pytest.raises(ValueError, match="max_support"):
        history.observe([10], [100], np.zeros((1, 384), np.float32), [False])
    assert history.size == 0


@pytest.mark.parametrize(
    ("lengths", "target", "count", "expected"),
    [
        ([4, 9], 6, 1, {1}),  # 6/4 == 9/6: equally near, the newer (id 1) wins
        ([9, 4], 6, 1, {1}),
        ([4, 9, 5], 6, 1, {2}),  # 6/5 is nearer than either
        ([7, 5, 7, 5], 6, 2, {0, 2}),  # 7/6 < 6/5: both 7s before any 5
        ([7, 5, 7, 5], 6, 3, {0, 2, 3}),  # then the newer 5
        ([20, 30], 24, 1, {0}),  # 24/20 = 1.2 is nearer than 30/24 = 1.25, though 30 is newer
    ],
)
def test_length_neighbours_by_hand(lengths, target, count, expected):
    history = SemanticHistory(window=10, fallback_neighbors=count)
    history.observe(lengths, [1] * len(lengths), np.zeros((len(lengths), 384)), [False] * len(lengths))
    assert set(history._by_length(target).tolist()) == expected
    ids = np.arange(len(lengths))
    assert set(nearest_by_ratio(np.array(lengths), ids, target, count).tolist()) == expected


_BY_LENGTH_SCRIPT = """
import numpy as np
from predictors.length_neighbours import nearest_by_ratio
from predictors.semantic_history import SemanticHistory
rng = np.random.default_rng(5)
history = SemanticHistory(window=10_000, fallback_neighbors=100)
prompts, outputs = rng.integers(1, 3_000, 10_000), rng.integers(1, 900, 10_000)
history.observe(prompts, outputs, np.zeros((10_000, 384)), [False] * 10_000)
print([sorted(history._by_length(q).tolist()) for q in range(1, 3_000, 7)])
"""
_AVX512 = "AVX512F AVX512CD AVX512VL AVX512BW AVX512DQ AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"


def test_length_neighbours_are_the_same_on_every_instruction_set():
    """numpy picks its selection and logarithm kernels by CPU; a replay's predictions must not
    depend on them. Run with AVX-512 and AVX2 switched off in turn (as on machines without them):
    numpy's argpartition, used before, chose differently among ties in each of the three."""
    import subprocess
    import sys

    outputs = set()
    for disabled in ("", _AVX512, f"{_AVX512} AVX2 FMA3"):
        env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": disabled}
        run = subprocess.run(
            [sys.executable, "-c", _BY_LENGTH_SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(run.stdout)
    assert len(outputs) == 1


def test_exclude_same_prompt_and_modes():
    history = SemanticHistory(min_neighbors=1, fallback_neighbors=4)
    h_a, h_b = prompt_hash("a"), prompt_hash("b")
    history.observe(
        [5, 5], [50, 500], np.vstack([basis(0), unit(basis(0) + 0.2 * basis(2))]), [True, True], [h_a, h_b]
    )
    own = history.predict_embedded([5], basis(0)[None], [True])[0]
    assert 50 in own.support.tolist()
    others = history.predict_embedded([5], basis(0)[None], [True], exclude_hashes=[h_a])[0]
    assert others.support.tolist() == [500]
    history.mode = "point"
    assert history.predict_embedded([5], basis(0)[None], [True])[0].support.size == 1


def test_cold_window_predicts_a_uniform_prior():
    prediction = SemanticHistory().predict_embedded([10], basis(0)[None], [True])[0]
    assert prediction.support.min() >= 1 and prediction.probs.sum() == pytest.approx(1.0)


def test_save_load_round_trip_and_copy_independence(tmp_path):
    rng = np.random.default_rng(0)
    history = SemanticHistory(window=50, min_neighbors=1)
    vectors = rng.normal(size=(70, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    has_text = rng.random(70) < 0.8
    history.observe(rng.integers(1, 100, 70), rng.integers(1, 900, 70), vectors, has_text, np.arange(70) + 1)
    history.save(tmp_path / "h")
    assert {p.suffix for p in (tmp_path / "h").iterdir()} <= {".json", ".npz", ".faiss"}
    loaded = read_component(tmp_path / "h")
    queries = vectors[-5:]
    for a, b in zip(
        history.predict_embedded([10] * 5, queries, [True] * 5),
        loaded.predict_embedded([10] * 5, queries, [True] * 5),
        strict=True,
    ):
        assert a.support.tolist() == pytest.approx(b.support.tolist()) and a.probs.tolist() == pytest.approx(
            b.probs.tolist()
        )
    twin = loaded.copy()
    twin.observe([1], [1], basis(3)[None], [True])
    assert twin.size == loaded.size == 50 and twin.next_id_ == loaded.next_id_ + 1


def test_instruction_split_is_stable_and_keeps_copies_together():
    texts = [f"prompt {i % 50}" for i in range(500)]
    held = instruction_split(texts, 0.3)
    assert (held == instruction_split(texts, 0.3)).all()
    for text, flag in zip(texts, held, strict=True):
        assert flag == held[texts.index(text)]
    assert 0.1 < held.mean() < 0.5


# ------------------------------------------------------------------------------- policy


def state(rid, prompt, arrival=0.0, text=None):
    return RequestState(rid, arrival, prompt, 4096, Request(rid, arrival, prompt, 1).slo, prompt_text=text)


def seeded_history():
    """Text-less history: prompts of 10 tokens produce 20-token outputs, prompts of 1,000 tokens 900."""
    history = SemanticHistory(fallback_neighbors=5)
    history.observe(
        [10] * 5 + [1000] * 5, [20] * 5 + [900] * 5, np.zeros((10, 384), np.float32), [False] * 10
    )
    return history


def test_policy_admits_lowest_index_first_and_learns_online():
    policy = SageSched(history=seeded_history())
    long, short = state("long", 1000), state("short", 10, arrival=1.0)
    policy.on_arrival(long, 0.0)
    policy.on_arrival(short, 1.0)
    view = EngineView(
        now=1.0,
        waiting=[long, short],
        running=[],
        kv_usage=0.0,
        token_budget=2048,
        max_running=8,
        mean_batch_time_s=0.02,
    )
    assert [r.id for r in policy.on_step(view).admit] == ["short", "long"]
    size = policy.history.size
    short.tokens_generated, short.phase, short.finish_s = 20, "finished", 2.0
    policy.on_finish(short, 2.0)
    assert policy.history.size == size + 1
    # A request its client aborted after one token (no finish_s) teaches nothing: 20 such once
    # made the history predict a length of 1 for their prompt.
    long.tokens_generated, long.phase = 1, "finished"
    policy.on_finish(long, 2.5)
    assert policy.history.size == size + 1


def test_preempt_on_flip_only_when_full_and_clearly_better():
    policy = SageSched(
        history=seeded_history(), preempt_on_flip=True, flip_ratio=2.0, preempt_below_tokens=10_000
    )
    running = state("run", 1000)
    policy.on_arrival(running, 0.0)
    policy.on_step(EngineView(0.0, [running], [], 0.0, 2048, 1, 0.02))
    policy.on_admit(running, 0.0)
    running.tokens_computed = 1000
    newcomer = state("new", 10, arrival=1.0)
    policy.on_arrival(newcomer, 1.0)
    roomy = policy.on_step(EngineView(1.0, [newcomer], [running], 0.1, 2048, 8, 0.02))
    assert roomy.preempt == []  # room to admit: no reason to preempt
    full = policy.on_step(EngineView(1.0, [newcomer], [running], 0.1, 2048, 1, 0.02))
    assert full.preempt == [running]
    guarded = SageSched(history=seeded_history(), preempt_on_flip=True, preempt_below_tokens=500)
    for r in (running, newcomer):
        r.cache.clear()
    guarded.on_arrival(running, 0.0)
    guarded.on_step(EngineView(0.0, [running], [], 0.0, 2048, 1, 0.02))
    guarded.on_admit(running, 0.0)
    guarded.on_arrival(newcomer, 1.0)
    assert guarded.on_step(EngineView(1.0, [newcomer], [running], 0.1, 2048, 1, 0.02)).preempt == []


def test_running_requests_keep_admission_order_unless_the_victim_is_by_priority():
    """By default KV pressure evicts the newest admitted (the running order is the engine's);
    with victim="priority" the running requests are sorted by index, the largest evicted first."""
    long, short = state("long", 1000), state("short", 10, arrival=1.0)
    orders = {}
    for victim in ("newest", "priority"):
        policy = SageSched(history=seeded_history(), victim=victim)
        for request in (long, short):
            request.cache.clear()
            policy.on_arrival(request, request.arrival_s)
            policy.on_admit(request, 1.0)
        view = EngineView(1.0, [], [long, short], 0.1, 2048, 8, 0.02)
        running_order = policy.on_step(view).running_order
        orders[victim] = None if running_order is None else [r.id for r in running_order]
    assert orders == {"newest": None, "priority": ["short", "long"]}


def ranked_with_true_lengths(true_lengths):
    """Three 10-token prompts (the history predicts 20 output tokens for each) that really generate
    500, 5 and 5 tokens; only `five-text` carries text (and its vector, so no model runs). Returns
    their admission order and the mean length each was ordered by."""
    policy = SageSched(history=seeded_history(), true_lengths=true_lengths)
    requests = [state("long", 10), state("five", 10, arrival=0.5), state("five-text", 10, 1.0, "a question")]
    requests[2].prompt_embedding = basis(3)
    for request, true in zip(requests, (500, 5, 5), strict=True):
        request.oracle_output_tokens = true
        policy.on_arrival(request, request.arrival_s)
    admit = policy.on_step(EngineView(1.0, requests, [], 0.0, 2048, 8, 0.02)).admit
    return [r.id for r in admit], {r.id: r.cache["sage_distribution"].mean for r in requests}


def test_true_lengths_orders_by_the_true_length_where_asked_and_is_refused_live():
    from adapt.mechanics import UnsupportedPolicy, check_policy

    # On the history's prediction all three tie at 20 tokens: arrival order. With the true lengths
    # the 500-token request goes last (KV cost 10 * 500 + 500^2 / 2 against 10 * 5 + 5^2 / 2).
    assert ranked_with_true_lengths("none") == (
        ["long", "five", "five-text"],
        dict.fromkeys(("long", "five", "five-text"), 20.0),
    )
    assert ranked_with_true_lengths("all") == (
        ["five", "five-text", "long"],
        {"long": 500.0, "five": 5.0, "five-text": 5.0},
    )
    assert ranked_with_true_lengths("no-text") == (
        ["five", "five-text", "long"],
        {"long": 500.0, "five": 5.0, "five-text": 20.0},
    )
    assert ranked_with_true_lengths("text") == (
        ["five-text", "long", "five"],
        {"long": 20.0, "five": 20.0, "five-text": 5.0},
    )
    assert SageSched(true_lengths="text").needs_oracle and not SageSched().needs_oracle
    with pytest.raises(UnsupportedPolicy, match="true output lengths"):
        check_policy(make_policy("sagesched", true_lengths="all"), "vllm")
    assert make_policy("sagesched", true_lengths="text").describe()["true_lengths"] == "text"


def test_bad_parameters_are_rejected():
    for params in (
        {"cost": "flops"},
        {"order": "random"},
        {"bucket": 0},
        {"uniform_mix": 2.0},
        {"memory_weight": -0.5},
        {"history_mode": "x"},
        {"victim": "largest"},
        {"true_lengths": "some"},
    ):
        with pytest.raises(ValueError):
            make_policy("sagesched", **params)


spec_variants = st.sampled_from(
    [
        {},
        {"order": "mean"},
        {"order": "static"},
        {"cost": "output", "bucket": 7},
        {"uniform_mix": 0.2, "bucket": 5},
        {"preempt_on_flip": True, "bucket": 3, "flip_ratio": 1.0},
        {"victim": "priority", "bucket": 4},
        {"victim": "priority", "order": "static"},
        {"true_lengths": "all", "bucket": 6},
    ]
)
rows = st.lists(
    st.tuples(st.floats(0, 10), st.integers(1, 300), st.integers(1, 150)), min_size=1, max_size=25
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=rows, params=spec_variants, max_running=st.integers(1, 6), kv_blocks=st.integers(30, 60))
def test_no_request_lost_and_fast_path_agrees(rows, params, max_running, kv_blocks):
    requests = [Request(f"r{i}", t, p, o) for i, (t, p, o) in enumerate(sorted(rows))]
    results = []
    for skip in (True, False):
        config = EngineConfig(
            max_running=max_running, kv_capacity_tokens=kv_blocks * 16, skip_decode_runs=skip
        )
        engine = CheckedEngine(SageSched(history=seeded_history(), **params), ConstantCost(0.01), config)
        result = engine.run(requests)
        assert engine.violations == []
        for request in requests:
            record = next(r for r in result.records if r.request_id == request.request_id)
            if record.dropped is None:
                assert engine.completions[request.request_id] == request.output_tokens
        assert len(result.records) == len(requests)
        results.append(result.metrics())
    for key in ("completed", "preemptions", "ttlt_mean"):
        assert results[0][key] == pytest.approx(results[1][key]), key


@pytest.mark.slow
def test_sagesched_mix_replay_with_real_embeddings():
    """The workload draws held-out AlpacaEval prompts; the policy embeds them with MiniLM, orders
    them, and every request completes with exactly its tokens."""
    from adapt.workloads import sagesched_mix

    requests = sagesched_mix(3.0, 150, seed=1)
    assert {r.label for r in requests} == {"alpaca", "chat", "summarize"}
    assert all(r.prompt_text for r in requests if r.label == "alpaca")
    engine = CheckedEngine(make_policy("sagesched"), ConstantCost(0.02), EngineConfig(max_running=16))
    result = engine.run(requests)
    assert engine.violations == [] and result.metrics()["completed"] == len(requests)


def test_sagesched_mix_over_other_answers_keeps_arrivals_and_the_textless_rows():
    """`answers=`: the same mix (arrivals, labels, chat and summarisation rows) whose text
    requests are another model's answers; with AlpacaEval's held-out rows it is the default mix."""
    import dataclasses

    from adapt.traces import load_trace, split_by_instruction
    from adapt.workloads import bundled, sagesched_mix

    _, test = split_by_instruction(load_trace(bundled("alpaca_eval_lengths.jsonl.gz")))
    assert sagesched_mix(3.0, 80, seed=2, answers=test) == sagesched_mix(3.0, 80, seed=2)
    verbose = test.take(np.flatnonzero(np.asarray(test.columns["generator"]) == "Yi-34B-Chat"))
    before, after = sagesched_mix(3.0, 200, seed=2), sagesched_mix(3.0, 200, seed=2, answers=verbose)
    pairs = set(zip(verbose.prompt_text, verbose.output_tokens.tolist(), strict=True))
    for old, new in zip(before, after, strict=True):
        assert (new.request_id, new.arrival_s, new.label) == (old.request_id, old.arrival_s, old.label)
        if new.label == "alpaca":
            assert (new.prompt_text, new.output_tokens) in pairs
        else:
            assert new.prompt_text is None and new.prompt_tokens > 0
    with pytest.raises(ValueError, match="has no prompt texts"):
        sagesched_mix(3.0, 10, seed=2, answers=dataclasses.replace(verbose, prompt_text=None))


def test_replay_engine_runs_sagesched_by_name():
    result = ReplayEngine(make_policy("sagesched"), ConstantCost(0.01)).run([Request("a", 0.0, 5, 3)])
    assert result.metrics()["completed"] == 1


# ------------------------------------------------------------ predictions off the step
def fake_embeddings(texts):
    """Every prompt embeds as basis(1): the "long answer" prompts of `history_with_text`."""
    return [(basis(1), True) for _ in texts]


def history_with_text():
    """Prompts of 10 tokens without text: 20-token outputs; prompts of 300 tokens whose text embeds
    as basis(1): 900-token outputs."""
    history = SemanticHistory(fallback_neighbors=5)
    embeddings = np.stack([np.zeros(384, np.float32)] * 5 + [basis(1)] * 5)
    history.observe([10] * 5 + [300] * 5, [20] * 5 + [900] * 5, embeddings, [False] * 5 + [True] * 5)
    return history


def test_a_request_is_ranked_on_its_prior_until_its_embedding_comes():
    from adapt.predictions import Delayed

    policy = SageSched(history=history_with_text())
    queues = []
    policy.use_predictions(lambda fn: queues.append(Delayed(fake_embeddings, delay_s=0.5)) or queues[-1])
    essay, short = state("essay", 10, arrival=0.0, text="write an essay"), state("short", 10, arrival=0.1)
    policy.on_arrival(essay, 0.0)
    policy.on_arrival(short, 0.1)

    def step(now, running=()):
        view = EngineView(now, [essay, short], list(running), 0.0, 2048, 8, 0.02)
        return [r.id for r in policy.on_step(view).admit], policy.horizon(view)

    # By prompt length both look like 20-token answers: the earlier arrival first.
    order, _ = step(0.1)
    assert order == ["essay", "short"] and essay.cache["sage_prior"]
    running = state("running", 10)
    running.phase, running.cache = "decode", {}
    policy.on_arrival(running, 0.0)
    policy.on_step(EngineView(0.1, [running], [], 0.0, 2048, 8, 0.02))
    policy.on_admit(running, 0.1)
    assert step(0.2, [running])[1].until_s == 0.5  # the embedding re-ranks: wake up then
    # Its embedding says 900 tokens: it goes behind the short one.
    order, _ = step(0.5)
    assert order == ["short", "essay"] and not essay.cache["sage_prior"]
    assert essay.cache["sage_distribution"].mean == pytest.approx(900)
    assert queues[0].stats.summary()["share_on_prior"] == 1.0


def test_no_request_lost_when_predictions_come_late():
    from adapt.predictions import Delayed

    requests = [
        Request(f"r{i}", 0.01 * i, 10 + 40 * (i % 3), 5 + i % 7, prompt_text=f"prompt {i}" if i % 2 else None)
        for i in range(30)
    ]
    late = functools.partial(Delayed, delay_s=0.05)
    engine = CheckedEngine(
        SageSched(history=history_with_text()),
        ConstantCost(0.01),
        EngineConfig(max_running=4, kv_capacity_tokens=2000),
        predictions=lambda fn: late(fake_embeddings),
    )
    result = engine.run(requests)
    assert engine.violations == [] and result.metrics()["completed"] == len(requests)
    assert all(engine.completions[r.request_id] == r.output_tokens for r in requests)


def test_an_embedding_that_came_with_the_request_ranks_it_at_its_first_step():
    """`adapt serve --embed-prompts`: the API server sent the vector along, so however slow the
    model, the first decision is made on it (and the prompt is never submitted to the model)."""
    from adapt.predictions import Delayed

    policy = SageSched(history=history_with_text())
    queues = []
    never = []
    policy.use_predictions(
        lambda fn: queues.append(Delayed(lambda texts: never.extend(texts) or [], delay_s=60.0)) or queues[-1]
    )
    essay = state("essay", 10, arrival=0.0, text="write an essay")
    essay.prompt_embedding = basis(1)
    short = state("short", 10, arrival=0.1)
    policy.on_arrival(essay, 0.0)
    policy.on_arrival(short, 0.1)
    view = EngineView(0.1, [essay, short], [], 0.0, 2048, 8, 0.02)
    assert [r.id for r in policy.on_step(view).admit] == ["short", "essay"]
    assert not essay.cache["sage_prior"] and essay.cache["sage_distribution"].mean == pytest.approx(900)
    assert never == []
    stats = queues[0].stats.summary()
    assert (stats["supplied"], stats["submitted"], stats["on_prior"]) == (1, 1, 0)
    assert stats["share_on_prior"] == 0.0


def test_a_policy_swapped_in_keeps_the_embeddings_and_asks_for_the_rest_from_the_swap():
    """A replay with a 0.5 s prediction delay swaps sagesched for sagesched at its step at 0.9 s:
    `done` (arrived at 0, embedded at 0.5) is ranked on its embedding at the new policy's first
    step, the model not asked again; `late` (arrived at 0.4, not yet embedded) is asked again, and
    its embedding is due 0.5 s after the swap, as the live worker, starting on it then, would have
    it. Before, both were asked again as if submitted when they arrived: `done` counted as a model
    result, and `late`'s was due at once."""
    from adapt.predictions import Delayed

    queues = []
    engine = ReplayEngine(
        SageSched(history=history_with_text()),
        ConstantCost(0.01),
        EngineConfig(max_running=1, kv_capacity_tokens=4000),
        predictions=lambda fn: queues.append(Delayed(fake_embeddings, delay_s=0.5)) or queues[-1],
    )
    engine.add(Request("long", 0.0, 10, 300))
    engine.add(Request("done", 0.0, 300, 5, prompt_text="write an essay"))
    engine.add(Request("late", 0.4, 300, 5, prompt_text="write another"))
    while engine.now < 0.7:  # (the last step runs to 0.9, where `late`'s embedding is due)
        engine.step()
    assert not engine.waiting["done"].cache["sage_prior"] and engine.waiting["late"].cache["sage_prior"]
    swapped_at = engine.now  # the next step's start, where the new policy takes over
    assert swapped_at == pytest.approx(0.9)
    engine.switch_policy(SageSched(history=history_with_text()))
    engine.step()
    new = queues[-1]
    assert not engine.waiting["done"].cache["sage_prior"] and engine.waiting["late"].cache["sage_prior"]
    assert (new.stats.supplied, new.stats.submitted, new.stats.delivered) == (1, 2, 0)
    assert new.next_ready_s == pytest.approx(swapped_at + 0.5)


def test_the_point_predictor_is_the_mean_length_above_what_was_generated_by_hand():
    """LTR/TRAIL's predictor from a semantic history: E[S | S > g], g + bucket past the support."""
    from predictors.length_distribution import LengthDistribution
    from serving_hooks.policies.sagesched import HistoryLengthPredictor

    predictor = HistoryLengthPredictor(None, bucket=200)
    request = state("r", 50)
    request.cache["point_distribution"] = LengthDistribution(
        np.array([100.0, 300.0, 500.0]), np.array([0.5, 0.3, 0.2])
    )
    expected = {0: 100 * 0.5 + 300 * 0.3 + 500 * 0.2, 150: (300 * 0.3 + 500 * 0.2) / 0.5, 500: 500 + 200}
    for generated, mean in expected.items():  # 240, 380, then past the support: 700
        request.tokens_generated = generated
        assert predictor(request) == pytest.approx(mean)


# ------------------------------------------------------- bucket refresh and flips, by hand
#
# Every request below has a 100-token prompt and, from `four_samples`, the output-length
# distribution {100: 3/4, 500: 1/4}. Its kv costs, l_in * l_out + l_out^2 / 2:
#   100 tokens: 100 * 100 + 100^2 / 2 = 15,000;   500 tokens: 100 * 500 + 500^2 / 2 = 175,000.
# The attained service after g generated tokens is the same function of g, and
# G(a) = min over s_j > a of E[min(S, s_j) - a | S > a] / P(S <= s_j | S > a):
#   g = 0:   a = 0.       Budget 15,000: 15,000 / (3/4) = 20,000; budget 175,000: E[S] / 1 =
#            3/4 * 15,000 + 1/4 * 175,000 = 55,000. G = 20,000.
#   g = 199: a = 19,900 + 19,800.5 = 39,700.5 (only 500 left): G would be 135,299.5.
#   g = 200: a = 20,000 + 20,000 = 40,000.    G = 175,000 - 40,000 = 135,000.
#   g = 250: a = 25,000 + 31,250 = 56,250.    G = 175,000 - 56,250 = 118,750.
#   g = 400: a = 40,000 + 80,000 = 120,000.   G = 175,000 - 120,000 = 55,000.
#   g = 600: a = 60,000 + 180,000 = 240,000, past the support: one more bucket of tokens,
#            cost(800) - cost(600) = (80,000 + 320,000) - 240,000 = 160,000.


def four_samples() -> SemanticHistory:
    """Four text-less answers to 100-token prompts, 100, 100, 100 and 500 tokens long; with four
    fallback neighbours every text-less request is predicted exactly their distribution."""
    history = SemanticHistory(fallback_neighbors=4)
    history.observe([100] * 4, [100, 100, 100, 500], np.zeros((4, 384), np.float32), [False] * 4)
    return history


def running_view(
    now: float, running: list[RequestState], waiting: Sequence[RequestState] = (), max_running: int = 8
) -> EngineView:
    return EngineView(now, list(waiting), running, 0.1, 2048, max_running, 0.02)


def admitted(policy: SageSched, *requests: RequestState) -> None:
    """Rank `requests` at a first step and admit them, as an engine would."""
    for request in requests:
        policy.on_arrival(request, request.arrival_s)
    policy.on_step(EngineView(0.0, list(requests), [], 0.0, 2048, 8, 0.02))
    for request in requests:
        policy.on_admit(request, 0.0)
        request.phase = "decode"


def generated(request: RequestState, tokens: int) -> None:
    request.tokens_generated, request.tokens_computed = tokens, request.prompt_tokens + tokens


def test_a_running_index_is_refreshed_only_when_its_tokens_cross_a_bucket_boundary():
    """Refreshes at 200, 400, 600 generated tokens (bucket 200) to the values computed above; at
    150, 199 and 399 the index stays, and the horizon lets the engine run up to the boundary."""
    policy = SageSched(history=four_samples(), preempt_on_flip=True, learn_online=False)
    request = state("a", 100)
    admitted(policy, request)
    distribution = request.cache["sage_distribution"]
    assert distribution.support.tolist() == [100, 500]
    assert distribution.probs.tolist() == pytest.approx([0.75, 0.25])
    assert request.cache["sage_index"] == pytest.approx(20_000)
    # tokens generated -> (index after the step, decode steps the plan holds after it)
    expected = {
        150: (20_000, 200 - 150 - 1),
        199: (20_000, 0),  # refreshed here it would be 135,299.5
        200: (135_000, 400 - 200 - 1),
        399: (135_000, 0),
        400: (55_000, 199),
        600: (160_000, 199),  # past everything predicted
    }
    for tokens, (index, steps) in expected.items():
        generated(request, tokens)
        view = running_view(float(tokens), [request])
        policy.on_step(view)
        assert request.cache["sage_index"] == pytest.approx(index), tokens
        assert policy.horizon(view).steps == steps, tokens


def flip_at(flip_ratio: float) -> tuple[Plan, Plan, SageSched, tuple[RequestState, ...]]:
    """A full engine (2 of 2 running): `a` (arrived first) and `b`, 100-token prompts, and `w`
    waiting at G = 20,000. `a` goes from 199 to 200 generated tokens, `b` is at 150. The plans
    of the two steps, the policy and the three requests."""
    policy = SageSched(
        history=four_samples(),
        preempt_on_flip=True,
        flip_ratio=flip_ratio,
        victim="priority",
        learn_online=False,
    )
    a, b, w = state("a", 100, arrival=0.0), state("b", 100, arrival=1.0), state("w", 100, arrival=2.0)
    admitted(policy, a, b)
    generated(b, 150)
    policy.on_arrival(w, 2.0)
    generated(a, 199)
    before = policy.on_step(running_view(3.0, [a, b], [w], max_running=2))
    generated(a, 200)
    after = policy.on_step(running_view(4.0, [a, b], [w], max_running=2))
    return before, after, policy, (a, b, w)


def test_a_full_engine_preempts_only_when_a_bucket_refresh_flips_the_order():
    """flip_ratio 1: the plain order. At 199 tokens every index is 20,000: ties go by arrival, so
    the waiting `w` stays behind `a` and `b` and nothing is preempted. At 200 `a`'s index is
    refreshed to 135,000 > 20,000: the order flips, `a` is the victim (the largest index), and,
    preempted, it waits behind `w`."""
    before, after, policy, (a, b, w) = flip_at(1.0)
    assert w.cache["sage_index"] == pytest.approx(20_000)
    assert before.preempt == [] and [r.id for r in before.running_order] == ["a", "b"]
    assert a.cache["sage_index"] == pytest.approx(135_000) and b.cache["sage_index"] == pytest.approx(20_000)
    assert after.preempt == [a] and [r.id for r in after.running_order] == ["b", "a"]
    policy.on_preempt(a, 4.0)  # re-ranked at 200 tokens: the same 135,000
    assert a.cache["sage_index"] == pytest.approx(135_000)
    assert [r.id for r in policy.waiting_in_order()] == ["w", "a"]


def test_flip_preemption_needs_the_running_index_above_flip_ratio_times_the_waiting_one():
    """135,000 = 6.75 x 20,000: at ratio 6.75 the flip is not clear enough, at 6.74 it is
    (20,000 x 6.74 = 134,800 < 135,000)."""
    assert flip_at(6.75)[1].preempt == []
    _, after, _, (a, _, _) = flip_at(6.74)
    assert after.preempt == [a]


@pytest.mark.parametrize("count", [1, 9])  # 1: the one-by-one refresh; 9: the vectorised pass
def test_an_index_re_ranked_between_boundaries_is_refreshed_again_at_the_next_boundary(count):
    """Buckets are fixed intervals of the generated tokens (0-199, 200-399, ...; SageSched
    section 3.3: "the Gittins index of each request is refreshed only at bucket boundaries"). A
    request re-ranked inside a bucket -- preempted at 250 tokens by KV pressure, or its embedding
    coming late -- takes the value at 250 (118,750), keeps it through 399, and is refreshed at the
    boundary 400 (to 55,000), not 200 tokens after the re-rank (450)."""
    policy = SageSched(history=four_samples(), preempt_on_flip=True, learn_online=False)
    requests = [state(f"r{i}", 100, arrival=float(i)) for i in range(count)]
    admitted(policy, *requests)
    for request in requests:
        generated(request, 250)
    if count == 1:
        policy.on_preempt(requests[0], 1.0)
        policy.on_admit(requests[0], 2.0)
    else:
        policy._refresh(requests)  # nine at once, as a step's batch of late embeddings is
    assert [r.cache["sage_index"] for r in requests] == pytest.approx([118_750] * count)
    for tokens, (index, steps) in {
        250: (118_750, 400 - 250 - 1),
        399: (118_750, 0),
        400: (55_000, 199),
    }.items():
        for request in requests:
            generated(request, tokens)
        view = running_view(float(tokens), requests, max_running=16)
        policy.on_step(view)
        assert [r.cache["sage_index"] for r in requests] == pytest.approx([index] * count), tokens
        assert policy.horizon(view).steps == steps, tokens
