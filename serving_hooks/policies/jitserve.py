"""JITServe's GMAX scheduler: serve each request just in time for its SLO, favouring the most
goodput per unit of generation time (DESIGN.md section 4; paper section 4.2).

Per request r, with `len_rem` an upper bound on its remaining output (`qrf-length` for single
requests, `pattern-graph`'s stage bound for compound calls, the truth for `jitserve-oracle`) and
`v` the engine's mean time per decode step:

    t_gen(r)    = t_prefill(r) + len_rem(r) * v          (upper bound on the time it still needs)
    goodput(r)  = what finishing r on that schedule earns: latency -- the remaining tokens that can
                  still arrive by arrival + TTFT + i * TBT; deadline -- prompt + output tokens if
                  t_gen fits before the deadline, else 0; compound -- the same against the stage's
                  sub-deadline start + phi(s) * D (half when only the program's deadline is still
                  reachable); best effort -- prompt + output tokens;
                  plus `delta` per frame spent waiting, so nothing starves
    priority(r) = goodput(r) / t_gen(r)                 [optionally (1-f) * priority + f * fairness]

Every frame (`frame_steps` = 50 decode steps) GMAX re-plans over waiting and running requests:
keep the candidates whose priority is at least p times the B-th highest, sort them by input length,
and pick the window of B consecutive candidates with the largest priority sum (the batch: high
payoff, similar lengths). Waiting members of that batch are admitted first, the other waiting
requests after them by priority. With `preempt=True`, a running request outside the batch is
preempted for a waiting member only if the projected gain over a frame, (priority_in -
priority_out) * frame time, exceeds the stall its recompute causes (stall time * the batch's token
speed) plus the goodput the victim still expected. It is off by default: on `jitserve-mix` it fires
600-700 times per run and costs 17-32% of the goodput (the study's ablation), because preemption
here is by recompute and a conservative bound makes running requests look hopeless that would
have made it. The cutoff p is adapted
online by an epsilon-greedy bandit over `cutoffs`, rewarded with the frame's goodput as the metrics
count it: a latency request's tokens that came on time (token i by arrival + TTFT + i * TBT, as
the engine counts them), a deadline or compound request's tokens when it finishes in time.
Admission control drops requests never scheduled within `waiting_time_s` (reported as `dropped`,
never lost). Bounds are refreshed every `refine_every` generated tokens.

The forest is never called inside a scheduling step (`adapt.predictions`, as SageSched's
embeddings): a single request's `qrf-length` bound is asked when it arrives and, at a frame, when
its bound is `refine_every` tokens old, under the key "id@g"; in replay the asks since the last
step are predicted in one batch and handed over after the engine's prediction delay (by default at
once, before the step plans: the results of a forest called in the step), live in vLLM's engine
process by a background worker. Until a request's bound is handed over it keeps what it has -- its
previous bound counted down, or for a new request the online quantile -- marked `jit_prior` in its
cache; a waiting request is re-ranked when its bound comes, a running one uses it from the next
frame. Bounds are memoised by (prompt tokens, prompt text, g), filled only at hand-over, so what the
policy decides depends only on what was handed over and when: a trace-driven replay that hands each
bound over at the live step that got it decides as the live engine did. The pattern graph's stage
bound (a nearest-graph match once per compound call, ~0.2 ms) stays in the step.

The batch size B caps the running requests: a smaller batch decodes faster, which is what lets
the admitted requests meet TBTs and deadlines under overload. Its default, 48, was the best of
32/48/64 on `jitserve-mix` (llama-3-8b / A100, 2.0-3.0 req/s, seed 0); `None` means the engine's
`max_running`. JITServe runs under the engine's token budget, as every policy does in a comparison
(each workload sets one for all policies: `WorkloadSpec.token_budget`); `token_budget=N` gives it its
own, which the leaderboard then shows beside its name.

The arithmetic lives in `serving_hooks.policies.gmax` over numpy columns; this module keeps the
per-request state (bounds, sub-deadlines, the admission order) up to date.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from typing import Any, NamedTuple

import numpy as np
from sortedcontainers import SortedList

from adapt.component import registry_version
from adapt.policy import EngineView, Horizon, Plan, Policy, RequestState
from adapt.predictions import Delayed, PredictionQueue, QueueFactory
from serving_hooks.policies.gmax import KINDS, RequestTable, estimates, select_batch

DEFAULT_STEP_S = 0.03  # decode step time assumed before the engine has measured one
FALLBACK_QUANTILE_WINDOW = 4096
MEMO_SIZE = 50_000  # QRF bounds memoised by (prompt, generated count): repeated prompts are common
MAX_PROGRAMS = 10_000  # compound programs whose calls are remembered for pattern matching
_WAITING = ("waiting", "preempted")
FALLBACK_BOUND = "online-quantile"  # `length_bound`'s name for the bound no component made


class JITServe(Policy):
    """GMAX (see module docstring). `qrf` and `patterns` take a component instance or None (then an
    online empirical quantile of completed lengths stands in); `make_policy` loads a registry alias
    or `vN` given by name."""

    name = "jitserve"
    components = {"qrf": "qrf-length", "patterns": "pattern-graph"}  # noqa: RUF012
    alternatives = {"qrf": ("neural-length",)}  # noqa: RUF012  (the network bounds as the forest does)

    def __init__(
        self,
        qrf: Any = None,
        patterns: Any = None,
        quantile: float = 0.95,
        frame_steps: int = 50,
        batch_size: int | None = 48,
        cutoff: float = 0.95,
        cutoffs: tuple[float, ...] = (0.8, 0.9, 0.95, 1.0),
        explore: float = 0.1,
        delta: float = 8.0,
        waiting_time_s: float | None = 5.0,
        preempt: bool = False,
        prefill_tokens_per_s: float = 20000.0,
        fairness: float = 0.0,
        refine_every: int = 50,
        token_budget: int | None = None,
        seed: int = 0,
    ) -> None:
        if frame_steps < 1 or refine_every < 1:
            raise ValueError("frame_steps and refine_every: must be >= 1")
        if not 0 < cutoff <= 1 or any(not 0 < c <= 1 for c in cutoffs):
            raise ValueError("cutoff(s): must be in (0, 1]")
        if not 0 <= fairness <= 1:
            raise ValueError(f"fairness: must be in [0, 1], got {fairness}")
        _check_part("qrf", qrf, ("predict_bound",), "qrf-length or neural-length")
        _check_part("patterns", patterns, ("stage_share", "stage_output_bound"), "pattern-graph")
        _check_bound_source(qrf)
        self.qrf = qrf
        if getattr(qrf, "name", None) in self.alternatives["qrf"]:  # follow (and report) that name
            self.components = {**self.components, "qrf": qrf.name}
        self.patterns = patterns
        self.quantile = quantile
        self.frame_steps = int(frame_steps)
        self.batch_size = batch_size
        self.cutoffs = tuple(cutoffs) if cutoffs else (cutoff,)
        self.cutoff = cutoff
        self.explore = explore
        self.delta = delta
        self.waiting_time_s = waiting_time_s
        self.preempt = preempt
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.fairness = fairness
        self.refine_every = int(refine_every)
        self.token_budget = token_budget
        self._rng = np.random.default_rng(seed)
        self._table = RequestTable()
        self._requests: dict[str, RequestState] = {}
        self._unscored: list[RequestState] = []
        self._arrivals: deque[RequestState] = deque()  # waiting, never admitted, in arrival order
        self._frame_ids: list[str] = []  # the last frame's admission order ...
        self._frame_keys = np.zeros((0, 2))  # ... and its (rank, -priority) keys
        self._order = SortedList()  # (rank, -priority, seq, id) of requests queued since the frame
        self._entry: dict[str, tuple] = {}
        self._priority: dict[str, float] = {}
        self._seq = 0
        self._frame_start = -math.inf
        self._frame_reward = 0.0
        self._arm = self.cutoffs.index(cutoff) if cutoff in self.cutoffs else 0
        self._arm_value = np.zeros(len(self.cutoffs))
        self._arm_count = np.zeros(len(self.cutoffs))
        self._bound_memo: dict[tuple[int, str, int], float] = {}
        # Forest bounds asked off the step (`adapt.predictions`): submission key "id@g" -> what was
        # asked (`_Asked`), until handed over or the request leaves; each request's keys.
        self._predictions: PredictionQueue = Delayed(LengthBounds())
        self._asked: dict[str, _Asked] = {}
        self._asked_by: dict[str, list[str]] = {}
        self._frame_rank: dict[str, float] = {}  # the last frame's rank of each waiting request
        self._reranked: set[str] = set()  # ... and those re-queued since (a bound came)
        self._lengths: list[int] = []  # completed output lengths (fallback bound), sorted
        self._lengths_fifo: deque[int] = deque()
        self._programs: dict[str, dict[int, list[RequestState]]] = {}
        self.frames = 0
        self.preemptions = 0

    @property
    def needs_prompt_text(self) -> bool:  # type: ignore[override]
        """Whether the length bound reads the prompt's words (`reads_prompt_text`: a forest with
        prompt features, the network): then vLLM detokenises each prompt for it, as replay passes
        the trace's text, so the live bound is the one replay computed. Read per arrival: a version
        swapped in later brings its own answer."""
        return self.qrf is not None and bool(getattr(self.qrf, "reads_prompt_text", False))

    def use_component(self, attribute: str, component: Any) -> None:
        """A new version applies to bounds and sub-deadlines computed from now on (bounds the old
        one is still computing are used for their requests but not memoised)."""
        if attribute == "qrf":
            _check_bound_source(component)
        super().use_component(attribute, component)
        self._bound_memo.clear()

    def use_predictions(self, queues: QueueFactory) -> None:
        """Forest bounds run where the engine says; ones already asked are asked again there (none
        is lost when a live engine swaps this policy in with requests in flight)."""
        self._predictions.close()
        self._predictions = queues(LengthBounds(self.qrf))
        for key, asked in self._asked.items():
            self._predictions.submit(key, asked.payload, asked.at_s)

    # ------------------------------------------------------------ lifecycle
    def on_arrival(self, request: RequestState, now: float) -> None:
        self._requests[request.id] = request
        request.cache["jit_credited"] = request.tokens_on_time  # (a swap hands some over started)
        self._unscored.append(request)  # scored at the next step, with that step's other arrivals
        if self.waiting_time_s is not None:  # only admission control reads (and empties) it
            self._arrivals.append(request)
        if self.qrf is not None and request.program is None:
            self._ask_bound(request, now)  # its forest bound starts now, off the step
        if request.program is not None:
            stages = self._programs.setdefault(request.program.program_id, {})
            stages.setdefault(request.program.stage, []).append(request)
            if len(self._programs) > MAX_PROGRAMS:  # forget the oldest program's calls
                del self._programs[next(iter(self._programs))]

    def on_admit(self, request: RequestState, now: float) -> None:
        self._unqueue(request)
        self._table.set(request.id, waiting=0.0)

    def on_preempt(self, request: RequestState, now: float) -> None:
        self._write(request)
        self._queue(request, rank=1)

    def on_finish(self, request: RequestState, now: float) -> None:
        for key in self._asked_by.pop(request.id, ()):
            del self._asked[key]
            self._predictions.discard(key, now)
        self._unqueue(request)
        self._table.release(request.id)
        self._requests.pop(request.id, None)
        self._priority.pop(request.id, None)
        if request.finish_s is None:
            return  # dropped
        if len(self.cutoffs) > 1:  # the bandit's reward
            if request.slo.kind == "latency":
                self._credit_tokens(request)
            else:
                self._frame_reward += self._earned(request)
        self._remember_length(request.tokens_generated)

    def _write(self, request: RequestState) -> None:
        """Copy what the estimates need about `request` into its table row."""
        slo = request.slo
        bound, at = request.cache["jit_bound"]
        self._table.set(
            request.id,
            arrival=request.arrival_s,
            prompt=request.prompt_tokens,
            generated=request.tokens_generated,
            prefill=request.tokens_to_compute - (request.phase == "decode"),
            kind=KINDS[slo.kind],
            deadline=request.deadline_at,
            stage_deadline=self.stage_deadline(request) if slo.kind == "compound" else math.inf,
            ttft=math.nan if slo.ttft_s is None else slo.ttft_s,
            tbt=math.nan if slo.tbt_s is None else slo.tbt_s,
            first_token=math.nan if request.first_token_s is None else request.first_token_s,
            bound=bound,
            bound_at=at,
            waiting=float(request.phase in _WAITING),
        )

    # ---------------------------------------------------------- the queue
    # Admission order = the last frame's order (one numpy sort per frame) merged with a small
    # sorted list of the requests that arrived or were preempted since, both by (rank, -priority).
    def _queue(self, request: RequestState, rank: int) -> None:
        self._unqueue(request)
        self._seq += 1
        entry = (rank, -self._priority.get(request.id, 0.0), self._seq, request.id)
        self._entry[request.id] = entry
        self._order.add(entry)

    def _unqueue(self, request: RequestState) -> None:
        entry = self._entry.pop(request.id, None)
        if entry is not None:
            self._order.remove(entry)

    def _admission_order(self):
        reranked = self._reranked
        frame = (
            (*self._frame_keys[i], -1, rid) for i, rid in enumerate(self._frame_ids) if rid not in reranked
        )
        seen: set[str] = set()
        for entry in heapq.merge(frame, self._order):
            rid = entry[-1]
            request = self._requests.get(rid)
            if request is not None and rid not in seen and request.phase in _WAITING:
                seen.add(rid)
                yield request

    # ------------------------------------------------------------ planning
    def on_step(self, view: EngineView) -> Plan:
        step_s = view.mean_batch_time_s or DEFAULT_STEP_S
        if len(self.cutoffs) > 1:  # the tokens on time since the last step count toward this frame
            for request in view.running:
                if request.slo.kind == "latency":
                    self._credit_tokens(request)
        drop = self._admission_control(view.now)
        fresh: list[RequestState] = []
        if self._unscored:
            fresh = [r for r in self._unscored if r.id in self._requests and r.phase != "finished"]
            self._unscored = []
            self._refresh_bounds(fresh, view.now)
        new_frame = view.step_index - self._frame_start >= self.frame_steps
        if new_frame:  # the frame re-scores running requests: refresh their stale bounds first
            running = [r for r in view.running if r.phase in ("prefill", "decode")]
            self._refresh_bounds([r for r in running if self._bound_is_stale(r)], view.now)
        if self._asked:  # bounds asked for so far (this step's too) that are ready now
            self._take_bounds(view.now, step_s, fresh)
        if fresh:
            for request, priority in zip(fresh, self.priorities(fresh, view.now, step_s), strict=True):
                self._priority[request.id] = float(priority)
                if request.phase in _WAITING:
                    self._queue(request, rank=1)
        preempt: list[RequestState] = []
        if new_frame:
            preempt = self._plan_frame(view, step_s)
        room = self._batch(view) - len(view.running) + len(preempt)
        admit = itertools.islice(self._admission_order(), max(0, room))
        # Highest priority first, so that KV pressure evicts the lowest-priority request first.
        order = sorted(view.running, key=lambda r: -self._priority.get(r.id, 0.0))
        return Plan(admit=admit, preempt=preempt, drop=drop, running_order=order)

    def _batch(self, view: EngineView) -> int:
        return min(self.batch_size or view.max_running, view.max_running)

    def horizon(self, view: EngineView) -> Horizon:
        # The view is the step just planned: the frame has this many steps left after it; a bound
        # still to come re-ranks its request when it is ready; admission control drops the oldest
        # request still waiting once its wait passes `waiting_time_s`.
        steps = max(0, self._frame_start + self.frame_steps - view.step_index - 1)
        until = self._predictions.next_ready_s if self._asked else math.inf
        if self.waiting_time_s is not None and self._arrivals:
            until = min(until, self._arrivals[0].arrival_s + self.waiting_time_s)
        return Horizon(steps=steps, until_s=until)

    def _admission_control(self, now: float) -> list[RequestState]:
        if self.waiting_time_s is None:
            return []
        drop = []
        while self._arrivals and now - self._arrivals[0].arrival_s > self.waiting_time_s:
            request = self._arrivals.popleft()
            # Never a started one: a preempted request was admitted once, and may have streamed
            # tokens (its phase says so, whoever admitted it: a live swap hands it over waiting).
            if request.id in self._requests and request.phase == "waiting":
                drop.append(request)
        return drop

    def _plan_frame(self, view: EngineView, step_s: float) -> list[RequestState]:
        """Re-plan (module docstring): score everyone, pick the batch, order admissions, and
        preempt where the projected gain beats the stall."""
        self._close_frame()
        self._frame_start = view.step_index
        self.frames += 1
        waiting = [r for r in view.waiting if r.id in self._requests]
        running = [r for r in view.running if r.phase in ("prefill", "decode")]
        candidates = waiting + running
        if not candidates:
            return []
        for request in running:  # (their stale bounds were refreshed at the start of the step)
            self._write(request)
        priority = self.priorities(candidates, view.now, step_s)
        for request, value in zip(running, priority[len(waiting) :].tolist(), strict=True):
            self._priority[request.id] = value
        batch = self._batch(view)
        chosen = select_batch(priority, [r.prompt_tokens for r in candidates], batch, self.cutoff)
        self._order_frame(waiting, priority[: len(waiting)], [i for i in chosen if i < len(waiting)])
        if not self.preempt:
            return []
        chosen_set = set(chosen)
        incoming = sorted((i for i in chosen if i < len(waiting)), key=lambda i: -priority[i])
        outgoing = sorted(
            (i for i in range(len(waiting), len(candidates)) if i not in chosen_set),
            key=lambda i: priority[i],
        )
        if view.kv_usage < 0.9 and batch - len(running) >= len(incoming):
            return []  # room for every incoming member without evicting anyone
        frame_s = self.frame_steps * step_s
        token_speed = max(1, len(running)) / step_s
        victims = []
        for new, old in zip(incoming, outgoing, strict=False):
            victim = candidates[old]
            stall_s = (victim.prompt_tokens + victim.tokens_generated) / self.prefill_tokens_per_s
            at_stake = float(self.estimates([victim], view.now, step_s)[0][0])  # lost with its KV
            if (priority[new] - priority[old]) * frame_s <= stall_s * token_speed + at_stake:
                break
            victims.append(victim)
        self.preemptions += len(victims)
        return victims

    def _order_frame(self, waiting: list[RequestState], priority: np.ndarray, in_batch: list[int]) -> None:
        """The frame's admission order: batch members first, then the rest, each by priority."""
        rank = np.ones(len(waiting))
        rank[in_batch] = 0
        order = np.lexsort((-priority, rank))
        self._frame_keys = np.column_stack([rank[order], -priority[order]]).tolist()
        self._frame_ids = [waiting[i].id for i in order.tolist()]
        self._priority.update(zip((r.id for r in waiting), priority.tolist(), strict=True))
        self._frame_rank = dict(zip(self._frame_ids, rank[order].tolist(), strict=True))
        self._reranked.clear()
        self._order.clear()
        self._entry.clear()

    def _close_frame(self) -> None:
        """Credit the frame's goodput to the cutoff that ran it and pick the next (epsilon-greedy)."""
        if len(self.cutoffs) == 1 or not math.isfinite(self._frame_start):
            return
        arm = self._arm
        self._arm_count[arm] += 1
        self._arm_value[arm] += (self._frame_reward - self._arm_value[arm]) / self._arm_count[arm]
        self._frame_reward = 0.0
        untried = np.flatnonzero(self._arm_count == 0)
        if len(untried):
            self._arm = int(untried[0])
        elif self._rng.random() < self.explore:
            self._arm = int(self._rng.integers(len(self.cutoffs)))
        else:
            self._arm = int(np.argmax(self._arm_value))
        self.cutoff = self.cutoffs[self._arm]

    # ------------------------------------------------------------ estimates
    def _columns(self, requests: list[RequestState]) -> dict[str, np.ndarray]:
        """The requests' table rows as columns (rows written first for requests not yet in it)."""
        rows = self._table.rows
        for request in requests:
            if request.id not in rows:
                self._write(request)
        return self._table.columns(
            np.fromiter((rows[r.id] for r in requests), dtype=np.int64, count=len(requests))
        )

    def estimates(
        self, requests: list[RequestState], now: float, step_s: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(goodput, t_gen) per request (`gmax.estimates`), from their table rows."""
        return estimates(self._columns(requests), now, step_s, self.prefill_tokens_per_s)

    def priorities(self, requests: list[RequestState], now: float, step_s: float) -> np.ndarray:
        """priority(r) = (goodput(r) + delta * frames waited) / t_gen(r)."""
        if not requests:
            return np.zeros(0)
        columns = self._columns(requests)
        goodput, t_gen = estimates(columns, now, step_s, self.prefill_tokens_per_s)
        waited = np.where(columns["waiting"] > 0, np.maximum(now - columns["arrival"], 0.0), 0.0)
        goodput = goodput + self.delta * np.floor(waited / (self.frame_steps * step_s))
        priority = goodput / np.maximum(t_gen, step_s)
        if self.fairness > 0:
            fair = waited / max(float(waited.max()), 1e-9) * float(priority.max())
            priority = (1 - self.fairness) * priority + self.fairness * fair
        # Orders must not hinge on the last bits: vectorised maths may round the same inputs
        # differently at different array positions, and replay and vLLM keep requests in
        # different table rows. Equal to 12 significant digits is a tie (broken by arrival).
        scale = float(np.abs(priority).max())
        if scale == 0.0 or not math.isfinite(scale):
            return priority
        return np.round(priority, 11 - math.floor(math.log10(scale)))

    def stage_deadline(self, request: RequestState) -> float:
        """start + phi(s) * D for a compound call; phi from the matched pattern graph (or the
        true share for the oracle), the whole deadline without a match."""
        if "stage_deadline" not in request.cache:
            share = self._stage_share(request)
            start = request.program.start_s if request.program.start_s is not None else request.arrival_s
            request.cache["stage_deadline"] = start + share * request.slo.deadline_s  # type: ignore[operator]
        return request.cache["stage_deadline"]

    def _stage_share(self, request: RequestState) -> float:
        if self.patterns is None:
            return 1.0
        seen, current = self._partial_graph(request)
        share = self.patterns.stage_share(seen, current)
        return 1.0 if share is None else share

    def _partial_graph(self, request: RequestState):
        """The program's completed stages as the server saw them (tool stages are the gaps in
        the stage numbers, lasting from the last parent's finish to this call's arrival)."""
        from adapt.programs import StageNode

        program = request.program
        stages = self._programs.get(program.program_id, {})
        seen: list[StageNode] = []
        last_finish = program.start_s or request.arrival_s
        for s in range(program.stage):
            calls = stages.get(s)
            if calls is None:
                first = min((c.arrival_s for c in stages.get(s + 1, [request])), default=request.arrival_s)
                seen.append(StageNode("tool", "tool", duration_s=max(0.0, first - last_finish)))
                continue
            outputs = [c.tokens_generated for c in calls]
            finish = max((c.finish_s or c.last_token_s or c.arrival_s) for c in calls)
            seen.append(
                StageNode(
                    "llm",
                    "llm",
                    width=len(calls),
                    input_tokens=float(np.mean([c.prompt_tokens for c in calls])),
                    output_tokens=float(np.mean(outputs)),
                    max_output_tokens=float(max(outputs)),
                    duration_s=max(0.0, finish - min(c.arrival_s for c in calls)),
                )
            )
            last_finish = finish
        current = StageNode("llm", "llm", input_tokens=float(request.prompt_tokens))
        return seen, current

    def _bound_is_stale(self, request: RequestState) -> bool:
        _, at = request.cache.get("jit_bound", (None, -self.refine_every))
        return request.tokens_generated - at >= self.refine_every

    def _refresh_bounds(self, requests: list[RequestState], now: float) -> None:
        """Give each request a bound: the pattern graph's for compound calls, the online quantile
        where no component applies, and for single requests the forest's, asked off the step
        (`_ask_bound`)."""
        if self.qrf is not None:
            for request in requests:
                if request.program is None:
                    self._ask_bound(request, now)
                    if "jit_bound" not in request.cache:  # its prior until the forest's bound comes
                        generated = request.tokens_generated
                        request.cache["jit_bound"] = (self._fallback_bound(generated), generated)
            requests = [r for r in requests if r.program is not None]
        for request in requests:
            if "jit_bound" in request.cache and not self._bound_is_stale(request):
                continue
            bound = None
            if request.program is not None and self.patterns is not None:
                if "stage_bound" not in request.cache:  # the program's past does not change mid-call
                    request.cache["stage_bound"] = self.patterns.stage_output_bound(
                        *self._partial_graph(request)
                    )
                per_call = request.cache["stage_bound"]
                if per_call is not None:
                    bound = max(1.0, per_call - request.tokens_generated)
            if bound is None:
                bound = self._fallback_bound(request.tokens_generated)
            request.cache["jit_bound"] = (bound, request.tokens_generated)

    def _ask_bound(self, request: RequestState, now: float) -> None:
        """The forest's bound at the last multiple g of `refine_every` tokens generated (counted
        down from there): from the memo at once if it holds it, else asked of the prediction queue
        under "id@g", once per g and policy. Until it is handed over the request keeps what it has
        -- its previous bound counted down, or for a new request the online quantile, given at its
        first step (`_refresh_bounds`: at a step, both engines have seen the same completions) --
        marked `jit_prior`. A policy swapped in live is handed the requests in flight with their
        cache: one with a forest bound at g or later keeps it; one whose bound the old policy had
        asked but not received is asked again here (the old queue, stopped, never hands it over)."""
        g = request.tokens_generated - request.tokens_generated % self.refine_every
        key = f"{request.id}@{g}"
        if g <= request.cache.get("jit_qrf_at", -1) or key in self._asked:
            return  # received, or asked already (its answer may still come; a refused one never does)
        request.cache["jit_asked"] = g
        row = (request.prompt_tokens, request.prompt_text or "", g)
        if row in self._bound_memo:
            self._use_bound(request, self._bound_memo[row], g)
            return
        asked = _Asked(request, row, self.qrf, (self.qrf, self.quantile, row), now)
        request.cache["jit_prior"] = True
        # Remembered even if the queue refuses it: whether a bound was asked for must not depend on
        # the queue (a trace-driven replay's never refuses), only whether it comes.
        self._asked[key] = asked
        self._asked_by.setdefault(request.id, []).append(key)
        self._predictions.submit(key, asked.payload, now)

    def _take_bounds(self, now: float, step_s: float, fresh: list[RequestState]) -> None:
        """Use the forest bounds handed over by `now` (memoised); a waiting request that got one
        takes its new place in line (this step's arrivals are scored after this, running requests
        at the next frame)."""
        reranked: dict[str, RequestState] = {}
        for key, bound in self._predictions.ready(now):
            asked = self._asked.pop(key)
            request = asked.request
            self._asked_by[request.id].remove(key)
            if asked.qrf is self.qrf:  # (not a version swapped out since it was asked)
                if len(self._bound_memo) >= MEMO_SIZE:
                    self._bound_memo.clear()
                self._bound_memo[asked.row] = bound
            if asked.row[2] >= request.cache.get("jit_qrf_at", -1):  # not older than the one in force
                self._use_bound(request, bound, asked.row[2])
                if request.phase in _WAITING and request.id in self._priority:
                    reranked[request.id] = request
        for request in fresh:
            reranked.pop(request.id, None)
        if reranked:
            waiting = list(reranked.values())
            for request in waiting:
                self._write(request)
            for request, priority in zip(waiting, self.priorities(waiting, now, step_s), strict=True):
                self._priority[request.id] = float(priority)
                self._reranked.add(request.id)
                self._queue(request, rank=self._frame_rank.get(request.id, 1))

    def _use_bound(self, request: RequestState, bound: float, g: int) -> None:
        request.cache["jit_bound"] = (bound, g)
        request.cache["jit_qrf_at"] = g
        request.cache["jit_prior"] = g < request.cache["jit_asked"]

    def _fallback_bound(self, generated: int) -> float:
        """The `quantile` of completed output lengths above `generated`, minus `generated`."""
        lengths = self._lengths
        above = len(lengths) - bisect.bisect_right(lengths, generated)
        if above < 20:
            return float(max(1024, 2 * generated) - generated)
        index = bisect.bisect_right(lengths, generated) + int(self.quantile * (above - 1))
        return float(lengths[index] - generated)

    def _remember_length(self, length: int) -> None:
        bisect.insort(self._lengths, length)
        self._lengths_fifo.append(length)
        if len(self._lengths_fifo) > FALLBACK_QUANTILE_WINDOW:
            old = self._lengths_fifo.popleft()
            del self._lengths[bisect.bisect_left(self._lengths, old)]

    def _credit_tokens(self, request: RequestState) -> None:
        """Add to the frame's reward the on-time tokens `request` (latency SLO) got since it was
        last credited. The engine counts them as each token comes (`RequestState.tokens_on_time`),
        so the reward does not depend on which step first sees a token: a replay that runs many
        decode steps at once credits what one that plans every step does."""
        credited = request.cache.get("jit_credited")
        if credited is not None and request.tokens_on_time > credited:
            self._frame_reward += request.tokens_on_time - credited
            request.cache["jit_credited"] = request.tokens_on_time

    def _earned(self, request: RequestState) -> float:
        """The bandit's reward for a finished deadline, compound or best-effort request: prompt and
        output tokens if it met its (stage's program) deadline."""
        late = request.slo.kind in ("deadline", "compound") and request.finish_s > request.deadline_at
        return 0.0 if late else float(request.prompt_tokens + request.tokens_generated)

    def length_bound(self, request: RequestState) -> tuple[str, float] | None:
        """The bound in force for `request` on its total output, and what made it: the `qrf`
        component for a single request it bounded (a request that finished before its first forest
        bound came had the online quantile), `patterns` for a compound call it matched, else the
        online quantile of completed lengths. Read when a request finishes, to measure coverage
        online (`serving_hooks.quality`); None before the request had a bound."""
        if "jit_bound" not in request.cache:
            return None
        bound, at = request.cache["jit_bound"]
        if request.program is None and "jit_qrf_at" in request.cache:
            source = self.components["qrf"]
        elif request.program is not None and request.cache.get("stage_bound") is not None:
            source = self.components["patterns"]
        else:
            source = FALLBACK_BOUND
        return source, at + bound

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "qrf": registry_version(self.qrf),
            "patterns": registry_version(self.patterns),
            "frame_steps": self.frame_steps,
            "batch_size": self.batch_size,
            "cutoffs": list(self.cutoffs),
            "delta": self.delta,
            "waiting_time_s": self.waiting_time_s,
            "fairness": self.fairness,
        }


