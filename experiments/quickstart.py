"""`adapt quickstart`: the main job, end to end on the bundled data with the embedded MLflow store.

Today it replays every available policy on every named workload and the real Azure trace, logs
each (workload, policy) as an MLflow run, and prints a leaderboard with each workload's headline
metric plus the paths of a Markdown report and its plots. Training and registering the learned
components joins it as those components land (see the README's status table).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.replay.cli import ReplaySetup, log_to_mlflow, replay_policy
from experiments.replay.metrics import ReplayResult
from experiments.workloads import WORKLOADS
from serving_hooks.policies import BASELINES


@dataclass(frozen=True)
class Headline:
    """The one number a workload is judged by, and which direction is better."""

    title: str
    key: str
    label: str | None = None
    lower_is_better: bool = True

    def value(self, metrics: dict[str, Any]) -> float | None:
        scope = metrics if self.label is None else metrics.get("by_class", {}).get(self.label, {})
        return scope.get(self.key)


HEADLINES: dict[str, Headline] = {
    "ewsjf-mixed": Headline("short-request mean TTFT (s)", "ttft_mean", label="short"),
    "slai-tiers": Headline("median TTFT (s)", "ttft_p50"),
    "azure-conv": Headline("mean TTLT (s)", "ttlt_mean"),
}

# (rate, number of requests) per workload: the full run, and --fast.
SIZES: dict[str, dict[bool, tuple[float, int]]] = {
    "ewsjf-mixed": {False: (40.0, 3000), True: (40.0, 800)},
    "slai-tiers": {False: (1.2, 1500), True: (1.2, 400)},
    "azure-conv": {False: (5.53, 19366), True: (5.53, 3000)},
}


def _cdf_plot(results: dict[str, ReplayResult], workload: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in results.items():
        done = [r for r in result.records if r.finish_s is not None]
        for ax, values in (
            (axes[0], [r.first_token_s - r.arrival_s for r in done]),
            (axes[1], [r.finish_s - r.arrival_s for r in done]),
        ):
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    for ax, title in zip(axes, ("TTFT", "TTLT"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{workload}: latency CDFs")
    fig.tight_layout()
    path = out / f"{workload}_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_quickstart(*, fast: bool = False, out_dir: str = "reports/quickstart", mlflow: bool = True) -> int:
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policies = list(BASELINES)
    leaderboard: dict[str, dict[str, float | None]] = {}
    plots: list[Path] = []
    everything: dict[str, Any] = {}
    print(
        f"adapt quickstart{' --fast' if fast else ''}: {len(policies)} policies x {len(SIZES)} workloads",
        file=sys.stderr,
    )
    for index, (workload, sizes) in enumerate(SIZES.items(), start=1):
        spec = WORKLOADS[workload]
        rate, num = sizes[fast]
        setup = ReplaySetup(spec.build(rate, num, 0), spec.info(rate, num, 0), spec.model, spec.gpu, spec.tp)
        print(
            f"[{index}/{len(SIZES)}] {workload}: {num:,} requests at {rate} req/s"
            f" on {spec.model} / {spec.tp} x {spec.gpu}",
            file=sys.stderr,
        )
        results: dict[str, ReplayResult] = {}
        metrics: dict[str, dict[str, Any]] = {}
        for policy in policies:
            results[policy] = replay_policy(setup, policy, progress=True)
            metrics[policy] = results[policy].metrics()
            if mlflow:
                log_to_mlflow("quickstart", setup.workload, policy, metrics[policy])
        headline = HEADLINES[workload]
        leaderboard[workload] = {p: headline.value(m) for p, m in metrics.items()}
        plots.append(_cdf_plot(results, workload, out))
        everything[workload] = {"workload": setup.workload, "policies": metrics}
    (out / "results.json").write_text(json.dumps(everything, indent=2) + "\n")
    table = format_leaderboard(leaderboard)
    report = out / "report.md"
    report.write_text(_report(table, plots, fast))
    print()
    print(table)
    print()
    print(f"report: {report}")
    for plot in plots:
        print(f"plot:   {plot}")
    print(f"json:   {out / 'results.json'}")
    if mlflow:
        from adapt import tracking

        print(f"runs:   MLflow experiment 'quickstart' in {tracking.tracking_uri()}")
        print(f"        browse: .venv/bin/mlflow ui --backend-store-uri {tracking.tracking_uri()}")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


def format_leaderboard(leaderboard: dict[str, dict[str, float | None]]) -> str:
    workloads = list(leaderboard)
    policies = list(next(iter(leaderboard.values())))
    lines = ["| policy | " + " | ".join(f"{w}: {HEADLINES[w].title}" for w in workloads) + " |"]
    lines.append("|---|" + "---|" * len(workloads))
    best = {w: min((v for v in leaderboard[w].values() if v is not None), default=None) for w in workloads}
    for policy in policies:
        cells = []
        for w in workloads:
            value = leaderboard[w][policy]
            text = "-" if value is None else f"{value:.3f}"
            cells.append(f"**{text}**" if value is not None and value == best[w] else text)
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _report(table: str, plots: list[Path], fast: bool) -> str:
    images = "\n".join(f"![{p.stem}]({p.name})" for p in plots)
    return (
        "# adapt quickstart report\n\n"
        f"Mode: {'fast' if fast else 'full'}. Each cell is the workload's headline metric (lower is better;"
        " best in bold). Oracle policies (`sjf-oracle`) know true output lengths and bound what a"
        " perfect predictor could reach.\n\n"
        f"{table}\n\n{images}\n"
    )
