"""SLAI pipelines: tune the `slai-offset` component on replay, register it, promote it if better.

`adapt train slai-offset` registers the tuned component; `adapt tune slai` also registers the whole
tuned policy as a `policy-config` version, so a server can swap to it in one move.
"""

from __future__ import annotations

import sys
from typing import Any

from adapt.component import PolicyConfig
from adapt.registry import Registry
from experiments.slai_study import replay_objective
from pipelines.outcome import TrainOutcome, beats
from predictors.slai_offset import SlaiOffset


def better(candidate: dict[str, Any], champion: dict[str, Any] | None, margin: float) -> bool:
    """A feasible candidate beats an infeasible champion; otherwise lower median TTFT by `margin`."""
    if not candidate.get("feasible"):
        return False
    if champion is None or not champion.get("feasible"):
        return True
    return beats(candidate["ttft_p50"], champion["ttft_p50"], lower_is_better=True, margin=margin)


def train_slai_offset(
    registry: Registry,
    *,
    rate: float = 2.8,
    num_requests: int = 800,
    trials: int = 20,
    seed: int = 0,
    overlap: str = "step",
    promote_if_better: bool = False,
    margin: float = 0.0,
    with_policy_config: bool = False,
) -> TrainOutcome:
    objective = replay_objective(rate, num_requests, seed, overlap)
    print(
        f"tuning slai-offset on slai-tiers at {rate} req/s, {num_requests} requests, {trials} trials",
        file=sys.stderr,
    )
    candidate = SlaiOffset().fit(objective, n_trials=trials, seed=seed)
    candidate.metadata["data_window"] = {
        "workload": "slai-tiers",
        "rate": rate,
        "requests": num_requests,
        "seed": seed,
        "overlap": overlap,
    }
    metrics = candidate.evaluate(objective)
    version = registry.log(candidate, metrics=metrics, params={"tune_rate": rate, "trials": trials})
    champion = registry.champion("slai-offset")
    champion_metrics = champion.evaluate(objective) if champion is not None else None
    promoted = False
    if promote_if_better and better(metrics, champion_metrics, margin):
        registry.promote("slai-offset", version)
        promoted = True
    outcome = TrainOutcome(version, promoted, metrics, champion_metrics)
    if with_policy_config:
        config = PolicyConfig("slai", {"offset": candidate.get_params(), "prefill_order": "spf"})
        outcome.policy_config_version = registry.log(config, metrics=metrics, run_name="policy-config:slai")
        if promoted:
            registry.promote("policy-config", outcome.policy_config_version)
    return outcome
