"""EWSJF (KDD'26): prompt-length queues, density-weighted scoring, adjacent backfill.

Dispatcher: a request goes to the queue whose [low, high] interval holds its prompt length; in a
gap between queues i and i+1 it joins queue i if within +10% of its high end, queue i+1 if within
-10% of its low end, else a new *bubble* queue of width min(bubble_width, gap) centred on it
(Algorithm 2). Score of a queue's head request r with prompt length b (equation 4):

    score = qf * (w_base + w_urg(mean_q) * cs + w_fair(mean_q) * log(b + 1)),
    qf = q_index / (b + 1),  cs = wait / C_prefill(b)

q_index counts queues from 1 in increasing length. The best queue fills the batch first, then
its neighbours outward (Algorithm 1's GreedyFill + Backfill). A queue empty for more than
`empty_threshold` steps is removed. Per step the cost is O(number of queues).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from sortedcontainers import SortedList

from adapt.component import registry_version
from adapt.policy import FOREVER, EngineView, Horizon, Plan, Policy, RequestState
from predictors.ewsjf_meta import EwsjfMetaPolicy, QueueSpec, layout_group_terms

ROUTED_KEPT = 10_000


class LengthQueue:
    """One prompt-length interval and its FIFO of waiting requests."""

    __slots__ = ("assigned", "bubble", "empty_since", "high", "items", "low", "mean")

    def __init__(self, low: float, high: float, mean: float, bubble: bool = False) -> None:
        self.low, self.high, self.mean, self.bubble = low, high, mean, bubble
        self.items: OrderedDict[str, RequestState] = OrderedDict()
        self.empty_since: int | None = None  # engine step at which the queue went empty
        # The prompt lengths routed here, for equation 5's layout terms (`layout_report`): the
        # newest `ROUTED_KEPT`, so a server's memory does not grow with every request it serves.
        self.assigned: deque[int] = deque(maxlen=ROUTED_KEPT)


def _check_meta(meta: Any) -> None:
    """Refuse a `meta` the policy cannot read its layout and weights from: a spec's number or list
    reaches the constructor as it is (only a string is a registry reference, which `make_policy`
    loads first), and used to fail with an AttributeError when the replay started."""
    if not (meta is None or isinstance(meta, dict) or callable(getattr(meta, "w_urg", None))):
        raise ValueError(
            "meta: expected a registered ewsjf-meta-policy (a version vN or an alias such as champion),"
            f" a dict of its parameters, or null, got {meta!r}"
        )


class EWSJF(Policy):
    name = "ewsjf"
    components = {"meta": "ewsjf-meta-policy"}  # noqa: RUF012

    def __init__(
        self,
        meta: EwsjfMetaPolicy | dict[str, Any] | None = None,
        queues: list[dict[str, float]] | None = None,
        prefill_base_s: float = 0.01,
        prefill_per_token_s: float = 5e-5,
    ) -> None:
        _check_meta(meta)
        if meta is None or isinstance(meta, dict):
            meta = EwsjfMetaPolicy(**(meta or {}))
            meta.queues_ = [QueueSpec(**q) for q in (queues or DEFAULT_LAYOUT)]
        self.meta = meta
        self.prefill_base_s = prefill_base_s
        self.prefill_per_token_s = prefill_per_token_s
        self.queues: list[LengthQueue] = [LengthQueue(q.low, q.high, q.mean) for q in meta.queues_]
        self.bubbles_created = 0
        self._where: dict[str, LengthQueue] = {}
        # What each waiting request needs computed to be admitted, smallest first (`horizon`).
        self._needs = SortedList()
        self._need: dict[str, int] = {}

    def use_component(self, attribute: str, component: Any) -> None:
        """A new meta-policy brings a new queue layout (`relayout`)."""
        super().use_component(attribute, component)
        self.relayout(component.queues_)

    def relayout(self, specs: list[QueueSpec]) -> None:
        """Rebuild the queues from `specs` and re-route every waiting request, oldest first, so
        none is lost and each keeps its place in line."""
        waiting = sorted(
            (r for queue in self.queues for r in queue.items.values()), key=lambda r: r.arrival_s
        )
        self.queues = [LengthQueue(q.low, q.high, q.mean) for q in specs]
        self._where = {}
        for request in waiting:
            queue = self._queue_for(request.prompt_tokens)
            queue.items[request.id] = request
            self._where[request.id] = queue

    # ------------------------------------------------------------ dispatcher
    def _queue_for(self, length: float) -> LengthQueue:
        """Algorithm 2: the holding queue, a neighbour within 10%, or a new bubble queue."""
        queues = self.queues
        if not queues:
            self.queues.append(LengthQueue(length, length, length, bubble=True))
            self.bubbles_created += 1
            return self.queues[0]
        i = bisect.bisect_right([q.low for q in queues], length) - 1
        if i < 0:
            return queues[0]
        if i > 0 and length <= queues[i - 1].high:  # a bubble may begin where its left queue ends:
            i -= 1  # that length is the left queue's (its upper end is inclusive)
        left = queues[i]
        if length <= left.high or i + 1 == len(queues):
            return left
        right = queues[i + 1]
        if length <= left.high * 1.10:
            return left
        if length >= right.low * 0.90:
            return right
        available = right.low - left.high
        width = min(self.meta.bubble_width, available)
        low = max(length - width / 2, left.high)
        high = min(length + width / 2, right.low)
        bubble = LengthQueue(low, high, length, bubble=True)
        queues.insert(i + 1, bubble)
        self.bubbles_created += 1
        return bubble

    def on_arrival(self, request: RequestState, now: float) -> None:
        queue = self._queue_for(request.prompt_tokens)
        queue.items[request.id] = request
        queue.assigned.append(request.prompt_tokens)
        self._where[request.id] = queue
        self._note_need(request)

    def on_preempt(self, request: RequestState, now: float) -> None:
        queue = self._queue_for(request.prompt_tokens)
        queue.items[request.id] = request
        queue.items.move_to_end(request.id, last=False)  # it has waited longest
        self._where[request.id] = queue
        self._note_need(request)

    def on_admit(self, request: RequestState, now: float) -> None:
        queue = self._where.pop(request.id, None)
        if queue is not None:
            queue.items.pop(request.id, None)
        need = self._need.pop(request.id, None)
        if need is not None:
            self._needs.remove(need)

    def _note_need(self, request: RequestState) -> None:
        """A waiting request's tokens to compute stay as they are until it is admitted."""
        self._need[request.id] = request.tokens_to_compute
        self._needs.add(request.tokens_to_compute)

    on_finish = on_admit

    # --------------------------------------------------------------- scoring
    def prefill_cost(self, length: float) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * length

    def score(self, request: RequestState, queue_index: int, queue_mean: float, now: float) -> float:
        """Equation 4 for the head request of the queue at 1-based `queue_index`."""
        b = request.prompt_tokens
        qf = queue_index / (b + 1)
        cs = max(0.0, now - request.arrival_s) / self.prefill_cost(b)
        return qf * (
            self.meta.w_base
            + self.meta.w_urg(queue_mean) * cs
            + self.meta.w_fair(queue_mean) * math.log(b + 1)
        )

    def score_slope(self, request: RequestState, queue_index: int, queue_mean: float) -> float:
        """How fast `score` grows with `now` while the request waits: equation 4 is linear in
        the wait, so two heads' order can change only where their lines cross (`horizon`)."""
        b = request.prompt_tokens
        return queue_index / (b + 1) * self.meta.w_urg(queue_mean) / self.prefill_cost(b)

    def on_step(self, view: EngineView) -> Plan:
        best, best_score = -1, -math.inf
        survivors = []
        for queue in self.queues:
            # Counted in engine steps, not calls: the replay engine's decode runs advance many
            # steps per call, and pruning must not depend on that.
            if queue.items:
                queue.empty_since = None
                survivors.append(queue)
            else:
                if queue.empty_since is None:
                    queue.empty_since = view.step_index
                if view.step_index - queue.empty_since < self.meta.empty_threshold:
                    survivors.append(queue)
        self.queues = survivors
        for index, _, _, value in self._scored_heads(view.now):
            if value > best_score:
                best, best_score = index, value
        return Plan(admit=self._fill_order(best) if best >= 0 else None)

    def _scored_heads(self, now: float) -> Iterator[tuple[int, LengthQueue, RequestState, float]]:
        """Each non-empty queue's position (from 0), the queue, its head and the head's score: what
        `on_step` picks the best of, and `horizon` foresees the next pick from."""
        for index, queue in enumerate(self.queues):
            if queue.items:
                head = next(iter(queue.items.values()))
                yield index, queue, head, self.score(head, index + 1, queue.mean, now)

    @staticmethod
    def _first_chunk_fits(tokens: int, budget: int, view: EngineView) -> bool:
        """Whether the first chunk of a request needing `tokens` (at most `budget`) fits in the
        free KV blocks."""
        return -(-min(tokens, budget) // view.kv_block_size) <= view.kv_free_blocks

    def horizon(self, view: EngineView) -> Horizon:
        """The engine asks only of a plan that admits nothing: the best queue's head does not fit
        (vLLM's head-of-line rule), or nothing waits. Scores grow with waiting time, so what the
        plan admits changes when the head of a queue that might fit overtakes the best one
        (`_overtaken_s`; a head that does not fit may overtake too, and still nothing is admitted);
        nothing changes while no waiting request can be admitted whatever the order -- the
        running cap is reached, or even the smallest first chunk needs more KV blocks than are
        free (decodes only take blocks until a completion, which ends the run) -- nor with empty
        queues, until an empty queue is due to be pruned."""
        until_s = math.inf
        if self._needs:
            budget = max(1, view.token_budget - len(view.running))
            blocked = len(view.running) >= view.max_running or not self._first_chunk_fits(
                self._needs[0], budget, view
            )
            if not blocked:
                until_s = self._overtaken_s(view, budget)
                if until_s <= view.now:
                    return Horizon(steps=0)
        # An empty queue is pruned at the step `empty_threshold` after it went empty; the next
        # arrival is routed by the queues as they are then, so that step is planned afresh.
        prune = [
            q.empty_since + self.meta.empty_threshold
            for q in self.queues
            if not q.items and q.empty_since is not None
        ]
        steps = max(0, min(prune) - view.step_index - 1) if prune else math.inf
        return Horizon(steps=steps, until_s=until_s) if prune or until_s < math.inf else FOREVER

    def _overtaken_s(self, view: EngineView, budget: int) -> float:
        """When the plan may next change: the earliest time at which the head of a queue whose
        first chunk fits in the free KV blocks now scores above the best queue's head; now if
        the best head fits (nothing then says the engine could not admit it). Free blocks only
        shrink until a completion ends the run, so a head that does not fit now cannot later in
        it. A little early, never late: the scores' rounding must not let `on_step` see the
        crossing before this time."""
        now = view.now
        heads = [
            (
                score,
                self.score_slope(head, index + 1, queue.mean),
                self._first_chunk_fits(head.tokens_to_compute, budget, view),
            )
            for index, queue, head, score in self._scored_heads(now)
        ]
        best_score, best_slope, best_fits = max(heads, key=lambda h: h[0])  # the first of equals
        if best_fits:
            return now
        earliest = math.inf
        for score, slope, fits in heads:
            if fits and slope > best_slope:  # (the best's own line does not fit)
                gap = slope - best_slope
                crossing = now + (best_score - score) / gap
                scale = abs(best_score) + abs(score) + abs(best_slope) * (crossing - now)
                earliest = min(earliest, crossing - 1e-9 * scale / gap - 1e-9 * abs(crossing))
        return earliest

    def _fill_order(self, primary: int) -> Iterator[RequestState]:
        """The primary queue first, then its neighbours outward, nearest first."""
        order = [primary]
        for distance in range(1, len(self.queues)):
            for index in (primary - distance, primary + distance):
                if 0 <= index < len(self.queues):
                    order.append(index)
        for index in order:
            # The engine admits only after it stops iterating, so no queue changes under us.
            yield from self.queues[index].items.values()

    def layout_report(self) -> dict[str, float]:
        """Equation 5's structural terms over the requests routed so far."""
        groups = [np.asarray(q.assigned, dtype=np.float64) for q in self.queues if q.assigned]
        terms = layout_group_terms(groups, len(self.queues), self.meta.max_queues)
        terms["bubbles_created"] = float(self.bubbles_created)
        return terms

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            **self.meta.get_params(),
            "queues": len(self.queues),
            # the registered version the layout came from (a copy adopted online keeps none)
            "meta_version": registry_version(self.meta),
        }


# A hand-set layout for bimodal short/long workloads, used only when no fitted component is given
# (`adapt train ewsjf-meta-policy` fits one with Refine-and-Prune on real prompt lengths).
DEFAULT_LAYOUT: list[dict[str, float]] = [
    {"low": 1, "high": 128, "mean": 64, "share": 0.4},
    {"low": 129, "high": 512, "mean": 300, "share": 0.4},
    {"low": 1024, "high": 2048, "mean": 1500, "share": 0.1},
    {"low": 2049, "high": 4096, "mean": 3000, "share": 0.1},
]
