"""Drift study: does the retraining loop win back what a stale learned part loses after a shift?

For each drift scenario (`adapt.workloads.drift`; what each stales and how that part is fitted:
`experiments.drift_scenarios`) and seed, one long replay per arm, all on the identical requests,
each arm with its own MLflow registry (sqlite in a temp directory):

- `stale`: the champion fitted on pre-shift traffic, never retrained;
- `loop`: the same champion, then every `window_s` simulated seconds the served requests (and,
  where the gate needs them, the engine's steps or the prompts' texts) are logged as `adapt serve
  --log-dir` logs them, `adapt retrain`'s code refits the policy's components on the newest logs
  and its gate decides, and promotions are hot-swapped between steps (`pipelines.replay_loop`);
  once, a window after the shift, a deliberately bad candidate -- fitted on lengths garbled (each
  replaced by 8192 / length: long and short swapped) -- goes through the same gate, judged on the
  clean logged data, which must refuse it;
- `oracle`: the champion until the shift; at the shift, a version retrained on post-shift traffic
  with hindsight is swapped in (the scenario's `oracle`).

The headline is the scenario's (EWSJF layout: short-request mean TTFT; JITServe bound: token
goodput per request), per window of arrivals and pooled over the windows after the shift; recovery
is the time from the shift to the first window within 5% of the oracle, and sustained recovery to
the first window from which every later one is (`experiments.drift_windows`).

    python -m experiments.drift_study [--fast] [--seeds 0,1,2] [--json OUT] [--plot-dir DIR]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from adapt.cli.usage import OUTPUT, OUTPUT_DIR, SEED_LIST, choice_list, number, write_json
from adapt.hotswap import PolicySlots
from adapt.plots import figure, save
from adapt.registry import Registry
from adapt.replay.checkpoints import run_with_checkpoints
from adapt.replay.metrics import ReplayResult
from adapt.workloads.drift import shift_time
from experiments.drift_scenarios import SCENARIOS, Scenario, Size
from experiments.drift_windows import mean_after, mean_before, recovery_s, window_means, within
from pipelines.catalogue import retrainers
from pipelines.replay_loop import Decision, RetrainLoop

TOLERANCE = 0.05
SHIFT_SHARE = 1 / 3  # where the drift workloads shift (their default)
FULL = Size(450.0, 30.0, 2)
FAST = Size(180.0, 20.0, 2)


def bad_candidate_hook(
    scenario: Scenario, registry: Registry, at_s: float, margin: float
) -> Callable[[float, Path], list[Decision]]:
    """Put the scenario's bad candidate through the gate once, at the first checkpoint at or after
    `at_s` with logs to judge it on."""
    done = False

    def hook(now: float, data_dir: Path) -> list[Decision]:
        nonlocal done
        if done or now < at_s or not any(data_dir.glob("requests*.jsonl")):
            return []
        done = True
        return [scenario.bad_candidate(registry, data_dir, margin, now)]

    return hook


def _registry(root: Path, arm: str, scenario: Scenario, seed: int) -> Registry:
    """A fresh store for one arm, its champion fitted on pre-shift traffic by the real pipeline."""
    registry = Registry(f"sqlite:///{root / arm}.db", cache_dir=root / f"cache-{arm}")
    scenario.champion(registry, seed)
    return registry


def run_cell(name: str, seed: int, size: Size, root: Path, margin: float = 0.0) -> dict[str, Any]:
    """The three arms of one scenario and seed: per-window headlines, pooled values, decisions."""
    scenario = SCENARIOS[name]
    spec = scenario.spec
    num_requests = size.num_requests(spec)
    requests = spec.build(spec.rate, num_requests, seed)
    shift_s = shift_time(spec.rate, num_requests, SHIFT_SHARE)
    end_s = max(r.arrival_s for r in requests)
    results: dict[str, ReplayResult] = {}

    results["stale"] = scenario.engine(_registry(root, "stale", scenario, seed)).run(requests)

    oracle_registry = _registry(root, "oracle", scenario, seed)
    oracle = scenario.engine(oracle_registry)
    oracle_slots = PolicySlots(oracle_registry, oracle.policy)
    oracle_slots.apply()
    champion = oracle_registry.champion(scenario.stales)
    best = scenario.oracle(size, seed, oracle_registry, requests, shift_s)

    def retrain_at_shift(_: float) -> None:
        if best is not champion:
            oracle_registry.promote(scenario.stales, oracle_registry.log(best))  # an oracle needs no gate
        oracle_slots.apply(use=oracle.use_component)  # at the next step, as the loop's swaps

    results["oracle"] = run_with_checkpoints(oracle, requests, [shift_s], retrain_at_shift)

    loop_registry = _registry(root, "loop", scenario, seed)
    loop = RetrainLoop(
        scenario.engine(loop_registry, record_steps=scenario.record_steps),
        loop_registry,
        root / "loop-logs",
        retrainers(),
        history=size.history,
        margin=margin,
        before_retrain=bad_candidate_hook(scenario, loop_registry, shift_s + size.window_s, margin),
        log_prompts=scenario.log_prompts,
    )
    results["loop"] = loop.run(requests, size.window_s, end_s)

    num_windows = math.ceil(size.duration_s / size.window_s)  # the same for every seed
    cell: dict[str, Any] = {"shift_s": shift_s, "window_s": size.window_s, "windows": {}}
    for arm, result in results.items():
        arrival, values = scenario.headline(result)
        cell["windows"][arm] = window_means(arrival, values, size.window_s, num_windows)
        cell[arm] = mean_after(arrival, values, shift_s)
        if arm == "stale":
            cell["before_shift"] = mean_before(arrival, values, shift_s)
    for key, sustained in (("recovery_s", False), ("sustained_recovery_s", True)):
        cell[key] = recovery_s(
            cell["windows"]["loop"],
            cell["windows"]["oracle"],
            size.window_s,
            shift_s,
            tolerance=TOLERANCE,
            higher_is_better=scenario.higher_is_better,
            sustained=sustained,
        )
    cell["decisions"] = [asdict(d) for d in loop.decisions if d.status != "no data"]
    bad = [d for d in loop.decisions if d.source == "bad-candidate" and d.status in ("registered", "refused")]
    cell["bad_candidate_refused"] = bool(bad) and not any(d.promoted for d in bad)  # it went through the gate
    # The positive control: the same gate let a retrained version of the staled part through after
    # the shift (a gate that refused everything would refuse the bad candidate too; the cost
    # model's own promotions say nothing about that gate).
    cell["good_candidate_promoted"] = any(
        d.promoted and d.source != "bad-candidate" and d.component == scenario.stales and d.at_s >= shift_s
        for d in loop.decisions
    )
    cell["swaps"] = loop.swaps
    return cell


def summarise(name: str, cells: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds, plus each seed's values."""
    scenario = SCENARIOS[name]
    summary: dict[str, Any] = {
        "metric": scenario.metric,
        "higher_is_better": scenario.higher_is_better,
        "stales": scenario.stales,
    }
    for key in ("before_shift", "stale", "loop", "oracle"):
        summary[key] = float(np.mean([c[key] for c in cells.values()]))
    for key in ("recovery_s", "sustained_recovery_s"):
        recoveries = [c[key] for c in cells.values()]
        summary[key] = None if None in recoveries else float(np.mean(recoveries))
    summary["bad_candidate_refused"] = all(c["bad_candidate_refused"] for c in cells.values())
    summary["good_candidate_promoted"] = all(c["good_candidate_promoted"] for c in cells.values())
    summary["loop_within_5pct_of_oracle"] = all(
        within(c["loop"], c["oracle"], TOLERANCE, scenario.higher_is_better) for c in cells.values()
    )
    # Degraded: worse by more than the tolerance than the better retrained arm (the loop can beat
    # the oracle, whose one retrain may keep the champion).
    pick = max if scenario.higher_is_better else min
    summary["stale_degrades"] = all(
        math.isfinite(c["stale"])
        and not within(c["stale"], pick(c["loop"], c["oracle"]), TOLERANCE, scenario.higher_is_better)
        for c in cells.values()
    )
    summary["per_seed"] = {str(seed): cell for seed, cell in cells.items()}
    return summary


