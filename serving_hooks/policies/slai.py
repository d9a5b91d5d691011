"""SLAI (Bari, Hegde, de Veciana, SIGMETRICS'26, section 6): defer decodes until their TBT is at risk.

For a running decode with TBT target `tbt`, whose previous token came out of the batch that ended
at `t_prev`, the last schedulable time is

    LST = t_prev + tbt - offset * mean_batch_time

and the decode is *critical* once `now >= LST`. Each step the batch is, in order:
  1. critical decodes, by increasing LST;
  2. prefills already started (chunked prefills in flight), oldest first;
  3. non-critical decodes by increasing LST, up to the decode limit, in the budget the new prefills
     leave (below);
  4. new prefills, shortest prompt first (SPF) or FCFS, optionally paying tier first, while the
     token budget and the cap on active requests allow.
The paper runs non-critical decodes *after* the new prefills, in whatever budget they leave. vLLM
V1 schedules every running request before any waiting one, so no engine that is also vLLM can do
that literally; SLAI instead reserves the budget the next admissions will take (the prompts at
the head of its queue that fit in the free KV blocks, while KV usage is below `reserve_below`, so
that under KV pressure the decodes that free memory run) and gives non-critical decodes the rest
-- the same plan in replay and live. Under KV pressure the
engine evicts the last of these (the decode with the most slack) first.
A decode without a TBT target is owed best effort: it becomes critical `best_effort_batches` mean
batch times after its last token (default 0: at once, i.e. it is never deferred, as in vLLM). The
paper gives every request a target and never says; leaving such decodes never critical
(`best_effort_batches=None`) lets them wait behind every new prefill, so on a length-only trace
(Azure conversations, no targets) SLAI kept admitting while its decodes stalled -- more KV held,
more preemptions, longer TTLT. The token budget is the engine's, as
for every policy in a comparison (`token_budget=N` gives SLAI its own; the paper runs Sarathi-Serve's
512). `offset` is a number (`slai-fixed`)
or a function of KV-cache usage (`slai`: the `slai-offset` component, by default the paper's rule:
5 below 96% usage, 10 above).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from adapt.policy import EngineView, Horizon, Plan, RequestState
from serving_hooks.policies.base import PriorityPolicy


def last_schedulable_time(
    request: RequestState, offset: float, mean_batch_time_s: float, best_effort_batches: float | None = None
) -> float:
    """LST of a decode's next iteration: +inf before its first token; without a TBT target,
    `best_effort_batches` batch times after its last token (+inf when None)."""
    tbt, last = request.slo.tbt_s, request.last_token_s
    if last is None:
        return math.inf
    if tbt is None:
        return math.inf if best_effort_batches is None else last + best_effort_batches * mean_batch_time_s
    return last + tbt - offset * mean_batch_time_s


def _is_number(value: Any) -> bool:
    """A finite real number (not a bool, which a spec's `true` would give)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class SLAI(PriorityPolicy):
    """SLAI with a fixed or KV-dependent offset (see module docstring)."""

    name = "slai"
    components = {"offset": "slai-offset"}  # noqa: RUF012  (the offset is read fresh every step)

    def __init__(
        self,
        offset: float | dict[str, list[float]] | Callable[[float], float] | None = None,
        prefill_order: str = "spf",
        paying_first: bool = False,
        token_budget: int | None = None,
        max_active: int = 128,
        decode_limit: int = 128,
        reserve_below: float = 0.9,
        best_effort_batches: float | None = 0.0,
    ) -> None:
        super().__init__()
        if prefill_order not in ("spf", "fcfs"):
            raise ValueError(f"prefill_order: expected spf or fcfs, got {prefill_order!r}")
        if offset is None or isinstance(offset, dict):
            from predictors.slai_offset import SlaiOffset

            offset = SlaiOffset(**(offset or {}))  # a dict is a policy-config's serialised offset
        elif not callable(offset) and not _is_number(offset):
            raise ValueError(
                f"offset: expected a number of batch times, a slai-offset or its parameters, got {offset!r}"
            )
        self.offset = offset
        self.prefill_order = prefill_order
        self.paying_first = paying_first
        self.token_budget = token_budget
        self.max_active = max_active
        self.decode_limit = decode_limit
        self.reserve_below = reserve_below
        self.best_effort_batches = best_effort_batches
        self._plan_flips = False

    def current_offset(self, kv_usage: float) -> float:
        return self.offset(kv_usage) if callable(self.offset) else float(self.offset)

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        tier = 0 if (self.paying_first and request.slo.tier == "paying") else 1
        size = request.prompt_tokens if self.prefill_order == "spf" else 0
        return (tier, size, request.arrival_s)

    def _admissions(self, room: int) -> Iterator[RequestState]:
        for entry in self._waiting:
            if room <= 0:
                return
            room -= 1
            yield entry[-1]

    def _margins(self, view: EngineView) -> tuple[float, float]:
        """(slack, best effort): what `last_schedulable_time` subtracts from a TBT deadline and
        adds to a last token without one, at this step's KV usage and batch time."""
        slack = self.current_offset(view.kv_usage) * view.mean_batch_time_s
        if self.best_effort_batches is None:
            return slack, math.inf
        return slack, self.best_effort_batches * view.mean_batch_time_s

    def on_step(self, view: EngineView) -> Plan:
        critical: list[tuple[float, RequestState]] = []
        optional: list[tuple[float, RequestState]] = []
        started: list[RequestState] = []
        slack, best_effort = self._margins(view)
        for request in view.running:  # `last_schedulable_time`, inlined: this runs every step
            if request.phase == "prefill":
                started.append(request)
                continue
            tbt, last = request.slo.tbt_s, request.last_token_s
            if last is None:
                lst = math.inf
            elif tbt is None:
                lst = last + best_effort
            else:
                lst = last + tbt - slack
            (critical if view.now >= lst else optional).append((lst, request))
        critical.sort(key=lambda item: item[0])
        # A critical decode with slack (LST after its last token) is not critical once its next
        # token is out: the next step's plan differs from this one (`horizon`).
        self._plan_flips = any(lst > request.last_token_s for lst, request in critical)
        optional.sort(key=lambda item: item[0])
        room = self.max_active - len(view.running)
        budget = view.token_budget - len(critical) - sum(r.tokens_to_compute for r in started)
        if view.kv_usage < self.reserve_below:
            budget -= self._reserved(view, min(room, view.max_running - len(view.running)), budget)
        allowed = max(0, min(self.decode_limit - len(critical), budget))
        order = [request for _, request in critical] + started + [r for _, r in optional[:allowed]]
        return Plan(admit=self._admissions(room), running_order=order)

    def _reserved(self, view: EngineView, room: int, budget: int) -> int:
        """Tokens the next admissions will take: the head of the queue, in order, as far as the
        budget, the free slots and the free KV blocks (whole sequences, as the engine admits) go.
        Counting only admissions that will happen keeps decodes from waiting on one that cannot."""
        reserved, free = 0, view.kv_free_blocks
        for request in self._admissions(room):
            need = request.tokens_to_compute
            blocks = -(-need // view.kv_block_size)
            if reserved >= budget or blocks > free:
                break
            reserved += min(need, budget - reserved)
            free -= blocks
        return reserved

    def horizon(self, view: EngineView) -> Horizon:
        """Wake up when the earliest deferred decode becomes critical; re-plan at once when a
        critical decode of this plan stops being critical after its token; otherwise after the
        next step, since the slack moves with the batch time and KV usage -- unless every running
        request is a decode without a TBT target at zero best-effort batches: each is critical
        from its last token on, they all get theirs together, and nothing moves until a request
        arrives or finishes."""
        if self._plan_flips:
            return Horizon(steps=0)
        slack, best_effort = self._margins(view)
        pending = math.inf
        steady = self.best_effort_batches == 0
        for request in view.running:  # `last_schedulable_time`, inlined as in `on_step`
            last = request.last_token_s
            if request.phase != "decode" or last is None:
                steady = False
                continue
            tbt = request.slo.tbt_s
            steady = steady and tbt is None
            lst = last + best_effort if tbt is None else last + tbt - slack
            # A decode without slack (best effort at 0 batches, a TBT inside the offset's margin)
            # is critical from its last token on: the passing time changes nothing for it.
            if last < lst < pending:
                pending = lst
        return Horizon(steps=math.inf if steady else 1, until_s=pending)

    def describe(self) -> dict[str, Any]:
        offset = self.offset.rule() if hasattr(self.offset, "rule") else self.offset
        return {
            "policy": self.name,
            "offset": offset,
            "prefill_order": self.prefill_order,
            "paying_first": self.paying_first,
            "token_budget": self.token_budget,
            "max_active": self.max_active,
            "decode_limit": self.decode_limit,
            "reserve_below": self.reserve_below,
            "best_effort_batches": self.best_effort_batches,
        }


class SLAIFixed(SLAI):
    """SLAI with the paper's fixed offset of 10 batch times."""

    name = "slai-fixed"
    components = {}  # noqa: RUF012  (a fixed offset: nothing to swap)

    def __init__(self, offset: float = 10.0, **kwargs: Any) -> None:
        super().__init__(offset=offset, **kwargs)
