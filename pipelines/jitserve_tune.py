"""`adapt tune jitserve`: the most goodput JITServe can earn without leaving an SLO class behind.

GMAX maximises token goodput, and on `jitserve-mix` the cheapest goodput is the compound calls': at
its hand-set defaults (batch cap 48, drop what waited 5 s) JITServe earns more than EDF by dropping
two in five latency-class requests (attainment 0.44 against EDF's 1.00, seed 1). The knobs that
trade goodput for fairness are policy parameters, so they are tuned like any other learned part:
Optuna (ask/tell, `adapt.online.tune`) on replay of `jitserve-mix` at its default rate and at
`OVERLOAD` times it (a configuration fair only at light load gives JITServe's lead away under load,
where it matters) on the tuning seed, over

    batch_share     the batch cap B as a share of the engine's running cap (B = share * max_running)
    waiting_time_s  admission control: a request never scheduled within it is dropped
    fairness        the blend of GMAX priority with time waited
    delta           goodput credited per frame waited

for the most token goodput, relative to EDF's and taken at the worse of the two loads, among
configurations whose every SLO class's attainment is within `FAIRNESS_POINTS` of EDF's on the same
requests and engine settings at both. A trial short of that scores its total shortfall (>= 0), so
any fair trial (scored -goodput / EDF's goodput, < 0) beats every unfair one. The learned
components (`qrf-length`, `pattern-graph`) are the registry's champions, pinned for the whole
study. The best configuration is registered as a `policy-config` version (not promoted: the
policy-config champion is what `adapt serve --follow-policy-config` serves, whichever policy it
names, so moving it is the operator's call).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

from adapt.registry import Registry
from adapt.replay.cost import roofline
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.requests import Request
from adapt.workloads import WORKLOADS
from pipelines.outcome import TrainOutcome
from serving_hooks.policies import PolicySpec, make_policy
from serving_hooks.policies.config import PolicyConfig
from serving_hooks.policies.jitserve import JITServe

WORKLOAD = "jitserve-mix"
FAIRNESS_POINTS = 0.10  # every class's SLO attainment at least EDF's minus this
OVERLOAD = 1.5  # the second load tuned at, times the workload's rate (issue 19's 1.5x)
SPACE: dict[str, tuple[float, float]] = {
    "batch_share": (0.1, 1.0),
    "waiting_time_s": (1.0, 60.0),
    "fairness": (0.0, 0.5),
    "delta": (0.0, 50.0),
}
# JITServe's hand-set defaults, as a point of the space (B = 48 of the workloads' 256 running)
DEFAULT_POINT = {"batch_share": 48 / 256, "waiting_time_s": 5.0, "fairness": 0.0, "delta": 8.0}
STUDY = "tune-jitserve"


def policy_params(point: dict[str, float], max_running: int) -> dict[str, Any]:
    """JITServe's constructor parameters for a point of `SPACE` under an engine's running cap."""
    return {
        "batch_size": max(1, round(point["batch_share"] * max_running)),
        "waiting_time_s": float(point["waiting_time_s"]),
        "fairness": float(point["fairness"]),
        "delta": float(point["delta"]),
    }


def score(metrics: dict[str, Any], reference: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(value to minimise, what to record) for a replay's metrics against EDF's on the same
    requests: the shortfall below EDF's attainment minus `FAIRNESS_POINTS`, summed over classes,
    if any; else minus the goodput as a share of EDF's."""
    record: dict[str, Any] = {
        "goodput_tokens": float(metrics["goodput_tokens"]),
        "goodput_vs_edf": metrics["goodput_tokens"] / max(reference["goodput_tokens"], 1.0),
        "dropped": int(metrics["dropped"]),
    }
    shortfall = 0.0
    for name, edf in reference["by_class"].items():
        attained = metrics["by_class"].get(name, {}).get("slo_attainment", 0.0)
        record[f"{name}_attainment"] = attained
        record[f"{name}_attainment_edf"] = edf["slo_attainment"]
        # rounded: an attainment exactly at the limit (0.70 against 0.80 - 0.10) is within it
        shortfall += max(0.0, round(edf["slo_attainment"] - FAIRNESS_POINTS - attained, 9))
    record["shortfall"] = shortfall
    record["fair"] = shortfall == 0.0
    return (shortfall if shortfall > 0 else -record["goodput_vs_edf"]), record


