"""How requests leave a live engine, and what a policy swapped in live reads, in both engines (the
model-free vLLM harness of `experiments.bench_scheduler`): answers vLLM's repetition detection
ends, requests that end in an error, requests their clients abort, and the prompt texts a policy
that reads them gets for the requests in flight when it goes live. Each live run's decision log
must replay step by step (`adapt.conformance`), and the policy must hear the same in both."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from typing import Any

import pytest

from adapt.policy import EngineView, Plan, Policy, RequestState
from tests.integration.test_scheduler_harness import _run, _serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from serving_hooks.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _heard_finishes(policy: Policy, monkeypatch) -> dict[str, float | None]:
    """What `policy` is told in `on_finish`: request id -> its finish time (None: it did not finish)."""
    heard: dict[str, float | None] = {}
    on_finish = policy.on_finish

    def hearing(state: RequestState, now: float) -> None:
        heard[state.id] = state.finish_s
        on_finish(state, now)

    monkeypatch.setattr(policy, "on_finish", hearing)
    return heard


def _requests(rng: random.Random, count: int, turns: int, repeating: float = 0.0) -> tuple[dict, dict]:
    """`count` requests of 8-200 prompt tokens and 2-40 answer tokens, each with its own sampling
    parameters, arriving over `turns` turns; a third of the answers ended early by a stop token,
    and a share `repeating` of the others by vLLM's repetition detection (the harness's "model"
    repeats one token per request, so an answer ends after its `min_count`-th token)."""
    from vllm.sampling_params import RepetitionDetectionParams

    from experiments.bench_scheduler import make_requests

    arrivals: dict[int, list] = {}
    stop_after: dict[str, int] = {}
    for i in range(count):
        max_tokens = rng.randint(2, 40)
        (request,) = make_requests(1, i, seed=i, max_tokens=max_tokens, prompt_tokens=rng.randint(8, 200))
        if rng.random() < 1 / 3:
            stop_after[request.request_id] = rng.randint(1, max_tokens - 1)
        elif rng.random() < repeating:
            request.sampling_params.repetition_detection = RepetitionDetectionParams(
                max_pattern_size=1, min_count=rng.randint(2, max_tokens)
            )
        arrivals.setdefault(rng.randint(0, turns), []).append(request)
    return arrivals, stop_after


def _ends(rng: random.Random, arrivals: dict[int, list], share: float) -> dict[int, list[str]]:
    """A share of the requests, each ended from outside at a turn from its arrival's (the same
    turn: before any step saw it) to 40 turns later: turn -> request ids."""
    ends: dict[int, list[str]] = {}
    for k, requests in arrivals.items():
        for request in requests:
            if rng.random() < share:
                ends.setdefault(k + rng.choice([0, rng.randint(0, 40)]), []).append(request.request_id)
    return ends


def _outside_ends(
    scheduler, aborts: dict[int, list[str]], errors: dict[int, list[str]] | None = None
) -> dict[int, Callable[[], None]]:
    """`_run`'s calls that end requests from outside, per turn. A client's abort (a disconnect, a
    stop string) is what vLLM's engine core does between two steps, `finish_requests(...,
    FINISHED_ABORTED)`; an error takes vLLM's own path: the request joins its grammars that
    failed to compile, and the next step's output ends it (`finish_requests(..., FINISHED_ERROR)`)."""
    from vllm.v1.request import RequestStatus

    errors = errors or {}

    def at(k: int) -> Callable[[], None]:
        def end() -> None:
            scheduler.finish_requests(aborts.get(k, []), RequestStatus.FINISHED_ABORTED)
            _fail_grammars(scheduler, errors.get(k, []))

        return end

    return {k: at(k) for k in {*aborts, *errors}}


def _fail_grammars(scheduler, request_ids: list[str]) -> None:
    """Put requests among the scheduler's grammars that failed to compile: a set of ids in vLLM up
    to 0.32, a dict of id -> `RequestError` from 0.33 on."""
    failed = scheduler.grammar_compile_error_reqs
    if isinstance(failed, dict):
        from vllm.outputs import RequestError

        failed.update(
            {i: RequestError(code="validation_error", message="a test's grammar") for i in request_ids}
        )
    else:
        failed.update(request_ids)


def _agreement(scheduler, policy: Policy, **handed_over: Any):
    from adapt.conformance import compare, replay_decisions

    replayed = replay_decisions(scheduler.decisions, policy, scheduler.replay_config(), **handed_over)
    return compare(scheduler.decisions, replayed)


def _identical(scheduler, policy: Policy, **handed_over: Any) -> None:
    agreement = _agreement(scheduler, policy, **handed_over)
    assert agreement.steps > 20 and agreement.identical == agreement.steps, agreement.describe()


# ------------------------------------------------------------------------ item 1: how answers end
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_answers_repetition_detection_ended_replay_at_their_length(tiny_model, monkeypatch, async_scheduling):
    """vLLM ends an answer that repeats itself (the client's `repetition_detection`) in its stop
    check, as it does at a stop token; the decision log keeps only stop tokens' and `max_tokens`'
    lengths, so the replay ran those answers to `max_tokens` (the reviewer's case: 4 of 5 steps
    identical). Now every answer a sampled token ended is logged with its length."""
    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    scheduler, fresh_policy = _serving(
        tiny_model, monkeypatch, "spf", 0, None, 4, 60, async_scheduling=async_scheduling
    )
    arrivals, stop_after = _requests(random.Random(1), 30, 60, repeating=0.7)
    statuses: dict[str, str] = {}
    _run(
        scheduler, 5_000, arrivals, stop_after, lambda k, r: statuses.__setitem__(r.request_id, r.status.name)
    )
    assert not scheduler.policy_errors
    _identical(scheduler, fresh_policy())
    repeated = [key for key, status in statuses.items() if status == "FINISHED_REPETITION"]
    assert len(repeated) >= 5
    logged = {key: n for step in scheduler.decisions for key, n in step["finished"].items()}
    assert set(repeated) <= set(logged)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_request_that_ends_in_an_error_did_not_finish_in_either_engine(
    tiny_model, monkeypatch, async_scheduling
):
    """vLLM ends a request in an error (`FINISHED_ERROR`: a grammar that failed to compile, an
    encoder cache mismatch) as it processes a step's output, whatever its answer's length: waiting
    with no answer yet, prefilling, or decoding. Its policy was told it finished there, with a
    finish time (sagesched and jitserve learn lengths from that), and the replay, which had no
    trace of it, ran it to `max_tokens`. Now the policy hears no finish time, the log notes when
    it left, and the replay ends it there, the same in both engines."""
    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    scheduler, fresh_policy = _serving(
        tiny_model, monkeypatch, "spf", 0, None, 4, 60, async_scheduling=async_scheduling
    )
    rng = random.Random(2)
    arrivals, stop_after = _requests(rng, 30, 60)
    calls = _outside_ends(scheduler, {}, _ends(rng, arrivals, 0.5))
    live = _heard_finishes(scheduler.adapt_policy, monkeypatch)
    _run(scheduler, 5_000, arrivals, stop_after, calls=calls)
    assert not scheduler.policy_errors
    replay_policy = fresh_policy()
    replayed = _heard_finishes(replay_policy, monkeypatch)
    _identical(scheduler, replay_policy)
    errors = {key for step in scheduler.decisions for key in step.get("aborted", {})}
    assert len(errors) >= 5
    assert all(live[key] is None for key in errors)
    assert all(live[key] is not None for key in set(live) - errors)
    assert {key: at is None for key, at in replayed.items()} == {key: at is None for key, at in live.items()}


# ------------------------------------------------------------------------- item 2: client aborts
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("policy", ["spf", "scrambled"])
def test_requests_their_clients_abort_leave_at_the_same_point_in_both_engines(
    tiny_model, monkeypatch, policy, async_scheduling
):
    """A client that disconnects (or a stop string, which vLLM's API server applies by aborting)
    makes vLLM's engine core call `finish_requests(..., FINISHED_ABORTED)` between two steps. The
    log did not mark it and the replay had no abort, so a replay diverged at the first one. Now
    the log notes each (`aborted`, with its moment), the policy's own drops aside (the replay's
    plan makes those), and the replay aborts the request there (`ReplayEngine.abort`): waiting,
    arriving in that very interval, prefilling, decoding, preempted, with a token in flight."""
    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    disagreements, aborted, dropped = {}, 0, 0
    for seed in range(4):
        rng = random.Random(seed)
        settings = {"prefix_caching": seed % 2 == 0, "async_scheduling": async_scheduling}
        scheduler, fresh_policy = _serving(tiny_model, monkeypatch, policy, seed, None, 4, 60, **settings)
        arrivals, stop_after = _requests(rng, 30, 60)
        aborts = _ends(rng, arrivals, 0.4)
        live = _heard_finishes(scheduler.adapt_policy, monkeypatch)
        _run(scheduler, 5_000, arrivals, stop_after, calls=_outside_ends(scheduler, aborts))
        assert not scheduler.policy_errors
        logged = {key for step in scheduler.decisions for key in step.get("aborted", {})}
        assert logged <= {key for ids in aborts.values() for key in ids}
        assert all(live[key] is None for key in logged)
        aborted += len(logged)
        dropped += sum(at is None for at in live.values()) - len(logged)  # the plan's own drops
        replay_policy = fresh_policy()
        replayed = _heard_finishes(replay_policy, monkeypatch)
        agreement = _agreement(scheduler, replay_policy)
        if agreement.identical != agreement.steps:
            disagreements[seed] = agreement.describe()
        elif {key: at is None for key, at in replayed.items()} != {
            key: at is None for key, at in live.items()
        }:
            disagreements[seed] = "the policies heard other finishes"
    assert not disagreements, "\n".join(f"seed {k}: {v}" for k, v in disagreements.items())
    assert aborted >= 20 and (dropped > 0) == (policy == "scrambled"), (aborted, dropped)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_aborts_around_a_prefix_cache_reset_replay_in_their_order(tiny_model, monkeypatch, async_scheduling):
    """Between two steps, a client aborts a running request, an operator's reset preempts the
    others (`reset_running_requests`), then a client aborts one of those: the replay must abort,
    preempt and abort in that order -- aborted before the reset, a request is not among the
    step's preemptions; after it, it is."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    if "reset_running_requests" not in inspect.signature(Scheduler.reset_prefix_cache).parameters:
        pytest.skip("this vLLM's reset_prefix_cache cannot preempt running requests")
    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    settings = {"prefix_caching": True, "async_scheduling": async_scheduling}
    scheduler, fresh_policy = _serving(tiny_model, monkeypatch, "spf", 0, None, 4, 60, **settings)
    arrivals, stop_after = _requests(random.Random(3), 30, 60)

    def around_reset() -> None:
        running = [r.request_id for r in scheduler.running]
        scheduler.finish_requests(running[:1], RequestStatus.FINISHED_ABORTED)
        scheduler.reset_prefix_cache(reset_running_requests=True)
        scheduler.finish_requests(running[1:2], RequestStatus.FINISHED_ABORTED)

    _run(scheduler, 5_000, arrivals, stop_after, calls=dict.fromkeys([15, 35, 55], around_reset))
    assert not scheduler.policy_errors
    noted = [step for step in scheduler.decisions if step.get("prefix_cache_reset") == "preempting"]
    assert len(noted) == 3 and all(len(step["aborted"]) == 2 for step in noted)
    assert all(len(set(step["aborted"]) & set(step["preempted"])) == 1 for step in noted)
    _identical(scheduler, fresh_policy())


def test_a_servers_log_with_aborts_errors_and_repetitions_passes_adapt_conformance(
    tiny_model, monkeypatch, tmp_path, capsys
):
    """The decision log on disk, as `adapt serve --log-decisions` writes it, read back by `adapt
    conformance`: every step identical, and the aborts named."""
    import json

    from adapt.cli import main

    log_dir = tmp_path / "logs"
    monkeypatch.setenv("ADAPT_LOG_DIR", str(log_dir))
    monkeypatch.setenv("ADAPT_LOG_DECISIONS", "1")
    scheduler, _ = _serving(tiny_model, monkeypatch, "spf", 0, None, 4, 60, async_scheduling=True)
    rng = random.Random(5)
    arrivals, stop_after = _requests(rng, 30, 60, repeating=0.5)
    calls = _outside_ends(scheduler, _ends(rng, arrivals, 0.2), _ends(rng, arrivals, 0.2))
    _run(scheduler, 5_000, arrivals, stop_after, calls=calls)
    scheduler.shutdown()
    report = tmp_path / "conformance.json"
    assert main(["conformance", "--log-dir", str(log_dir), "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["steps"] == result["identical"] > 20 and result["runs"][0]["aborted"] >= 5
    assert "aborted live (a client's abort, a stop string or an error), and so in the replay" in (
        capsys.readouterr().out
    )


# ------------------------------------------------------- item 3: prompt texts for a policy swapped in
class TextOrder(Policy):
    """A stand-in for a policy that reads prompts: with its `reader` component it admits waiting
    requests in the order of a hash of their text (no text: first, by arrival), without one in
    arrival order; it remembers the text each request arrived with, and the last it read."""

    name = "text-order"
    components = {"reader": "text-reader"}  # noqa: RUF012

    def __init__(self, reader: object | None = True) -> None:
        self.reader = reader
        self.heard: dict[str, str | None] = {}
        self.read: dict[str, str | None] = {}

    @property
    def needs_prompt_text(self) -> bool:  # type: ignore[override]
        return self.reader is not None

    def on_arrival(self, request: RequestState, now: float) -> None:
        self.heard[request.id] = request.prompt_text

    def on_step(self, view: EngineView) -> Plan:
        if self.reader is None:
            return Plan(admit=list(view.waiting))
        self.read.update((s.id, s.prompt_text) for s in [*view.running, *view.waiting])
        return Plan(admit=sorted(view.waiting, key=lambda s: zlib.crc32((s.prompt_text or "").encode())))


class _OneSwap:
    """The registry side of `adapt serve` (`serving_hooks.live.LiveComponents`) for one component
    swap: once `arm`ed, the next step's `apply` hands the component to the policy."""

    slots: dict = {}  # noqa: RUF012
    applied: dict = {}  # noqa: RUF012

    def __init__(self) -> None:
        self.armed: tuple[Policy, str, object] | None = None

    def arm(self, policy: Policy, attribute: str, component: object) -> None:
        self.armed = (policy, attribute, component)

    def next_policy(self) -> None:
        return None

    def apply(self) -> None:
        if self.armed is not None:
            policy, attribute, component = self.armed
            policy.use_component(attribute, component)
            self.armed = None


def _burst(tiny_model, monkeypatch, policy: str):
    """A scheduler serving `policy` with 2 running and a burst of 16 requests at turn 0, 4 more at
    turn 6 (the swap's turn): many wait when the swap comes."""
    from experiments.bench_scheduler import make_requests

    monkeypatch.setenv("ADAPT_RECORD_DECISIONS", "1")
    scheduler, _ = _serving(tiny_model, monkeypatch, policy, 0, None, 2, 200, async_scheduling=True)
    arrivals = {0: make_requests(16, 0, seed=1, max_tokens=8), 6: make_requests(4, 16, seed=2, max_tokens=8)}
    return scheduler, arrivals


def _texts(scheduler, arrivals: dict[int, list]) -> dict[str, str]:
    tokenizer = scheduler._load_tokenizer()
    return {
        r.request_id: tokenizer.decode(r.prompt_token_ids, skip_special_tokens=True)
        for requests in arrivals.values()
        for r in requests
    }


def _swap_position(scheduler) -> int:
    (position,) = [i for i, step in enumerate(scheduler.decisions) if "prompt_texts" in step]
    return position


def test_a_policy_swapped_in_that_reads_prompts_gets_the_texts_of_the_requests_in_flight(
    tiny_model, monkeypatch
):
    """fcfs -> a policy that reads prompts, with 20 requests in flight (4 of them arrived since the
    last step): each is handed over with its text, where before they kept none (`add_request`
    decodes it only for a policy that reads it) and sat on the policy's length-only prior. The
    decision log carries the texts given, and the replay gives them at the same step."""
    from serving_hooks.policies import make_policy

    scheduler, arrivals = _burst(tiny_model, monkeypatch, "fcfs")
    reader, in_flight = TextOrder(), set()

    def swap() -> None:
        in_flight.update(scheduler._states)
        scheduler._switch_policy(reader)

    _run(scheduler, 5_000, arrivals, calls={6: swap})
    assert not scheduler.policy_errors
    assert len(in_flight) >= 15
    assert reader.heard == {
        key: text for key, text in _texts(scheduler, arrivals).items() if key in in_flight
    }
    position = _swap_position(scheduler)
    assert scheduler.decisions[position]["prompt_texts"].keys() == in_flight
    _identical(scheduler, make_policy("fcfs"), switches={position: TextOrder()})


def test_a_component_version_that_reads_prompts_gets_the_texts_of_the_requests_in_flight(
    tiny_model, monkeypatch
):
    """The same policy, whose new component version reads prompts (jitserve with a forest on
    prompt features): its `needs_prompt_text` turns on at the swap, and the requests in flight get
    their text there, in both engines."""
    scheduler, arrivals = _burst(tiny_model, monkeypatch, "fcfs")
    policy = TextOrder(reader=None)
    scheduler._switch_policy(policy)
    scheduler.live = live = _OneSwap()
    texts: dict[str, str | None] = {}

    def swap() -> None:
        live.arm(policy, "reader", True)
        texts.update({key: scheduler._states[key].prompt_text for key in scheduler._states})

    _run(scheduler, 5_000, arrivals, calls={6: swap})
    assert not scheduler.policy_errors
    assert texts and set(texts.values()) == {None}  # before the swap: no text
    given = {key: text for key, text in _texts(scheduler, arrivals).items() if key in texts}
    assert {key: policy.read[key] for key in texts} == given  # after it, each read its own
    position = _swap_position(scheduler)
    assert scheduler.decisions[position]["prompt_texts"] == given
    _identical(scheduler, TextOrder(reader=None), swaps={position: {"reader": True}})
