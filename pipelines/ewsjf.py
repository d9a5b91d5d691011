"""EWSJF pipelines: Refine-and-Prune on a history window, and Bayesian meta-optimisation on replay.

`adapt train ewsjf-meta-policy` fits the queue layout on a window of prompt lengths (keeping the
champion's Theta when there is one) and registers it. `adapt tune ewsjf` runs Optuna ask/tell over
Theta; each trial refits the layout with its `alpha` (the offline mode of the paper's optimiser),
replays the workload, and scores equation 5's reward

    R = l1 * C + l2 * L - l3 * S - l4 * U

with C, L, S the layout's compactness, load balance and proliferation as routed during the replay,
and U the mean TTFT relative to FCFS on the same requests. Every trial is an MLflow run, the
reward curve is logged as a plot, and the best Theta is registered as a new `ewsjf-meta-policy`
version and as a `policy-config`. `adapt tune ewsjf --trace FILE` tunes on a user's trace instead
of the workload (`trace_traffic`), on the same engine.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from adapt.plots import figure, save
from adapt.registry import Registry, StoreLocked
from adapt.replay.cost import roofline
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.replay.metrics import ReplayResult
from adapt.requests import Request
from adapt.steplog import CostModel
from adapt.traces import Trace
from adapt.workloads import WORKLOADS
from adapt.workloads.builders import trace_requests
from pipelines.outcome import (
    Gate,
    TrainOutcome,
    latest_version,
    register_and_gate,
    trained_on,
    unchanged,
    usable_champion,
)
from predictors.ewsjf_meta import REWARD_WEIGHTS, THETA_SPACE, EwsjfMetaPolicy, equation5
from serving_hooks.policies import make_policy
from serving_hooks.policies.config import PolicyConfig
from serving_hooks.policies.ewsjf import EWSJF

STUDY = "ewsjf"  # the Optuna study `adapt tune ewsjf` works (shared by every worker on one --storage)


@dataclass
class EwsjfTrial:
    """What one replay under a candidate Theta measured."""

    reward: float
    terms: dict[str, float]
    metrics: dict[str, Any]


# The seed of the history window a layout is fitted on. The studies judge EWSJF on small seeds (0 is
# tuned on, 1-3 held out, a few more in the studies): with seed 1 here the champion's layout was
# fitted on exactly the prompts of held-out seed 1's trace.
HISTORY_SEED = 10_000


def history_lengths(num_requests: int = 4000, seed: int = HISTORY_SEED) -> np.ndarray:
    """A history window of prompt lengths from the ewsjf-mixed sources (a seed no evaluation uses,
    so the layout is not fitted on the requests it is judged on)."""
    spec = WORKLOADS["ewsjf-mixed"]
    return np.array([r.prompt_tokens for r in spec.build(spec.rate, num_requests, seed)], dtype=np.float64)


# A layout fitted on fewer prompts than this, or judged on fewer requests, says little.
MIN_TRACE_SIDE = 50


class TuningTraffic(NamedTuple):
    """What a tuning study replays (`requests`) and the prompt lengths each trial's layout is
    fitted on (`history`): disjoint, so a layout is never judged on the prompts it was fitted to."""

    requests: list[Request]
    history: np.ndarray
    source: str


def workload_traffic(rate: float, num_requests: int, seed: int) -> TuningTraffic:
    """`ewsjf-mixed` at `rate`, its history window drawn with another seed (`history_lengths`)."""
    requests = WORKLOADS["ewsjf-mixed"].build(rate, num_requests, seed)
    return TuningTraffic(requests, history_lengths(), f"ewsjf-mixed at {rate} req/s")


def trace_traffic(trace: Trace, rate: float | None, num_requests: int | None, seed: int) -> TuningTraffic:
    """A user's trace split in time: its last `num_requests` (default: the later half, at most
    1,500) are replayed -- at their own arrival times, or time-scaled to `rate` (Poisson at `rate`
    for a length-only trace, as `adapt replay --trace` does) -- and the prompts before them are the
    history the layout is fitted on, as a server's earlier traffic would be."""
    replayed = min(num_requests or min(1500, len(trace) // 2), len(trace) - MIN_TRACE_SIDE)
    if replayed < MIN_TRACE_SIDE:
        raise ValueError(
            f"{trace.name}: {len(trace)} requests; tuning needs at least {2 * MIN_TRACE_SIDE} (a history"
            f" window of {MIN_TRACE_SIDE} or more before the {MIN_TRACE_SIDE} or more it replays)"
        )
    split = len(trace) - replayed
    history = trace.prompt_tokens[:split].astype(np.float64)
    requests = trace_requests(trace.take(np.arange(split, len(trace))), rate, seed)
    pace = "its own arrivals" if rate is None else f"{rate} req/s"
    return TuningTraffic(
        requests, history, f"{trace.name} ({replayed} requests at {pace}, {split} before them)"
    )


def replay_ewsjf(
    meta: EwsjfMetaPolicy, requests, weights=REWARD_WEIGHTS, baseline_ttft: float | None = None
) -> EwsjfTrial:
    spec = WORKLOADS["ewsjf-mixed"]
    cost = roofline(spec.model, spec.gpu, tp=spec.tp)
    policy = EWSJF(meta)
    metrics = ReplayEngine(policy, cost, spec.engine_config()).run(requests).metrics()
    if baseline_ttft is None:
        fcfs = ReplayEngine(make_policy("fcfs"), cost, spec.engine_config())
        baseline_ttft = fcfs.run(requests).metrics()["ttft_mean"]
    terms = policy.layout_report()
    terms["latency"] = metrics["ttft_mean"] / baseline_ttft
    return EwsjfTrial(equation5(terms, weights), terms, metrics)


@dataclass(frozen=True)
class EwsjfObjective:
    """Optuna objective over Theta: refit the layout with the trial's alpha on the history window,
    replay `requests`, return (-reward, measured terms). Plain data, so it pickles to a worker."""

    requests: list[Request]
    lengths: np.ndarray
    baseline_ttft: float

    def __call__(self, theta: dict[str, float]) -> tuple[float, dict[str, Any]]:
        meta = EwsjfMetaPolicy(**theta).fit(self.lengths)
        trial = replay_ewsjf(meta, self.requests, baseline_ttft=self.baseline_ttft)
        short = trial.metrics.get("by_class", {}).get("short", {})
        return -trial.reward, {
            "reward": trial.reward,
            **trial.terms,
            "short_ttft_mean": short.get("ttft_mean"),
        }


def ewsjf_objective(requests: list[Request], lengths: np.ndarray) -> EwsjfObjective:
    """The objective for these requests, its latency term relative to FCFS on them."""
    spec = WORKLOADS["ewsjf-mixed"]
    cost = roofline(spec.model, spec.gpu, tp=spec.tp)
    baseline = ReplayEngine(make_policy("fcfs"), cost, spec.engine_config()).run(requests)
    return EwsjfObjective(requests, lengths, baseline.metrics()["ttft_mean"])


class ServedShare(NamedTuple):
    """Requests a layout's gate replays and the engine they were served on: a cost model and the
    replica's limits (None: ewsjf-mixed's engine). A fleet's logs give one share per replica
    (`pipelines.retrain.served_shares`, all timed by the fleet's cost-model champion): each
    replica saw only its router's share of the load."""

    requests: list[Request]
    engine: tuple[CostModel, EngineConfig] | None = None


def train_ewsjf_meta(
    registry: Registry,
    *,
    lengths: np.ndarray | None = None,
    history: int = 4000,
    promote_if_better: bool = False,
    margin: float = 0.0,
    skip_unchanged: bool = False,
    replay: Sequence[ServedShare] = (),
) -> TrainOutcome:
    """Refit the layout on a window of prompt lengths (default: a fresh ewsjf-mixed history) with the
    champion's Theta (or the defaults) and gate it against the champion. The gate: with `replay`
    (the served traffic, e.g. rebuilt from request logs: one share per replica that served it), the
    mean TTFT of EWSJF replaying it with each layout (`replay_ttft`: `replay_ttft_mean`, lower is
    better); without, equation 5 without its latency term, scored on the same window. The layout
    score alone can prefer a stale layout: after chat traffic gains long prompts, a 3-queue layout fitted
    on chat scored 1.18 on the new mix against 0.75 for a 14-queue one refitted to it (few queues are
    rewarded for balance and penalised less for proliferation), though the refitted layouts serve short
    requests faster under load (`experiments.drift_study`). With `skip_unchanged`, nothing is registered
    when the lengths equal the latest version's (`pipelines.outcome.unchanged`). A champion that
    cannot be loaded is none (`pipelines.outcome.usable_champion`): default Theta, no comparison."""
    champion, unusable = usable_champion(registry, "ewsjf-meta-policy")
    lengths = history_lengths(history) if lengths is None else lengths
    candidate = EwsjfMetaPolicy(**(champion.get_params() if champion else {})).fit(lengths)
    latest = latest_version(registry, "ewsjf-meta-policy") if skip_unchanged else None
    if latest is not None and trained_on(latest, candidate.metadata["data_hash"]):
        return unchanged(registry, latest)
    metrics = candidate.evaluate(lengths)
    metrics["layout_score"] = equation5(metrics)
    champion_metrics = None
    if champion is not None:
        champion_metrics = champion.evaluate(lengths)
        champion_metrics["layout_score"] = equation5(champion_metrics)
    gate = Gate("layout_score", lower_is_better=False, margin=margin)
    if any(share.requests for share in replay):
        gate = Gate("replay_ttft_mean", lower_is_better=True, margin=margin)
        metrics["replay_ttft_mean"] = replay_ttft(candidate, replay)
        if champion_metrics is not None:
            champion_metrics["replay_ttft_mean"] = replay_ttft(champion, replay)
    outcome = register_and_gate(
        registry, candidate, metrics, champion_metrics, gate, promote_if_better=promote_if_better
    )
    return replace(outcome, note=f"{unusable}: default Theta, compared with nothing" if unusable else "")


def replay_ttft(meta: EwsjfMetaPolicy, shares: Sequence[ServedShare]) -> float:
    """Mean TTFT of `ewsjf` with this layout over every request of `shares`, each share replayed
    on its own engine by its own copy of the policy, as each replica ran one."""
    results = []
    for requests, engine in shares:
        if engine is None:
            spec = WORKLOADS["ewsjf-mixed"]
            engine = roofline(spec.model, spec.gpu, tp=spec.tp), spec.engine_config()
        cost, config = engine
        results.append(ReplayEngine(EWSJF(meta), cost, config).run(requests))
    return float(ReplayResult.merge(results, 0.0).metrics()["ttft_mean"])


def tune_ewsjf(
    registry: Registry,
    *,
    rate: float = 40.0,
    num_requests: int = 1500,
    trials: int = 20,
    seed: int = 0,
    storage: str | None = None,
    experiment: str = "tune-ewsjf",
    margin: float = 0.0,
    jobs: int = 1,
    traffic: TuningTraffic | None = None,
) -> TrainOutcome:
    """Bayesian optimisation of Theta on replay of ewsjf-mixed (or `traffic`, e.g. a user's trace:
    `trace_traffic`; `rate` and `num_requests` then only say what it holds), warm-started from the
    champion's Theta and the defaults, on ewsjf-mixed's engine either way. The best trial is
    registered and promoted if its reward beats the champion's Theta scored on the same replay and
    layout window by `margin`."""
    from adapt.online import tune

    on_workload = traffic is None
    traffic = traffic or workload_traffic(rate, num_requests, seed)
    lengths = traffic.history
    objective = ewsjf_objective(traffic.requests, lengths)

    champion = registry.champion("ewsjf-meta-policy")
    warm = [champion.get_params()] if champion is not None else []
    warm.append(EwsjfMetaPolicy().get_params())
    print(
        f"tuning EWSJF Theta on {traffic.source}, {len(traffic.requests)} requests, {trials} trials",
        file=sys.stderr,
    )
    result = tune(
        objective,
        THETA_SPACE,
        n_trials=trials,
        seed=seed,
        warm_start=warm,
        name=STUDY,
        storage=storage,
        mlflow_experiment=experiment,
        jobs=jobs,
    )
    metrics = {k: v for k, v in result.best_metrics.items() if v is not None}
    if storage is not None and not result.finished_last:
        print(
            "  other workers of this study are still running trials: the last to finish registers the best",
            file=sys.stderr,
        )
        return TrainOutcome(None, False, metrics, None)
    best = EwsjfMetaPolicy(**result.params).fit(lengths)
    best.metadata["data_window"] = {
        "history_prompts": len(lengths),
        **({"history_seed": HISTORY_SEED} if on_workload else {}),
        "traffic": traffic.source,
        **({"tune_rate": rate} if on_workload else {}),
        "requests": len(traffic.requests),
        "study": {"name": STUDY, "best_trial": result.best_trial, "value": result.value},
    }
    champion_metrics = None
    if champion is not None:  # the champion's Theta on the same replay and layout window: its
        # warm-start trial, unless a shared study had already run it (then score it here)
        theta = {k: v for k, v in champion.get_params().items() if k in THETA_SPACE}
        scored = next((m for params, _, m in result.history if params == theta), None)
        scored = scored if scored is not None else objective(theta)[1]
        champion_metrics = {k: v for k, v in scored.items() if v is not None}

    def register() -> TrainOutcome:
        outcome = register_and_gate(
            registry,
            best,
            metrics,
            champion_metrics,
            Gate("reward", lower_is_better=False, margin=margin),
            promote_if_better=True,
            params={
                "trials": trials,
                "traffic": traffic.source,
                **({"tune_rate": rate} if on_workload else {}),
            },
        )
        _log_reward_curve(registry, outcome.version, [h[2]["reward"] for h in result.history])
        queues = [q.__dict__ for q in best.queues_]
        config = PolicyConfig("ewsjf", {"meta": best.get_params(), "queues": queues})
        outcome.policy_config_version = registry.log(config, metrics=metrics, run_name="policy-config:ewsjf")
        return outcome

    if storage is None:
        return register()
    # A shared study: every worker that finishes last (two can, at the same moment) would register
    # the same best; under the store's lock, only the first one that finds it unregistered does.
    try:
        with registry.store_lock(f"tune-{STUDY}"):
            if _study_best_registered(registry, result.best_trial, result.value):
                return TrainOutcome(None, False, metrics, None)
            return register()
    except StoreLocked:
        print("  another worker is registering this study's best", file=sys.stderr)
        return TrainOutcome(None, False, metrics, None)


def _study_best_registered(registry: Registry, trial: int, value: float) -> bool:
    """Whether a version of ewsjf-meta-policy records this study's best trial as its origin."""
    if "ewsjf-meta-policy" not in registry.names():
        return False
    for info in registry.versions("ewsjf-meta-policy"):
        window = json.loads(info.tags.get("adapt.data_window") or "null") or {}
        study = window.get("study") or {}
        if study.get("name") == STUDY and study.get("best_trial") == trial and study.get("value") == value:
            return True
    return False


def _log_reward_curve(registry: Registry, version: int, rewards: list[float]) -> None:
    fig, ax = figure(1, (6, 3.5))
    ax.plot(range(1, len(rewards) + 1), rewards, "o-", label="trial reward")
    ax.plot(range(1, len(rewards) + 1), np.maximum.accumulate(rewards), "-", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel("reward R (equation 5)")
    ax.legend()
    with tempfile.TemporaryDirectory() as tmp:
        path = save(fig, Path(tmp) / "reward_curve.png")
        run_id = registry.client.get_model_version("ewsjf-meta-policy", str(version)).run_id
        registry.client.log_artifact(run_id, str(path))


def online_tune_ewsjf(
    registry: Registry,
    *,
    rate: float = 12.0,
    num_requests: int = 4000,
    window: int = 200,
) -> TrainOutcome:
    """Run `ewsjf-online` inside an engine serving `ewsjf-mixed` traffic (the replay engine stands
    in for a live server), starting from the champion, and register the incumbent it ends with.
    It is promoted only if the policy adopted a candidate: adoption already needed a paired gain
    above the measured window-to-window noise (`adapt.paired`), which is the gate here."""
    from serving_hooks.policies.ewsjf_online import OnlineEWSJF

    spec = WORKLOADS["ewsjf-mixed"]
    champion = registry.champion("ewsjf-meta-policy") or EwsjfMetaPolicy().fit(history_lengths())
    policy = OnlineEWSJF(champion, window=window, mlflow_experiment="tune-ewsjf-online")
    cost = roofline(spec.model, spec.gpu, tp=spec.tp)
    ReplayEngine(policy, cost, spec.engine_config()).run(spec.build(rate, num_requests, 0))
    candidate = policy.incumbent
    candidate.metadata["data_window"] = {
        "online_windows": policy.windows_closed,
        "window": window,
        "rate": rate,
    }
    gain = sum(a["score"] for a in policy.adoptions)
    metrics = {
        "paired_gain": gain,
        "windows": float(policy.windows_closed),
        "candidates": float(len(policy.evaluations)),
        "adoptions": float(len(policy.adoptions)),
    }
    return register_and_gate(
        registry,
        candidate,
        metrics,
        {"paired_gain": 0.0},
        Gate("paired_gain", lower_is_better=False),
        promote_if_better=bool(policy.adoptions),
        params={"mode": "online", "window": window},
    )
