"""Replay memory benchmark: peak RSS of `adapt replay` on a large length-only trace.

    .venv/bin/python -m experiments.bench_memory [--requests 200000 1000000] [--json OUT]

Each trace is generated from the bundled Azure conversation lengths (resampled with seed 0) with
Poisson arrivals at 6 req/s -- a load llama-2-7b on one H100 sustains, so what is in flight stays
small and memory should not grow with the trace. Each size is replayed under `fcfs` in a fresh
`adapt replay` process, whose peak RSS (the kernel's high-water mark for the child) is the figure.
Issue targets: 1,000,000 requests under 1.5 GB, 200,000 under 400 MB.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from adapt.cli.usage import COUNT, OUTPUT, write_json
from adapt.traces import load_trace
from adapt.workloads import bundled

RATE = 6.0


def write_trace(path: Path, count: int, seed: int = 0) -> None:
    """An Azure-format CSV of `count` requests: bundled lengths resampled, Poisson arrivals."""
    azure = load_trace(bundled("azure_conv_2023.csv.gz"))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(azure), size=count)
    arrivals = np.cumsum(rng.exponential(1.0 / RATE, size=count))
    rows = np.column_stack([arrivals, azure.prompt_tokens[picks], azure.output_tokens[picks]])
    np.savetxt(
        path,
        rows,
        fmt=("%.6f", "%d", "%d"),
        delimiter=",",
        comments="",
        header="arrived_at,num_prefill_tokens,num_decode_tokens",
    )


def measure(trace: Path) -> dict[str, object]:
    """Replay the trace in a child process; its peak RSS, wall time and printed table row."""
    command = [
        sys.executable,
        "-m",
        "adapt.cli",
        "replay",
        "--trace",
        str(trace),
        "--policies",
        "fcfs",
        "--model",
        "llama-2-7b",
        "--gpu",
        "h100-80g",
        "--no-mlflow",
        "--quiet",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak_kb <= before:
        raise RuntimeError("an earlier child had a higher peak: measure the larger trace last")
    row = next(line for line in done.stdout.splitlines() if line.startswith("fcfs"))
    return {"peak_rss_mb": round(peak_kb / 1024, 1), "wall_s": round(wall, 1), "table_row": row}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=COUNT, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--json", type=OUTPUT, metavar="OUT", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        # Smallest first: RUSAGE_CHILDREN keeps the largest peak of any child so far.
        for count in sorted(args.requests):
            trace = Path(scratch) / f"azure_{count}.csv"
            write_trace(trace, count)
            figures = measure(trace)
            results[str(count)] = figures
            print(f"{count:>9,} requests: peak RSS {figures['peak_rss_mb']:,} MB, wall {figures['wall_s']} s")
            print(f"           {figures['table_row']}")
    if args.json is not None:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
