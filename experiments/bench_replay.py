"""Replay speed benchmark: simulated requests and simulated seconds per wall-clock second.

    .venv/bin/python -m experiments.bench_replay [--synthetic N] [--policies a,b] [--jobs N] [--json OUT]

1. The full Azure conversation hour (19,366 requests, real arrivals) under `fcfs` and each learned
   policy (their default, untrained components: the trace has no prompts) on llama-2-13b /
   1 x a100-80g: wall seconds and real-time factor (makespan / wall). Issue 21's targets: FCFS under
   2 s, no policy more than 2x FCFS.
2. A synthetic trace of N requests (default 200,000: Azure lengths resampled, Poisson arrivals at
   the rate llama-2-7b on one H100 sustains) (target: under 2 minutes).
3. The decode-run fast path on and off on the first 3,000 Azure requests (same run, ratio).
4. Every core: 48 cells -- every policy on three slices of 1,000 Azure requests -- serially, on
   `--jobs` processes and, with `--ray [ADDRESS]`, as Ray tasks (`adapt.replay.cells`): wall
   seconds of each and whether every metric is identical to the serial run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np

from adapt.cli.usage import COUNT, NAME_LIST, OUTPUT, write_json
from adapt.parallel import default_jobs
from adapt.replay.cells import ReplayCell, compare_serial_parallel
from adapt.replay.cost import roofline
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.replay.runner import ReplaySetup
from adapt.traces import load_trace
from adapt.workloads import bundled
from adapt.workloads.builders import build_requests, poisson_arrivals
from serving_hooks.policies import POLICIES, PolicySpec, make_policy

LEARNED = ("ewsjf", "sagesched", "jitserve", "slai")


def _replay(requests, model: str, gpu: str, skip: bool = True, policy: str = "fcfs") -> tuple[float, dict]:
    engine = ReplayEngine(make_policy(policy), roofline(model, gpu), EngineConfig(skip_decode_runs=skip))
    start = time.perf_counter()
    result = engine.run(requests)
    wall = time.perf_counter() - start
    return wall, result.metrics()


def _rebased(requests: list) -> list:
    """A slice of the trace with its arrivals shifted to start at zero (a replay of its own)."""
    first = requests[0].arrival_s
    return [dataclasses.replace(r, arrival_s=r.arrival_s - first) for r in requests]


def _report(name: str, requests, wall: float, metrics: dict) -> None:
    simulated = max(r.arrival_s for r in requests) if requests else 0.0
    print(
        f"{name}: {len(requests):,} requests, {metrics['steps']:,} steps, wall {wall:.2f} s ->"
        f" {len(requests) / wall:,.0f} req/s, {metrics['makespan_s'] / wall:,.0f}x real time"
        f" (arrivals span {simulated:,.0f} s, makespan {metrics['makespan_s']:,.0f} s)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", type=COUNT, default=200_000, help="size of the synthetic trace")
    parser.add_argument(
        "--policies", type=NAME_LIST, default=",".join(("fcfs", *LEARNED)), help="policies on the hour"
    )
    parser.add_argument("--json", type=OUTPUT, metavar="OUT", help="write the figures as JSON here")
    parser.add_argument("--jobs", type=COUNT, default=default_jobs(), help="processes for section 4")
    parser.add_argument(
        "--ray", nargs="?", const="local", metavar="ADDRESS", help="section 4 on Ray too (default: local)"
    )
    args = parser.parse_args(argv)

    azure = load_trace(bundled("azure_conv_2023.csv.gz"))
    requests = build_requests(azure)
    hour: dict[str, dict[str, float]] = {}
    for policy in args.policies:
        wall, metrics = _replay(requests, "llama-2-13b", "a100-80g", policy=policy)
        _report(f"azure-conv hour, {policy}, llama-2-13b/a100-80g", requests, wall, metrics)
        hour[policy] = {"wall_s": round(wall, 3), "realtime_factor": round(metrics["makespan_s"] / wall, 1)}
    figures: dict[str, Any] = {"azure_hour": {"policy": hour}}

    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(azure), size=args.synthetic)
    synthetic = azure.take(picks)
    synthetic_requests = build_requests(synthetic, poisson_arrivals(args.synthetic, 6.0, rng))
    wall, metrics = _replay(synthetic_requests, "llama-2-7b", "h100-80g")
    _report(
        f"synthetic {args.synthetic:,}, fcfs, llama-2-7b/h100-80g at 6 req/s",
        synthetic_requests,
        wall,
        metrics,
    )

    head = requests[:3000]
    fast_wall, fast = _replay(head, "llama-2-13b", "a100-80g", skip=True)
    slow_wall, slow = _replay(head, "llama-2-13b", "a100-80g", skip=False)
    print(
        f"fast path on/off, azure first 3,000: {fast_wall:.2f} s vs {slow_wall:.2f} s"
        f" ({slow_wall / fast_wall:.1f}x faster; {fast['steps']:,} steps either way;"
        f" mean TTLT {fast['ttlt_mean']:.4f} vs {slow['ttlt_mean']:.4f})"
    )

    cells = []
    for start in (0, 1000, 2000):
        piece = _rebased(requests[start : start + 1000])
        setup = ReplaySetup(piece, {"name": f"azure-conv-{start}"}, "llama-2-13b", "a100-80g", 1)
        cells += [ReplayCell((start, p), f"{start}:{p}", setup, PolicySpec(p)) for p in POLICIES]
    parallel = compare_serial_parallel(cells, args.jobs, args.ray)
    figures["parallel"] = parallel
    line = (
        f"every core, {len(cells)} cells ({len(POLICIES)} policies x 3 slices of 1,000 Azure requests):"
        f" serial {parallel['serial_s']:.1f} s, {parallel['jobs']} processes {parallel['parallel_s']:.1f} s"
        f" ({parallel['speedup']}x), identical: {parallel['identical']}"
    )
    if args.ray:
        line += (
            f"; Ray {parallel['ray_s']:.1f} s after {parallel['ray_start_s']:.1f} s start-up,"
            f" identical: {parallel['ray_identical']}"
        )
    print(line)
    if args.json is not None:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
