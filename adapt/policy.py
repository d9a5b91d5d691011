"""The policy contract: what a scheduling policy sees (EngineView) and what it decides (Plan).

A policy is written once against this module and runs unchanged in the replay simulator
(`adapt.replay`) and inside vLLM (`serving_hooks`). The engine owns the mechanics -- token
budget, KV blocks, chunked prefill, preemption by recompute -- and the policy only orders, defers,
preempts and drops. Policies are incremental: they keep their own index (a sorted list, a heap, a
set of queues) up to date through the lifecycle hooks, so one `on_step` costs O(changed + log n)
rather than a rebuild over every request.

Lifecycle of a request as the hooks report it:
    on_arrival -> (on_admit -> [on_preempt -> on_admit]* ) -> on_finish
`on_finish` is also called for a request dropped from the waiting queue.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from adapt.requests import SLO, ProgramRef

if TYPE_CHECKING:
    from adapt.predictions import QueueFactory

Phase = Literal["waiting", "prefill", "decode", "preempted", "finished"]


class RequestState:
    """What a policy sees of one request. The engine updates the counters; policies read them and
    may keep predictor outputs in `cache` (e.g. a length bound refreshed every 50 tokens).

    `oracle_output_tokens` is the true output length, filled in only for policies that declare
    `needs_oracle = True` (sjf-oracle, jitserve-oracle); every other policy sees None.

    `prompt_embedding` is the prompt's MiniLM vector where the request arrived with it (`adapt
    serve --embed-prompts` computes it in the API server, before the engine sees the request), so
    a policy that embeds prompts has it at its first decision instead of asking for it.
    """

    __slots__ = (
        "arrival_s",
        "cache",
        "finish_s",
        "first_token_s",
        "id",
        "label",
        "last_token_s",
        "max_tokens",
        "num_preemptions",
        "oracle_output_tokens",
        "phase",
        "program",
        "prompt_embedding",
        "prompt_text",
        "prompt_tokens",
        "slo",
        "tokens_computed",
        "tokens_generated",
        "tokens_on_time",
    )

    def __init__(
        self,
        request_id: str,
        arrival_s: float,
        prompt_tokens: int,
        max_tokens: int,
        slo: SLO,
        prompt_text: str | None = None,
        program: ProgramRef | None = None,
        label: str | None = None,
        prompt_embedding: Any = None,
    ) -> None:
        self.id = request_id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.slo = slo
        self.prompt_text = prompt_text
        self.program = program
        self.label = label
        self.prompt_embedding = prompt_embedding
        self.tokens_computed = 0
        self.tokens_generated = 0
        # Output tokens that came by their due time under a latency SLO (`token_due_s`, from the
        # arrival the engine saw), counted by the engine as each token comes -- in replay by the
        # same arithmetic as the metrics' on-time tokens, however many steps a run covers.
        self.tokens_on_time = 0
        self.phase: Phase = "waiting"
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.finish_s: float | None = None
        self.num_preemptions = 0
        self.oracle_output_tokens: int | None = None
        self.cache: dict[str, Any] = {}

    @property
    def tokens_to_compute(self) -> int:
        """Tokens the next step must process for this request: the (rest of the) prompt plus, after a
        preemption by recompute, every token generated so far; 1 for a decode."""
        return self.prompt_tokens + self.tokens_generated - self.tokens_computed

    @property
    def deadline_at(self) -> float:
        """Absolute deadline for deadline/compound SLOs, +inf otherwise (EDF's key). A compound
        deadline runs from the program's first arrival, not from this stage's."""
        deadline = self.slo.deadline_s
        if deadline is None:
            return math.inf
        if self.program is not None and self.program.start_s is not None:
            return self.program.start_s + deadline
        return self.arrival_s + deadline

    def token_due_s(self, index: int, intake_delay_s: float = 0.0) -> float:
        """When output token `index` (0 = the first) is due under a latency SLO: by arrival + TTFT +
        index * TBT (DESIGN section 4), the TTFT counted from the request's arrival at the server,
        `intake_delay_s` before the engine saw it; with a TBT target only, from the first token.
        +inf where the SLO sets no limit on that token. One formula for the metrics' on-time
        tokens and for a policy that estimates its own goodput (JITServe's cutoff bandit)."""
        slo = self.slo
        if slo.ttft_s is not None:
            if index == 0 or slo.tbt_s is not None:
                return self.arrival_s - intake_delay_s + slo.ttft_s + index * (slo.tbt_s or 0.0)
            return math.inf
        if index == 0 or self.first_token_s is None or slo.tbt_s is None:
            return math.inf
        return self.first_token_s + index * slo.tbt_s

    def __repr__(self) -> str:
        return (
            f"RequestState({self.id!r}, phase={self.phase}, prompt={self.prompt_tokens},"
            f" computed={self.tokens_computed}, generated={self.tokens_generated})"
        )


@dataclass
class EngineView:
    """The engine at the start of one scheduling step.

    `waiting` is in the order requests (re-)entered the queue (arrivals, then preempted ones as
    they were preempted) and `running` in admission order; both are the engine's own containers,
    to be read, never modified. `mean_batch_time_s` is a moving average of recent step durations
    (SLAI's offset is measured in it): of the steps that ran tokens, each from its start until its
    output came, so neither idle time nor empty steps move it. `kv_free_blocks` of
    `kv_block_size` tokens are free now (a waiting request is admitted only if its whole known
    sequence fits in them).
    """

    now: float
    waiting: Sequence[RequestState]
    running: Sequence[RequestState]
    kv_usage: float
    token_budget: int
    max_running: int
    mean_batch_time_s: float
    step_index: int = 0
    kv_free_blocks: float = math.inf
    kv_block_size: int = 16


class WaitingView(Sequence[RequestState]):
    """`EngineView.waiting` in both engines: a read-only view of an engine's waiting requests
    (id -> state, in the order they (re-)entered the queue), copied by no one. Both engines hand
    the policy the same kind of object, so a policy that keeps it sees the same thing in both;
    the engine's queue changes under it between steps."""

    __slots__ = ("_waiting",)

    def __init__(self, waiting: dict[str, RequestState]) -> None:
        self._waiting = waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self):
        return iter(self._waiting.values())

    def __getitem__(self, index):  # type: ignore[override]
        return list(self._waiting.values())[index]

    def __contains__(self, state: object) -> bool:
        return isinstance(state, RequestState) and self._waiting.get(state.id) is state


@dataclass
class Plan:
    """A policy's decision for one step; the engine applies it with its own mechanics.

    admit:   waiting requests in the order to admit them; consumed lazily and only as far as the
             running cap, the token budget and free KV blocks allow (so a policy may return an
             iterator over its whole index at no cost). None admits nothing.
    defer:   running requests to leave out of this step (decode deferral).
    preempt: running requests to preempt (their KV is freed; they return to waiting, and are not
             admitted again in this step; `on_preempt` comes after this step's `on_admit`s).
    drop:    waiting requests to drop (admission control); reported with outcome `dropped`. A
             running request is not droppable: both engines refuse the plan.
    running_order: if given, exactly these running requests are scheduled before admissions, in
             this order (the rest are deferred); default: every running request not in `defer`, in
             admission order (vLLM's rule). It is also the protection order: when KV blocks run
             out, the engine preempts the *last* request of it not yet scheduled (vLLM pops the end
             of its running list), so a policy picks its victims by where it puts them.
    """

    admit: Iterable[RequestState] | None = None
    defer: set[RequestState] = field(default_factory=set)
    preempt: list[RequestState] = field(default_factory=list)
    drop: list[RequestState] = field(default_factory=list)
    running_order: list[RequestState] | None = None


@dataclass(frozen=True)
class Horizon:
    """How long the policy's plan stays valid if nothing arrives or finishes: a number of
    decode steps after the step it was asked about, an absolute time, and a KV-usage level whose
    crossing (from below) changes the plan. The replay engine uses it to advance runs of identical
    decode steps in one move; a policy that re-plans at token, time or memory boundaries must say
    so. It is asked right after `on_step`, before the planned step runs: the requests' counters
    are those the plan was made from (a request `d` tokens short of a boundary it re-plans at
    leaves `d - 1` steps after the planned one). `steps` is at least 0; an engine left idle asks
    it only for `until_s`, its wake-up time.

    `past_arrivals`: the plan holds across arrivals too -- an arrival changes neither what it
    admits nor its order nor this horizon. The engine asks for a horizon only of a plan that
    admits nothing, so this says a newcomer would not be admitted either (FCFS behind a non-empty
    queue: it waits behind the head that blocks admission). A run then goes on past arrivals, each
    entering at the start of the step it arrived before, as one step at a time would have it."""

    steps: float = math.inf
    until_s: float = math.inf
    kv_usage_below: float = math.inf
    past_arrivals: bool = False


FOREVER = Horizon()


class Policy:
    """Base class. It admits nothing by default, so every subclass states its own order.

    Class attributes tell the engine about mechanics the policy relies on (`adapt.mechanics` names
    them all and says what each engine does with each):
    `prefill_first` -- vLLM V0 style: a step with admissible prefills runs only prefills;
    `token_budget` -- overrides the engine's per-step token budget (Sarathi-Serve's small chunks);
    `needs_oracle` -- fill `RequestState.oracle_output_tokens` (oracle baselines only);
    `needs_prompt_text` -- fill `RequestState.prompt_text` where the engine only has token ids
    (vLLM's engine core detokenises the prompt for such policies; replay passes the trace's text);
    `components` -- the learned components the policy holds, by attribute, which `adapt serve`
    follows in the registry and swaps in with `use_component`;
    `alternatives` -- other registered components the policy also takes in an attribute's place
    (same interface; a policy built with one follows that name instead).
    """

    name: str = "policy"
    prefill_first: bool = False
    token_budget: int | None = None
    needs_oracle: bool = False
    needs_prompt_text: bool = False
    components: dict[str, str] = {}  # noqa: RUF012  (attribute -> registered component it holds)
    alternatives: dict[str, tuple[str, ...]] = {}  # noqa: RUF012  (attribute -> other components)

    def use_component(self, attribute: str, component: Any) -> None:
        """Serve a new version of a learned component (a live hot swap in `adapt serve`).
        `attribute` is a key of `components`; policies that keep derived state override this."""
        setattr(self, attribute, component)

    def use_predictions(self, queues: QueueFactory) -> None:
        """The engine says where this policy's model calls run and when their results are ready
        (`adapt.predictions`): called once before the first request, and again after a live swap.
        Policies that call no model while deciding ignore it."""

    def on_arrival(self, request: RequestState, now: float) -> None:
        """A request entered the waiting queue."""

    def on_admit(self, request: RequestState, now: float) -> None:
        """A waiting request was scheduled for the first time since arriving or being preempted."""

    def on_preempt(self, request: RequestState, now: float) -> None:
        """A running request was preempted and is waiting again (its KV is gone)."""

    def on_finish(self, request: RequestState, now: float) -> None:
        """A request left the engine: finished, or dropped from the waiting queue."""

    def on_step(self, view: EngineView) -> Plan:
        """Decide this step. Must not modify the view's containers."""
        return Plan()

    def horizon(self, view: EngineView) -> Horizon:
        """See `Horizon`. The default suits policies whose plan only changes on arrivals,
        admissions and completions."""
        return FOREVER

    def describe(self) -> dict[str, Any]:
        """The parameters and state worth recording, as plain JSON values: which component
        versions and settings the policy runs. A replay logs them with its MLflow run (params
        `policy.NAME`) and its JSON, and a live server publishes them in its status
        (`policy_state`), so two runs of one policy name can be told apart."""
        return {"policy": self.name}
