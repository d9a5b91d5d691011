"""Baseline policies the learned ones are measured against (DESIGN.md section 4).

Each is a few lines on top of `PriorityPolicy`: a sort key, sometimes engine hints (prefill-first,
token budget), and for the preemptive ones (`trail`, `fastserve`) a rule for when a waiting request
displaces a running one.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from adapt.policy import FOREVER, EngineView, Horizon, Plan, RequestState
from serving_hooks.policies.base import PriorityPolicy

LengthPredictor = Callable[[RequestState], float]
FULL_KV_USAGE = 0.95  # trail/fastserve treat the engine as full (and preempt) above this usage
_BEHIND_THE_QUEUE = Horizon(past_arrivals=True)


class FCFS(PriorityPolicy):
    """vLLM V1's default: running requests first (the engine does that), waiting ones by arrival."""

    name = "fcfs"

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        return (request.arrival_s,)

    orders_running = False  # vLLM's running order (the last admitted is evicted first)

    def horizon(self, view: EngineView) -> Horizon:
        """Arrivals come in time order, so a newcomer sorts behind every waiting request: behind
        a non-empty queue it changes nothing this plan does (`Horizon.past_arrivals`)."""
        return _BEHIND_THE_QUEUE if self._waiting else FOREVER


class VllmV0(FCFS):
    """vLLM V0: whole-prompt prefills first, decodes only in steps without admissible prefills.
    V0 sets max_num_batched_tokens to max(max_model_len, 2048); 4096 is Llama-2's context."""

    name = "vllm-v0"
    prefill_first = True
    token_budget = 4096


class Sarathi(FCFS):
    """Sarathi-Serve: stall-free batching -- decodes first, then chunked prefills under a small
    token budget (512, the setting the Sarathi-Serve and SLAI papers use). New prefills FCFS, or
    shortest prompt first with `order="spf"` (the SLAI paper's Sarathi-SPF baseline)."""

    name = "sarathi"

    def __init__(self, token_budget: int = 512, order: str = "fcfs") -> None:
        super().__init__()
        if order not in ("fcfs", "spf"):
            raise ValueError(f"order: expected fcfs or spf, got {order!r}")
        self.token_budget = token_budget
        self.order = order

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        return (request.prompt_tokens, request.arrival_s) if self.order == "spf" else (request.arrival_s,)

    def horizon(self, view: EngineView) -> Horizon:
        """FCFS's, in FCFS order; in SPF order a shorter newcomer goes ahead of the queue."""
        return super().horizon(view) if self.order == "fcfs" else FOREVER

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name, "token_budget": self.token_budget, "order": self.order}


class SPF(PriorityPolicy):
    """Shortest prompt first: prompt length is known on arrival; long prompts can starve."""

    name = "spf"

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        return (request.prompt_tokens, request.arrival_s)


def slo_deadline(request: RequestState) -> float:
    """The earliest absolute time the request's SLO cares about (EDF's key)."""
    slo = request.slo
    if slo.kind in ("deadline", "compound"):
        return request.deadline_at
    if slo.kind == "latency":
        return request.arrival_s + (slo.ttft_s if slo.ttft_s is not None else slo.tbt_s or math.inf)
    return math.inf


class EDF(PriorityPolicy):
    """Earliest deadline first over each request's first SLO deadline; best effort last, FCFS."""

    name = "edf"

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        return (slo_deadline(request), request.arrival_s)


class SJFOracle(PriorityPolicy):
    """Shortest job first with the true output length: the non-preemptive upper bound on what a
    perfect length predictor buys."""

    name = "sjf-oracle"
    needs_oracle = True

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        return (request.oracle_output_tokens, request.arrival_s)


def noisy_oracle(sigma: float, seed: int = 0) -> LengthPredictor:
    """A point predictor: the true length times log-normal noise (sigma 0 = exact). A stand-in for
    a learned ranker in tests and ablations; registered predictors replace it via `predict`."""
    rng = np.random.default_rng(seed)

    def predict(request: RequestState) -> float:
        true = request.oracle_output_tokens
        if true is None:
            raise ValueError("noisy_oracle needs a policy with needs_oracle = True")
        return float(true) * (float(np.exp(rng.normal(0.0, sigma))) if sigma > 0 else 1.0)

    return predict