def plot(name: str, summary: dict[str, Any], out_dir: Path) -> Path:
    """The headline per window for the three arms (mean over seeds), the shift and the loop's swaps."""
    cells = list(summary["per_seed"].values())
    window_s, shift_s = cells[0]["window_s"], cells[0]["shift_s"]
    fig, ax = figure()
    for arm in ("stale", "loop", "oracle"):
        series = np.nanmean(np.array([c["windows"][arm] for c in cells], dtype=np.float64), axis=0)
        ax.plot((np.arange(len(series)) + 0.5) * window_s, series, "o-", label=arm)
    ax.axvline(shift_s, color="grey", linestyle="--", label="shift")
    for at_s in sorted({s[0] for c in cells for s in c["swaps"] if s[0] > 0}):
        ax.axvline(at_s, color="green", alpha=0.15)
    ax.set_xlabel("simulated time (s), by arrival window")
    ax.set_ylabel(summary["metric"])
    ax.legend()
    out_dir.mkdir(parents=True, exist_ok=True)
    return save(fig, out_dir / f"{name}.png", f"{name}: {summary['metric']} per window (green: loop swaps)")


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """Mean over seeds per scenario; recovery in seconds after the shift (first window within 5%
    of the oracle / first from which every later window is)."""

    def seconds(value: float | None) -> str:
        return "never" if value is None else f"{value:.0f}"

    rows = [
        f"{'scenario':<34}{'before':>8}{'stale':>8}{'loop':>8}{'oracle':>8}{'loop/oracle':>12}"
        f"{'recovery':>10}{'sustained':>10}  bad refused / a retrain promoted after the shift"
    ]
    for name, s in summaries.items():
        rows.append(
            f"{name:<34}{s['before_shift']:>8.3f}{s['stale']:>8.3f}{s['loop']:>8.3f}{s['oracle']:>8.3f}"
            f"{s['loop'] / s['oracle']:>12.3f}{seconds(s['recovery_s']):>10}"
            f"{seconds(s['sustained_recovery_s']):>10}  {s['bad_candidate_refused']} /"
            f" {s['good_candidate_promoted']}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--fast", action="store_true", help="180 s of traffic instead of 450 s, 20 s windows instead of 30 s"
    )
    parser.add_argument("--seeds", type=SEED_LIST, default="0,1,2")
    parser.add_argument(
        "--scenarios",
        type=choice_list(SCENARIOS),
        default=",".join(SCENARIOS),
        help=f"of {', '.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--margin", type=number(0.0, low_open=False), default=0.0, help="the gate's relative margin"
    )
    parser.add_argument("--json", type=OUTPUT, default=None)
    parser.add_argument("--plot-dir", type=OUTPUT_DIR, default="reports/drift")
    args = parser.parse_args(argv)
    size = FAST if args.fast else FULL
    seeds = args.seeds
    summaries = {}
    for name in args.scenarios:
        cells = {}
        for seed in seeds:
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="drift-") as root:
                cells[seed] = run_cell(name, seed, size, Path(root), args.margin)
            c = cells[seed]
            print(
                f"{name} seed {seed}: before {c['before_shift']:.3f} stale {c['stale']:.3f}"
                f" loop {c['loop']:.3f} oracle {c['oracle']:.3f} recovery {c['recovery_s']}"
                f" (sustained {c['sustained_recovery_s']})"
                f" bad refused {c['bad_candidate_refused']}, a retrain promoted after the shift"
                f" {c['good_candidate_promoted']} ({time.perf_counter() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        summaries[name] = summarise(name, cells)
        print(f"plot: {plot(name, summaries[name], args.plot_dir)}", file=sys.stderr)
    print(table(summaries))
    if args.json is not None:
        write_json(args.json, {"scenarios": summaries})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
