"""The leaderboard on traces no component was trained or tuned on (issue 19, item 5).

    .venv/bin/python -m experiments.generalisation [--fast] [--seeds 1,2,3] [--requests N] [--jobs N]
                                                   [--json OUT] [--store URI]

Scenarios: the bundled Azure conversation trace at 1x, 1.5x and 2x its rate (real arrivals
time-scaled; seed k replays the trace's k-th window of N requests, the quickstart's is window 0),
and two length-only traces a user brings -- the bundled ShareGPT and arXiv-summarisation lengths,
loaded as `adapt replay --trace FILE --num-requests N --rate R --seed k` loads them: the first N
rows, Poisson arrivals drawn with seed k, at a rate a little past what FCFS sustains on the engine.
Every policy in every scenario runs on one engine, azure-conv's (model, GPUs, token budget, cost
form), printed with each table.

Policies: every non-oracle baseline and the four learned ones with the store's champions pinned by
version (`--store`, default the MLflow tracking URI; a component without a champion is trained
first through the quickstart's pipeline on the bundled data). None of these traces carries prompt
text, so the learned policies that read it fall back to what the trace offers; the `text` column
says so. The headline is azure-conv's, mean TTLT; a policy that dropped requests may not rank, and
one whose P99 TTFT is above 1.2x FCFS's is flagged as starving requests (shown beside its rank).
A ceiling runs beside them, shown and never ranked: SageSched given every request's true output
length (`sagesched:true_lengths=all`, replay only), what a perfect length predictor could buy over
the best baseline on that trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adapt.cli.usage import COUNT, OUTPUT, SEED_LIST, add_parallel_arguments, write_json
from adapt.registry import CHAMPION, Registry
from adapt.replay.cells import ReplayCell, replay_cells
from adapt.replay.cost import DEFAULT_OVERLAP
from adapt.replay.runner import ReplaySetup
from adapt.requests import Request
from adapt.traces import load_trace
from adapt.workloads import WORKLOADS, bundled
from adapt.workloads.builders import trace_requests
from experiments.own_workload import TARGETS, learned_spec, mean_metrics
from experiments.quickstart import HEADLINES, LEARNED, NON_ORACLE_BASELINES, SAGESCHED_CEILING, TRAINING
from serving_hooks.policies import PolicySpec

ENGINE = WORKLOADS["azure-conv"]  # one engine for every scenario and policy
HEADLINE = HEADLINES["azure-conv"]  # mean TTLT
# What a learned policy does with a request that has no prompt text (decided per request:
# SageSched's `_predict` embeds only requests with text, the rest get the history's length-only
# prediction; JITServe's `_ask_bound` hands qrf-length "" as the text). EWSJF and SLAI read none.
TEXT_FALLBACK = {
    "sagesched": "length-only fallback: history neighbours by prompt length",
    "jitserve": "qrf-length on prompt length and tokens generated only",
}
# SageSched's order and victim with every request's true output length: the most any length
# predictor could buy on a trace (an oracle: shown, never ranked)
CEILING = SAGESCHED_CEILING
# (mean over seeds, spread) of these; served and preemptions per request are derived per run.
SHOWN = (
    ("ttlt_mean", "mean TTLT s"),
    ("ttft_p50", "med TTFT s"),
    ("ttft_p99", "P99 TTFT s"),
    ("served", "served"),
    ("preemptions_per_request", "preempt/req"),
)
REQUESTS = {False: 2000, True: 500}  # per run: full, --fast
STARVATION_FACTOR = 1.2  # P99 TTFT above this times FCFS's is flagged (the ewsjf guard's factor)


@dataclass(frozen=True)
class Scenario:
    """A trace at a rate. `windowed`: the trace has its own arrivals and seed k takes its k-th
    window of N rows (a different slice of real traffic); otherwise the trace is length-only and
    seed k draws its Poisson arrivals, as `adapt replay --trace` does."""

    name: str
    source: str  # a bundled file, read as a user's trace
    rate: float
    windowed: bool
    arrivals: str  # said in the output

    def requests(self, num: int, seed: int) -> list[Request]:
        trace = load_trace(bundled(self.source))
        if self.windowed:
            if (seed + 1) * num > len(trace):
                raise ValueError(f"{self.name}: seed {seed} needs rows up to {(seed + 1) * num:,}")
            trace = trace.take(np.arange(seed * num, (seed + 1) * num))
        else:
            trace = trace.head(num)
        return trace_requests(trace, self.rate, seed)


# ShareGPT and arXiv rates: FCFS on this engine sustains about 750 and 660 output tokens/s on them
# (1,000 requests, measured here), so 2.0 and 2.75 req/s offer 1.17x and 1.21x that: loaded, as
# azure-conv is at its own rate.
AZURE = "real arrivals time-scaled to {:g}x the trace's rate"
SCENARIOS = (
    *(
        Scenario(f"azure-conv-x{s:g}", "azure_conv_2023.csv.gz", ENGINE.rate * s, True, AZURE.format(s))
        for s in (1.0, 1.5, 2.0)
    ),
    Scenario("sharegpt", "sharegpt_lengths.csv.gz", 2.0, False, "Poisson (length-only trace)"),
    Scenario("arxiv", "arxiv_summarization_lengths.csv.gz", 2.75, False, "Poisson (length-only trace)"),
)


def engine_settings() -> dict[str, Any]:
    """The one engine every policy runs on, as reported with the tables."""
    config = ENGINE.engine_config()
    return {
        "model": ENGINE.model,
        "gpu": ENGINE.gpu,
        "tp": ENGINE.tp,
        "token_budget": config.token_budget,
        "max_running": config.max_running,
        "cost": f"roofline, overlap {DEFAULT_OVERLAP}, decode attention sum",
    }


def champion_specs(registry: Registry, fast: bool) -> dict[str, str]:
    """Each learned policy with its champions pinned by version; a component without a champion is
    trained first with the quickstart's step (its pipeline, the bundled data). A policy whose
    component still has none (slai-offset's gate refuses an infeasible offset) runs its defaults."""
    specs = {}
    for target in TARGETS:
        for component in target.components.values():
            if registry.resolve(component, CHAMPION, missing_ok=True) is None:
                print(f"[train] {component}: no champion in the store", file=sys.stderr)
                with tempfile.TemporaryDirectory() as out:
                    TRAINING[component].run(registry, Path(out), fast)
        components = target.components.values()
        missing = [c for c in components if registry.resolve(c, CHAMPION, missing_ok=True) is None]
        specs[target.policy] = target.policy if missing else learned_spec(registry, target)
        if missing:
            print(f"  {target.policy}: no {', '.join(missing)} champion; runs its defaults", file=sys.stderr)
    return specs


def text_use(policy: str, requests: list[Request]) -> str:
    """Whether a learned policy ran on prompt text or fell back to what the trace offers."""
    if policy not in TEXT_FALLBACK:
        return "not read"
    share = sum(r.prompt_text is not None for r in requests) / len(requests)
    if share == 1.0:
        return "yes"
    if share == 0.0:
        return f"no ({TEXT_FALLBACK[policy]})"
    return f"{share:.0%} of requests ({TEXT_FALLBACK[policy]} for the rest)"


def with_derived(metrics: dict[str, Any]) -> dict[str, Any]:
    """A run's metrics plus the served share and preemptions per request the tables show."""
    num = metrics["num_requests"]
    return {
        **metrics,
        "served": metrics["completed"] / num,
        "preemptions_per_request": metrics["preemptions"] / num,
    }


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per policy: the seed means (own_workload's) of every metric and the min-max of the shown ones."""
    table = {}
    for policy, per_seed in runs.items():
        values = {key: [r[key] for r in per_seed if r.get(key) is not None] for key, _ in SHOWN}
        spread = {key: [min(v), max(v)] if v else None for key, v in values.items()}
        table[policy] = {**mean_metrics(per_seed), "spread": spread}
    return table


def rank(table: dict[str, dict[str, Any]], specs: dict[str, str], requests: list[Request]) -> dict[str, Any]:
    """The best non-oracle baseline by the headline, and each learned policy's rank (among the
    policies allowed to rank: no drops) and gain against it."""
    barred = {p: why for p, m in table.items() if (why := HEADLINE.barred(m, table["fcfs"]))}
    # The starvation guard paired with the headline (issue 19): a mean TTLT bought by holding some
    # requests back shows in the P99 TTFT. Shown, not barred: on these traces every length-aware
    # order -- the best baseline's too -- pays 1.6-7x FCFS's P99 TTFT for its mean, so barring it
    # would leave FCFS's order alone to rank.
    fcfs_p99 = table["fcfs"]["ttft_p99"]
    starving = {
        p: f"P99 TTFT {m['ttft_p99'] / fcfs_p99:.1f}x FCFS's"
        for p, m in table.items()
        if m["ttft_p99"] > STARVATION_FACTOR * fcfs_p99
    }
    contenders = (p for p in table if p not in barred and p != CEILING)
    order = sorted(contenders, key=lambda p: HEADLINE.value(table[p]))
    baselines = [p for p in order if p in NON_ORACLE_BASELINES]
    best = baselines[0] if baselines else None
    learned = {}
    for policy in LEARNED:
        value = HEADLINE.value(table[policy])
        learned[policy] = {
            "spec": specs[policy],
            "rank": order.index(policy) + 1 if policy in order else None,
            "barred": barred.get(policy),
            "gain_vs_best_baseline": None if best is None else value / HEADLINE.value(table[best]) - 1.0,
            "text": text_use(policy, requests),
        }
    ceiling = None
    if CEILING in table and best is not None:
        ceiling = HEADLINE.value(table[CEILING]) / HEADLINE.value(table[best]) - 1.0
    return {
        "best_baseline": best,
        "barred": barred,
        "starving": starving,
        "ranking": order,
        "learned": learned,
        "ceiling_gain_vs_best_baseline": ceiling,
    }


def format_scenario(name: str, result: dict[str, Any], seeds: list[int]) -> str:
    """One table: per policy the headline's seed mean [min-max], the other shown metrics' means,
    its rank among the policies allowed to rank, and for a learned one its gain over the best
    baseline and its use of prompt text (the JSON has every metric's spread)."""
    settings = result["settings"]
    titles = [title for _, title in SHOWN[1:]]
    width = max(len(policy) for policy in result["policies"])
    lines = [
        f"\n{name}: {settings['requests']:,} requests at {settings['rate']:g} req/s, {settings['arrivals']};"
        f" seeds {','.join(map(str, seeds))}; best baseline {result['best_baseline']}",
        f"  {'policy':<{width}} {SHOWN[0][1] + ' [spread]':>24}"
        + "".join(f"{t:>12}" for t in titles)
        + f"{'rank':>6}{'gain':>8}  text",
    ]
    ranking = result["ranking"]
    for policy, m in result["policies"].items():
        low, high = m["spread"][SHOWN[0][0]]
        row = f"  {policy:<{width}} {f'{m[SHOWN[0][0]]:.2f} [{low:.2f}-{high:.2f}]':>24}"
        row += "".join(f"{m[key]:>12.2f}" for key, _ in SHOWN[1:])
        row += f"{ranking.index(policy) + 1 if policy in ranking else '-':>6}"
        learned = result["learned"].get(policy)
        if learned:
            gain = learned["gain_vs_best_baseline"]
            row += f"{'-' if gain is None else f'{gain:+.1%}':>8}  {learned['text']}"
        elif policy == CEILING and result["ceiling_gain_vs_best_baseline"] is not None:
            row += f"{result['ceiling_gain_vs_best_baseline']:>+8.1%}  (ceiling: true lengths, not ranked)"
        if policy in result["barred"]:
            row += f"  (may not rank: {result['barred'][policy]})"
        elif policy in result["starving"]:
            row += f"  (starves: {result['starving'][policy]})"
        lines.append(row)
    return "\n".join(lines)


def run_study(
    specs: dict[str, str], seeds: list[int], num: int, jobs: int, ray: str | None = None
) -> dict[str, Any]:
    """Every scenario x seed x policy as replay cells on `jobs` processes; the per-scenario result
    (settings, seed means with spread, best baseline, learned policies' rank, gain and text use)."""
    policies = {**{p: p for p in NON_ORACLE_BASELINES}, **specs, CEILING: CEILING}
    settings = engine_settings()
    cells, requests = [], {}
    for scenario in SCENARIOS:
        for seed in seeds:
            requests[scenario.name, seed] = scenario.requests(num, seed)
            info = {"name": scenario.name, "rate": scenario.rate, "num_requests": num, "seed": seed}
            setup = ReplaySetup(requests[scenario.name, seed], info, ENGINE.model, ENGINE.gpu, ENGINE.tp)
            for name, spec in policies.items():
                label = f"{scenario.name} seed {seed} {name}"
                cells.append(
                    ReplayCell((scenario.name, name), label, setup, PolicySpec(spec), ENGINE.engine_config())
                )
    print(f"{len(cells)} replays on {jobs} process(es)", file=sys.stderr)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for cell, result in zip(cells, replay_cells(cells, jobs=jobs, ray=ray), strict=True):
        scenario_name, name = cell.key
        runs.setdefault(scenario_name, {}).setdefault(name, []).append(with_derived(result.metrics()))
    scenarios = {}
    for scenario in SCENARIOS:
        table = summarise(runs[scenario.name])
        scenarios[scenario.name] = {
            "settings": {
                **settings,
                "trace": scenario.source,
                "rate": scenario.rate,
                "arrivals": scenario.arrivals,
                "requests": num,
                "engine_settings_per_policy": {p: _engine_of(m) for p, m in table.items()},
            },
            "policies": table,
            **rank(table, specs, requests[scenario.name, seeds[0]]),
        }
    return {"seeds": seeds, "headline": HEADLINE.title, "scenarios": scenarios}


def _engine_of(metrics: dict[str, Any]) -> dict[str, Any]:
    """The engine settings a policy's replays reported (sarathi declares its own token budget)."""
    return {key: metrics.get(key) for key in ("token_budget", "max_running")}


def own_budgets(report: dict[str, Any]) -> str:
    """The policies that ran under a token budget of their own (declared by the policy: vllm-v0's
    4096), as the quickstart's settings line says them."""
    budget = engine_settings()["token_budget"]
    own = {
        f"{policy} {engine['token_budget']:g}"
        for scenario in report["scenarios"].values()
        for policy, engine in scenario["settings"]["engine_settings_per_policy"].items()
        if engine["token_budget"] != budget
    }
    return f"; policies with their own token budget: {', '.join(sorted(own))}" if own else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help=f"{REQUESTS[True]} requests per run")
    parser.add_argument(
        "--seeds", type=SEED_LIST, default="1,2,3", help="seeds (azure: trace windows; others: arrivals)"
    )
    parser.add_argument("--requests", type=COUNT, help=f"requests per run (default {REQUESTS[False]})")
    parser.add_argument("--store", help="MLflow store with the champions (default: the tracking URI)")
    parser.add_argument("--json", type=OUTPUT, metavar="OUT")
    add_parallel_arguments(parser)
    args = parser.parse_args(argv)
    if args.store:  # workers read the store from the environment
        os.environ["MLFLOW_TRACKING_URI"] = args.store
    seeds = args.seeds
    specs = champion_specs(Registry(), args.fast)
    report = run_study(specs, seeds, args.requests or REQUESTS[args.fast], args.jobs, args.ray)
    print(f"engine for every policy: {json.dumps(engine_settings())}{own_budgets(report)}")
    print(f"headline {HEADLINE.title}; a policy that dropped requests may not rank")
    for name, result in report["scenarios"].items():
        print(format_scenario(name, result, seeds))
    if args.json is not None:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