def _check_predictor(predict: Any) -> None:
    """Refuse a `predict` that is not a function of a request. Only code can hand one over
    (`make_policy("ltr", predict=...)`); a spec's value (a string, a number) used to reach the
    policy as it was and fail at the first arrival."""
    if predict is not None and not callable(predict):
        raise ValueError(
            f"predict: expected a length predictor (a function of a request, given in code), got"
            f" {predict!r}; a spec cannot give one: leave predict out for the noisy oracle (sigma)"
        )


class LTR(PriorityPolicy):
    """Rank by a point prediction of the output length made once on arrival (learning-to-rank)."""

    name = "ltr"

    def __init__(self, predict: LengthPredictor | None = None, sigma: float = 0.5, seed: int = 0) -> None:
        _check_predictor(predict)
        super().__init__()
        self.needs_oracle = predict is None
        self.predict = predict or noisy_oracle(sigma, seed)
        self.sigma = sigma if predict is None else None

    def on_arrival(self, request: RequestState, now: float) -> None:
        request.cache["ltr_pred"] = self.predict(request)
        super().on_arrival(request, now)

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        return (request.cache["ltr_pred"], request.arrival_s)

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "predictor": "noisy-oracle" if self.sigma is not None else "custom",
            "sigma": self.sigma,
        }


class Trail(PriorityPolicy):
    """TRAIL: shortest predicted *remaining* length first, predictions refined every `refresh`
    generated tokens, with limited preemption -- a running request may be displaced only while it
    has generated less than `preempt_before` tokens and the engine is full."""

    name = "trail"

    def __init__(
        self,
        predict: LengthPredictor | None = None,
        sigma: float = 0.5,
        refresh: int = 50,
        preempt_before: int = 256,
        seed: int = 0,
    ) -> None:
        _check_predictor(predict)
        super().__init__()
        self.needs_oracle = predict is None
        self.predict = predict or noisy_oracle(sigma, seed)
        self.refresh = refresh
        self.preempt_before = preempt_before

    def _remaining(self, request: RequestState) -> float:
        return max(1.0, request.cache["trail_total"] - request.tokens_generated)

    def on_arrival(self, request: RequestState, now: float) -> None:
        request.cache["trail_total"] = self.predict(request)
        request.cache["trail_at"] = 0
        super().on_arrival(request, now)

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        return (self._remaining(request), request.arrival_s)

    def on_step(self, view: EngineView) -> Plan:
        for request in view.running:
            if request.tokens_generated - request.cache["trail_at"] >= self.refresh:
                # Refinement: a fresh prediction of the total, now conditioned on having got this far.
                request.cache["trail_total"] = max(self.predict(request), request.tokens_generated + 1.0)
                request.cache["trail_at"] = request.tokens_generated
        plan = Plan(admit=self.waiting_in_order(), running_order=self.running_in_order(view.running))
        full = len(view.running) >= view.max_running or view.kv_usage >= FULL_KV_USAGE
        if full and self._waiting:
            best = self._waiting[0][-1]
            victims = [r for r in view.running if r.tokens_generated < self.preempt_before]
            if victims:
                worst = max(victims, key=self._remaining)
                if self._remaining(worst) > self._remaining(best):
                    plan.preempt.append(worst)
        return plan

    def horizon(self, view: EngineView) -> Horizon:
        if not view.running:
            return Horizon()
        # The first request to reach `refresh` tokens since its last refinement ends the run (0
        # when the planned step takes it there); so does crossing the KV level of `full`.
        steps = min(self.refresh - (r.tokens_generated - r.cache["trail_at"]) for r in view.running) - 1
        return Horizon(steps=max(0, steps), kv_usage_below=FULL_KV_USAGE)


