"""SLAI pipelines: tune the `slai-offset` component on replay, register it, promote it if better.

`adapt train slai-offset` registers the tuned component; `adapt tune slai` also registers the whole
tuned policy as a `policy-config` version, so a server can swap to it in one move.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import numpy as np

from adapt.policy import Policy
from adapt.registry import Registry
from adapt.replay.cost import DEFAULT_OVERLAP, roofline
from adapt.replay.engine import ReplayEngine
from adapt.replay.metrics import ReplayResult
from adapt.replay.runner import ReplaySetup
from adapt.workloads import WORKLOADS, slai_tiers
from pipelines.outcome import Gate, TrainOutcome, register_and_gate
from predictors.slai_offset import SlaiOffset
from serving_hooks.policies.config import PolicyConfig
from serving_hooks.policies.slai import SLAI

TTFT_TARGET_S = 0.5
MIN_THROUGHPUT_RATIO = 0.95


def make_setup(rate: float, num_requests: int, seed: int = 0, paying_share: float = 0.05) -> ReplaySetup:
    spec = WORKLOADS["slai-tiers"]
    requests = slai_tiers(rate, num_requests, seed, paying_share=paying_share)
    return ReplaySetup(requests, spec.info(rate, num_requests, seed), spec.model, spec.gpu, spec.tp)


def run(
    setup: ReplaySetup, policy: Policy, overlap: str = DEFAULT_OVERLAP, keep_token_times: bool = False
) -> ReplayResult:
    """One replay on the slai-tiers engine settings (`keep_token_times`: keep the KV timeline)."""
    cost = roofline(setup.model, setup.gpu, tp=setup.tp, overlap=overlap)
    config = dataclasses.replace(WORKLOADS["slai-tiers"].engine_config(), keep_token_times=keep_token_times)
    engine = ReplayEngine(policy, cost, config)
    return engine.run(setup.requests)


def summarise(result: ReplayResult, slos: dict[str, float]) -> dict[str, Any]:
    """Median TTFT, P99 TBT per tier, throughput against the offered load, and whether the run
    meets every target. A policy only *sustains* a rate if it also keeps up with it (completes
    requests at >= 95% of the arrival rate in steady state, see `keep_up_ratio`): a low median TTFT
    bought by letting a backlog of long requests pile up is not a sustained load."""
    metrics = result.metrics()
    tiers = metrics.get("by_class", {})
    summary: dict[str, Any] = {"ttft_p50": metrics["ttft_p50"], "completed": metrics["completed"]}
    excess = 0.0
    for tier, slo in slos.items():
        p99 = tiers.get(tier, {}).get("tbt_p99")
        summary[f"{tier}_tbt_p99"] = p99
        if p99 is not None:
            excess = max(excess, p99 / slo - 1.0)
    summary["tbt_within_slo"] = excess <= 0.0
    ratio = keep_up_ratio(result)
    summary["throughput_ratio"] = ratio
    summary["keeps_up"] = ratio >= MIN_THROUGHPUT_RATIO
    excess = max(excess, MIN_THROUGHPUT_RATIO - ratio)
    summary["tbt_excess"] = max(0.0, excess)
    summary["feasible"] = excess <= 0.0
    summary["sustained"] = bool(summary["feasible"] and metrics["ttft_p50"] <= TTFT_TARGET_S)
    summary["preemptions"] = metrics["preemptions"]
    return summary


SLOS = {"paying": 0.1, "free": 0.5}


def keep_up_ratio(result: ReplayResult, start: float = 0.2, end: float = 0.8) -> float:
    """Completions over arrivals inside the middle of the arrival span. A finite trace always
    ends with a drain, so whole-run throughput understates a server that keeps up; in steady
    state the two counts match, and a growing backlog shows as a ratio below 1."""
    arrivals = result.table.column("arrival_s")
    if len(arrivals) < 10:
        return 1.0
    first, span = arrivals.min(), arrivals.max() - arrivals.min()
    low, high = first + start * span, first + end * span
    arrived = int(np.count_nonzero((low <= arrivals) & (arrivals < high)))
    finish = result.table.column("finish_s")  # NaN (never inside) for a request not finished
    finished = int(np.count_nonzero((low <= finish) & (finish < high)))
    return finished / arrived if arrived else 1.0


@dataclasses.dataclass(frozen=True)
class ReplayObjective:
    """What `SlaiOffset.fit` optimises: replay SLAI (SPF) with a candidate offset on slai-tiers.
    Plain data, so it pickles to a worker that evaluates a batch of trials; the requests are
    built once per process."""

    rate: float
    num_requests: int
    seed: int = 0
    overlap: str = DEFAULT_OVERLAP

    def __call__(self, offset: SlaiOffset) -> dict[str, Any]:
        setup = _cached_setup(self.rate, self.num_requests, self.seed)
        return summarise(run(setup, SLAI(offset=offset), self.overlap), SLOS)


@functools.lru_cache(maxsize=4)
def _cached_setup(rate: float, num_requests: int, seed: int) -> ReplaySetup:
    return make_setup(rate, num_requests, seed)


def slai_gate(margin: float = 0.0) -> Gate:
    """A feasible candidate beats an infeasible champion; otherwise lower median TTFT by `margin`."""
    return Gate("ttft_p50", lower_is_better=True, margin=margin, feasible="feasible")


# Tuned at Sarathi's largest sustained rate on slai-tiers, on enough requests to show keeping up.
TUNE_RATE = 2.0
TUNE_REQUESTS = 800


def train_slai_offset(
    registry: Registry,
    *,
    rate: float = TUNE_RATE,
    num_requests: int = TUNE_REQUESTS,
    trials: int = 20,
    seed: int = 0,
    overlap: str = DEFAULT_OVERLAP,
    promote_if_better: bool = False,
    margin: float = 0.0,
    with_policy_config: bool = False,
    jobs: int = 1,
) -> TrainOutcome:
    objective = ReplayObjective(rate, num_requests, seed, overlap)
    print(
        f"tuning slai-offset on slai-tiers at {rate} req/s, {num_requests} requests, {trials} trials",
        file=sys.stderr,
    )
    candidate = SlaiOffset().fit(objective, n_trials=trials, seed=seed, jobs=jobs)
    candidate.metadata["data_window"] = {
        "workload": "slai-tiers",
        "rate": rate,
        "requests": num_requests,
        "seed": seed,
        "overlap": overlap,
    }
    metrics = candidate.evaluate(objective)
    champion = registry.champion("slai-offset")
    champion_metrics = champion.evaluate(objective) if champion is not None else None
    outcome = register_and_gate(
        registry,
        candidate,
        metrics,
        champion_metrics,
        slai_gate(margin),
        promote_if_better=promote_if_better,
        params={"tune_rate": rate, "trials": trials, **candidate.rule()},  # get_params() is the untuned rule
    )
    if with_policy_config:
        config = PolicyConfig("slai", {"offset": candidate.rule(), "prefill_order": "spf"})
        outcome.policy_config_version = registry.log(config, metrics=metrics, run_name="policy-config:slai")
        if outcome.promoted:
            registry.promote("policy-config", outcome.policy_config_version)
    return outcome
