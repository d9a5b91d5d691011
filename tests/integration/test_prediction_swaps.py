"""Prediction workers across a live whole-policy swap, in vLLM's real V1 scheduler without a model
(the harness of `test_scheduler_harness`): the step never waits for the old policy's batch in
flight, the new policy gets what the old one had (an embedding, a length bound) or asks again for
what never came, timed from the swap, and the lockstep replay hands every result over at the step
the live engine did."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

from tests.integration.test_scheduler_harness import _BlockingBound, _run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from serving_hooks.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _scheduler(tiny_model, monkeypatch, policy: str, running: int = 8, **settings: Any):
    """A harness scheduler serving `policy`: `running` requests at most, 400 KV blocks of 16."""
    from experiments.bench_scheduler import make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", policy)
    return make_scheduler(tiny_model, PolicyScheduler, running, 400, **settings)


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _embed_by_text(monkeypatch, vectors: dict[str, np.ndarray], gate: threading.Event | None = None) -> None:
    """SageSched's embeddings without MiniLM: each prompt's vector from `vectors` (a unit vector
    per prompt if none), once `gate` (if any) is open; the same in the live worker and the replay."""
    from predictors.embedding import DIMENSION
    from serving_hooks.policies import sagesched

    def embed(self, texts: list[str]) -> list[tuple[np.ndarray, bool]]:
        if gate is not None:
            gate.wait(30)
        time.sleep(0.003)  # a model that costs a little: some requests are ranked on their prior
        unit = np.eye(DIMENSION, dtype=np.float32)
        return [(vectors.get(text, unit[len(text) % DIMENSION]), True) for text in texts]

    monkeypatch.setattr(sagesched.PromptEmbeddings, "__call__", embed)
    monkeypatch.setattr(sagesched.PromptEmbeddings, "warm_up", lambda self: None)


def test_a_swap_never_waits_for_the_old_policys_batch_in_flight(tiny_model, monkeypatch):
    """The old policy's worker is 5 s into a batch when a new policy goes live: the swap (inside
    `schedule()`) stops that worker and returns at once; shutdown joins it. Before, the swap joined
    it, holding the step up to 30 s."""
    from experiments.bench_scheduler import make_requests
    from serving_hooks.policies.baselines import FCFS

    started = threading.Event()

    def slow(payloads: list[Any]) -> list[Any]:
        started.set()
        time.sleep(5.0)
        return payloads

    class Asks(FCFS):
        """FCFS that asks a slow model about every arrival."""

        def use_predictions(self, queues):
            self.worker = queues(slow)

        def on_arrival(self, request, now):
            super().on_arrival(request, now)
            self.worker.submit(request.id, request.prompt_tokens, now)

    scheduler = _scheduler(tiny_model, monkeypatch, "fcfs")
    asks = Asks()
    scheduler._switch_policy(asks)
    (request,) = make_requests(1, 0, seed=1, max_tokens=4)
    scheduler.add_request(request)
    assert started.wait(5)  # one item in flight
    begun = time.monotonic()
    scheduler._switch_policy(FCFS())
    took = time.monotonic() - begun
    assert took < 0.5, f"the swap waited {took:.2f} s for the old worker"
    assert asks.worker._closed and asks.worker in scheduler._retired_queues
    scheduler.shutdown()
    assert not asks.worker._thread.is_alive()  # joined at shutdown


def test_a_bound_the_old_jitserve_never_received_is_asked_again_by_the_new_one(tiny_model, monkeypatch):
    """jitserve -> jitserve while the forest computes a request's first bound: the new policy asks
    for it again (the old queue, stopped, never hands it over). Before, the request's cache said
    "asked" and the new policy waited for it, on the fallback bound, until `refine_every` more
    tokens."""
    from experiments.bench_scheduler import make_requests, step
    from serving_hooks.policies import make_policy

    scheduler = _scheduler(tiny_model, monkeypatch, "jitserve:waiting_time_s=null")
    release = threading.Event()
    model = _BlockingBound(release)
    scheduler.adapt_policy.use_component("qrf", model)
    (request,) = make_requests(1, 0, seed=2, max_tokens=400)
    scheduler.add_request(request)
    _until(lambda: model.calls == 1)  # the old worker is inside the forest
    replacement = make_policy("jitserve", waiting_time_s=None)
    replacement.use_component("qrf", model)
    scheduler._switch_policy(replacement)
    release.set()
    (worker,) = scheduler.prediction_queues
    assert worker.drain(10)
    step(scheduler)
    state = scheduler._states[request.request_id]
    assert state.cache["jit_qrf_at"] == 0 and not state.cache["jit_prior"]
    assert state.cache["jit_bound"] == (64.0, 0)  # the forest's, not the fallback's
    scheduler.shutdown()


def test_a_sagesched_swap_keeps_the_embeddings_it_had_and_times_new_ones_from_the_swap(
    tiny_model, monkeypatch
):
    """sagesched -> sagesched with 12 requests in flight, 9 embedded by the old policy and 3 still
    waiting on its worker: the 9 are ranked on their embedding at the new policy's first step (none
    back on its prior, the model not called for them), and the 3 are embedded by the new worker,
    their wait counted from the swap, not from their arrival 0.3 s before it. Before, all 12 went
    back on their prior and the status reported waits of the old policy's time."""
    from experiments.bench_scheduler import make_requests, step
    from serving_hooks.policies import make_policy

    gate = threading.Event()
    gate.set()
    _embed_by_text(monkeypatch, {}, gate)
    scheduler = _scheduler(tiny_model, monkeypatch, "sagesched")
    early, late = make_requests(9, 0, seed=3, max_tokens=400), make_requests(3, 9, seed=4, max_tokens=400)
    for request in early:
        scheduler.add_request(request)
    assert scheduler.prediction_queues[0].drain(10)
    step(scheduler)
    gate.clear()  # the old worker takes the next three and waits
    for request in late:
        scheduler.add_request(request)
    time.sleep(0.3)
    scheduler._switch_policy(make_policy("sagesched", bucket=100))
    gate.set()
    (worker,) = scheduler.prediction_queues
    assert worker.drain(10)
    step(scheduler)
    states = [scheduler._states[r.request_id] for r in [*early, *late]]
    assert not any(state.cache["sage_prior"] for state in states)
    summary = scheduler.prediction_summary()
    assert (summary["supplied"], summary["submitted"], summary["delivered"]) == (9, 12, 3)
    assert summary["on_prior"] == 0  # the three were computed before the new policy's first step
    assert summary["mean_wait_s"] < 0.25, summary
    scheduler.shutdown()