class FastServe(PriorityPolicy):
    """FastServe: skip-join multi-level feedback queue. A request joins the level whose quantum
    covers its prompt's first-iteration cost, is demoted after generating its level's quantum of
    tokens (quantum doubles per level), and a waiting request of a higher level preempts a running
    one of a lower level when the engine is full."""

    name = "fastserve"

    def __init__(self, levels: int = 6, base_quantum: int = 32, prompt_tokens_per_quantum: int = 512) -> None:
        super().__init__()
        self.levels = levels
        self.base_quantum = base_quantum
        self.prompt_tokens_per_quantum = prompt_tokens_per_quantum

    def _level(self, request: RequestState) -> int:
        level = request.cache.get("mlfq_level")
        if level is None:
            # Skip-join: the first level whose quantum covers the prompt, level L covering
            # `prompt_tokens_per_quantum * 2**L` tokens: ceil(log2(ceil(prompt / per quantum))).
            join = ((request.prompt_tokens - 1) // self.prompt_tokens_per_quantum).bit_length()
            level = min(self.levels - 1, join)
            request.cache["mlfq_level"] = level
            request.cache["mlfq_used"] = 0
        return level

    def _quantum(self, level: int) -> int:
        return self.base_quantum * (2**level)

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        return (self._level(request), request.arrival_s)

    def on_step(self, view: EngineView) -> Plan:
        for request in view.running:
            level = self._level(request)
            used = request.tokens_generated - request.cache.get("mlfq_base", 0)
            if used >= self._quantum(level) and level < self.levels - 1:
                request.cache["mlfq_level"] = level + 1
                request.cache["mlfq_base"] = request.tokens_generated
        plan = Plan(admit=self.waiting_in_order(), running_order=self.running_in_order(view.running))
        full = len(view.running) >= view.max_running or view.kv_usage >= FULL_KV_USAGE
        if full and self._waiting and view.running:
            best_level = self._waiting[0][0]
            worst = max(reversed(view.running), key=lambda r: (self._level(r), r.arrival_s))
            if self._level(worst) > best_level:
                plan.preempt.append(worst)
        return plan

    def horizon(self, view: EngineView) -> Horizon:
        if not view.running:
            return Horizon()
        # The first request to use up its quantum ends the run (0 when the planned step does);
        # so does crossing the KV level of `full`.
        steps = (
            min(
                self._quantum(self._level(r)) - (r.tokens_generated - r.cache.get("mlfq_base", 0))
                for r in view.running
            )
            - 1
        )
        return Horizon(steps=max(0, steps), kv_usage_below=FULL_KV_USAGE)


# The programs PLAS remembers the service of; the least recently served is forgotten first.
MAX_PROGRAMS = 100_000


class PLAS(PriorityPolicy):
    """Autellix's PLAS: program-level least attained service. A request's priority is the service
    (tokens generated) its program has received so far, taken when it enters the queue, so calls
    of long agentic programs yield to new short ones. A request without a program is its own."""

    name = "plas"

    def __init__(self) -> None:
        super().__init__()
        # Attained service per program, least recently served first (at most `MAX_PROGRAMS`).
        self._attained: OrderedDict[str, int] = OrderedDict()

    @staticmethod
    def _program(request: RequestState) -> str:
        return request.program.program_id if request.program is not None else request.id

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        return (self._attained.get(self._program(request), 0), request.arrival_s)

    def _count(self, request: RequestState) -> None:
        """Add what `request` generated since it was last counted: it keeps its tokens across a
        recompute preemption, so a second preemption must not count the first's again."""
        program = self._program(request)
        new = request.tokens_generated - request.cache.get("plas_counted", 0)
        self._attained[program] = self._attained.get(program, 0) + new
        self._attained.move_to_end(program)
        request.cache["plas_counted"] = request.tokens_generated
        if len(self._attained) > MAX_PROGRAMS:  # a server's memory must not grow with its traffic
            self._attained.popitem(last=False)

    def on_preempt(self, request: RequestState, now: float) -> None:
        self._count(request)
        super().on_preempt(request, now)

    def on_finish(self, request: RequestState, now: float) -> None:
        if request.program is None:  # its own program, over: no later call reads it
            self._attained.pop(request.id, None)
        else:
            self._count(request)
        super().on_finish(request, now)
