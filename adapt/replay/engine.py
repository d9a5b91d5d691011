"""An iteration-level discrete-event model of a vLLM V1 engine.

Each step: the policy plans (`adapt.policy`); the engine applies drops and preemptions, schedules
running requests in the plan's running order (default: admission order; decodes take 1 token,
unfinished prefills a chunk) under the token budget, allocating KV blocks and, when the pool runs
dry, preempting by recompute the *last* request of that order not yet scheduled (possibly the
request itself), then -- only if nothing was preempted -- admits waiting requests in the policy's
order while the running cap, the budget and the free blocks allow, a request being admitted only if
its whole known sequence fits (vLLM's `scheduler_reserve_full_isl`). These are vLLM V1's rules, so
a policy's running order means the same in both engines: the order requests get tokens in, and the
reverse of the order KV pressure evicts them in (`adapt.mechanics`). The step's duration comes from
the cost model; every request whose known tokens are all computed samples one token at its end.

Async scheduling (`EngineConfig.async_scheduling`, vLLM's default): a step's sampled tokens reach
the scheduler only after the next step has been scheduled, so the next step plans without them (a
decode already in flight counts as one placeholder token, a request whose `max_tokens`-th token
is in flight is skipped -- one whose answer ends earlier (an EOS) is decoded once more, its stop
still in flight -- a finished request holds its KV blocks one step longer, a request preempted with a
token in flight gets that token and waits for it before it can resume, unless a prefix-cache reset
preempted it: that token is dropped) -- as vLLM's
`AsyncScheduler` does. Trace-driven steps (`TraceStep`) take their start, number and duration from
a live engine's decision log, so a replay can be compared with it step by step (`adapt.conformance`).

Prefix caching (`EngineConfig.prefix_caching`, vLLM's default): a waiting request first takes the
cached blocks its tokens match and computes only the rest, and freed blocks keep their content
until reused, in vLLM's order (`adapt.replay.prefix_cache`).

Compound programs: a request whose `program.parent_ids` are set is held back when added and
arrives `program.after_parents_s` (a tool call) after its last parent finishes; if a parent is
dropped, its dependants are dropped too, with that reason, so no request disappears unreported.

Fast path: when every running request got a token at the end of the last step and the plan for
this one drops, preempts, defers and admits nothing, the step is plain decodes, and so are the
steps after it until an arrival (unless the plan holds across arrivals, `Horizon.past_arrivals`),
a completion, a KV block shortfall or the policy's horizon (or just before requests finish
together, whose leaving order the policy's next plan gives); the engine takes that whole run at
once (step times summed in Python for a few steps, vectorised for more). A step whose running
decodes are plain but which admits or continues a prefill takes the decodes in bulk likewise,
and only the prefills one by one (`_bulk_decode_step`). With `skip_decode_runs=False` it steps one
by one (the property tests check both agree).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import json
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from adapt.policy import EngineView, Plan, Policy, RequestState, WaitingView
from adapt.predictions import BatchFunction, Delayed, PredictionQueue, QueueFactory
from adapt.replay.kv import BlockPool
from adapt.replay.metrics import Recorder, ReplayResult
from adapt.replay.prefix_cache import PrefixCachingBlockPool
from adapt.requests import Request
from adapt.steplog import CostModel, StepBatch, step_batch

MAX_RUN_STEPS = 4096
SHORT_RUN_STEPS = 16  # decode runs up to this long are advanced in plain Python (`_short_run`)


class PolicyError(RuntimeError):
    """A policy broke the contract (e.g. left the engine idle with work and no wake-up time)."""


def running_drop(policy: str, request_id: str) -> PolicyError:
    """The error both engines raise for a plan that drops a running request: drops are admission
    control, for waiting requests only (vLLM would abort the running one, after it streamed tokens;
    to stop one, a policy preempts it)."""
    return PolicyError(
        f"policy {policy!r} dropped request {request_id!r}, which is running: a plan drops waiting"
        " requests only (admission control); preempt a running one instead"
    )


@dataclass(frozen=True)
class EngineConfig:
    """vLLM-like engine limits. Defaults follow vLLM V1's online-serving defaults: chunked
    prefill, `max_num_batched_tokens` 2048, `max_num_seqs` 256, block size 16."""

    token_budget: int = 2048
    max_running: int = 256
    block_size: int = 16
    max_model_len: int = 32768
    kv_capacity_tokens: int | None = None
    skip_decode_runs: bool = True
    batch_time_ema: float = 0.1
    record_steps: bool = False
    async_scheduling: bool = False
    reserve_full_sequence: bool = True
    record_decisions: bool = False
    # Raw TBT samples and the KV-usage timeline (memory grows with the trace); without them TBT
    # percentiles come from a sketch within 1e-4 relative (`adapt.replay.sketch`).
    keep_token_times: bool = False
    # Simulated seconds from a request's arrival until its policy's model call (an embedding)
    # is done (`adapt.predictions.Delayed`); 0: ready at the next step, as if the model were free.
    prediction_delay_s: float = 0.0
    # Simulated seconds from a request's arrival at the server until the engine sees it: `adapt
    # serve --embed-prompts` holds each request in the API server while its prompt is embedded
    # (`prompt_embedder.mean_wait_s` in the server's status). The policy sees the request from
    # then on, as live; its latencies and SLOs count from its arrival, as its client's do.
    intake_delay_s: float = 0.0
    # vLLM's automatic prefix caching (`adapt.replay.prefix_cache`): a request reuses the cached
    # blocks its prompt shares (`Request.prompt_blocks`), and a preempted one its own. Off by
    # default (a trace has no prompt content); a live server's `engine.json` says what it ran.
    prefix_caching: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str, source: str = "engine config") -> EngineConfig:
        """An engine's limits as `to_json` wrote them (a live server writes its own beside its
        logs, `ENGINE_FILE`); a field this version does not know is an error, not ignored."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(fields).__name__}")
        annotations = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(fields) - set(annotations)
        if unknown:
            raise ValueError(f"{source}: unknown fields {sorted(unknown)}")
        for name, value in fields.items():
            if not _of_type(value, annotations[name]):
                raise ValueError(f"{source}: {name}: expected {annotations[name]}, got {value!r}")
        try:
            return cls(**fields)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_running", "block_size", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("prediction_delay_s", "intake_delay_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name}: must be finite and >= 0, got {getattr(self, name)}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ValueError(
                f"kv_capacity_tokens: must hold at least one block ({self.block_size} tokens),"
                f" got {self.kv_capacity_tokens}"
            )
        if not 0 < self.batch_time_ema <= 1:
            raise ValueError(f"batch_time_ema: must be in (0, 1], got {self.batch_time_ema}")


def _of_type(value: Any, annotation: str) -> bool:
    """Whether a JSON value fits an `EngineConfig` field's annotation (`int`, `int | None`, `bool`,
    `float`): JSON has no integer/boolean distinction Python keeps (`true` is an int to Python),
    and a float field must be finite."""
    kinds = {part.strip() for part in annotation.split("|")}
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, int):
        return bool(kinds & {"int", "float"})
    if isinstance(value, float):
        return "float" in kinds and math.isfinite(value)
    return False


# Written by `adapt serve --log-dir` beside its request and step logs: the serving engine's limits,
# so a retrain's gate replays the logged traffic on the engine that served it.
ENGINE_FILE = "engine.json"