def _two_kinds_history(directions: np.ndarray):
    """A `semantic-history` window that knows two kinds of prompt of every length: embedded as
    `directions[0]` they were answered in 4 tokens, as `directions[1]` in 60. By prompt length
    alone (a request's prior) a request is either; its embedding tells which."""
    from predictors.semantic_history import SemanticHistory

    history = SemanticHistory()
    lengths = [16 + 8 * i for i in range(24)] * 2
    kinds = [0] * 24 + [1] * 24
    history.observe(lengths, [(4, 60)[k] for k in kinds], directions[kinds], [True] * 48)
    return history


def test_a_sagesched_swap_mid_run_replays_identically_step_by_step(tiny_model, monkeypatch):
    """The lockstep conformance check across a live swap sagesched -> sagesched:bucket=100: 60
    requests of two kinds (embedded as two directions: short answers or long) arriving over the
    run, 2 running at most, the swap halfway. A key handed over twice -- to the old policy, then
    to the new one at the swap -- is handed over at each of those steps in the replay too; before,
    the replay kept only the last, so its old policy got the embedding late and ranked the request
    on its prior meanwhile."""
    import random

    from adapt.conformance import compare, replay_decisions
    from experiments.bench_scheduler import make_requests
    from predictors.embedding import DIMENSION
    from serving_hooks.policies.sagesched import SageSched

    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    rng = random.Random(5)
    arrivals: dict[int, list] = {}
    kind: dict[str, int] = {}
    for i in range(60):
        kind_i = int(rng.random() < 0.5)
        (request,) = make_requests(
            1, i, seed=500 + i, max_tokens=(4, 60)[kind_i], prompt_tokens=rng.randint(16, 200)
        )
        kind[request.request_id] = kind_i
        arrivals.setdefault(rng.randint(0, 160), []).append(request)
    directions = np.eye(DIMENSION, dtype=np.float32)[:2]
    history = _two_kinds_history(directions)
    settings = {"prefix_caching": False, "async_scheduling": True}
    scheduler = _scheduler(tiny_model, monkeypatch, "fcfs", running=2, **settings)
    tokenizer = scheduler._load_tokenizer()
    vectors = {
        tokenizer.decode(r.prompt_token_ids, skip_special_tokens=True): directions[kind[r.request_id]]
        for requests in arrivals.values()
        for r in requests
    }
    _embed_by_text(monkeypatch, vectors)
    scheduler._switch_policy(SageSched(history=history))  # before any request: the run's policy
    swapped_at: list[int] = []

    def forward() -> None:
        """An engine's forward pass between two steps: the worker runs meanwhile (the harness's
        own steps take well under a millisecond: the swap would come before any embedding)."""
        time.sleep(0.002)

    def forward_then_swap() -> None:
        forward()
        swapped_at.append(len(scheduler.decisions))
        scheduler._switch_policy(SageSched(history=history, bucket=100))

    _run(scheduler, 20_000, arrivals, calls={**dict.fromkeys(range(20_000), forward), 80: forward_then_swap})
    assert not scheduler.policy_errors and swapped_at
    handed = Counter(key for record in scheduler.decisions for key in record["predicted"])
    assert sum(count > 1 for count in handed.values()) >= 3  # handed to both policies
    replayed = replay_decisions(
        scheduler.decisions,
        SageSched(history=history),
        scheduler.replay_config(),
        switches={swapped_at[0]: SageSched(history=history, bucket=100)},
    )
    agreement = compare(scheduler.decisions, replayed)
    assert agreement.steps > 100 and agreement.identical == agreement.steps, agreement.describe()
    scheduler.shutdown()


def test_shutdown_closes_the_embedding_process_after_a_swap_to_a_policy_without_workers(
    tiny_model, monkeypatch
):
    """`ADAPT_EMBEDDING_PROCESS=1`, sagesched -> fcfs: no policy serving has a worker at shutdown,
    and the embedding child its worker started is still closed. Before, shutdown closed the child
    only while the serving policy had workers. (The child's functions are recorded here, not
    run: the real child is `test_scheduler_harness`'s.)"""
    from predictors import embedding
    from serving_hooks.policies.baselines import FCFS

    calls: list[str] = []
    for name in ("compute_in_child_process", "close_child_process", "compute_in_this_process"):
        monkeypatch.setattr(embedding, name, lambda name=name: calls.append(name))
    _embed_by_text(monkeypatch, {})
    monkeypatch.setenv("ADAPT_EMBEDDING_PROCESS", "1")
    scheduler = _scheduler(tiny_model, monkeypatch, "sagesched")
    assert calls == ["compute_in_child_process"]
    scheduler._switch_policy(FCFS())
    assert not scheduler.prediction_queues
    scheduler.shutdown()
    assert calls == ["compute_in_child_process", "close_child_process", "compute_in_this_process"]