class JITServeOracle(JITServe):
    """GMAX with the true remaining length and the true stage share phi(s)."""

    name = "jitserve-oracle"
    needs_oracle = True
    components = {}  # noqa: RUF012  (it knows the truth: nothing learned to swap)

    def _refresh_bounds(self, requests: list[RequestState], now: float) -> None:
        for request in requests:  # the true total, counted down by `gmax.remaining`
            request.cache["jit_bound"] = (float(request.oracle_output_tokens), 0)  # type: ignore[arg-type]

    def _bound_is_stale(self, request: RequestState) -> bool:
        return False

    def length_bound(self, request: RequestState) -> tuple[str, float] | None:
        return None  # the truth: nothing to measure

    def _stage_share(self, request: RequestState) -> float:
        share = request.program.deadline_share  # type: ignore[union-attr]
        return 1.0 if share is None else share


class _Asked(NamedTuple):
    """A forest bound asked off the step: for whom, its memo row (prompt tokens, text, g), the
    component asked, the queue's payload, and when."""

    request: RequestState
    row: tuple[int, str, int]
    qrf: Any
    payload: tuple[Any, float, tuple[int, str, int]]
    at_s: float


def _check_part(attribute: str, part: Any, methods: tuple[str, ...], components: str) -> None:
    """Refuse a `qrf` or `patterns` without the methods the policy calls: a spec's number or list
    reaches the constructor as it is (only a string is a registry reference, which `make_policy`
    loads first), and used to fail mid-replay at the first request that asked it."""
    if part is not None and not all(callable(getattr(part, method, None)) for method in methods):
        raise ValueError(
            f"{attribute}: expected a registered {components} (a version vN or an alias such as"
            f" champion) or null, got {part!r}"
        )