@dataclass(frozen=True)
class TraceStep:
    """One step of a live engine's decision log: when it started, its number, how long until the
    next one, and when its output (sampled tokens) reached the scheduler."""

    at: float
    index: int
    duration: float
    output_at: float | None = None


class ReplayEngine:
    """One engine replica. Feed requests with `add` (in arrival order) and call `step` while
    `has_work`; `run` does both for a whole request list."""

    def __init__(
        self,
        policy: Policy,
        cost: CostModel,
        config: EngineConfig | None = None,
        predictions: QueueFactory | None = None,
    ) -> None:
        """`predictions`: where the policy's model calls run (`adapt.predictions`); by default
        `Delayed` by `config.prediction_delay_s`."""
        self.policy = policy
        self.cost = cost
        self.config = config or EngineConfig()
        self._predictions = predictions or functools.partial(Delayed, delay_s=self.config.prediction_delay_s)
        policy.use_predictions(self._predictions)
        capacity = self.config.kv_capacity_tokens or cost.kv_capacity_tokens()
        pool = PrefixCachingBlockPool if self.config.prefix_caching else BlockPool
        self.kv = pool(capacity // self.config.block_size, self.config.block_size)
        self._prefix_cache = self.kv if isinstance(self.kv, PrefixCachingBlockPool) else None
        self.token_budget = self._budget_of(policy)
        self.now = 0.0
        self.step_index = 0
        self.mean_batch_time = 0.0
        self.waiting: dict[str, RequestState] = {}
        self.running: list[RequestState] = []
        self._waiting_view = WaitingView(self.waiting)  # every step's view of it (a live view)
        # The running requests per class, and those with a latency SLO: what a decode run records
        # of them (`Recorder.run_tokens`), kept up to date rather than counted every step.
        self._running_labels: dict[str | None, int] = defaultdict(int)
        self._running_latency: dict[str, RequestState] = {}
        self._pending: list[Request] = []
        self._pending_pos = 0
        # True output lengths of the requests in the engine (dropped as each leaves: memory is
        # bounded by what is in flight).
        self._true_len: dict[str, int] = {}
        # Compound programs: dependants held until their parents finish (see module doc). Only
        # program members are remembered here.
        self._added: set[str] = set()
        self._finished_s: dict[str, float] = {}
        self._held: dict[str, Request] = {}
        self._unmet: dict[str, int] = {}
        self._ready_s: dict[str, float] = {}
        self._dependants: dict[str, list[str]] = defaultdict(list)
        # A cluster routes arrivals one at a time; this fence keeps a decode run from jumping past
        # the next arrival routed anywhere (it might come here).
        self.arrival_fence_s = math.inf
        self.recorder = Recorder(
            record_steps=self.config.record_steps,
            keep_token_times=self.config.keep_token_times,
            intake_delay_s=self.config.intake_delay_s,
        )
        # Async scheduling: the last step's sampled requests, delivered after the next is planned.
        # (when its output came, who sampled, its duration for the mean step time or None)
        self._in_flight: tuple[float, list[RequestState], float | None] | None = None
        self._placeholders: dict[str, int] = defaultdict(int)
        # Decision log (`EngineConfig.record_decisions`), in the live adapter's format.
        self.decisions: list[dict] | None = [] if self.config.record_decisions else None
        # This step's preemptions, told to the policy once the step is planned (after its
        # admissions, as the live adapter tells them); none of them is admitted again this step.
        self._preempted_step: list[RequestState] = []
        # A reset's preemptions (`reset_prefix_cache`), listed with the next step's; and those of
        # them whose token was in flight, dropped when it comes.
        self._reset_preempted: list[str] = []
        self._dropped_in_flight: set[str] = set()
        self._freed_since: list[str] = []
        self._queues: dict[str, list[str]] = {}
        # When every running decode got its last token, if all got it together at the end of the
        # last step (each then owes one token; the other running requests are prefilling):
        # `_running_decodes_plain`'s test. `_all_sampled_at`: the same, and no request is prefilling.
        self._decodes_sampled_at = -math.inf
        self._all_sampled_at = -math.inf
        # One decode-only step's time alone, where the cost model offers it (the roofline does):
        # short decode runs are then timed step by step in Python (`_short_run`).
        self._step_timer = getattr(cost, "decode_step_timer", None)
        self._arrival_overhead_s = float(cost.arrival_overhead_s)
        self._component_swaps: list[tuple[str, Any]] = []  # `use_component`, for the next step
        self._next_policy: Policy | None = None  # `switch_policy`, for the next step

    def reset_prefix_cache(self, preempt_running: bool = False, at: float | None = None) -> bool:
        """Forget every cached block, as vLLM's `reset_prefix_cache` does (an operator's call,
        e.g. after new weights). Like vLLM's, it needs every block free: False (nothing reset)
        while a request holds any, or without prefix caching.

        With `preempt_running` (vLLM's `reset_running_requests`) it first preempts every running
        request by recompute, the last of the running order first, as vLLM does: the policy hears
        of each at once (at `at`, default now), they may be admitted again in the very next step,
        whose record lists them as preempted, and under async scheduling a token still in flight
        for one is dropped when its step's output comes (vLLM's `drop_stale_output`), not
        delivered: the request computes it again."""
        if preempt_running and self.running:
            if at is not None:  # requests that reached the live engine before the reset: first
                self._admit_arrivals(until_s=at)
            for state in reversed(self.running):
                self._requeue(state)
                if self._placeholders.pop(state.id, 0):
                    self._dropped_in_flight.add(state.id)
                if self.decisions is not None:
                    self._reset_preempted.append(state.id)
                self.policy.on_preempt(state, self.now if at is None else at)
            self._decodes_sampled_at = self._all_sampled_at = -math.inf  # no decode run from here
        return self._prefix_cache is not None and self._prefix_cache.reset()

    def switch_policy(self, policy: Policy) -> None:
        """Serve a whole new policy from the next step on, handed over as `adapt serve` swaps one
        live (`PolicyScheduler._switch_policy`, at the start of `schedule()`): after that step's
        intake, every request in flight goes to it oldest first -- waiting ones as arrivals (a
        preempted one keeps its phase), running ones as arrivals then admissions -- and its token
        budget is the step's."""
        self._next_policy = policy

    def _hand_over(self, policy: Policy) -> None:
        policy.use_predictions(self._queues_opened_now)
        running = {state.id for state in self.running}
        for state in sorted([*self.waiting.values(), *self.running], key=lambda s: s.arrival_s):
            policy.on_arrival(state, state.arrival_s)
            if state.id in running:
                policy.on_admit(state, self.now)
        self.policy = policy
        self.token_budget = self._budget_of(policy)

    def _queues_opened_now(self, function: BatchFunction) -> PredictionQueue:
        """A queue of the engine's kind for a policy swapped in now: the requests in flight are
        handed to it with their arrival times, and their model calls count from now, as the live
        adapter's (`PolicyScheduler._prediction_queue`)."""
        queue = self._predictions(function)
        queue.opened_s = self.now
        return queue

    def _budget_of(self, policy: Policy) -> int:
        """A step's token budget under `policy`: its own (Sarathi's chunks) or the engine's."""
        return self.config.token_budget if policy.token_budget is None else policy.token_budget

    def use_component(self, attribute: str, component: Any) -> None:
        """Serve a new version of one of the policy's learned components from the next step on:
        handed to the policy after that step's intake and before its plan, where `adapt serve`
        applies a swap (at the start of vLLM's `schedule()`, after the requests that came during
        the last step were taken in -- and told to the policy -- under the old version)."""
        self._component_swaps.append((attribute, component))

    def abort(self, request_id: str, at: float | None = None) -> bool:
        """End a request that did not finish, between two steps, as vLLM's `finish_requests`
        does for its client's abort (a disconnect, a stop string its API server applies) or an
        error: out of its queue, its blocks freed (their cached content kept), recorded as
        dropped, reason "aborted" (not served: no metric counts it finished), and its policy told
        with no finish time (`on_finish`, as `PolicyScheduler._free_request` tells it). Requests
        that arrived by `at` (default now) enter first: they reached the live engine before it.
        A token still in flight for it is discarded when it comes. False if it is not here."""
        if at is not None:
            self._admit_arrivals(until_s=at)
        state = self.waiting.pop(request_id, None)
        if state is None:
            state = next((s for s in self.running if s.id == request_id), None)
            if state is None:
                return False
            self._leave_running(state)
        self._free_leaving(state)
        now = self.now if at is None else at
        state.phase = "finished"
        self.recorder.dropped(state, now, "aborted")
        self.policy.on_finish(state, now)
        self._parent_done(state.id, finished=False)
        self._decodes_sampled_at = self._all_sampled_at = -math.inf  # no decode run from here
        return True

    # ----------------------------------------------------------------- arrivals
    def add(self, request: Request) -> None:
        """Queue a future arrival; requests must be added in arrival order. A dependant (a request
        with parents) is held until its parents finish; its own `arrival_s` is then ignored, but
        its parents must have been added before it. Each reaches the engine
        `config.intake_delay_s` after it arrives."""
        self._check_block_keys(request)
        parents = request.program.parent_ids if request.program is not None else ()
        if parents:
            self._hold(request, parents)
            return
        if self.config.intake_delay_s:
            request = dataclasses.replace(request, arrival_s=request.arrival_s + self.config.intake_delay_s)
        if self._pending and request.arrival_s < self._pending[-1].arrival_s:
            raise ValueError(f"{request.request_id}: requests must be added in arrival order")
        if request.program is not None:
            self._added.add(request.request_id)
        self._pending.append(request)

    def _hold(self, request: Request, parents: Sequence[str]) -> None:
        rid = request.request_id
        unknown = [p for p in parents if p not in self._added]
        if unknown:
            raise ValueError(f"{rid}: parent(s) {', '.join(unknown)} not added before it")
        self._added.add(rid)
        self._held[rid] = request
        self._unmet[rid] = 0
        self._ready_s[rid] = 0.0
        for parent in parents:
            if parent in self._finished_s:
                self._ready_s[rid] = max(self._ready_s[rid], self._finished_s[parent])
            else:
                self._unmet[rid] += 1
                self._dependants[parent].append(rid)
        if self._unmet[rid] == 0:
            self._release(rid)

    def _release(self, rid: str) -> None:
        """All parents finished: the dependant arrives after its tool time (and reaches the engine
        after the intake delay)."""
        request = self._held.pop(rid)
        arrival = max(self._ready_s.pop(rid), self.now) + request.program.after_parents_s  # type: ignore[union-attr]
        arrival += self.config.intake_delay_s
        del self._unmet[rid]
        released = dataclasses.replace(request, arrival_s=arrival)
        bisect.insort(self._pending, released, lo=self._pending_pos, key=lambda r: r.arrival_s)

    def _parent_done(self, parent: str, finished: bool) -> None:
        """A parent finished (or was dropped): release or drop the dependants waiting on it."""
        if finished and parent in self._added:
            self._finished_s[parent] = self.now
        for rid in self._dependants.pop(parent, ()):
            if rid not in self._held:
                continue
            if not finished:
                self._drop_held(rid, f"parent {parent} dropped")
                continue
            self._ready_s[rid] = max(self._ready_s[rid], self.now)
            self._unmet[rid] -= 1
            if self._unmet[rid] == 0:
                self._release(rid)

    def _drop_held(self, rid: str, reason: str) -> None:
        request = self._held.pop(rid)
        del self._unmet[rid], self._ready_s[rid]
        # Never sent (its program ended): recorded as arriving now, as the recorder reads arrivals.
        arrival = max(self.now, request.arrival_s) + self.config.intake_delay_s
        state = self._state_for(dataclasses.replace(request, arrival_s=arrival))
        self.recorder.arrived(state, request.output_tokens)
        self.recorder.dropped(state, self.now, reason)
        self._parent_done(rid, finished=False)

    def drop_unreleased(self, reason: str = "parents never finished") -> None:
        """Report dependants still held when the replay ends (their parents never completed)."""
        for rid in list(self._held):
            if rid in self._held:
                self._drop_held(rid, reason)

    @property
    def next_arrival_s(self) -> float:
        return (
            self._pending[self._pending_pos].arrival_s if self._pending_pos < len(self._pending) else math.inf
        )

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight or self._pending_pos < len(self._pending))

    @property
    def outstanding(self) -> int:
        """Requests in the engine or routed to it but not yet arrived (for least-outstanding routing)."""
        return (
            len(self.waiting) + len(self.running) + len(self._pending) - self._pending_pos + len(self._held)
        )

    def _admit_arrivals(self, until_s: float | None = None) -> int:
        """Every request that has arrived by now (or `until_s`) enters the engine; returns how many."""
        first, until_s = self._pending_pos, self.now if until_s is None else until_s
        while (
            self._pending_pos < len(self._pending) and self._pending[self._pending_pos].arrival_s <= until_s
        ):
            request = self._pending[self._pending_pos]
            self._pending_pos += 1
            self._arrive(request)
        return self._pending_pos - first

    def _state_for(self, request: Request) -> RequestState:
        return RequestState(
            request.request_id,
            request.arrival_s,
            request.prompt_tokens,
            request.max_tokens or self.config.max_model_len - request.prompt_tokens,
            request.slo,
            request.prompt_text,
            request.program,
            request.label,
            request.prompt_embedding,
        )

    def _arrive(self, request: Request) -> None:
        state = self._state_for(request)
        if self.policy.needs_oracle:
            state.oracle_output_tokens = request.output_tokens
        self._true_len[state.id] = request.output_tokens
        self.recorder.arrived(state, request.output_tokens)
        too_long = request.prompt_tokens + request.output_tokens > self.config.max_model_len
        if too_long or self.kv.blocks_for(request.prompt_tokens + request.output_tokens) > self.kv.num_blocks:
            reason = "longer than max_model_len" if too_long else "larger than the whole KV cache"
            self.recorder.dropped(state, self.now, reason)
            del self._true_len[state.id]
            self._parent_done(state.id, finished=False)
            return
        if self._prefix_cache is not None:
            keys = request.prompt_blocks + request.answer_blocks
            self._prefix_cache.register(state.id, keys, reads=not request.skip_reading_prefix_cache)
        self.waiting[state.id] = state
        self.policy.on_arrival(state, self.now)

    def _check_block_keys(self, request: Request) -> None:
        """With prefix caching on, a request's content keys must fit its full blocks at this
        engine's block size: keys a log wrote with another block size would name other content,
        and answer keys only line up after a key for every full prompt block. (Without it they
        are not read.)"""
        if not self.config.prefix_caching:
            return
        full_prompt = request.prompt_tokens // self.config.block_size
        if len(request.prompt_blocks) > full_prompt:
            raise ValueError(
                f"{request.request_id}: {len(request.prompt_blocks)} prompt block keys for "
                f"{request.prompt_tokens} tokens, which fill {full_prompt} blocks of "
                f"{self.config.block_size} (keys made with another block size?)"
            )
        if not request.answer_blocks:
            return
        full = (request.prompt_tokens + request.output_tokens) // self.config.block_size
        if (
            len(request.prompt_blocks) < full_prompt
            or len(request.prompt_blocks) + len(request.answer_blocks) > full
        ):
            raise ValueError(
                f"{request.request_id}: answer block keys need one key per full prompt block "
                f"({full_prompt}, got {len(request.prompt_blocks)}) and at most "
                f"{full - full_prompt} of their own (got {len(request.answer_blocks)})"
            )

    # ----------------------------------------------------------------- one step
    def step(self, trace: TraceStep | None = None) -> None:
        """Run one scheduling step (or a run of identical decode steps), advancing `now`. With
        `trace`, the step starts when and as the live engine's did, and never waits."""
        if trace is not None:
            self.now, self.step_index = trace.at, trace.index
        elif not self.waiting and not self.running and not self._in_flight:
            self.now = max(self.now, self.next_arrival_s)
        arrived = self._admit_arrivals()
        if arrived and trace is None:  # their intake runs before this step (a trace's time has it)
            self.now += arrived * self._arrival_overhead_s
        if self._next_policy is not None:
            self._hand_over(self._next_policy)
            self._next_policy = None
        for attribute, component in self._component_swaps:
            self.policy.use_component(attribute, component)
        self._component_swaps.clear()
        if not self.waiting and not self.running and not self._in_flight:
            if trace is not None and self.decisions is not None:
                self._queues = {"running": [], "waiting": []}
                self._record_decision(trace.index, [])
            return
        view = EngineView(
            self.now,
            self._waiting_view,
            self.running,
            self.kv.usage,
            self.token_budget,
            self.config.max_running,
            self.mean_batch_time,
            self.step_index,
            self.kv.free_blocks,
            self.kv.block_size,
        )
        if self.decisions is not None:
            self._queues = {"running": [r.id for r in self.running], "waiting": list(self.waiting)}
        plan = self.policy.on_step(view)
        if trace is None and self._running_decodes_plain(plan):
            if self._all_sampled_at == self.now and (
                not self.waiting or plan.admit is None or self._admits_nothing(plan)
            ):
                if self._decode_run(view, plan.running_order):
                    return
            elif self._bulk_decode_step(plan):
                return
        scheduled, changed = self._schedule(plan)
        if self.decisions is not None:
            self._record_decision(trace.index if trace is not None else self.step_index, scheduled)
        self._tell_preempted()
        previous, self._in_flight = self._in_flight, None
        if scheduled or trace is not None:
            self._execute(scheduled, trace)
        elif previous is not None:  # vLLM counts the empty schedule() it makes while a batch is in flight
            self.step_index += 1
        delivered = self._deliver(previous)
        if trace is None and not scheduled and not changed and not delivered:
            self._idle(view)

    def _running_decodes_plain(self, plan: Plan) -> bool:
        """Whether this step's running requests are plain decodes: every one sampled a token at
        the end of the last step (so each is a decode owing one token), and the plan drops,
        preempts and defers nothing. If no time passed since (no intake, no idling) and it admits
        nothing either, the step opens a decode run (more than half of the engine's steps on a
        busy trace); otherwise the decodes are still taken in bulk (`_bulk_decode_step`: most
        other steps)."""
        if (
            not self.config.skip_decode_runs
            or self.config.async_scheduling
            or self.decisions is not None
            or not self.running
            or self._decodes_sampled_at == -math.inf
            or plan.drop
            or plan.preempt
        ):
            return False
        running = self.running
        if plan.defer and not plan.defer.isdisjoint(running):
            return False
        order = plan.running_order
        return order is None or order == running or set(order).issuperset(running)  # else it defers some

    def _admits_nothing(self, plan: Plan) -> bool:
        """Whether `_admit` would admit nothing after this step's decodes (one token each) took
        their blocks: the running cap is reached, or the first request of the plan's order still
        waiting does not fit (the head-of-line rule). Reads the plan's order as far as that first
        request and puts back what it read (the order may be a one-pass iterator)."""
        running = self.running
        if self.config.max_running - len(running) <= 0:
            return True
        if self.policy.prefill_first:  # it admits before the decodes, with the whole budget
            return False
        budget = self.token_budget - len(running)
        if budget <= 0:
            return True
        candidates = iter(plan.admit)  # type: ignore[arg-type]
        read: list[RequestState] = []
        head = None
        for state in candidates:
            read.append(state)
            if self.waiting.get(state.id) is state:
                head = state
                break
        if candidates is plan.admit:  # a one-pass iterator: hand `_admit` what was read, too
            plan.admit = itertools.chain(read, candidates)
        if head is None:
            return True
        if self._prefix_cache is not None and self._prefix_cache.lookup(head.id, head.tokens_to_compute):
            return False  # its hits may be free blocks the decodes take: `_admit` will see
        need = head.tokens_to_compute
        fits = need if self.config.reserve_full_sequence else min(need, budget)
        kv = self.kv
        extra, free = kv.extra_blocks(head.id, fits), kv.free_blocks
        if extra > free or extra <= free - len(running):  # whatever the decodes take
            return extra > free
        held, block_size = kv.held_by_request.get, kv.block_size
        for state in running:
            if held(state.id, 0) * block_size <= state.tokens_computed:
                free -= 1  # its decode takes a new block
        return extra > free

    def _record_decision(self, index: int, scheduled: list[tuple[RequestState, int]]) -> None:
        self.decisions.append(  # type: ignore[union-attr]
            {
                "index": index,
                "t": self.now,
                "scheduled": {state.id: n for state, n in scheduled},
                "preempted": sorted([*self._reset_preempted, *(state.id for state in self._preempted_step)]),
                "freed": sorted(self._freed_since),
                **self._queues,
            }
        )
        self._freed_since, self._reset_preempted = [], []

    def _note_freed(self, state: RequestState) -> None:
        if self.decisions is not None:  # only a decision log reads these; they are reset per step
            self._freed_since.append(state.id)

    def _idle(self, view: EngineView) -> None:
        """Nothing could be scheduled: wait for the next arrival or the policy's wake-up time, or
        up to the arrival fence, where a driver (`Cluster`, `run_with_checkpoints`) may hand this
        engine an arrival it does not know of yet (a live engine would see it there)."""
        wake = min(self.next_arrival_s, self.arrival_fence_s, self.policy.horizon(view).until_s)
        if not math.isfinite(wake) or wake <= self.now:
            raise PolicyError(
                f"policy {self.policy.name!r} scheduled nothing at t={self.now:.3f}s with "
                f"{len(self.waiting)} waiting / {len(self.running)} running and no future event"
            )
        self.now = wake

    def _schedule(self, plan: Plan) -> tuple[list[tuple[RequestState, int]], bool]:
        """Apply the plan. Returns the (request, tokens) pairs to compute this step, and whether
        any request changed queues (drop or preemption: re-plan at once even if nothing runs)."""
        changed = False
        for state in plan.drop:
            if state in self.running:
                raise running_drop(self.policy.name, state.id)
        for state in plan.drop:
            if self.waiting.pop(state.id, None) is not None:
                self.recorder.dropped(state, self.now, "admission control")
                del self._true_len[state.id]
                if self._prefix_cache is not None:
                    self._prefix_cache.forget(state.id)
                self._note_freed(state)
                state.phase = "finished"
                self.policy.on_finish(state, self.now)
                self._parent_done(state.id, finished=False)
                changed = True
        for state in plan.preempt:
            if state in self.running:
                self._preempt(state)
                changed = True
        if self.policy.prefill_first and plan.admit is not None:
            admitted = self._admit(plan, self.token_budget, chunked=False)
            if admitted:
                return admitted, changed
        budget = self.token_budget
        scheduled: list[tuple[RequestState, int]] = []
        if plan.running_order is not None:
            running = set(self.running)
            sequence = [r for r in dict.fromkeys(plan.running_order) if r in running]
        elif plan.defer:
            sequence = [r for r in self.running if r not in plan.defer]
        else:
            sequence = list(self.running)
        if self.decisions is not None:
            self._queues["order"] = [r.id for r in sequence]
        budget, preempted_now = self._schedule_running(sequence, budget, scheduled)
        if plan.admit is not None and not preempted_now and budget > 0:
            scheduled.extend(self._admit(plan, budget, chunked=True))
        return scheduled, changed or preempted_now

    def _last_token_in_flight(self, state: RequestState) -> bool:
        """Async scheduling: whether the token in flight is the request's `max_tokens`-th, so
        vLLM skips it. A stop token (an EOS) comes unannounced: vLLM schedules one more decode
        for that request before the stop reaches it, and so does this engine."""
        placeholder = self._placeholders.get(state.id, 0)
        return placeholder > 0 and state.tokens_generated + placeholder >= state.max_tokens

    def _schedule_running(
        self,
        sequence: list[RequestState],
        budget: int,
        scheduled: list[tuple[RequestState, int]],
    ) -> tuple[int, bool]:
        """Give running requests their next tokens in `sequence` order under the budget. When KV
        blocks run out, the last request of `sequence` not yet scheduled is preempted by
        recompute (possibly the request itself, which ends the pass), as vLLM does with its
        running list."""
        preempted = False
        placeholders = self._placeholders  # empty unless async scheduling has tokens in flight
        try_grow = self.kv.try_grow
        held = self.kv.held_by_request.get
        block_size = self.kv.block_size
        index = 0
        while index < len(sequence) and budget > 0:
            state = sequence[index]
            index += 1
            computed = state.tokens_computed
            need = state.prompt_tokens + state.tokens_generated - computed  # tokens_to_compute, inlined
            if placeholders:
                if self._last_token_in_flight(state):
                    continue  # vLLM's async rule: no step past the last token
                need += placeholders.get(state.id, 0)
            tokens = need if need < budget else budget
            target = computed + tokens
            if held(state.id, 0) * block_size < target:  # `try_grow`'s test: most steps need no block
                while not try_grow(state.id, target):
                    victim = sequence.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is state:
                        return budget, preempted
            if self._prefix_cache is not None:
                self._prefix_cache.cache(state.id, min(target, state.prompt_tokens + state.tokens_generated))
            scheduled.append((state, tokens))
            budget -= tokens
        return budget, preempted

    def _admit(self, plan: Plan, budget: int, *, chunked: bool) -> list[tuple[RequestState, int]]:
        """Admit waiting requests in the plan's order while the running cap, the budget and free
        KV blocks allow; stop at the first that does not fit (vLLM's head-of-line rule). A
        request is admitted only if its whole known sequence fits in the free blocks
        (`reserve_full_sequence`, vLLM's default), though only its first chunk is allocated; one
        still waiting for a token from before its preemption sits this step out, and so does one
        preempted in this very step (vLLM's adapter holds it out too).
        `chunked=False` is vLLM V0's prefill-first mode: whole prompts only (the first one even if
        it exceeds the budget), and such a step runs nothing but those prefills."""
        admitted: list[tuple[RequestState, int]] = []
        kv = self.kv
        room = self.config.max_running - len(self.running)
        preempted = {state.id for state in self._preempted_step}
        taken: set[str] = set()  # a plan that lists a request twice admits it once, as live
        for state in plan.admit or ():
            if room <= 0 or budget <= 0:
                break
            if (
                self.waiting.get(state.id) is not state
                or self._placeholders.get(state.id, 0)
                or state.id in preempted  # preempted this step: back in the queue next step
                or state.id in taken
            ):
                continue
            taken.add(state.id)
            # With prefix caching, it first takes the cached blocks its tokens match (vLLM's
            # `get_computed_blocks`, then `allocate_slots`); a resumed request's output counts.
            hits = kv.lookup(state.id, state.prompt_tokens + state.tokens_generated)
            cached = len(hits) * kv.block_size
            need = state.tokens_to_compute - cached
            tokens = min(need, budget) if chunked else need
            fits = need if self.config.reserve_full_sequence else tokens
            if (tokens > budget and admitted) or not kv.fits(state.id, hits, cached + fits):
                break
            kv.adopt(state.id, hits)
            kv.grow(state.id, cached + tokens)
            kv.cache(state.id, cached + tokens)
            state.tokens_computed += cached
            admitted.append((state, tokens))
            budget -= tokens
            room -= 1
        for state, _ in admitted:
            del self.waiting[state.id]
            state.phase = "prefill"
            self._join_running(state)
            self.policy.on_admit(state, self.now)
        return admitted

    def _join_running(self, state: RequestState) -> None:
        self.running.append(state)
        self._running_labels[state.label] += 1
        if state.slo.kind == "latency":
            self._running_latency[state.id] = state

    def _leave_running(self, state: RequestState) -> None:
        self.running.remove(state)
        self._running_labels[state.label] -= 1
        self._running_latency.pop(state.id, None)

    def _preempt(self, state: RequestState) -> None:
        """Preempt within a step: the policy hears of it once the step is planned (`_tell_preempted`)."""
        self._requeue(state)
        self._preempted_step.append(state)

    def _requeue(self, state: RequestState) -> None:
        """A running request preempted by recompute: its blocks freed, back in the waiting queue."""
        self._leave_running(state)
        self.kv.release(state.id)
        state.tokens_computed = 0
        state.phase = "preempted"
        state.num_preemptions += 1
        self.recorder.preempted(state)
        self.waiting[state.id] = state

    def _tell_preempted(self) -> None:
        """`on_preempt` for this step's preemptions, in the order they happened, after the step's
        admissions were told: vLLM's adapter learns of both only when vLLM's `schedule()` returns,
        so a policy whose admission order is read lazily would otherwise see its victim waiting
        again in replay and not live."""
        preempted, self._preempted_step = self._preempted_step, []
        for state in preempted:
            self.policy.on_preempt(state, self.now)

    def _execute(self, scheduled: list[tuple[RequestState, int]], trace: TraceStep | None = None) -> None:
        """Time the step (the cost model, or the live step's duration) and apply its effects:
        at its end, or -- async scheduling -- after the next step is planned (`_deliver`)."""
        asynchronous = self.config.async_scheduling
        placeholders = self._placeholders
        work = []  # what is not a plain decode, for `step_batch`; decodes are counted in bulk
        context_sum = context_max = 0
        sampled_states = []
        for state, n in scheduled:
            computed = state.tokens_computed
            need = state.prompt_tokens + state.tokens_generated - computed  # tokens_to_compute
            if placeholders:
                need += placeholders.get(state.id, 0)
            sampled = n == need  # all known tokens done: it samples one
            if n == 1 and state.phase == "decode":
                context_sum += computed
                if computed > context_max:
                    context_max = computed
            else:
                work.append((n, computed, False, sampled))
            state.tokens_computed = computed + n
            if sampled:
                sampled_states.append(state)
        # Decodes counted from what is not one (fewer operations per decode, most of a step).
        decodes = len(scheduled) - len(work)
        decode_samples = len(sampled_states) - sum(sampled for _, _, _, sampled in work)
        base = step_batch(work) if work else _NO_WORK
        batch = _with_decodes(base, decodes, decode_samples, context_sum, context_max)
        duration = trace.duration if trace is not None else float(self.cost.time(batch))
        start = self.now
        self.now = start + duration
        if trace is None:
            self.step_index += 1
        if scheduled:
            self.recorder.step(start, duration, batch, self.kv.usage)
        output_at = trace.output_at if trace is not None and trace.output_at is not None else self.now
        # The mean step time takes in a step that ran tokens, from its start until its output
        # came (a live gap to the next step would add idle time, or vLLM's empty steps), when
        # that output comes: at once here, with the tokens under async scheduling (`_deliver`).
        sample = output_at - start if scheduled else None
        if sample is not None and not asynchronous:
            self._note_batch_time(sample)
        everyone_sampled = len(sampled_states) == len(self.running) and not asynchronous
        self._all_sampled_at = output_at if everyone_sampled else -math.inf
        if asynchronous:
            self._decodes_sampled_at = -math.inf
            for state in sampled_states:
                placeholders[state.id] += 1
            self._in_flight = (output_at, sampled_states, sample)
        else:
            self._emit_tokens(sampled_states, output_at)
            decodes_sampled = everyone_sampled or all(
                state.last_token_s == output_at for state in self.running if state.phase == "decode"
            )
            self._decodes_sampled_at = output_at if decodes_sampled else -math.inf

    def _deliver(self, previous: tuple[float, list[RequestState], float | None] | None) -> bool:
        """Async scheduling: the previous step's tokens reach the scheduler once this step is
        scheduled (stamped with when that step's output came), and its duration the mean step
        time. True if any token did."""
        if previous is None:
            return False
        output_at, states, sample = previous
        if sample is not None:
            self._note_batch_time(sample)
        cache = self._prefix_cache
        dropped = self._dropped_in_flight
        for state in states:
            if state.id in dropped:  # preempted by a reset while this token was in flight
                dropped.discard(state.id)
                continue
            if state.phase != "finished":  # else a token sampled after its stop: vLLM drops it
                self._placeholders[state.id] -= 1
                if cache is not None and state.phase != "preempted":
                    # vLLM's `AsyncScheduler` caches what is computed and no longer in flight as
                    # each output comes, before a request that ends with it is freed.
                    cache.cache(state.id, state.tokens_computed - self._placeholders[state.id])
                self._emit_tokens([state], output_at)
        return bool(states)

    def _note_batch_time(self, duration: float) -> None:
        self._note_batch_times((duration,))

    def _note_batch_times(self, durations: Iterable[float]) -> None:
        """The moving average of step durations (`EngineView.mean_batch_time_s`), fed the steps
        of a step or a run in turn; the live adapter keeps the same one (`_note_step_output`)."""
        alpha, mean = self.config.batch_time_ema, self.mean_batch_time
        for duration in durations:
            mean = duration if mean == 0 else ((1 - alpha) * mean + alpha * duration)
        self.mean_batch_time = mean

    def _emit_tokens(self, states: list[RequestState], now: float) -> None:
        """Each of `states` gets its next output token at `now`; finished ones leave, in order."""
        self.recorder.tokens(states, now)
        true_len = self._true_len
        for state in states:
            generated = state.tokens_generated + 1
            state.tokens_generated = generated
            state.last_token_s = now
            if state.first_token_s is None:
                state.first_token_s = now
            if state.phase != "preempted":
                state.phase = "decode"
            if generated >= true_len[state.id]:
                self._finish(state, now)

    def _free_leaving(self, state: RequestState) -> None:
        """What a request that leaves the engine for good (finished or aborted) holds: its blocks
        (their cached content kept), its token in flight, its true length; noted as freed."""
        self.kv.release(state.id)
        if self._prefix_cache is not None:
            self._prefix_cache.forget(state.id)
        self._placeholders.pop(state.id, None)
        del self._true_len[state.id]
        self._note_freed(state)

    def _finish(self, state: RequestState, now: float) -> None:
        if state.phase == "preempted":  # its last token was in flight when it was preempted
            del self.waiting[state.id]
        else:
            self._leave_running(state)
        self._free_leaving(state)
        state.finish_s = now
        state.phase = "finished"
        self.recorder.finished(state)
        self.policy.on_finish(state, now)
        self._parent_done(state.id, finished=True)

    # ------------------------------------------------------------ fast path
    def _bulk_decode_step(self, plan: Plan) -> bool:
        """Take a step whose running decodes are plain (`_running_decodes_plain`) but which is no pure
        decode run -- it admits, continues a chunked prefill, or comes after an intake or a wait:
        the step after almost every arrival -- as `_schedule` and `_execute` would, with the
        decodes counted, advanced and recorded in bulk as a one-step decode run is (`_advance`)
        and only the prefills one by one. False (nothing done) when that could differ from
        scheduling request by request: a prefill ordered before a decode, a budget the decodes
        exhaust, or a KV shortfall (a preemption)."""
        if self.policy.prefill_first:
            return False
        running = self.running
        order = plan.running_order
        if order is None or order == running:
            sequence = running
        else:
            members = set(running)
            sequence = [r for r in dict.fromkeys(order) if r in members]
        kv = self.kv
        prefills: list[RequestState] = []
        context_sum, context_max, growing = self._gather_bulk(sequence, prefills)
        if growing is None:
            return False
        decodes = sequence[: len(sequence) - len(prefills)]  # the prefills follow every decode
        budget = self.token_budget - len(decodes)
        if budget < 0:
            return False  # some decodes would wait for a later step
        chunks: list[tuple[RequestState, int]] = []
        blocks = len(growing)
        for state in prefills:
            if budget <= 0:
                break
            need = state.tokens_to_compute
            tokens = need if need < budget else budget
            blocks += kv.extra_blocks(state.id, state.tokens_computed + tokens)
            chunks.append((state, tokens))
            budget -= tokens
        if blocks > kv.free_blocks:
            return False
        # The decodes by class (a copy: admissions are about to join the running).
        counts = self._running_labels.copy()
        for state in prefills:
            counts[state.label] -= 1
        latency = [s for s in self._running_latency.values() if s.phase == "decode"]
        cache = self._prefix_cache
        for state in growing:
            kv.grow(state.id, state.tokens_computed + 1)
        if cache is not None:  # as vLLM caches them when scheduled: before this step's admissions look
            for state in decodes:
                cache.cache(state.id, state.tokens_computed + 1)
        for state, tokens in chunks:
            kv.grow(state.id, state.tokens_computed + tokens)
            if cache is not None:
                cache.cache(state.id, state.tokens_computed + tokens)
        admitted = self._admit(plan, budget, chunked=True) if plan.admit is not None and budget > 0 else []
        chunks.extend(admitted)
        work, sampled = [], []
        for state, n in chunks:
            computed = state.tokens_computed
            samples = n == state.prompt_tokens + state.tokens_generated - computed
            work.append((n, computed, False, samples))
            state.tokens_computed = computed + n
            if samples:
                sampled.append(state)
        count = len(decodes)
        batch = _with_decodes(step_batch(work) if work else _NO_WORK, count, count, context_sum, context_max)
        duration = float(self.cost.time(batch))
        start = self.now
        self.now = now = start + duration
        self._note_batch_time(duration)
        self.step_index += 1
        self.recorder.step(start, duration, batch, kv.usage)
        # Each decode's gap runs from its last token, when every decode sampled (before any wait).
        self.recorder.run_tokens(counts, latency, [now - self._decodes_sampled_at], [now])
        self._advance(decodes, 1, now, order)
        if sampled:
            self._emit_tokens(sampled, now)
        self._decodes_sampled_at = now
        everyone_sampled = len(sampled) == len(prefills) + len(admitted)
        self._all_sampled_at = now if everyone_sampled else -math.inf
        return True

    def _gather_bulk(
        self, sequence: list[RequestState], prefills: list[RequestState]
    ) -> tuple[int, int, list[RequestState] | None]:
        """`_bulk_decode_step`'s pass over the running requests in `sequence` order: the decodes'
        summed and largest contexts, the decodes whose token starts a block (None: the step
        cannot be taken in bulk), and -- into `prefills` -- the requests still prefilling."""
        held, block_size = self.kv.held_by_request.get, self.kv.block_size
        context_sum = context_max = 0
        growing: list[RequestState] = []
        for state in sequence:
            computed = state.tokens_computed
            if state.phase != "decode":
                prefills.append(state)
                continue
            if prefills:
                return 0, 0, None  # a prefill before this decode might take the budget it needs
            context_sum += computed
            if computed > context_max:
                context_max = computed
            room = held(state.id, 0) * block_size - computed
            if room <= 0:
                if room < 0:
                    return 0, 0, None  # fewer blocks than cached tokens (a KV-capacity override)
                growing.append(state)
        return context_sum, context_max, growing

    def _decode_run(self, view: EngineView, order: list[RequestState] | None = None) -> int:
        """Take the step planned from `view` -- plain decodes only (`_running_decodes_plain`), admitting
        nothing -- and the longest run of identical steps after it (see module doc) at once;
        return how many steps that was. The planned step runs whatever the walls (the next
        arrival, the policy's horizon), as it would alone; 0 (nothing done) if the KV blocks it
        needs are not free: it is then scheduled one by one, preempting. `order`: the plan's
        running order, which requests finishing together leave in (`_advance`)."""
        horizon = self.policy.horizon(view)
        running = self.running
        # A plan that holds across arrivals runs past them when their intake takes no time.
        past_arrivals = horizon.past_arrivals and self._arrival_overhead_s == 0.0
        wall = min(math.inf if past_arrivals else self.next_arrival_s, self.arrival_fence_s, horizon.until_s)
        steps = 1 + max(0, horizon.steps)  # the most the policy's plan allows
        # One pass over the running requests gathers what both paths need (this is the hot loop).
        gathered = _gather(running, self._true_len, self.kv, int(min(steps, SHORT_RUN_STEPS)))
        remaining, together = gathered.remaining, gathered.together
        limit = min(remaining, steps)
        if together > 1 and order is not None and remaining > 1:
            # Requests finishing in one step leave in that step's running order, which the policy
            # may have changed by then: that step is planned afresh.
            limit = min(limit, remaining - 1)
        threshold = horizon.kv_usage_below if view.kv_usage < horizon.kv_usage_below else math.inf
        if self._step_timer is not None and not gathered.overdrawn:
            taken = self._short_run(limit, wall, threshold, gathered, order)
            if taken is not None:
                return taken
        computed = np.fromiter((s.tokens_computed for s in running), dtype=np.int64, count=len(running))
        context_sum, context_max = gathered.context_sum, gathered.context_max
        times = self.cost.decode_run_times(len(running), context_sum, context_max, int(limit))
        # Step by step, as `_execute` adds each duration to `now` (now + cumsum(times) would round
        # differently and move a run's end across an arrival).
        ends = np.cumsum(np.concatenate(([self.now], times)))[1:]
        starts = np.concatenate(([self.now], ends[:-1]))
        k = max(int(np.searchsorted(starts, wall, side="left")), 1)
        # KV room last: the run is usually cut short by the next arrival, and this check's cost
        # grows with the steps it looks at (each step's times do not depend on the run's length).
        ids = [s.id for s in running]
        held = self.kv.held_many(ids)
        k = self._kv_step_limit(computed, held, k, threshold)
        if k < 1:
            return 0
        times, ends = times[:k], ends[:k]
        self.kv.grow_many(ids, held, computed + k)
        return self._end_run(times.tolist(), ends, order, gathered)

    def _short_run(
        self,
        limit: float,
        wall: float,
        threshold: float,
        gathered: _Gathered,
        order: list[RequestState] | None,
    ) -> int | None:
        """`_decode_run` in plain Python for a run of at most `SHORT_RUN_STEPS` steps (most runs:
        the next arrival is a few steps away, and SLAI's horizon is one step), where numpy's fixed
        cost per call outweighs the work. The same arithmetic, step by step: each step's time
        from the cost model's `decode_step_timer`, `now` advanced by each in turn, and the KV test
        of `_kv_step_limit` -- within `block_size` steps a request needs at most one more block,
        from the step at which its tokens pass its blocks (`new_blocks` and `near`, gathered by
        `_decode_run`). The first step runs whatever the walls. Returns the steps taken, or None
        (nothing done) when the run may be longer than this path looks."""
        running, kv = self.running, self.kv
        reach = int(min(limit, SHORT_RUN_STEPS, kv.block_size))
        count, free, num_blocks = len(running), kv.free_blocks, kv.num_blocks
        new_blocks = gathered.new_blocks
        step_time = self._step_timer(count, gathered.context_sum, gathered.context_max)  # type: ignore[misc]
        times: list[float] = []
        ends: list[float] = []
        now, extra = self.now, 0
        for step in range(1, reach + 1):
            free_at_start = free - extra
            extra += new_blocks[step]
            if extra > free or (step > 1 and (now >= wall or 1.0 - free_at_start / num_blocks >= threshold)):
                break
            duration = step_time(step - 1)
            now = now + duration
            times.append(duration)
            ends.append(now)
        else:
            if reach < limit:
                return None
        k = len(times)
        if not k:
            return 0
        for state, room in gathered.near:
            if room < k:
                kv.grow(state.id, state.tokens_computed + k)
        return self._end_run(times, ends, order, gathered)

    def _end_run(
        self,
        times: Sequence[float],
        ends: Sequence[float],
        order: list[RequestState] | None,
        gathered: _Gathered,
    ) -> int:
        """What both forms of a decode run do once its `len(times)` steps are timed (ending at
        `ends`) and their KV blocks taken: count the steps, record them and their tokens, let in
        the arrivals it went past, and advance the running requests. Returns the steps."""
        k = len(times)
        self._note_batch_times(times)
        self.step_index += k
        self.now = now = float(ends[-1])
        # KV usage after the run's blocks are taken, as `_execute` records a step's.
        self.recorder.decode_run(
            self._running_labels,
            self._running_latency.values(),
            times,
            ends,
            self.kv.usage,
            gathered.context_sum,
            gathered.context_max,
        )
        self._arrive_during(ends[: k - 1])
        self._advance(self.running, k, now, order, gathered.remaining)
        return k

    def _arrive_during(self, starts: Sequence[float]) -> None:
        """The arrivals a decode run went past (`Horizon.past_arrivals`), `starts` being the starts
        of its steps after the first (ascending): each enters at the start of the first step at
        or after its arrival, as `_admit_arrivals` has it when stepping one at a time."""
        pending, end = self._pending, self.now
        while (
            self._pending_pos < len(pending)
            and len(starts)
            and pending[self._pending_pos].arrival_s <= starts[-1]
        ):
            request = pending[self._pending_pos]
            self.now = float(starts[bisect.bisect_left(starts, request.arrival_s)])
            self._pending_pos += 1
            self._arrive(request)
        self.now = end

    def _advance(
        self,
        running: list[RequestState],
        k: int,
        now: float,
        order: list[RequestState] | None,
        remaining: int = 0,
    ) -> None:
        """Every running request decoded `k` tokens, the last at `now`; finished ones leave, in
        the order the step scheduled them (`order`, else admission order), as `_emit_tokens`
        has them leave: a policy that learns from finished requests sees them in the same order.
        (Given a running order, requests finish together only in a run's first step, whose plan
        gave it: `_decode_run` stops a run before such a step.) `remaining`, when known: the
        fewest tokens any of them had left -- in fewer steps none finishes, and none is looked at
        for it."""
        self._all_sampled_at = self._decodes_sampled_at = now
        if self._prefix_cache is not None:
            # What the run's last step cached: every decode's tokens up to the one it computed
            # then (as `_schedule_running` caches each step), before any finished one is freed.
            for state in running:
                self._prefix_cache.cache(state.id, state.tokens_computed + k)
        if k < remaining:
            for state in running:
                state.tokens_computed += k
                state.tokens_generated += k
                state.last_token_s = now
            return
        true_len = self._true_len
        finished = []
        for state in running:
            state.tokens_computed += k
            state.tokens_generated += k
            state.last_token_s = now
            if state.tokens_generated >= true_len[state.id]:
                finished.append(state)
        if len(finished) > 1 and order is not None:
            position: dict[RequestState, int] = {}
            for index, state in enumerate(order):
                position.setdefault(state, index)
            finished.sort(key=position.__getitem__)
        for state in finished:
            self._finish(state, now)

    def _kv_step_limit(self, computed: np.ndarray, held: np.ndarray, limit: int, usage_below: float) -> int:
        """Largest k <= limit such that growing every context by k tokens fits in the free blocks
        and KV usage stays below `usage_below` at the start of every run step (the policy would
        re-plan once it is reached). Step j computes one more token for each request, so it needs
        room for computed + j, and starts with the blocks of steps 1..j-1 taken."""
        bs = self.kv.block_size
        free = self.kv.free_blocks
        j = np.arange(1, limit + 1)
        extra = np.maximum(0, -(-(computed[None, :] + j[:, None]) // bs) - held[None, :]).sum(axis=1)
        over = extra > free
        if math.isfinite(usage_below):
            free_at_start = free - np.concatenate(([0], extra[:-1]))
            over |= 1.0 - free_at_start / self.kv.num_blocks >= usage_below  # BlockPool.usage's formula
        stop = np.flatnonzero(over)
        return limit if len(stop) == 0 else int(stop[0])

    # ------------------------------------------------------------------ driver
    def run(self, requests: Sequence[Request], *, progress=None) -> ReplayResult:
        wall_start = time.perf_counter()
        for request in requests:
            self.add(request)
        last = 0
        while self.has_work:
            self.step()
            if progress is not None and self.recorder.done_count != last:
                progress(self.recorder.done_count - last)
                last = self.recorder.done_count
        self.drop_unreleased()
        return self.result(time.perf_counter() - wall_start)

    def result(self, sim_wall_s: float) -> ReplayResult:
        """What this replica recorded, with the engine settings and the policy parameters it ran
        under."""
        result = self.recorder.result(sim_wall_s)
        result.engine_settings = {"token_budget": self.token_budget, "max_running": self.config.max_running}
        result.policy_params = self.policy.describe()
        return result


class _Gathered(NamedTuple):
    """What a decode run (`ReplayEngine._decode_run`) needs to know of its decoding requests."""

    remaining: int  # the fewest tokens any has left (at most MAX_RUN_STEPS)
    together: int  # how many have that few left
    context_sum: int
    context_max: int
    # new_blocks[j]: requests whose step j of a run takes another block (j <= the gather's reach);
    # near: those requests, with their room (the tokens they can still cache in their blocks).
    new_blocks: list[int]
    near: list[tuple[RequestState, int]]
    overdrawn: bool  # a request with fewer blocks than cached tokens (a KV-capacity override)


def _gather(states: Sequence[RequestState], true_len: dict[str, int], kv: BlockPool, reach: int) -> _Gathered:
    """What a decode run of at most `reach` (<= SHORT_RUN_STEPS) steps in Python needs to know of
    its decoding `states`, in one pass (the hot loop): only requests that take a block within
    `reach` steps are `near` (a policy that re-plans every step keeps the list short)."""
    held, block_size = kv.held_by_request.get, kv.block_size
    remaining, together, context_sum, context_max = MAX_RUN_STEPS, 0, 0, 0
    new_blocks, near, overdrawn = [0] * (SHORT_RUN_STEPS + 1), [], False
    for state in states:
        rid, computed = state.id, state.tokens_computed
        left = true_len[rid] - state.tokens_generated
        if left < remaining:
            remaining, together = left, 1
        elif left == remaining:
            together += 1
        context_sum += computed
        if computed > context_max:
            context_max = computed
        room = held(rid, 0) * block_size - computed
        if room < reach:
            if room < 0:
                overdrawn = True
            else:
                new_blocks[room + 1] += 1
                near.append((state, room))
    return _Gathered(remaining, together, context_sum, context_max, new_blocks, near, overdrawn)


_NO_WORK = step_batch(())  # a step of plain decodes only: nothing but the decodes counted in bulk


def _with_decodes(
    batch: StepBatch, decodes: int, sampled: int, context_sum: int, context_max: int
) -> StepBatch:
    """`batch` (what `step_batch` made of a step's other work) plus `decodes` plain decodes, counted
    as `step_batch` counts them -- a token each, `sampled` of them sampling, their cached contexts
    summed and maxed -- but in bulk: they are most of a step's requests. Integer sums, so the
    features are the same numbers whatever the order."""
    return StepBatch(
        batch.tokens + decodes,
        batch.sampled + sampled,
        batch.prefill_attn_units,
        batch.prefill_kv_read,
        batch.num_decodes + decodes,
        batch.decode_ctx_sum + context_sum,
        max(batch.decode_ctx_max, context_max),
    )
