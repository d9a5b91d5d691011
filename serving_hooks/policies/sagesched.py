"""SageSched (section 3): order requests by the Gittins index of their predicted service-cost
distribution.

1. Prediction: each arriving request gets an output-length distribution from the `semantic-history`
   component. Its prompt is embedded off the scheduling step (`adapt.predictions`: in replay in
   one batch per step, ready after the engine's prediction delay, by default at once; live in a
   background worker, so vLLM's step never waits on MiniLM). Until its embedding is ready a request
   is ranked on the length-only prediction (neighbours by prompt length: what a request without
   text always gets) and marked `sage_prior`; the embedding re-ranks it when it comes.
2. Cost: a request with input l_in that generates l_out tokens occupies `l_in * l_out + l_out^2 / 2`
   token-steps of KV cache (`cost="kv"`, the paper's compute+memory model: both are proportional to
   it); `cost="output"` is l_out alone and `cost="weighted"` is `l_out + memory_weight * kv`.
3. Order: the Gittins index of the cost distribution S given attained service a,

       G(a) = min over support points s_j > a of  E[min(S, s_j) - a | S > a] / P(S <= s_j | S > a),

   lowest first: the best ratio of expected work to completion probability over all budgets. With
   the support sorted, prefix sums give every budget's ratio at once, O(K) per request.
4. Eviction: the paper assumes swap-based, nearly free preemption; vLLM V1 and our replay preempt
   by recompute, which loses every token the victim computed. By default (`victim="newest"`)
   running requests keep admission order, so KV pressure evicts the newest admitted (vLLM's FCFS
   rule: the fewest tokens lost). With `victim="priority"` they are ordered by index and the
   largest is evicted -- the longest predicted, often the one that computed the most: 11-20% higher
   mean TTLT on `sagesched-mix` at 3.0-3.5 req/s (`experiments.sagesched_study`). A running
   request's index is refreshed when it crosses a bucket boundary (every `bucket` generated tokens,
   200 by default) only where something reads it: the priority victim, or flip preemption; a
   preempted request is re-ranked at its attained service in any case. With `preempt_on_flip`, a
   full engine also preempts a running request whose index exceeds the best waiting one's by
   `flip_ratio` (4x) if its recompute is cheap (fewer than `preempt_below_tokens` tokens); under
   recompute preemption it raised mean TTLT at every load we measured, so it is off by default.
5. Learning online: every completion is added to the history window.

Ablations from the paper: `order="mean"` (mean remaining cost), `order="static"` (Gittins without
refresh; with the default victim the running order needs no index, so it matters only with
`victim="priority"`), `uniform_mix=0.2` (predictions mixed 1:4 with a uniform distribution).

A ceiling of our own, replay only (it reads the true output length, so vLLM refuses it as it refuses
every oracle): `true_lengths="text"` orders the requests that carry prompt text by a point mass at
their true length, `"no-text"` those without text, `"all"` every request. What an ordering gains
with a perfect predictor where only text-bearing requests can be predicted better than from their
length is the most any text predictor can buy on a workload (`experiments.sagesched_study`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from adapt.policy import EngineView, Horizon, Plan, RequestState
from adapt.predictions import Delayed, PredictionQueue, QueueFactory
from predictors.length_distribution import LengthDistribution
from serving_hooks.policies.base import PriorityPolicy
from serving_hooks.policies.baselines import FULL_KV_USAGE

COSTS = ("kv", "output", "weighted")
ORDERS = ("gittins", "mean", "static")
TRUE_LENGTHS = ("none", "text", "no-text", "all")
UNIFORM_MAX_TOKENS = 2048
_ONE_BY_ONE = 8  # refreshes of up to this many requests run in Python floats (`_refresh_one`)
MAX_FLIPS_PER_STEP = 4  # flip preemptions in one step, at most (`preempt_on_flip`)


def service_cost(
    prompt_tokens: np.ndarray | float,
    output_tokens: np.ndarray | float,
    cost: str = "kv",
    memory_weight: float = 0.01,
):
    """Cost of generating `output_tokens` after a prompt of `prompt_tokens` (see module docstring)."""
    l_out = np.asarray(output_tokens, dtype=np.float64)
    kv = prompt_tokens * l_out + l_out * l_out / 2.0
    if cost == "kv":
        return kv
    if cost == "output":
        return l_out
    if cost == "weighted":
        return l_out + memory_weight * kv
    raise ValueError(f"cost: expected one of {', '.join(COSTS)}, got {cost!r}")


def gittins_index(costs: np.ndarray, probs: np.ndarray, attained: np.ndarray) -> np.ndarray:
    """Gittins index of each row's discrete cost distribution given its attained service.

    `costs` (n, K) ascending per row (pad with +inf), `probs` (n, K) (pad with 0), `attained` (n,).
    Rows with no support above their attained service get +inf (the caller decides what that means).
    For budget s_j the ratio's numerator is sum_{a < s_k <= s_j} p_k (s_k - a) + (s_j - a) * P(S > s_j),
    its denominator sum_{a < s_k <= s_j} p_k (the 1 / P(S > a) normalisations cancel).
    """
    a = np.asarray(attained, dtype=np.float64)[:, None]
    alive = (costs > a) & (probs > 0)
    p = np.where(alive, probs, 0.0)
    c = np.where(alive, costs, 0.0)  # padding (+inf) must not reach a product: 0 * inf is nan
    mass = np.cumsum(p, axis=1)
    work = np.cumsum(p * c, axis=1)
    tail = mass[:, -1:] - mass
    with np.errstate(invalid="ignore", over="ignore"):
        numerator = work - a * mass + np.where(alive, c - a, 0.0) * tail
        ratio = np.where(alive, numerator / np.where(mass > 0, mass, 1.0), np.inf)
    return ratio.min(axis=1)


def gittins_index_one(costs: Sequence[float], probs: Sequence[float], attained: float) -> float:
    """`gittins_index` of one distribution, in Python floats: the same operations in the same order
    (numpy's cumsum adds left to right; entries that are not alive add zeros, so they are skipped),
    hence the same value, without numpy's fixed cost per call -- most refreshes are one request.
    `costs` ascend (as `gittins_index` has them), so the support above `attained` is the suffix
    from the bisection point."""
    start = bisect.bisect_right(costs, attained)
    total = 0.0  # the last cumulative mass, summed as the cumsum sums it
    for p in probs[start:]:
        if p > 0:
            total += p
    best, mass, work = math.inf, 0.0, 0.0
    for c, p in zip(costs[start:], probs[start:], strict=True):
        if not p > 0:
            continue
        mass += p
        work += p * c
        ratio = (work - attained * mass + (c - attained) * (total - mass)) / mass
        if ratio < best:
            best = ratio
        elif ratio != ratio:  # nan: numpy's min returns it
            return ratio
    return best


def mean_remaining(costs: np.ndarray, probs: np.ndarray, attained: np.ndarray) -> np.ndarray:
    """E[S - a | S > a] per row (the `order="mean"` ablation); +inf where no support is above a."""
    a = np.asarray(attained, dtype=np.float64)[:, None]
    alive = (costs > a) & (probs > 0)
    p = np.where(alive, probs, 0.0)
    total = p.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = (p * (np.where(alive, costs, 0.0) - a)).sum(axis=1) / total
    return np.where(total > 0, expected, np.inf)


class SageSched(PriorityPolicy):
    """See the module docstring. `history` is a fitted `SemanticHistory` (the policy works on its own
    copy), a dict of its parameters (an empty window that learns online), or None (an empty default
    window; `make_policy` loads a registry reference such as `champion` or `v3` given by name);
    `history_mode` overrides its mode."""

    name = "sagesched"
    needs_prompt_text = True
    components = {"history": "semantic-history"}  # noqa: RUF012

    def __init__(
        self,
        history: Any = None,
        history_mode: str | None = None,
        cost: str = "kv",
        memory_weight: float = 0.01,
        order: str = "gittins",
        bucket: int = 200,
        uniform_mix: float = 0.0,
        learn_online: bool = True,
        preempt_on_flip: bool = False,
        flip_ratio: float = 4.0,
        preempt_below_tokens: int = 512,
        victim: str = "newest",
        true_lengths: str = "none",
    ) -> None:
        super().__init__(victim)
        if cost not in COSTS:
            raise ValueError(f"cost: expected one of {', '.join(COSTS)}, got {cost!r}")
        if order not in ORDERS:
            raise ValueError(f"order: expected one of {', '.join(ORDERS)}, got {order!r}")
        if bucket < 1:
            raise ValueError(f"bucket: expected >= 1 tokens, got {bucket!r}")
        if not 0.0 <= uniform_mix <= 1.0:
            raise ValueError(f"uniform_mix: expected a weight in [0, 1], got {uniform_mix!r}")
        if not memory_weight >= 0.0:  # a cost that falls as a request grows orders nothing sensibly
            raise ValueError(f"memory_weight: expected >= 0, got {memory_weight!r}")
        if true_lengths not in TRUE_LENGTHS:
            raise ValueError(f"true_lengths: expected one of {', '.join(TRUE_LENGTHS)}, got {true_lengths!r}")
        self.true_lengths = true_lengths
        self.needs_oracle = true_lengths != "none"
        if history_mode is not None:
            from predictors.semantic_history import MODES

            if history_mode not in MODES:
                raise ValueError(f"history_mode: expected one of {', '.join(MODES)}, got {history_mode!r}")
        # The predictor ablation's mode holds for every version swapped in; None: each version's own.
        self.history_mode = history_mode
        self.history = self._own_history(history)
        self.cost = cost
        self.memory_weight = memory_weight
        self.order = order
        self.bucket = int(bucket)
        self.uniform_mix = float(uniform_mix)
        self.learn_online = learn_online
        self.preempt_on_flip = preempt_on_flip
        self.flip_ratio = flip_ratio
        self.preempt_below_tokens = preempt_below_tokens
        # A running request's index decides its place in the running order (whom KV pressure
        # evicts, with the priority victim) and flip preemptions; with neither, refreshing it every
        # bucket changes nothing.
        self._indexes_running = victim == "priority" or preempt_on_flip
        self._new: dict[str, RequestState] = {}  # arrived since the last step, not yet ranked
        self._awaiting: dict[str, RequestState] = {}  # embedding submitted, not yet here
        self._predictions: PredictionQueue = Delayed(PromptEmbeddings())
        # The last running order and the running requests it sorted; reused while the same
        # requests run and no index has changed (most steps), since the sort runs every step.
        self._keys = _IndexKeys()
        # Tokens generated at which each indexed request's index is next refreshed (the first
        # bucket boundary, a multiple of `bucket`, above sage_at: `_next_boundary`), looked up by
        # request: the bucket-crossing scan runs every step.
        self._due = _RefreshDue(self.bucket)
        self._sorted: list[RequestState] = []
        self._sorted_for: tuple[RequestState, ...] = ()

    def use_predictions(self, queues: QueueFactory) -> None:
        """Embeddings run where the engine says; ones already submitted are submitted again there
        (none is lost when a live engine swaps this policy in with requests waiting)."""
        self._predictions.close()
        self._predictions = queues(PromptEmbeddings())
        for request in list(self._awaiting.values()):
            if not self._ask(request, request.arrival_s):  # the new queue is full: its prior it is
                del self._awaiting[request.id]

    def use_component(self, attribute: str, component: Any) -> None:
        """A new history version replaces the window: in its own mode unless `history_mode` says
        otherwise, as it would had the policy been built with it (how a replay loads its version),
        so a swapped-in version predicts live as it does in replay."""
        self.history = self._own_history(component)

    def _own_history(self, history: Any) -> Any:
        """The policy's own copy of `history` (any form `resolve_history` takes), in its mode."""
        own = resolve_history(history)
        if self.history_mode is not None:
            own.mode = self.history_mode
        return own

    def length_estimate(self, request: RequestState) -> tuple[str, float] | None:
        """The component and the mean of the output-length distribution `request` was ordered by,
        read when it finishes to measure the predictions' rank correlation online
        (`serving_hooks.quality`); None if it finished before it was predicted."""
        distribution = request.cache.get("sage_distribution")
        return None if distribution is None else (self.components["history"], float(distribution.mean))

    def neighbour_match(self, request: RequestState) -> tuple[str, bool] | None:
        """The component and whether `request` had enough close neighbours in the window, for a
        request with text whose embedding was used (None otherwise: a request without text never
        matches, and counting it would measure the traffic's share of text instead)."""
        cache = request.cache
        if not cache.get("sage_has_text") or cache.get("sage_prior", True):
            return None
        return self.components["history"], bool(cache["sage_matched"])

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "predictor": self.history.mode,
            "history_size": self.history.size,
            "history_version": self.history.metadata.get("registry_version"),
            "cost": self.cost,
            "order": self.order,
            "bucket": self.bucket,
            "uniform_mix": self.uniform_mix,
            "true_lengths": self.true_lengths,
        }

    # ------------------------------------------------------------ lifecycle
    def on_arrival(self, request: RequestState, now: float) -> None:
        self._new[request.id] = request  # ranked at the next step, with that step's other arrivals
        if self._ask(request, now):
            self._awaiting[request.id] = request

    def _ask(self, request: RequestState, now: float) -> bool:
        """Ask for `request`'s embedding; False if it will have none (no text, or a full queue). One
        it arrived with, or one a policy before this one got (a policy swapped in live is handed
        the requests in flight), is handed over at the next step, as a model that costs nothing
        would: embedding it again would put it back on its prior, and fill the queue."""
        known = _known_embedding(request)
        if known is not None:
            self._predictions.supply(request.id, (known, True), now)
            return True
        return bool(request.prompt_text) and self._predictions.submit(request.id, request.prompt_text, now)

    def on_preempt(self, request: RequestState, now: float) -> None:
        self._refresh([request])
        super().on_preempt(request, now)

    def on_finish(self, request: RequestState, now: float) -> None:
        self._new.pop(request.id, None)
        if self._awaiting.pop(request.id, None) is not None:
            self._predictions.discard(request.id, now)
        self._keys.pop(request, None)
        self._due.pop(request, None)
        super().on_finish(request, now)
        # Only answers that ended: a request its client aborted (or a policy dropped) has no
        # `finish_s`, and its length so far would teach the history that such prompts are short.
        answered = request.finish_s is not None and request.tokens_generated > 0
        if self.learn_online and answered and "sage_embedding" in request.cache:
            has_text = request.cache["sage_has_text"]
            self.history.observe(
                [request.prompt_tokens],
                [request.tokens_generated],
                request.cache["sage_embedding"][None, :],
                [has_text],
                [request.cache["sage_hash"]],
            )

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        return _index_key(request)

    def running_in_order(self, running: Sequence[RequestState]) -> list[RequestState] | None:
        """`PriorityPolicy.running_in_order` with the key taken directly: the index does not
        depend on the time, and this sort runs every step (so it is reused while the running
        requests and their indices stay the same: `_refresh` clears it)."""
        if self.victim == "newest":
            return None  # vLLM's running order: the newest admitted is evicted first
        members = tuple(running)
        if members != self._sorted_for:
            self._sorted = sorted(members, key=self._keys.__getitem__)
            self._sorted_for = members
        return list(self._sorted)

    # ----------------------------------------------------------- prediction
    def _predict(self, now: float) -> None:
        """Rank the step's new requests and re-rank those whose embedding came: one history lookup
        for all. A new request whose embedding is not ready is ranked on the length-only
        prediction (its prior) meanwhile; one without text, or refused by a full queue, keeps it."""
        from adapt.traces import prompt_hash
        from predictors.embedding import DIMENSION

        embedded = dict(self._predictions.ready(now)) if self._awaiting else {}
        new, self._new = self._new, {}
        batch = [*new.values(), *(self._awaiting[key] for key in embedded if key not in new)]
        if not batch:
            return
        embeddings = np.zeros((len(batch), DIMENSION), dtype=np.float32)
        has_text = np.zeros(len(batch), dtype=bool)
        for row, request in enumerate(batch):
            if request.id in embedded:
                embeddings[row], has_text[row] = embedded[request.id]
                del self._awaiting[request.id]
        prompts = [r.prompt_tokens for r in batch]
        distributions, matched = self.history.predict_with_matches(prompts, embeddings, has_text)
        for request, distribution, embedding, text_flag, match in zip(
            batch, distributions, embeddings, has_text, matched.tolist(), strict=True
        ):
            if self._knows_true_length(request):
                distribution = LengthDistribution.point(float(request.oracle_output_tokens))
            if self.uniform_mix > 0:
                high = min(request.max_tokens or UNIFORM_MAX_TOKENS, UNIFORM_MAX_TOKENS)
                distribution = distribution.mix(LengthDistribution.uniform(1, max(2, high)), self.uniform_mix)
            request.cache.pop("sage_costs", None)
            request.cache.pop("sage_support", None)
            request.cache.update(
                sage_distribution=distribution,
                sage_embedding=embedding,
                sage_has_text=bool(text_flag),
                sage_hash=prompt_hash(request.prompt_text),
                sage_prior=request.id in self._awaiting,
                sage_matched=match,
            )
        self._refresh(batch)
        for request in batch:
            if request.id in self._entries:  # waiting on its prior: take its new place in line
                self._remove(request)
                self._insert(request, request.arrival_s)
            elif request.id in new:  # (a running one re-sorts by its new key)
                self._insert(request, request.arrival_s)

    def _knows_true_length(self, request: RequestState) -> bool:
        """Whether the `true_lengths` ceiling gives `request` its true length (see the docstring)."""
        if self.true_lengths in ("none", "all"):
            return self.true_lengths == "all"
        has_text = bool(request.prompt_text) or request.prompt_embedding is not None
        return has_text == (self.true_lengths == "text")

    def _refresh(self, requests: Sequence[RequestState]) -> None:
        """Recompute the index of each request at its attained service, in one vectorised pass.
        A request's support costs never change (prompt and distribution are fixed), so they are
        computed once per prediction and cached."""
        if not requests:
            return
        count = len(requests)
        for request in requests:
            if "sage_costs" not in request.cache:
                distribution: LengthDistribution = request.cache["sage_distribution"]
                request.cache["sage_costs"] = self._cost(request.prompt_tokens, distribution.support)
        if count <= _ONE_BY_ONE and self.order != "mean":
            for request in requests:
                self._refresh_one(request)
            return
        width = max(r.cache["sage_costs"].size for r in requests)
        costs = np.full((count, width), np.inf)
        probs = np.zeros((count, width))
        for row, request in enumerate(requests):
            size = request.cache["sage_costs"].size
            costs[row, :size] = request.cache["sage_costs"]
            probs[row, :size] = request.cache["sage_distribution"].probs
        prompts = np.fromiter((r.prompt_tokens for r in requests), np.float64, count)
        generated = np.fromiter((r.tokens_generated for r in requests), np.float64, count)
        attained = self._cost(prompts, generated)
        index = (mean_remaining if self.order == "mean" else gittins_index)(costs, probs, attained)
        # Longer than anything predicted: expect one more bucket of tokens.
        beyond = self._cost(prompts, generated + self.bucket) - attained
        index = np.where(np.isfinite(index), index, beyond)
        for request, value in zip(requests, index.tolist(), strict=True):
            request.cache["sage_index"] = value
            request.cache["sage_at"] = request.tokens_generated
            self._keys[request] = (value, request.arrival_s)
            self._due[request] = self._next_boundary(request.tokens_generated)
        self._sorted_for = ()  # indices changed: re-sort the running requests

    def _refresh_one(self, request: RequestState) -> None:
        """`_refresh` of one request (most refreshes are of one or two: a bucket crossing, a step's
        arrivals), in Python floats: the same operations as the vectorised pass, without numpy's
        fixed cost per call."""
        prompt, generated = float(request.prompt_tokens), float(request.tokens_generated)
        attained = self._cost_one(prompt, generated)
        support = request.cache.get("sage_support")
        if support is None:  # the costs and probabilities as lists, once per prediction
            costs, probs = request.cache["sage_costs"], request.cache["sage_distribution"].probs
            support = request.cache["sage_support"] = (costs.tolist(), probs.tolist())
        index = gittins_index_one(*support, attained)
        if not math.isfinite(index):  # longer than anything predicted: one more bucket of tokens
            index = self._cost_one(prompt, generated + self.bucket) - attained
        request.cache["sage_index"] = index
        request.cache["sage_at"] = request.tokens_generated
        self._keys[request] = (index, request.arrival_s)
        self._due[request] = self._next_boundary(request.tokens_generated)
        self._sorted_for = ()  # indices changed: re-sort the running requests

    def _next_boundary(self, tokens_generated: int) -> int:
        """The first bucket boundary above `tokens_generated`. Boundaries are fixed multiples of
        `bucket` (the paper refreshes "only at bucket boundaries"): a request re-ranked inside a
        bucket -- preempted, or its embedding late -- is refreshed again where the bucket ends,
        not `bucket` tokens after the re-rank."""
        return (tokens_generated // self.bucket + 1) * self.bucket

    def _cost(self, prompt_tokens: np.ndarray | float, output_tokens: np.ndarray | float) -> np.ndarray:
        return service_cost(prompt_tokens, output_tokens, self.cost, self.memory_weight)

    def _cost_one(self, prompt_tokens: float, output_tokens: float) -> float:
        """`service_cost` of one request in Python floats (the same operations in the same order)."""
        kv = prompt_tokens * output_tokens + output_tokens * output_tokens / 2.0
        if self.cost == "kv":
            return kv
        if self.cost == "output":
            return output_tokens
        return output_tokens + self.memory_weight * kv

    # ------------------------------------------------------------------ step
    def on_step(self, view: EngineView) -> Plan:
        if self._new or self._awaiting:
            self._predict(view.now)
        if self.order != "static" and self._indexes_running:
            due = self._due
            crossed = [r for r in view.running if r.tokens_generated >= due[r]]
            self._refresh(crossed)
        plan = Plan(admit=self.waiting_in_order(), running_order=self.running_in_order(view.running))
        full = len(view.running) >= view.max_running or view.kv_usage >= FULL_KV_USAGE
        if self.preempt_on_flip and full and self._waiting:
            victims = [r for r in view.running if r.tokens_computed < self.preempt_below_tokens]
            worst_first = sorted(victims, key=lambda r: self.key(r, view.now), reverse=True)
            for waiting, running in zip(self.waiting_in_order(), worst_first, strict=False):
                if len(plan.preempt) >= MAX_FLIPS_PER_STEP:
                    break
                if waiting.cache["sage_index"] * self.flip_ratio >= running.cache.get("sage_index", np.inf):
                    break
                plan.preempt.append(running)
        return plan

    def horizon(self, view: EngineView) -> Horizon:
        until = self._predictions.next_ready_s if self._awaiting else math.inf  # it re-ranks one
        if not view.running:
            return Horizon(until_s=until)
        if self.order == "static" or not self._indexes_running:
            # no bucket refresh: only the KV level of "full" changes the plan
            return Horizon(until_s=until, kv_usage_below=FULL_KV_USAGE)
        due = self._due
        steps = min(due[r] - r.tokens_generated for r in view.running) - 1  # a bucket refresh ends it
        return Horizon(steps=max(0, steps), until_s=until, kv_usage_below=FULL_KV_USAGE)


class PromptEmbeddings:
    """The model call SageSched makes off the scheduling step: (embedding, has text) per prompt,
    in one batch. A live worker calls `warm_up` first, so the model is loaded before a prompt
    waits for it."""

    def __call__(self, texts: list[str]) -> list[tuple[np.ndarray, bool]]:
        from predictors.semantic_history import embed_prompts

        embeddings, has_text = embed_prompts(texts)
        return list(zip(embeddings, has_text.tolist(), strict=True))

    def warm_up(self) -> None:
        from predictors.embedding import load_model

        load_model()


class _IndexKeys(dict):
    """`_index_key` of each request the policy has indexed, updated with its index: the running
    sort, every step, then looks keys up in C instead of calling a Python key per request."""

    def __missing__(self, request: RequestState) -> tuple[float, float]:
        return _index_key(request)


class _RefreshDue(dict):
    """Request -> tokens generated at which its index is refreshed next; `bucket` for a request
    never indexed (as if indexed at 0 tokens)."""

    def __init__(self, bucket: int) -> None:
        super().__init__()
        self.bucket = bucket

    def __missing__(self, request: RequestState) -> int:
        return self.bucket


def _known_embedding(request: RequestState) -> np.ndarray | None:
    """`request`'s prompt embedding where no model need compute it: the vector it arrived with,
    else the one it was ranked on (`sage_has_text`: only an embedding of its text sets it)."""
    if request.prompt_embedding is not None:
        return request.prompt_embedding
    return request.cache["sage_embedding"] if request.cache.get("sage_has_text") else None


def _index_key(request: RequestState) -> tuple[float, float]:
    # A request the policy never indexed (an engine fell back to FCFS for a step) sorts last.
    return (request.cache.get("sage_index", np.inf), request.arrival_s)


def resolve_history(history: Any):
    """A `SemanticHistory` of the policy's own from any form `SageSched(history=...)` accepts."""
    from predictors.semantic_history import SemanticHistory

    if history is None:
        return SemanticHistory()
    if isinstance(history, SemanticHistory):
        return history.copy()
    if isinstance(history, dict):
        empty = SemanticHistory(**history)
        empty._validate_params()  # not at its first completion: a policy-config's canary only builds it
        return empty
    raise ValueError(
        f"history: expected a SemanticHistory or a dict of its parameters, got {type(history).__name__}"
    )


class HistoryLengthPredictor:
    """A point predictor of the total output length from a `semantic-history`, for the point-based
    baselines (`ltr`, `trail`) in place of their noisy oracle: the mean of the predicted
    distribution conditioned on the tokens generated so far (E[S | S > g]; g + bucket past the
    support), so TRAIL's refinement sees the same information SageSched's refresh does. A class,
    not a closure, so a policy built with it pickles to a replay worker."""

    def __init__(self, history: Any, bucket: int = 200) -> None:
        self.history = resolve_history(history)
        self.bucket = bucket

    def __call__(self, request: RequestState) -> float:
        from predictors.semantic_history import embed_prompts

        if "point_distribution" not in request.cache:
            embeddings, has_text = embed_prompts([request.prompt_text])
            request.cache["point_distribution"] = self.history.predict_embedded(
                [request.prompt_tokens], embeddings, has_text
            )[0]
        distribution: LengthDistribution = request.cache["point_distribution"]
        above = distribution.support > request.tokens_generated
        if not above.any():
            return float(request.tokens_generated + self.bucket)
        probs = distribution.probs[above]
        return float(distribution.support[above] @ probs / probs.sum())