def _check_bound_source(qrf: Any) -> None:
    """Refuse a forest that reads the generated text (`generated_features` > 0): a scheduler has
    the prompt and the count of generated tokens, not their text (vLLM's scheduler sees token ids,
    and detokenising inside a step is what issue 22 took out), so such a forest would be asked
    with blank text at every refinement -- inputs it met in training only before the first token
    (a 14% higher bound on held-out AlpacaEval at 100 tokens). `adapt train qrf-length` trains
    count-only forests."""
    if getattr(qrf, "generated_features", 0):
        raise ValueError(
            f"qrf-length v{registry_version(qrf)} reads the generated text (generated_features="
            f"{qrf.generated_features}), which a scheduler does not have; train it with generated_features=0"
        )


class LengthBounds:
    """The model call JITServe makes off the scheduling step: a `qrf-length` bound per payload
    (component, quantile, (prompt tokens, prompt text, g)), each distinct row predicted once, one
    forest call per component and quantile (rows are predicted independently: the same bound as
    one by one). `warm_up` readies the component the policy held when it asked for this worker
    (the network's embedding model), so that it does not load while the engine serves; a version
    swapped in later loads on its first batch."""

    def __init__(self, component: Any = None) -> None:
        self.component = component

    def warm_up(self) -> None:
        warm_up = getattr(self.component, "warm_up", None)
        if warm_up is not None:
            warm_up()

    def __call__(self, payloads: list[tuple[Any, float, tuple[int, str, int]]]) -> list[float]:
        groups: dict[tuple[int, float], tuple[Any, float, dict[tuple[int, str, int], None]]] = {}
        for qrf, quantile, row in payloads:
            groups.setdefault((id(qrf), quantile), (qrf, quantile, {}))[2][row] = None
        bounds: dict[tuple[int, float, tuple[int, str, int]], float] = {}
        for qrf, quantile, rows in groups.values():
            prompt_tokens, texts, generated = zip(*rows, strict=True)
            blank = [""] * len(rows)
            predicted = qrf.predict_bound(prompt_tokens, texts, generated, blank, quantile=quantile)
            bounds.update(
                ((id(qrf), quantile, row), float(b)) for row, b in zip(rows, predicted, strict=True)
            )
        return [bounds[id(qrf), quantile, row] for qrf, quantile, row in payloads]
