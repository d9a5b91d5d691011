"""Replay a request sequence under one policy: the library call that the CLI, the pipelines'
replay checks, the tuners and the studies share, plus the one MLflow run per (workload, policy)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapt.policy import Policy
from adapt.replay.cluster import Cluster, make_router
from adapt.replay.cost import DEFAULT_OVERLAP, roofline
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.replay.metrics import ReplayResult
from adapt.requests import Request
from adapt.steplog import CostModel


@dataclass
class ReplaySetup:
    """What to replay and on what: the requests plus the engine preset."""

    requests: list[Request]
    workload: dict[str, Any]
    model: str
    gpu: str
    tp: int


def replay_policy(
    setup: ReplaySetup,
    build_policy: Callable[[], Policy],
    *,
    label: str,
    replicas: int = 1,
    router: str = "least-outstanding",
    decode_attention: str = "sum",
    overlap: str = DEFAULT_OVERLAP,
    seed: int = 0,
    progress: bool = False,
    config: EngineConfig | None = None,
    cost: CostModel | None = None,
) -> ReplayResult:
    """Replay the setup's requests under the policy `build_policy` makes (a fresh one per replica;
    `label` names it in progress output). `cost` overrides the preset roofline (e.g. a fitted
    `cost-model`). The caller turns policy names into factories: the core knows no policy by name."""
    cost = cost or roofline(
        setup.model, setup.gpu, tp=setup.tp, decode_attention=decode_attention, overlap=overlap
    )
    engines = [ReplayEngine(build_policy(), cost, config) for _ in range(replicas)]
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(setup.requests), desc=f"{label:>12}", unit="req", file=sys.stderr, leave=False)
    update = bar.update if bar is not None else None
    try:
        if replicas == 1:
            result = engines[0].run(setup.requests, progress=update)
        else:
            result = Cluster(engines, make_router(router, seed)).run(setup.requests, progress=update)
    finally:
        if bar is not None:
            bar.close()
    if progress:
        print(f"  {label}: {len(setup.requests):,} requests in {result.sim_wall_s:.1f} s", file=sys.stderr)
    return result


def log_to_mlflow(
    experiment: str,
    workload: dict[str, Any],
    policy: str,
    metrics: dict[str, Any],
    policy_params: dict[str, Any] | None = None,
) -> str:
    """One MLflow run per (workload, policy): params (the workload's, the policy's name and its
    parameters, `ReplayResult.policy_params`, as `policy.NAME`), flat numeric metrics, the metrics
    JSON."""
    from adapt import tracking

    client = tracking.client()
    experiment_id = tracking.ensure_experiment(client, experiment, tracking.tracking_uri())
    run = client.create_run(
        experiment_id, run_name=f"{workload.get('name')}:{policy}", tags={"kind": "replay"}
    )
    run_id = run.info.run_id
    params = {f"workload.{k}": str(v) for k, v in workload.items() if v is not None}
    params["policy"] = policy
    if isinstance(metrics.get("policy_config"), str):  # a registered policy-config: what it ran
        params["policy_config"] = metrics["policy_config"]
    for key, value in (policy_params or {}).items():
        if key != "policy":  # its name, logged as `policy` above
            params[f"policy.{key}"] = value if isinstance(value, str) else json.dumps(value, default=str)
    from mlflow.entities import Metric, Param

    flat = {k: v for k, v in metrics.items() if isinstance(v, int | float) and v is not None}
    for label, sub in (metrics.get("by_class") or {}).items():
        flat.update(
            {f"{label}.{k}": v for k, v in sub.items() if isinstance(v, int | float) and v is not None}
        )
    client.log_batch(
        run_id,
        metrics=[Metric(k, float(v), 0, 0) for k, v in flat.items()],
        params=[Param(k, v[:500]) for k, v in params.items()],
    )
    client.log_text(
        run_id,
        json.dumps(
            {"workload": workload, "policy": policy, "policy_params": policy_params, "metrics": metrics},
            indent=2,
            default=str,
        ),
        "replay.json",
    )
    client.set_terminated(run_id)
    return run_id
