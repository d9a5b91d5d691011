"""`adapt quickstart`: the main job, end to end on the bundled data with the embedded MLflow store.

1. Trains the learned components that exist through their pipelines, registers and promotes them:
   `cost-model` (calibrated on a step log of a replayed Azure slice), `slai-offset` (Optuna on
   replay of slai-tiers), `ewsjf-meta-policy` (Refine-and-Prune + Optuna on ewsjf-mixed),
   `semantic-history` (MiniLM + FAISS window on the AlpacaEval train split), `qrf-length` (quantile
   forest on the same split), `neural-length` (quantile MLP on the same split, the forest's
   learned-network alternative) and `pattern-graph` (k-medoids over generated compound programs).
2. Replays every policy on every named workload and the real Azure trace -- `slai`, `ewsjf`,
   `sagesched` and `jitserve` with the champions loaded from the registry -- logging each
   (workload, policy) as an MLflow run.
3. Prints a front page (per workload: the best baseline allowed to win its headline against the
   learned policy, with the gain and served share), a leaderboard of each workload's headline
   metric and the paths of a Markdown report, latency-CDF plots, headline-versus-load plots (full
   run) and a JSON of every metric; says how to browse the runs in `mlflow ui`.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from adapt.parallel import default_jobs, run_cells
from adapt.plots import figure, save
from adapt.registry import CHAMPION, Registry
from adapt.replay.cells import ReplayCell, replay_cells
from adapt.replay.cost import roofline
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.replay.metrics import ReplayResult
from adapt.replay.runner import ReplaySetup, log_to_mlflow
from adapt.traces import load_trace
from adapt.workloads import WORKLOADS, bundled
from pipelines.cost_model import train_cost_model
from pipelines.ewsjf import tune_ewsjf
from pipelines.jitserve import train_pattern_graph, train_qrf_length
from pipelines.neural_length import train_neural_length
from pipelines.semantic_history import train_semantic_history
from pipelines.slai import SLOS, train_slai_offset
from serving_hooks.policies import POLICIES, PolicySpec


def starves_long_requests(metrics: dict[str, Any], fcfs: dict[str, Any]) -> str | None:
    """EWSJF's starvation guard: a short-request TTFT bought by holding long requests back (their
    P99 TTFT above 1.2x FCFS's) does not count. Tokens/s is not part of the guard: on a finite
    overloaded trace it is set by the drain at the end, where FCFS is hard to beat by a fraction of
    a percent; `experiments/own_workload.py` checks EWSJF's throughput target separately."""
    if metrics["by_class"]["long"]["ttft_p99"] > 1.2 * fcfs["by_class"]["long"]["ttft_p99"]:
        return "starves long requests"
    return None


def misses_tbt_slo(metrics: dict[str, Any], fcfs: dict[str, Any]) -> str | None:
    """SLAI's guard: a median TTFT bought by missing a tier's P99 TBT target does not count, nor
    one whose tier has no P99 TBT at all (it cannot show the target met)."""
    p99 = {tier: metrics["by_class"].get(tier, {}).get("tbt_p99") for tier in SLOS}
    missed = [tier for tier, slo in SLOS.items() if p99[tier] is None or p99[tier] > slo]
    return f"misses the {'/'.join(missed)} TBT SLO" if missed else None


@dataclass(frozen=True)
class Headline:
    """The one number a workload is judged by, which direction is better, and what a policy must
    not trade for it (`guard`: the reason a value may not win, given the policy's and FCFS's
    metrics on the same run; a latency headline also needs every request served)."""

    title: str
    key: str
    label: str | None = None
    lower_is_better: bool = True
    scale: float = 1.0  # shown as value / scale
    guard: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None

    def value(self, metrics: dict[str, Any]) -> float | None:
        scope = metrics if self.label is None else metrics.get("by_class", {}).get(self.label, {})
        return scope.get(self.key)

    def barred(self, metrics: dict[str, Any], fcfs: dict[str, Any]) -> str | None:
        """Why this policy's value may not win (None: it may)."""
        if self.lower_is_better and metrics["dropped"]:
            return f"{metrics['dropped'] / metrics['num_requests']:.0%} dropped"
        return None if self.guard is None else self.guard(metrics, fcfs)


