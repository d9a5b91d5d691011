"""Replay memory is bounded by what is in flight: TBT goes into a mergeable sketch, finished
requests into columns, and the engine forgets a request once it leaves."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapt.replay.cost import roofline
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.replay.metrics import RecordTable, ReplayResult, RequestRecord, weighted_percentile
from adapt.replay.sketch import QuantileSketch
from adapt.requests import SLO, Request
from serving_hooks.policies import make_policy

values = st.lists(st.floats(1e-6, 1e3, allow_nan=False), min_size=1, max_size=200)


@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.tuples(values, st.integers(1, 5)), min_size=1, max_size=5), q=st.floats(0, 100))
def test_sketch_quantile_is_within_its_relative_accuracy_of_the_exact_one(chunks, q):
    sketch = QuantileSketch()
    exact_chunks = []
    for chunk, weight in chunks:
        sketch.add_many(np.array(chunk), float(weight))
        exact_chunks.append((np.array(chunk), float(weight)))
    exact = weighted_percentile(exact_chunks, q)
    assert sketch.quantile(q) == pytest.approx(exact, rel=sketch.relative_accuracy * 1.0001)


def test_sketch_by_hand():
    sketch = QuantileSketch()
    assert sketch.quantile(50) is None
    for value in (0.1, 0.1, 0.1, 0.2):
        sketch.add(value)
    # One distinct value per bucket: answered exactly (clamped to the bucket's min and max).
    assert sketch.quantile(50) == 0.1 and sketch.quantile(100) == 0.2
    sketch.add(0.0)  # a token delivered with its predecessor
    assert sketch.quantile(0) == 0.0 and sketch.total_weight == 5


def test_merged_sketches_answer_as_one():
    rng = np.random.default_rng(0)
    a, b = rng.lognormal(-3, 1, 1000), rng.lognormal(-2, 0.5, 500)
    whole, left, right = QuantileSketch(), QuantileSketch(), QuantileSketch()
    whole.add_many(a)
    whole.add_many(b, 2.0)
    left.add_many(a)
    right.add_many(b, 2.0)
    left.merge(right)
    for q in (1, 50, 99):
        assert left.quantile(q) == whole.quantile(q)
    with pytest.raises(ValueError, match="relative accuracy"):
        left.merge(QuantileSketch(1e-2))


def test_record_table_round_trips_and_concatenates():
    records = [
        RequestRecord("a", "x", "latency", 0.0, 10, 5, 0.5, 1.0, 5, 1),
        RequestRecord("b", None, "best_effort", 1.0, 20, 3, dropped="admission control"),
        RequestRecord("c", "y", "compound", 2.0, 5, 2, 2.5, 3.0, program_id="p", deadline_s=4.0),
    ]
    table = RecordTable.from_records(records)
    assert table.records() == records
    other = RecordTable.from_records([RequestRecord("d", "y", "latency", 3.0, 1, 1, 3.1, 3.1)])
    merged = RecordTable.concat([other, table])
    assert merged.records() == [*other.records(), *records]
    assert np.isnan(table.column("finish_s")[1])


def _requests(n: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    slos = (SLO("latency", ttft_s=1.0, tbt_s=0.05), SLO())
    return [
        Request(f"r{i}", float(t), int(p), int(o), slo=slos[i % 2], label=("a", "b")[i % 2])
        for i, (t, p, o) in enumerate(
            zip(
                np.cumsum(rng.exponential(0.05, n)),
                rng.integers(10, 400, n),
                rng.integers(1, 60, n),
                strict=True,
            )
        )
    ]


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), policy=st.sampled_from(["fcfs", "sarathi", "spf"]))
def test_sketch_metrics_match_kept_samples_and_nothing_stays_in_the_engine(seed, policy):
    requests = _requests(150, seed)
    cost = roofline("llama-2-7b", "h100-80g")
    runs = {}
    for keep in (False, True):
        engine = ReplayEngine(make_policy(policy), cost, EngineConfig(keep_token_times=keep))
        runs[keep] = engine.run(requests)
        # Memory bounded by what is in flight: nothing of a request is kept once it left.
        assert not engine._true_len and not engine.recorder._open and not engine._added
    streamed, kept = runs[False].metrics(), runs[True].metrics()
    for key, value in kept.items():
        if key in ("tbt_p50", "tbt_p99"):
            assert streamed[key] == pytest.approx(value, rel=1e-4)
        elif key not in ("sim_wall_s", "by_class"):
            assert streamed[key] == value, key
    for label, sub in kept["by_class"].items():
        assert streamed["by_class"][label]["ttlt_mean"] == sub["ttlt_mean"]
        assert streamed["by_class"][label]["tbt_p99"] == pytest.approx(sub["tbt_p99"], rel=1e-4)
    assert [r.request_id for r in runs[False].records] == [r.request_id for r in requests]
    assert runs[True].kv_timeline is not None and runs[False].kv_timeline is None


def test_merged_results_keep_every_request():
    cost = roofline("llama-2-7b", "h100-80g")
    requests = _requests(60, 1)
    parts = [ReplayEngine(make_policy("fcfs"), cost).run(requests[i::2]) for i in range(2)]
    merged = ReplayResult.merge(parts, 0.0).metrics()
    assert merged["num_requests"] == 60
    assert merged["completed"] == sum(p.metrics()["completed"] for p in parts)


def test_a_cluster_reports_the_engine_settings_it_ran_under():
    from adapt.replay.cluster import Cluster, make_router

    cost = roofline("llama-2-7b", "h100-80g")
    config = EngineConfig(token_budget=1024, max_running=64)
    engines = [ReplayEngine(make_policy("fcfs"), cost, config) for _ in range(2)]
    metrics = Cluster(engines, make_router("round-robin", 0)).run(_requests(40, 2)).metrics()
    assert (metrics["token_budget"], metrics["max_running"], metrics["num_requests"]) == (1024, 64, 40)
