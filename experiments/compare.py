"""`adapt compare`: replay runs of an MLflow experiment side by side, plus plots versus load.

Every replay run carries its workload (name, rate, preset) as params and its metrics, so runs made
by different commands, machines or days line up in one table: policies as rows, (workload, rate)
as columns. With several rates per workload it also draws token goodput and mean TTLT versus load
per policy, saves them under `--out` and logs them, with the table as CSV, to a `compare` run in
the same experiment so `mlflow ui` shows them next to the runs.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from adapt import tracking
from adapt.cli.usage import write_json
from adapt.plots import figure, save

METRICS = ("ttft_mean", "ttlt_mean", "tbt_p99", "throughput_tps", "goodput_tokens", "slo_attainment")


def collect_runs(experiment: str) -> list[dict[str, Any]]:
    """(workload, rate, policy, metrics) of every finished replay run, newest first per key."""
    client = tracking.client()
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ValueError(
            f"--experiment: no MLflow experiment named {experiment!r} in {tracking.tracking_uri()}"
        )
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for run in client.search_runs(
        [found.experiment_id], "tags.kind = 'replay'", order_by=["attributes.start_time DESC"]
    ):
        params = run.data.params
        key = (params.get("workload.name", "?"), params.get("workload.rate", "?"), params.get("policy", "?"))
        rows.setdefault(
            key, {"workload": key[0], "rate": key[1], "policy": key[2], "metrics": dict(run.data.metrics)}
        )
    return list(rows.values())


def format_table(rows: list[dict[str, Any]], metric: str) -> str:
    columns = sorted({(r["workload"], r["rate"]) for r in rows}, key=lambda c: (c[0], _as_float(c[1])))
    policies = sorted({r["policy"] for r in rows})
    value = {(r["workload"], r["rate"], r["policy"]): r["metrics"].get(metric) for r in rows}
    titles = [f"{w}@{rate}" for w, rate in columns]
    width = max([len(t) for t in titles] + [12]) + 2
    name_width = max([len(p) for p in policies] + [12]) + 2  # specs such as spf:victim=newest
    lines = [f"{metric}", f"{'policy':<{name_width}}" + "".join(f"{t:>{width}}" for t in titles)]
    for policy in policies:
        cells = []
        for workload, rate in columns:
            v = value.get((workload, rate, policy))
            cells.append(f"{'-':>{width}}" if v is None else f"{v:>{width}.4g}")
        lines.append(f"{policy:<{name_width}}" + "".join(cells))
    return "\n".join(lines)


def _as_float(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return float("inf")


def plot_versus_load(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Goodput and mean TTLT versus arrival rate, one figure per workload with >= 2 rates."""
    by_workload: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_workload[row["workload"]].append(row)
    paths = []
    for workload, items in sorted(by_workload.items()):
        rates = {_as_float(r["rate"]) for r in items}
        if len(rates) < 2 or float("inf") in rates:
            continue
        fig, axes = figure(2, (11, 4))
        for policy in sorted({r["policy"] for r in items}):
            points = sorted((_as_float(r["rate"]), r["metrics"]) for r in items if r["policy"] == policy)
            xs = [x for x, _ in points]
            axes[0].plot(xs, [m.get("goodput_tokens", float("nan")) for _, m in points], "o-", label=policy)
            axes[1].plot(xs, [m.get("ttlt_mean", float("nan")) for _, m in points], "o-", label=policy)
        axes[0].set_ylabel("token goodput")
        axes[1].set_ylabel("mean TTLT (s)")
        axes[1].set_yscale("log")
        for ax in axes:
            ax.set_xlabel("arrival rate (req/s)")
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7)
        paths.append(
            save(fig, out / f"{workload}_vs_load.png", f"{workload}: goodput and latency versus load")
        )
    return paths


def run_compare(
    experiment: str, metric: str, out_dir: str | Path, json_out: str | Path | None, log: bool = True
) -> int:
    rows = collect_runs(experiment)
    if not rows:
        print(f"no replay runs in experiment {experiment!r} yet (adapt replay ... or adapt quickstart)")
        return 0
    table = format_table(rows, metric)
    print(table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_versus_load(rows, out)
    for path in plots:
        print(f"plot: {path}")
    if json_out is not None:
        write_json(json_out, rows)
    if log:
        client = tracking.client()
        experiment_id = tracking.ensure_experiment(client, experiment, tracking.tracking_uri())
        run = client.create_run(experiment_id, run_name=f"compare:{metric}", tags={"kind": "compare"})
        with tempfile.TemporaryDirectory() as tmp:
            csv = Path(tmp) / f"compare_{metric}.txt"
            csv.write_text(table + "\n")
            client.log_artifact(run.info.run_id, str(csv))
        for path in plots:
            client.log_artifact(run.info.run_id, str(path))
        client.set_terminated(run.info.run_id)
        print(f"logged to MLflow run {run.info.run_id} in experiment {experiment!r}")
    return 0
