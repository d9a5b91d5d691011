"""Prometheus metrics of an `adapt` policy serving inside vLLM, on the server's own `/metrics`.

Across processes. `PolicyScheduler` runs in vLLM's engine-core process; `/metrics` is answered by
the API-server process from `vllm.v1.metrics.prometheus.get_prometheus_registry()`, which is
prometheus_client's `MultiProcessCollector` whenever `PROMETHEUS_MULTIPROC_DIR` is set (vLLM's own
mode when it runs several API servers). `adapt serve` therefore gives the server a fresh
`PROMETHEUS_MULTIPROC_DIR` (or keeps the operator's): every process of the server -- the API server
with its `vllm:*` metrics, the engine core with these `adapt_*` ones -- writes its values to
memory-mapped files there, and one scrape of `/metrics` reads them all, counters of several engine
cores summed. We chose this over the engine core writing a snapshot file for a custom collector in
the API server because it needs no format or channel of our own: prometheus_client writes the
values and vLLM's own collector reads them, whereas a snapshot means serialising the registry on
the scheduler's thread and parsing it back in the API server. The price: vLLM's `/metrics` then
omits the default registry's process and GC collectors, and an update is a locked write into a
mapped file (a few microseconds on this machine, `experiments.bench_metrics`). So the per-step and
per-request paths only add to numbers in memory (`_Pending`), and `publish`, once per
`publish_interval_s` (1 s) and whenever the engine goes idle, writes them out -- one write per
counter child and per touched histogram bucket, whatever the traffic; a scrape sees counts up to
that long late. Outside a multiprocess directory (tests, the benchmark harness) the same metrics
live in the recorder's own `registry`.

What is recorded (labels are bounded: SLO class = SLO kind, tier (the first MAX_TIERS seen, then
"other"), cause, reason, component name; never a request id or prompt text):
- per step: the time the policy and adapter take before vLLM schedules (`adapt_step_seconds`), the
  engine's step time as the scheduler sees it (gap between schedule calls), admissions, deferred
  running requests, preemptions by cause (the policy's plan, or vLLM under KV pressure), drops by
  reason, steps that fell back to FCFS because the policy raised, policy errors;
- per request that leaves: SLO outcome by class and tier (met | violated | dropped; client aborts
  apart), token goodput, TTFT and mean TBT as the scheduler sees them (when a step's output reaches
  it, not when the client reads the token), and the request's prediction against its true length
  for the online quality windows (`serving_hooks.quality`);
- every `publish_interval_s`: waiting requests by class, running requests, KV usage and SLAI's
  offset and threshold, the live policy and component versions, swaps and failed swaps, when the
  last swap happened, length-bound coverage / over-estimation, rank correlation of length
  estimates, and the drift alarm (coverage more than `drift_margin` below the serving version's
  registered held-out coverage, once the window holds `drift_least` requests).

Per version: a component's windows measure one version. When the version serving it changes (its
live slot swapped, or without live slots the loaded component's `registry_version`), its windows
start afresh and the old version's last figures are kept as the entry's `predecessor` in the status
file -- what `pipelines.watch` compares to decide a rollback. The change is seen at `publish`, so
requests that finish in the (at most `publish_interval_s`) between a swap and it count for the old
version; the first version a window sees is the one it measured from its first request. A
whole-policy swap (`policy-config`) retires what the new policy holds no component for: windows,
predecessors and per-component gauges go (a gauge in a multiprocess directory turns NaN, which
prometheus_client cannot remove there), counters keep their totals, and SLAI's and the prediction
gauges are NaN under a policy without them. Swapping back to the version that served before counts
no swap: no new version went live.

SLO outcome from what the scheduler sees: latency -- the first token by arrival + TTFT and the last
by arrival + TTFT + (n - 1) * TBT (first token + (n - 1) * TBT with only a TBT target); deadline and
compound -- finished by the (program's) deadline, each call judged alone; best effort -- met when it
finishes. Goodput counts a met request's tokens (output only for latency SLOs, as in replay).

Off unless `ADAPT_METRICS=1` (`adapt serve` sets it unless `--no-metrics`): then the scheduler holds
no recorder and every hook costs one `is None` test.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_left
from collections import Counter as Tally
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adapt.policy import Policy, RequestState
from adapt.requests import SLO_KINDS
from serving_hooks.quality import (
    DEFAULT_WINDOW,
    BoundWindow,
    RankWindow,
    ShareWindow,
    drift_alarm,
    held_out_coverage,
)

ENABLE_ENV = "ADAPT_METRICS"
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
WINDOW_ENV = "ADAPT_QUALITY_WINDOW"
DRIFT_MARGIN_ENV = "ADAPT_DRIFT_MARGIN"
DRIFT_LEAST_ENV = "ADAPT_DRIFT_MIN_REQUESTS"
DEFAULT_DRIFT_MARGIN = 0.05
DEFAULT_DRIFT_LEAST = 100
PUBLISH_INTERVAL_S = 1.0
MAX_TIERS = 8
STEP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
ENGINE_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
TBT_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


def slo_met(state: RequestState) -> bool:
    """Did a finished request meet its SLO, as far as the scheduler can tell (module docstring)?"""
    slo, finish = state.slo, state.finish_s
    if finish is None:
        return False
    if slo.kind == "latency":
        first = state.first_token_s
        if first is None:
            return False
        if slo.ttft_s is not None and first > state.arrival_s + slo.ttft_s:
            return False
        if slo.tbt_s is None or state.tokens_generated <= 1:
            return True
        start = first if slo.ttft_s is None else state.arrival_s + slo.ttft_s
        return finish <= start + (state.tokens_generated - 1) * slo.tbt_s
    if slo.kind in ("deadline", "compound"):
        return finish <= state.deadline_at
    return True


def goodput_tokens(state: RequestState) -> int:
    """Tokens a met request earns: its output for a latency SLO, prompt and output otherwise."""
    if state.slo.kind == "latency":
        return state.tokens_generated
    return state.prompt_tokens + state.tokens_generated


class _Family:
    """A metric whose children are looked up once (`.labels()` takes a lock and builds a key on
    every call); `family(*labels)` is the child, or the metric itself when it has no labels."""

    def __init__(self, metric: Any, buckets: tuple[float, ...] = ()) -> None:
        self.metric = metric
        self.bounds = (*buckets, float("inf"))  # a histogram's bucket upper bounds
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *labels: str) -> Any:
        if not labels:
            return self.metric
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self.metric.labels(*labels)
        return child

    def labelled(self) -> list[tuple[str, ...]]:
        """The label values of the children set so far."""
        return list(self._children)

    def forget(self, *labels: str) -> None:
        """Take a gauge's child off `/metrics`. In a multiprocess directory its value stays in
        the process's file, which every scrape reads (prometheus_client cannot remove a child
        there), so it is set to NaN, no value to Prometheus, as an empty window's gauges are."""
        child = self._children.pop(labels, None)
        if child is None:
            return
        if MULTIPROCESS_ENV in os.environ:
            child.set(math.nan)
        else:
            self.metric.remove(*labels)