HEADLINES: dict[str, Headline] = {
    "ewsjf-mixed": Headline(
        "short-request mean TTFT (s)", "ttft_mean", label="short", guard=starves_long_requests
    ),
    "slai-tiers": Headline("median TTFT (s)", "ttft_p50", guard=misses_tbt_slo),
    "azure-conv": Headline("mean TTLT (s)", "ttlt_mean"),
    "sagesched-mix": Headline("mean TTLT (s)", "ttlt_mean"),
    "jitserve-mix": Headline("token goodput (M)", "goodput_tokens", lower_is_better=False, scale=1e6),
}

# Configured baselines replayed beside every named policy: SPF evicting the newest admitted under
# KV pressure (vLLM's FCFS rule) instead of the longest prompt. Under recompute preemption the victim
# moves mean TTLT more than the order does (`experiments.sagesched_study`), so the best-tuned
# baseline a learned policy must beat includes it.
BASELINE_VARIANTS = ("spf:victim=newest",)
# Baselines that read no true lengths (ltr and trail default to a noisy oracle, so they are out).
NON_ORACLE_BASELINES = ("fcfs", "vllm-v0", "sarathi", "spf", "edf", "fastserve", "plas", *BASELINE_VARIANTS)
# The learned policy each workload was written for (azure-conv: none; the best learned one shows).
OWN_POLICY = {
    "ewsjf-mixed": "ewsjf",
    "slai-tiers": "slai",
    "sagesched-mix": "sagesched",
    "jitserve-mix": "jitserve",
}
LEARNED = ("ewsjf", "slai", "sagesched", "jitserve")
# A workload's oracle: its learned policy with a perfect predictor, where the policy has an oracle form.
ORACLE = {"jitserve-mix": "jitserve-oracle"}
# SageSched given every request's true output length (replay only): the most its predictions could
# buy on any trace. A ceiling to show, never a contender.
SAGESCHED_CEILING = "sagesched:true_lengths=all"
CEILING = {"sagesched-mix": SAGESCHED_CEILING}
# The oracle drawn in each load plot: the workload's oracle or ceiling, else shortest-job-first on
# the true length.
PLOT_ORACLE = {**ORACLE, **CEILING}
# Loads of the headline-versus-load plots, as multiples of each workload's rate (full run only).
LOAD_SCALES = (0.75, 1.5)  # with the main run's 1x: three points, 30 more replays

# The seed of the traffic every policy is judged on: one the tuners never see (they replay seed 0:
# `adapt tune slai` / `ewsjf` on the workloads, the EWSJF layout on its own history seed), so the
# front page does not judge a learned policy on the requests it was tuned on. azure-conv is the
# real trace and takes no seed.
EVAL_SEED = 1

# (rate, number of requests) per workload: the full run, and --fast.
SIZES: dict[str, dict[bool, tuple[float, int]]] = {
    "ewsjf-mixed": {False: (40.0, 3000), True: (40.0, 800)},
    "slai-tiers": {False: (2.0, 1500), True: (2.0, 400)},  # Sarathi's largest sustained rate
    "azure-conv": {False: (5.53, 19366), True: (5.53, 3000)},
    "sagesched-mix": {False: (3.0, 2000), True: (3.0, 600)},
    "jitserve-mix": {False: (2.5, 1500), True: (2.5, 400)},
}


def cdf_points(latencies: Any) -> tuple[Any, Any]:
    """A latency CDF over *all* requests: a request that never got there (dropped, unfinished) is
    NaN and has no point, so a policy that drops requests levels off below 1 instead of looking as
    fast as one that served them all."""
    import numpy as np

    xs = np.sort(latencies[~np.isnan(latencies)])
    return xs, np.arange(1, len(xs) + 1) / max(len(latencies), 1)