@functools.lru_cache(maxsize=4)
def _setup(rate: float, num_requests: int, seed: int) -> tuple[list[Request], Any, EngineConfig]:
    """The workload's requests, cost model and engine settings (built once per process)."""
    spec = WORKLOADS[WORKLOAD]
    requests = spec.build(rate, num_requests, seed)
    return requests, roofline(spec.model, spec.gpu, tp=spec.tp), spec.engine_config()


@functools.lru_cache(maxsize=4)
def _edf(rate: float, num_requests: int, seed: int) -> dict[str, Any]:
    requests, cost, config = _setup(rate, num_requests, seed)
    return ReplayEngine(make_policy("edf"), cost, config).run(requests).metrics()


@dataclass(frozen=True)
class JitserveObjective:
    """One trial: JITServe with a point's parameters on the study's requests, scored against EDF.
    Plain data (the components as pinned registry references), so it pickles to a worker."""

    rates: tuple[float, ...]
    num_requests: int
    seed: int = 0
    components: str = ""  # e.g. ":qrf=v3:patterns=v2"

    def __call__(self, point: dict[str, float]) -> tuple[float, dict[str, Any]]:
        """`score` at each rate, combined: the shortfalls summed, else the worse goodput share.
        Recorded with each rate's figures suffixed `_at_<rate>`."""
        record: dict[str, Any] = {}
        shortfall, worst = 0.0, float("inf")
        for rate in self.rates:
            requests, cost, config = _setup(rate, self.num_requests, self.seed)
            params = ":".join(f"{k}={v}" for k, v in policy_params(point, config.max_running).items())
            policy = PolicySpec(f"jitserve{self.components}:{params}")()
            metrics = ReplayEngine(policy, cost, config).run(requests).metrics()
            _, at_rate = score(metrics, _edf(rate, self.num_requests, self.seed))
            shortfall += at_rate["shortfall"]
            worst = min(worst, at_rate["goodput_vs_edf"])
            record.update({f"{key}_at_{rate:g}": value for key, value in at_rate.items()})
        record.update(shortfall=shortfall, fair=shortfall == 0.0, goodput_vs_edf=worst)
        return (shortfall if shortfall > 0 else -worst), record


def pinned_components(registry: Registry) -> str:
    """The champions of JITServe's components as a spec suffix pinned to their versions."""
    parts = []
    for attribute, name in JITServe.components.items():
        version = registry.resolve(name, missing_ok=True) if name in registry.names() else None
        if version is not None:
            parts.append(f":{attribute}=v{version}")
    return "".join(parts)


def tune_jitserve(
    registry: Registry,
    *,
    rate: float | None = None,
    num_requests: int | None = None,
    trials: int = 24,
    seed: int = 0,
    jobs: int = 1,
) -> TrainOutcome:
    """Tune on replay and register the best configuration as a `policy-config` (see the module)."""
    from adapt.online import tune

    spec = WORKLOADS[WORKLOAD]
    rate = spec.rate if rate is None else rate
    num_requests = spec.num_requests if num_requests is None else num_requests
    rates = (rate, round(OVERLOAD * rate, 6))
    objective = JitserveObjective(rates, num_requests, seed, pinned_components(registry))
    print(
        f"tuning jitserve on {WORKLOAD} at {rates[0]:g} and {rates[1]:g} req/s, {num_requests} requests,"
        f" {trials} trials"
        f" (components: {objective.components.lstrip(':') or 'none registered'});"
        f" every SLO class within {FAIRNESS_POINTS:.2f} of EDF's attainment",
        file=sys.stderr,
    )
    result = tune(
        objective,
        SPACE,
        n_trials=trials,
        seed=seed,
        warm_start=[DEFAULT_POINT],
        name=STUDY,
        mlflow_experiment=STUDY,
        jobs=jobs,
    )
    metrics = {k: float(v) for k, v in result.best_metrics.items() if isinstance(v, int | float)}
    if not result.best_metrics.get("fair"):
        print(
            f"  no trial kept every class within {FAIRNESS_POINTS:.2f} of EDF's attainment", file=sys.stderr
        )
    config = PolicyConfig("jitserve", policy_params(result.params, spec.engine_config().max_running))
    version = registry.log(config, metrics=metrics, run_name="policy-config:jitserve")
    return TrainOutcome(version, False, metrics, None)