class _Buckets:
    """A histogram child's observations since the last flush, counted by bucket. `flush_into`
    does what `Histogram.observe` does for each of them (add to the sum, add one to the bucket)
    with one write per touched bucket: prometheus_client has no batched observe, so this writes
    the child's `_sum` and `_buckets` values, whose layout a unit test pins
    (tests/serving_hooks/test_metrics.py)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket with value <= bound
        self.total += value

    def flush_into(self, child: Any) -> None:
        child._sum.inc(self.total)
        for index, count in enumerate(self.counts):
            if count:
                child._buckets[index].inc(count)


class _Pending:
    """Counter increments and histogram observations held in memory until `flush`."""

    def __init__(self) -> None:
        self.counts: defaultdict[tuple[_Family, tuple[str, ...]], float] = defaultdict(float)
        self.observed: dict[tuple[_Family, tuple[str, ...]], _Buckets] = {}

    def inc(self, family: _Family, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        self.counts[(family, labels)] += amount

    def observe(self, family: _Family, labels: tuple[str, ...], value: float) -> None:
        buckets = self.observed.get((family, labels))
        if buckets is None:
            buckets = self.observed[(family, labels)] = _Buckets(family.bounds)
        buckets.add(value)

    def flush(self) -> None:
        for (family, labels), amount in self.counts.items():
            family(*labels).inc(amount)
        for (family, labels), buckets in self.observed.items():
            buckets.flush_into(family(*labels))
        self.counts.clear()
        self.observed.clear()


class SchedulerMetrics:
    """The recorder `PolicyScheduler` calls (see the module docstring for what and when)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        window: int = DEFAULT_WINDOW,
        drift_margin: float = DEFAULT_DRIFT_MARGIN,
        drift_least: int = DEFAULT_DRIFT_LEAST,
        publish_interval_s: float = PUBLISH_INTERVAL_S,
    ) -> None:
        if not 0 <= drift_margin <= 1:
            raise ValueError(f"drift margin: must be in [0, 1], got {drift_margin}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.window = window
        self.drift_margin = drift_margin
        self.drift_least = drift_least
        self.publish_interval_s = publish_interval_s
        self._next_publish = 0.0
        self._tiers: set[str] = set()
        self._policy: str | None = None
        self._serving: Policy | None = None  # the policy the last `publish` saw
        self._seen: dict[tuple[int, str], tuple[Any, int]] = {}
        self._published: dict[str, int] = {}  # per component, the version last published, kept after it stops
        self.bounds: dict[str, BoundWindow] = {}
        self.ranks: dict[str, RankWindow] = {}
        self.matches: dict[str, ShareWindow] = {}
        self.measured: dict[str, int] = {}  # the version each component's windows measure
        self.predecessors: dict[str, dict[str, Any]] = {}  # the last figures of the version before it
        self._pending = _Pending()
        self._define()

    @classmethod
    def from_environment(cls) -> SchedulerMetrics | None:
        """The recorder `adapt serve` asks for through the engine's environment; None when off."""
        if os.environ.get(ENABLE_ENV) != "1":
            return None
        return cls(
            window=int(os.environ.get(WINDOW_ENV, DEFAULT_WINDOW)),
            drift_margin=float(os.environ.get(DRIFT_MARGIN_ENV, DEFAULT_DRIFT_MARGIN)),
            drift_least=int(os.environ.get(DRIFT_LEAST_ENV, DEFAULT_DRIFT_LEAST)),
        )

    def _define(self) -> None:
        r = self.registry

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> _Family:
            return _Family(Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent"))

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> _Family:
            return _Family(Counter(name, doc, labels, registry=r))

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
        ) -> _Family:
            return _Family(Histogram(name, doc, labels, registry=r, buckets=buckets), buckets)

        self.step_seconds = histogram(
            "adapt_step_seconds",
            "Policy and adapter time per scheduling step, before vLLM schedules",
            STEP_BUCKETS,
        )
        self.engine_step_seconds = histogram(
            "adapt_engine_step_seconds",
            "Time between scheduling steps as the scheduler sees it",
            ENGINE_STEP_BUCKETS,
        )
        self.admitted_total = counter("adapt_requests_admitted", "Requests admitted into the batch")
        self.deferred_total = counter(
            "adapt_requests_deferred", "Running requests the policy left out of a step (request-steps)"
        )
        self.preempted_total = counter(
            "adapt_requests_preempted",
            "Preemptions by cause: policy plan, vLLM under KV pressure, or a prefix-cache reset",
            ("cause",),
        )
        self.dropped_total = counter("adapt_requests_dropped", "Requests dropped by the policy", ("reason",))
        self.fallback_steps_total = counter(
            "adapt_fallback_steps", "Steps run as plain vLLM FCFS because the policy raised"
        )
        self.policy_errors_total = counter(
            "adapt_policy_errors", "Policy hook failures and failed live policy/component changes"
        )
        self.slo_requests_total = counter(
            "adapt_slo_requests",
            "Requests that left, by SLO class, tier and outcome (met, violated, dropped)",
            ("slo_class", "tier", "outcome"),
        )
        self.aborted_total = counter(
            "adapt_requests_aborted", "Requests the client aborted, by SLO class", ("slo_class",)
        )
        self.goodput_tokens_total = counter(
            "adapt_goodput_tokens", "Tokens of requests that met their SLO", ("slo_class", "tier")
        )
        self.ttft_seconds = histogram(
            "adapt_ttft_seconds", "Time to first token as the scheduler sees it", TTFT_BUCKETS, ("slo_class",)
        )
        self.tbt_seconds = histogram(
            "adapt_tbt_seconds", "Mean time between tokens of a finished request", TBT_BUCKETS, ("slo_class",)
        )
        self.waiting_requests = gauge(
            "adapt_waiting_requests", "Waiting requests by SLO class", ("slo_class",)
        )
        self.running_requests = gauge("adapt_running_requests", "Running requests")
        self.kv_usage = gauge("adapt_kv_usage_ratio", "KV cache usage the policy sees (0-1)")
        self.slai_offset = gauge("adapt_slai_offset_batches", "SLAI's decode offset now, in batch times")
        self.slai_threshold = gauge(
            "adapt_slai_kv_threshold", "KV usage above which SLAI's offset rises (its first threshold)"
        )
        self.policy_info = gauge("adapt_policy_info", "1 for the policy serving now", ("policy",))
        self.component_version = gauge(
            "adapt_component_version", "Registry version of each component serving", ("component",)
        )
        self.swaps_total = counter(
            "adapt_component_swaps",
            "Versions that went live, the first load included (not a policy swap back to the last one)",
            ("component",),
        )
        self.failed_swaps_total = counter(
            "adapt_component_failed_swaps", "Versions refused (load or validation failed)", ("component",)
        )
        self.last_swap = gauge(
            "adapt_component_last_swap_timestamp_seconds",
            "Unix time the serving version went live",
            ("component",),
        )
        self.coverage = gauge(
            "adapt_length_bound_coverage",
            "Share of the window's finished requests whose output stayed within the length bound",
            ("component",),
        )
        self.overestimate = gauge(
            "adapt_length_bound_overestimate_ratio",
            "Mean bound / actual output length over the window",
            ("component",),
        )
        self.window_requests = gauge(
            "adapt_length_bound_window_requests", "Finished requests in the coverage window", ("component",)
        )
        self.held_out_coverage = gauge(
            "adapt_length_bound_heldout_coverage",
            "Held-out coverage registered for the serving version",
            ("component",),
        )
        self.drift = gauge(
            "adapt_length_bound_drift_alarm",
            "1 when online coverage is more than the margin below the registered held-out coverage",
            ("component",),
        )
        self.prediction_prior_share = gauge(
            "adapt_prediction_prior_share",
            "Share of requests first scheduled on a prior because their model prediction was not ready",
        )
        self.prediction_wait = gauge(
            "adapt_prediction_wait_seconds",
            "Mean wait from arrival to prediction hand-over",
        )
        self.prediction_refused = gauge(
            "adapt_prediction_refused",
            "Predictions refused by a full worker queue (the policy used its prior)",
        )
        self.neighbour_share = gauge(
            "adapt_semantic_neighbour_share",
            "Share of the window's requests with text that had enough close neighbours in the history",
            ("component",),
        )
        self.rank_correlation = gauge(
            "adapt_length_rank_correlation",
            "Spearman correlation of predicted and actual output lengths over the window",
            ("component",),
        )
        self.per_component = (
            self.component_version,
            self.last_swap,
            self.coverage,
            self.overestimate,
            self.window_requests,
            self.held_out_coverage,
            self.drift,
            self.neighbour_share,
            self.rank_correlation,
        )

    # ---------------------------------------------------------------- per step
    def step(self, policy_s: float, gap_s: float | None, fallback: bool) -> None:
        self._pending.observe(self.step_seconds, (), policy_s)
        if gap_s is not None:
            self._pending.observe(self.engine_step_seconds, (), gap_s)
        if fallback:
            self._pending.inc(self.fallback_steps_total)

    def admitted(self, count: int) -> None:
        if count:
            self._pending.inc(self.admitted_total, (), count)

    def deferred(self, count: int) -> None:
        if count:
            self._pending.inc(self.deferred_total, (), count)

    def preempted(self, cause: str, count: int) -> None:
        if count:
            self._pending.inc(self.preempted_total, (cause,), count)

    def dropped(self, reason: str, count: int) -> None:
        if count:
            self._pending.inc(self.dropped_total, (reason,), count)

    def policy_error(self) -> None:
        self._pending.inc(self.policy_errors_total)

    # ------------------------------------------------------------- per request
    def finished(self, state: RequestState, outcome: str, policy: Policy) -> None:
        """A request left the engine: `outcome` is finished, dropped (by the policy) or aborted
        (by the client). `state.finish_s` is set for a finished one."""
        pending, kind = self._pending, state.slo.kind
        if outcome == "aborted":
            pending.inc(self.aborted_total, (kind,))
            return
        tier = self._tier(state.slo.tier)
        if outcome == "dropped":
            pending.inc(self.slo_requests_total, (kind, tier, "dropped"))
            return
        met = slo_met(state)
        pending.inc(self.slo_requests_total, (kind, tier, "met" if met else "violated"))
        if met:
            pending.inc(self.goodput_tokens_total, (kind, tier), goodput_tokens(state))
        first, finish, n = state.first_token_s, state.finish_s, state.tokens_generated
        if first is not None:
            pending.observe(self.ttft_seconds, (kind,), max(0.0, first - state.arrival_s))
            if n > 1 and finish is not None:
                pending.observe(self.tbt_seconds, (kind,), max(0.0, finish - first) / (n - 1))
        self._observe_quality(state, policy)

    def _observe_quality(self, state: RequestState, policy: Policy) -> None:
        bound = getattr(policy, "length_bound", None)
        predicted = bound(state) if bound is not None else None
        if predicted is not None:
            name, tokens = predicted
            window = self.bounds.get(name) or self.bounds.setdefault(name, BoundWindow(self.window))
            window.observe(state.tokens_generated, tokens)
        estimate = getattr(policy, "length_estimate", None)
        predicted = estimate(state) if estimate is not None else None
        if predicted is not None:
            name, tokens = predicted
            ranks = self.ranks.get(name) or self.ranks.setdefault(name, RankWindow(self.window))
            ranks.observe(state.tokens_generated, tokens)
        neighbours = getattr(policy, "neighbour_match", None)
        match = neighbours(state) if neighbours is not None else None
        if match is not None:
            name, held = match
            share = self.matches.get(name) or self.matches.setdefault(name, ShareWindow(self.window))
            share.observe(held)

    def _tier(self, tier: str | None) -> str:
        if tier is None:
            return "none"
        if tier in self._tiers:
            return tier
        if len(self._tiers) < MAX_TIERS:
            self._tiers.add(tier)
            return tier
        return "other"

    # ----------------------------------------------------------------- gauges
    def flush(self) -> None:
        """Write the counts and observations held in memory into the metrics."""
        self._pending.flush()

    def due(self, now: float) -> bool:
        return now >= self._next_publish

    def publish(
        self,
        now: float,
        *,
        policy: Policy,
        waiting: Iterable[RequestState],
        running: int,
        kv_usage: float,
        live: Any = None,
        predictions: Mapping[str, Any] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Write out the counts held since the last call, set the gauges and count the swaps;
        returns the online quality per component, for the status file
        (`LiveComponents.report_quality`)."""
        self._next_publish = now + self.publish_interval_s
        self.flush()
        by_class = Tally(state.slo.kind for state in waiting)
        for kind in SLO_KINDS:
            self.waiting_requests(kind).set(by_class.get(kind, 0))
        self.running_requests().set(running)
        self.kv_usage().set(kv_usage)
        self._retire(policy, live)
        self._publish_policy(policy, kv_usage)
        self._publish_predictions(predictions)
        serving, held_out = self._publish_components(policy, live)
        self._follow_versions(serving)
        return self._publish_quality(held_out)

    def _publish_policy(self, policy: Policy, kv_usage: float) -> None:
        if policy.name != self._policy:
            if self._policy is not None:
                self.policy_info(self._policy).set(0)
            self.policy_info(policy.name).set(1)
            self._policy = policy.name
        # SLAI and its variants; NaN (no value) for any other policy, not the last SLAI's figures.
        current_offset = getattr(policy, "current_offset", None)
        rule = getattr(getattr(policy, "offset", None), "rule", None)
        thresholds = rule()["thresholds"] if current_offset is not None and rule is not None else []
        self.slai_offset().set(math.nan if current_offset is None else current_offset(kv_usage))
        self.slai_threshold().set(thresholds[0] if thresholds else math.nan)

    def _publish_predictions(self, predictions: Mapping[str, Any] | None) -> None:
        """`adapt.predictions.PredictionStats.summary`; None (NaN) when the policy serving makes
        no predictions off the step, so a policy swapped out leaves no figures behind."""
        for gauge, key in (
            (self.prediction_prior_share, "share_on_prior"),
            (self.prediction_wait, "mean_wait_s"),
            (self.prediction_refused, "refused"),
        ):
            gauge().set(math.nan if predictions is None else predictions[key])

    def _retire(self, policy: Policy, live: Any) -> None:
        """On a whole-policy swap, drop the windows, versions and per-component gauges of every name
        the new policy holds no component for: else the status and `/metrics` would report the
        old policy's figures as the serving ones for good (`_Family.forget`). Counters keep their
        totals, as counters do; a component that comes back starts its windows afresh."""
        previous, self._serving = self._serving, policy
        if previous is None or previous is policy:
            return
        held = {*policy.components.values(), *(slot.name for slot in _slots(live))}
        for entries in (self.bounds, self.ranks, self.matches, self.measured, self.predecessors):
            for name in [name for name in entries if name not in held]:
                del entries[name]
        for family in self.per_component:
            for labels in family.labelled():
                if labels[0] not in held:
                    family.forget(*labels)
        self._seen = {key: seen for key, seen in self._seen.items() if key[1] in held}

    def _publish_components(
        self, policy: Policy, live: Any
    ) -> tuple[dict[str, int], dict[str, Mapping[str, float]]]:
        """Versions, swaps and swap times of the live slots (or, without live slots, the version
        each component was loaded at); returns each component's serving version and registered
        metrics."""
        serving: dict[str, int] = {}
        if live is None:
            for attribute, name in policy.components.items():
                version = getattr(getattr(policy, attribute, None), "metadata", {}).get("registry_version")
                if version is not None:
                    self._publish_version(name, version)
                    serving[name] = version
            return serving, {}
        held_out = {}
        for slot in _slots(live):
            name = slot.name
            if slot.version is not None:  # nothing went live in a slot before its first load
                # A new slot's first load of the version published last (a policy swapped away
                # and back) is no version going live.
                returned = slot.version == self._published.get(name)
                self._advance(self.swaps_total, name, slot, slot.swaps, baseline=int(returned))
                self._publish_version(name, slot.version)
                serving[name] = slot.version
            self._advance(self.failed_swaps_total, name, slot, slot.failed_swaps)
            last = slot.last_swap_s
            if last is not None:
                self.last_swap(name).set(last)
            held_out[name] = slot.held_out
        return serving, held_out

    def _follow_versions(self, serving: Mapping[str, int]) -> None:
        """Start a component's windows afresh when the version serving it changed, keeping the old
        version's figures as its predecessor (module docstring). Once per publish, never per request."""
        for name, version in serving.items():
            measured = self.measured.get(name)
            self.measured[name] = version
            if measured is None or measured == version:
                continue
            self.predecessors[name] = self._figures(name, measured)
            if name in self.bounds:
                self.bounds[name] = BoundWindow(self.window)
            if name in self.ranks:
                self.ranks[name] = RankWindow(self.window)
            if name in self.matches:
                self.matches[name] = ShareWindow(self.window)

    def _figures(self, name: str, version: int) -> dict[str, Any]:
        """A component's figures now, as the `predecessor` entry of the status keeps them."""
        bounds, ranks = self.bounds.get(name), self.ranks.get(name)
        correlation = ranks.correlation() if ranks is not None else None
        return {
            "version": version,
            "coverage": _rounded(bounds.coverage if bounds else None, 3),
            "overestimate": _rounded(bounds.overestimate if bounds else None, 2),
            "rank_correlation": _rounded(correlation, 3),
            "requests": bounds.count if bounds else ranks.count if ranks else 0,
        }

    def _publish_version(self, name: str, version: int) -> None:
        """Set the version gauge and remember the version past a policy swap that retires it: a
        swap back to it is no new version (`_publish_components`)."""
        self.component_version(name).set(version)
        self._published[name] = version

    def _advance(self, family: _Family, name: str, slot: Any, total: int, baseline: int = 0) -> None:
        """Count a slot's own running total into a Prometheus counter: only the increase since the
        last look (a policy swap makes new slots, whose totals start again from zero). `baseline`:
        how much of a new slot's total not to count; kept even while its total has not reached it
        (a slot shows a version just before it counts the swap)."""
        key = (id(family), name)
        seen_slot, seen = self._seen.get(key, (None, 0))
        if seen_slot is not slot:
            seen = baseline
        if total > seen:
            family(name).inc(total - seen)
        self._seen[key] = (slot, max(total, seen))

    def _publish_quality(self, held_out: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, Any]]:
        quality: dict[str, dict[str, Any]] = {}
        for name, window in self.bounds.items():
            if window.coverage is None and name not in self.predecessors:
                continue  # nothing measured yet; a new version's empty window shows beside its predecessor
            reference = held_out_coverage(held_out.get(name, {}))
            alarm = drift_alarm(window, reference, self.drift_margin, self.drift_least)
            # An empty window (a version nothing has finished under yet) is NaN, which Prometheus
            # shows as no value: the predecessor's figure would pass for the new version's.
            self.coverage(name).set(math.nan if window.coverage is None else window.coverage)
            self.overestimate(name).set(math.nan if window.overestimate is None else window.overestimate)
            self.window_requests(name).set(window.count)
            self.drift(name).set(int(alarm))
            if reference is not None:
                self.held_out_coverage(name).set(reference)
            quality[name] = {
                "coverage": _rounded(window.coverage, 3),
                "overestimate": _rounded(window.overestimate, 2),
                "requests": window.count,
                "held_out_coverage": None if reference is None else round(reference, 3),
                "drift_alarm": alarm,
            }
        for name, matches in self.matches.items():
            if matches.share is not None:
                self.neighbour_share(name).set(matches.share)
            quality.setdefault(name, {}).update(neighbour_share=_rounded(matches.share, 3))
        for name, ranks in self.ranks.items():
            correlation = ranks.correlation()
            if correlation is not None:
                self.rank_correlation(name).set(correlation)
            quality.setdefault(name, {}).update(
                rank_correlation=None if correlation is None else round(correlation, 3), requests=ranks.count
            )
        for name, entry in quality.items():
            entry.update(version=self.measured.get(name), predecessor=self.predecessors.get(name))
        return quality


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _slots(live: Any) -> list[Any]:
    """The hot-swap slots of `live` (`serving_hooks.live.LiveComponents`), its policy-config slot
    included; none without live slots."""
    if live is None:
        return []
    return [*live.slots.values(), *([live.config_slot] if live.config_slot is not None else [])]