def _cdf_plot(results: dict[str, ReplayResult], workload: str, out: Path) -> Path:
    fig, axes = figure(2, (11, 4))
    for name, result in results.items():
        arrival = result.table.column("arrival_s")
        for ax, values in (
            (axes[0], result.table.column("first_token_s") - arrival),
            (axes[1], result.table.column("finish_s") - arrival),
        ):
            ax.plot(*cdf_points(values), label=name)
    for ax, title in zip(axes, ("TTFT", "TTLT"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    return save(fig, out / f"{workload}_cdf.png", f"{workload}: latency CDFs")


def _train_cost_model(registry: Registry, out: Path, fast: bool) -> None:
    spec = WORKLOADS["azure-conv"]
    engine = ReplayEngine(
        POLICIES["fcfs"](), roofline(spec.model, spec.gpu, tp=spec.tp), EngineConfig(record_steps=True)
    )
    engine.run(spec.build(spec.rate, 1000 if fast else 4000, 0))
    step_log = out / "azure_step_log.csv"
    pd.DataFrame(engine.recorder.step_log()).to_csv(step_log, index=False)
    outcome = train_cost_model(
        registry, step_log, kv_capacity=engine.kv.num_blocks * engine.kv.block_size, promote_if_better=True
    )
    print(
        f"  cost-model v{outcome.version}: held-out MAPE {outcome.metrics['mape']:.3f}"
        f" (promoted: {'yes' if outcome.promoted else 'no'})",
        file=sys.stderr,
    )


def _train_slai_offset(registry: Registry, out: Path, fast: bool) -> None:
    outcome = train_slai_offset(
        registry,
        rate=2.0,  # the highest load Sarathi sustains under the default cost form (median TTFT 0.43-0.63 s)
        num_requests=800,  # fewer cannot show keeping up with the rate (the feasibility gate)
        trials=4 if fast else 12,
        promote_if_better=True,
    )
    print(
        f"  slai-offset v{outcome.version}: median TTFT {outcome.metrics['ttft_p50']:.3f}s,"
        f" feasible {bool(outcome.metrics['feasible'])} (promoted: {'yes' if outcome.promoted else 'no'})",
        file=sys.stderr,
    )


def _train_ewsjf_meta(registry: Registry, out: Path, fast: bool) -> None:
    outcome = tune_ewsjf(registry, rate=40.0, num_requests=400 if fast else 1000, trials=3 if fast else 8)
    print(
        f"  ewsjf-meta-policy v{outcome.version}: reward {outcome.metrics['reward']:.3f}"
        f" (promoted: {'yes' if outcome.promoted else 'no'})",
        file=sys.stderr,
    )


def _train_semantic_history(registry: Registry, out: Path, fast: bool) -> None:
    outcome = train_semantic_history(registry, promote_if_better=True)
    print(
        f"  semantic-history v{outcome.version}: held-out Wasserstein {outcome.metrics['wasserstein']:.1f}"
        f" tokens (length-only {outcome.metrics['length_wasserstein']:.1f},"
        f" point {outcome.metrics['point_wasserstein']:.1f};"
        f" promoted: {'yes' if outcome.promoted else 'no'})",
        file=sys.stderr,
    )


def _train_qrf_length(registry: Registry, out: Path, fast: bool) -> None:
    outcome = train_qrf_length(registry, promote_if_better=True, **({"n_estimators": 20} if fast else {}))
    _print_bound("qrf-length", outcome)


def _train_neural_length(registry: Registry, out: Path, fast: bool) -> None:
    _print_bound("neural-length", train_neural_length(registry, promote_if_better=True))


def _train_pattern_graph(registry: Registry, out: Path, fast: bool) -> None:
    outcome = train_pattern_graph(registry, promote_if_better=True)
    print(
        f"  pattern-graph v{outcome.version}: held-out stage-share error {outcome.metrics['share_error']:.3f}"
        f" (after 0 stages {outcome.metrics['share_error_after_0']:.3f}, after 1"
        f" {outcome.metrics['share_error_after_1']:.3f}; promoted: {'yes' if outcome.promoted else 'no'})",
        file=sys.stderr,
    )


@dataclass(frozen=True)
class TrainingStep:
    """How the quickstart trains one catalogue component: settings sized for a demo run.
    `typical_s` (seconds on a 2-core machine, --fast) only orders the steps: longest first."""

    describe: str
    run: Callable[[Registry, Path, bool], None]
    typical_s: float


# Steps for components of `pipelines.catalogue.CATALOGUE`, in its order (a test keeps them so); a new
# component joins the quickstart by adding its step here.
TRAINING: dict[str, TrainingStep] = {
    "cost-model": TrainingStep(
        "step log of a replayed Azure trace slice -> fit -> register", _train_cost_model, 2
    ),
    "slai-offset": TrainingStep("Optuna on replay of slai-tiers -> register -> gate", _train_slai_offset, 8),
    "ewsjf-meta-policy": TrainingStep(
        "Refine-and-Prune + Bayesian meta-optimiser on replay", _train_ewsjf_meta, 5
    ),
    "semantic-history": TrainingStep(
        "embed AlpacaEval prompts -> FAISS window -> held-out score", _train_semantic_history, 10
    ),
    "qrf-length": TrainingStep(
        "quantile forest on the AlpacaEval train split -> coverage", _train_qrf_length, 24
    ),
    "neural-length": TrainingStep(
        "Lightning quantile MLP over MiniLM embeddings, the same split", _train_neural_length, 15
    ),
    "pattern-graph": TrainingStep("k-medoids over generated compound programs", _train_pattern_graph, 2),
}


@dataclass(frozen=True)
class TrainingCell:
    """One training step as a cell for `run_cells`: the components are independent, so they
    train side by side, each registering its own versions in the shared store."""

    name: str
    out: Path
    fast: bool


def train_one(cell: TrainingCell) -> tuple[str, float]:
    """Run one training step; returns its progress output and its seconds. The output is held
    and printed whole when the step ends, so steps running side by side do not interleave."""
    step = TRAINING[cell.name]
    buffer = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stderr(buffer):
        print(f"[train] {cell.name}: {step.describe}", file=sys.stderr)
        step.run(Registry(), cell.out, cell.fast)
    return buffer.getvalue(), time.perf_counter() - started


def _embed_bundled_prompts() -> None:
    """Embed the bundled AlpacaEval prompts once, here, on every core (MiniLM uses them all):
    semantic-history and neural-length train on them side by side and sagesched-mix replays them,
    and each would otherwise embed the same texts in its own single-threaded worker. The vectors
    land in the on-disk embedding cache every process reads."""
    from predictors.semantic_history import embed_prompts

    started = time.perf_counter()
    texts = sorted(set(load_trace(bundled("alpaca_eval_lengths.jsonl.gz")).prompt_text))
    embed_prompts(texts)
    seconds = time.perf_counter() - started
    print(
        f"[train] {len(texts):,} bundled prompts embedded or found cached ({seconds:.0f} s)", file=sys.stderr
    )


def train_components(out: Path, fast: bool, jobs: int) -> dict[str, str]:
    """Step 1: train, register and promote each component (on `jobs` processes); returns, per
    learned policy, the spec that runs it with the registered champions pinned by version
    (`jitserve:qrf=v3:patterns=v2`), so every replay -- here or in a worker -- uses the same ones."""
    registry = Registry()  # creates the store before the workers share it
    _embed_bundled_prompts()

    def report(cell: TrainingCell, outcome: tuple[str, float]) -> None:
        text, seconds = outcome
        print(f"{text.rstrip()}\n  ({cell.name}: {seconds:.0f} s)", file=sys.stderr)

    print(f"[train] {len(TRAINING)} components on {min(jobs, len(TRAINING))} process(es)", file=sys.stderr)
    run_cells(
        train_one,
        [TrainingCell(name, out, fast) for name in TRAINING],
        jobs=jobs,
        describe=lambda cell: cell.name,
        cost=lambda cell: TRAINING[cell.name].typical_s,
        on_result=report,
    )

    def pinned(component: str) -> str:
        return f"v{registry.resolve(component, CHAMPION)}"

    specs = {
        "jitserve": f"jitserve:qrf={pinned('qrf-length')}:patterns={pinned('pattern-graph')}",
        "sagesched": f"sagesched:history={pinned('semantic-history')}",
        "ewsjf": f"ewsjf:meta={pinned('ewsjf-meta-policy')}",
        "ewsjf-online": f"ewsjf-online:meta={pinned('ewsjf-meta-policy')}",
    }
    if registry.resolve("slai-offset", CHAMPION, missing_ok=True) is not None:
        specs["slai"] = f"slai:offset={pinned('slai-offset')}"
    else:
        print("  no feasible slai-offset champion yet: slai runs the paper's rule", file=sys.stderr)
    return specs


def _print_bound(name: str, outcome: Any) -> None:
    coverage = ", ".join(f"{outcome.metrics[f'coverage_at_{g}']:.3f}" for g in (0, 50, 100, 200))
    bound = ", ".join(f"{outcome.metrics[f'bound_mean_at_{g}']:.0f}" for g in (0, 50, 100, 200))
    print(
        f"  {name} v{outcome.version}: held-out coverage of the 0.95 bound after 0/50/100/200 tokens"
        f" {coverage}, mean bound {bound} tokens (promoted: {'yes' if outcome.promoted else 'no'})",
        file=sys.stderr,
    )


def run_quickstart(
    *,
    fast: bool = False,
    out_dir: str | Path = "reports/quickstart",
    mlflow: bool = True,
    serve: bool = False,
    jobs: int | None = None,
) -> int:
    """The main job; `jobs` processes replay the policy x workload cells (default: every core)."""
    started = time.perf_counter()
    jobs = default_jobs() if jobs is None else jobs
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policies = [*POLICIES, *BASELINE_VARIANTS]
    specs = train_components(out, fast, jobs)
    leaderboard: dict[str, dict[str, float | None]] = {}
    dropped: dict[str, dict[str, float]] = {}
    barred: dict[str, dict[str, str]] = {}
    settings: dict[str, dict[str, int]] = {}
    plots: list[Path] = []
    everything: dict[str, Any] = {}
    setups: dict[str, ReplaySetup] = {}
    cells: list[ReplayCell] = []
    for workload, sizes in SIZES.items():
        spec = WORKLOADS[workload]
        rate, num = sizes[fast]
        setups[workload] = ReplaySetup(
            spec.build(rate, num, EVAL_SEED), spec.info(rate, num, EVAL_SEED), spec.model, spec.gpu, spec.tp
        )
        config = spec.engine_config()
        settings[workload] = {"token_budget": config.token_budget, "max_running": config.max_running}
        print(
            f"  {workload}: {num:,} requests at {rate} req/s on {spec.model} / {spec.tp} x {spec.gpu},"
            f" every policy at token budget {config.token_budget}",
            file=sys.stderr,
        )
        cells += [
            ReplayCell(
                (workload, p), f"{workload}:{p}", setups[workload], PolicySpec(specs.get(p, p)), config
            )
            for p in policies
        ]
    print(
        f"[replay] {len(policies)} policies x {len(SIZES)} workloads = {len(cells)} replays"
        f" on {jobs} process(es)",
        file=sys.stderr,
    )
    replay_started = time.perf_counter()
    replayed = dict(zip((cell.key for cell in cells), replay_cells(cells, jobs=jobs), strict=True))
    print(f"  (replays: {time.perf_counter() - replay_started:.0f} s)", file=sys.stderr)
    for workload, setup in setups.items():
        results = {p: replayed[workload, p] for p in policies}
        metrics = {p: result.metrics() for p, result in results.items()}
        if mlflow:
            for policy, values in metrics.items():
                log_to_mlflow("quickstart", setup.workload, policy, values, results[policy].policy_params)
        headline = HEADLINES[workload]
        leaderboard[workload] = {p: headline.value(m) for p, m in metrics.items()}
        dropped[workload] = {
            p: m["dropped"] / m["num_requests"] for p, m in metrics.items() if m["num_requests"]
        }
        barred[workload] = {
            p: reason for p, m in metrics.items() if (reason := headline.barred(m, metrics["fcfs"]))
        }
        plots.append(_cdf_plot(results, workload, out))
        everything[workload] = {"workload": setup.workload, "engine": settings[workload], "policies": metrics}
    (out / "results.json").write_text(json.dumps(everything, indent=2) + "\n")
    own_budgets = {
        p: m["token_budget"]
        for w, data in everything.items()
        for p, m in data["policies"].items()
        if m["token_budget"] != settings[w]["token_budget"]
    }
    table = "\n\n".join(
        (
            format_front_page(everything, barred),
            format_settings(settings, own_budgets),
            format_leaderboard(leaderboard, dropped, barred),
            format_guards(everything),
        )
    )
    if not fast:  # --fast keeps to its time budget: the load plots need 30 more replays
        load_started = time.perf_counter()
        plots = load_plots(everything, barred, specs, jobs, out) + plots
        print(f"  (load plots: {time.perf_counter() - load_started:.0f} s)", file=sys.stderr)
    report = out / "report.md"
    report.write_text(_report(table, plots, fast))
    print()
    print(table)
    print()
    print(f"report: {report}")
    for plot in plots:
        print(f"plot:   {plot}")
    print(f"json:   {out / 'results.json'}")
    if serve:
        from experiments.quickstart_serve import serve_demo

        live = serve_demo(out, fast)
        (out / "serve.json").write_text(json.dumps(live, indent=2) + "\n")
        client = live["client"]
        print(
            f"serve:  jitserve in vLLM swapped pattern-graph v{live['before']['components']['pattern-graph']}"
            f" -> v{live['after']['components']['pattern-graph']} during the load;"
            f" {client['ok']}/{client['requests']} requests ok, {client['failed']} failed"
            f" (swaps {live['after']['swaps']}, failed swaps {live['after']['failed_swaps']})"
            f"; {out / 'serve.json'}"
        )
    if mlflow:
        from adapt import tracking

        print(f"runs:   MLflow experiment 'quickstart' in {tracking.tracking_uri()}")
        print(f"        browse: .venv/bin/mlflow ui --backend-store-uri {tracking.tracking_uri()}")
        print("        table:  .venv/bin/adapt compare --experiment quickstart --metric ttlt_mean")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


def front_page_pair(workload: str, metrics: dict[str, Any], barred: dict[str, str]) -> tuple[str, str]:
    """(best non-oracle baseline allowed to win the headline, the learned policy shown against it:
    the workload's own, or on a workload no learned policy was written for the best allowed one)."""
    headline = HEADLINES[workload]
    allowed = {p: headline.value(m) for p, m in metrics.items() if p not in barred}
    pick = min if headline.lower_is_better else max
    baselines = {p: v for p, v in allowed.items() if p in NON_ORACLE_BASELINES and v is not None}
    learned = OWN_POLICY.get(workload) or pick(
        (p for p in LEARNED if allowed.get(p) is not None), key=allowed.get, default=LEARNED[0]
    )
    return pick(baselines, key=baselines.get), learned


def load_plots(
    everything: dict[str, Any],
    barred: dict[str, dict[str, str]],
    specs: dict[str, str],
    jobs: int,
    out: Path,
) -> list[Path]:
    """Per workload, the headline versus load for the learned policy, the best baseline at the
    quickstart's rate and an oracle (`PLOT_ORACLE`): the same requests' generator at `LOAD_SCALES`
    times the rate (the 1x points are the main run's, or replayed here for a policy it did not
    run), all as replay cells on `jobs` processes."""
    cells = []
    for workload, data in everything.items():
        spec, (rate, num) = WORKLOADS[workload], SIZES[workload][False]
        shown = dict.fromkeys(
            (
                *front_page_pair(workload, data["policies"], barred[workload]),
                PLOT_ORACLE.get(workload, "sjf-oracle"),
            )
        )
        not_in_main_run = [p for p in shown if p not in data["policies"]]
        for scale, policies in (*((s, list(shown)) for s in LOAD_SCALES), (1.0, not_in_main_run)):
            if not policies:
                continue
            setup = ReplaySetup(
                spec.build(rate * scale, num, EVAL_SEED),
                spec.info(rate * scale, num, EVAL_SEED),
                spec.model,
                spec.gpu,
                spec.tp,
            )
            for policy in policies:
                build = PolicySpec(specs.get(policy, policy))
                label = f"{workload}@{rate * scale:g}:{policy}"
                cells.append(ReplayCell((workload, scale, policy), label, setup, build, spec.engine_config()))
    curves: dict[str, dict[str, dict[float, float | None]]] = {}
    for cell, result in zip(cells, replay_cells(cells, jobs=jobs), strict=True):
        workload, scale, policy = cell.key
        curves.setdefault(workload, {}).setdefault(policy, {})[scale] = HEADLINES[workload].value(
            result.metrics()
        )
    paths = []
    for workload, by_policy in curves.items():
        headline, rate = HEADLINES[workload], SIZES[workload][False][0]
        fig, ax = figure()
        for policy, points in by_policy.items():
            main_run = everything[workload]["policies"]
            if policy in main_run:
                points[1.0] = headline.value(main_run[policy])
            xs = sorted(p for p in points if points[p] is not None)
            ax.plot([x * rate for x in xs], [points[x] / headline.scale for x in xs], "o-", label=policy)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(headline.title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(save(fig, out / f"{workload}_vs_load.png", f"{workload}: {headline.title} versus load"))
    return paths


def format_front_page(everything: dict[str, Any], barred: dict[str, dict[str, str]]) -> str:
    """Per workload: its engine settings, the best non-oracle baseline that may win the headline,
    the learned policy (the workload's own; on azure-conv the best learned one), its gain over that
    baseline and the share of requests it served -- or why its value may not win."""
    lines = [
        "| workload | token budget | headline | best baseline | learned policy | gain | served |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, data in everything.items():
        headline, metrics = HEADLINES[workload], data["policies"]
        baseline, learned = front_page_pair(workload, metrics, barred.get(workload, {}))
        value, base = headline.value(metrics[learned]), headline.value(metrics[baseline])
        change = value / base - 1.0
        better = change < 0 if headline.lower_is_better else change > 0
        why = barred.get(workload, {}).get(learned)
        gain = f"{change:+.1%} ({'better' if better else 'worse'})" + (
            f", not eligible: {why}" if why else ""
        )
        served = metrics[learned]["completed"] / metrics[learned]["num_requests"]
        lines.append(
            f"| {workload} | {data['engine']['token_budget']} | {headline.title} |"
            f" {baseline} {base / headline.scale:.3f} | {learned} {value / headline.scale:.3f} | {gain} |"
            f" {served:.0%} |"
        )
    return "\n".join(lines)


def format_settings(settings: dict[str, dict[str, int]], budgets: dict[str, int]) -> str:
    """The engine settings every policy ran under, per workload, and the policies that ran under a
    budget of their own somewhere (`budgets`: policy -> its budget)."""
    per_workload = ", ".join(f"{w} {s['token_budget']}" for w, s in settings.items())
    own = ", ".join(f"{p} {b}" for p, b in budgets.items())
    line = f"Engine settings, the same for every policy: token budget per workload: {per_workload}"
    line += f"; max running {next(iter(settings.values()))['max_running']}."
    return line + (f" Policies with their own budget: {own}." if own else "")


def guard(metrics: dict[str, Any]) -> tuple[float, float, float | None]:
    """What a headline cannot hide: the share of requests served, the worst request class's P99
    TTFT (all requests when there are no classes: starvation shows here), and the worst class's SLO
    attainment (None without SLOs)."""
    served = metrics["completed"] / metrics["num_requests"] if metrics["num_requests"] else 0.0
    classes = list(metrics.get("by_class", {}).values()) or [metrics]
    ttft = [c["ttft_p99"] for c in classes if c.get("ttft_p99") is not None]
    attained = [
        c["slo_attainment"] for c in classes if c.get("slo_requests") and c["slo_attainment"] is not None
    ]
    return served, max(ttft, default=float("nan")), min(attained, default=None)


def format_guards(everything: dict[str, Any]) -> str:
    """Policy x workload: served share / worst class's P99 TTFT / worst class's SLO attainment."""
    workloads = list(everything)
    policies = list(next(iter(everything.values()))["policies"])
    lines = [
        "Guards (served share / worst class's P99 TTFT in s / worst class's SLO attainment):",
        "",
        "| policy | " + " | ".join(workloads) + " |",
        "|---|" + "---|" * len(workloads),
    ]
    for policy in policies:
        cells = []
        for w in workloads:
            served, ttft, attained = guard(everything[w]["policies"][policy])
            cells.append(f"{served:.0%} / {ttft:.1f} / " + ("-" if attained is None else f"{attained:.2f}"))
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_leaderboard(
    leaderboard: dict[str, dict[str, float | None]],
    dropped: dict[str, dict[str, float]] | None = None,
    barred: dict[str, dict[str, str]] | None = None,
) -> str:
    """Policy x workload headline table, best in bold. A policy's drop share shows next to its
    number; a value the workload's guard bars from winning (`barred`: workload -> policy -> why:
    drops under a latency headline, starved long requests, a missed TBT SLO) is marked with a
    dagger and its reason listed under the table, and is never bold. Goodput counts drops as
    zero already, so a policy that dropped may still win it."""
    dropped = dropped or {}
    barred = barred or {}
    workloads = list(leaderboard)
    policies = list(next(iter(leaderboard.values())))
    lines = ["| policy | " + " | ".join(f"{w}: {HEADLINES[w].title}" for w in workloads) + " |"]
    lines.append("|---|" + "---|" * len(workloads))

    def eligible(w: str, policy: str) -> bool:
        if policy in barred.get(w, {}):
            return False
        return not HEADLINES[w].lower_is_better or not dropped.get(w, {}).get(policy)

    best = {
        w: (min if HEADLINES[w].lower_is_better else max)(
            (v for p, v in leaderboard[w].items() if v is not None and eligible(w, p)), default=None
        )
        for w in workloads
    }
    for policy in policies:
        cells = []
        for w in workloads:
            value = leaderboard[w][policy]
            text = "-" if value is None else f"{value / HEADLINES[w].scale:.3f}"
            share = dropped.get(w, {}).get(policy, 0.0)
            if share:
                text += f" ({share:.0%} dropped)"
            if policy in barred.get(w, {}) and not share:
                text += " †"
            cells.append(
                f"**{text}**" if value is not None and value == best[w] and eligible(w, policy) else text
            )
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    reasons = [
        f"{w}: {policy} ({why})"
        for w in workloads
        for policy, why in barred.get(w, {}).items()
        if not dropped.get(w, {}).get(policy)
    ]
    if reasons:
        lines += ["", "† not eligible to win: " + "; ".join(reasons) + "."]
    return "\n".join(lines)


def _report(table: str, plots: list[Path], fast: bool) -> str:
    images = "\n".join(f"![{p.stem}]({p.name})" for p in plots)
    return (
        "# adapt quickstart report\n\n"
        "The first table is the front page: per workload, the best baseline allowed to win its headline"
        " against the learned policy, the gain and the learned policy's served share.\n\n"
        f"Mode: {'fast' if fast else 'full'}. In the leaderboard, each cell is the workload's headline"
        " metric (best in bold;"
        " lower is better except goodput; latencies average served requests only, so a policy that"
        " dropped requests shows its drop share and is not bolded there; nor is one that starved"
        " ewsjf-mixed's long requests or missed a slai-tiers TBT SLO, marked †). Oracle policies"
        " (`sjf-oracle`, `jitserve-oracle`) know true output lengths (and, for jitserve, true stage"
        " shares) and bound what a perfect predictor could reach.\n\n"
        f"{table}\n\n{images}\n"
    )
