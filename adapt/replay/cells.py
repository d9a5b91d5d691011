"""A replay cell: one policy on one request sequence, the unit every parallel loop runs.

`adapt replay --policies`, the quickstart and the benchmarks describe their work as a list of
cells and hand it to `replay_cells`, which runs them on every core (`adapt.parallel.run_cells`).
A cell holds only what pickles: the requests, the engine preset and settings, and a policy
*factory* (a picklable callable such as `serving_hooks.policies.PolicySpec`), so a worker builds
its own fresh policy exactly as a serial run would, and the results are the same either way.
`run_cell` is the one function a worker runs; a remote executor (Ray) can run it unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from adapt.parallel import run_cells
from adapt.policy import Policy
from adapt.replay.cost import DEFAULT_OVERLAP
from adapt.replay.engine import EngineConfig
from adapt.replay.metrics import ReplayResult
from adapt.replay.runner import ReplaySetup, replay_policy
from adapt.steplog import CostModel


@dataclass(frozen=True)
class ReplayCell:
    """One replay: `label` names it in progress output and errors; `key` is the caller's handle
    (e.g. (workload, policy)) for putting the result back where it belongs."""

    key: Any
    label: str
    setup: ReplaySetup
    build_policy: Callable[[], Policy]
    config: EngineConfig | None = None
    cost: CostModel | None = None
    options: dict[str, Any] = field(default_factory=dict)  # replay_policy's keywords: replicas, router, ...

    def size(self) -> float:
        """Work estimate for scheduling the dearest cells first: requests x replicas."""
        return len(self.setup.requests) * self.options.get("replicas", 1)


def run_cell(cell: ReplayCell) -> ReplayResult:
    """Replay one cell (in a worker or in this process: the same call)."""
    options = {"decode_attention": "sum", "overlap": DEFAULT_OVERLAP, **cell.options}
    return replay_policy(
        cell.setup, cell.build_policy, label=cell.label, config=cell.config, cost=cell.cost, **options
    )


def replay_cells(
    cells: Sequence[ReplayCell],
    *,
    jobs: int | None = None,
    progress: bool = True,
    on_result: Callable[[ReplayCell, ReplayResult], None] | None = None,
    ray: str | None = None,
) -> list[ReplayResult]:
    """Every cell's result, in the cells' order, replayed on up to `jobs` processes (default:
    every core), or as Ray tasks (`ray`: see `run_cells`). With one job and no Ray they run here
    one after another, with the per-replay progress bar."""
    if jobs == 1 and ray is None:
        cells = [_with_progress(cell, progress) for cell in cells]
    return run_cells(
        run_cell,
        cells,
        jobs=jobs,
        describe=lambda cell: cell.label,
        cost=ReplayCell.size,
        progress=progress,
        on_result=on_result,
        ray=ray,
    )


def _with_progress(cell: ReplayCell, progress: bool) -> ReplayCell:
    return dataclasses.replace(cell, options={**cell.options, "progress": progress})


def compare_serial_parallel(cells: Sequence[ReplayCell], jobs: int, ray: str | None = None) -> dict[str, Any]:
    """Run the cells serially and on `jobs` processes (and as Ray tasks on `ray`, if given); wall
    seconds of each and whether every cell's metrics are identical to the serial run's (compared
    as JSON, so a NaN equals a NaN). Ray's start-up is timed apart from its run."""
    import time

    def timed(**how: Any) -> tuple[float, list[str]]:
        started = time.perf_counter()
        results = replay_cells(cells, progress=False, **how)
        return time.perf_counter() - started, [_as_json(r.metrics()) for r in results]

    serial_s, serial = timed(jobs=1)
    parallel_s, parallel = timed(jobs=jobs)
    figures: dict[str, Any] = {
        "jobs": jobs,
        "cells": len(cells),
        "serial_s": round(serial_s, 3),
        "parallel_s": round(parallel_s, 3),
        "speedup": round(serial_s / parallel_s, 2) if parallel_s else None,
        "identical": parallel == serial,
    }
    if ray is not None:
        figures["ray_start_s"] = round(_start_ray(ray, jobs), 3)
        ray_s, on_ray = timed(jobs=jobs, ray=ray)
        figures.update(ray_s=round(ray_s, 3), ray_identical=on_ray == serial)
    return figures


def _start_ray(address: str, jobs: int) -> float:
    """Seconds to bring up (or connect to) the Ray runtime, so a sweep's timing excludes it."""
    import time

    started = time.perf_counter()
    run_cells(len, [[]], jobs=jobs, ray=address, progress=False)
    return time.perf_counter() - started


def _as_json(metrics: dict[str, Any]) -> str:
    """Metrics without wall-clock figures, which differ between any two runs."""
    return json.dumps({k: v for k, v in metrics.items() if k != "sim_wall_s"}, sort_keys=True)
