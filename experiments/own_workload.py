"""Each learned policy against every non-oracle baseline on its own workload (issue 19, item 4).

    .venv/bin/python -m experiments.own_workload [--seeds 1,2,3] [--scales 1,1.5] [--requests N]
                                                 [--jobs N] [--ray [ADDRESS]] [--json OUT]

Per workload: held-out seeds (the quickstart and the tuners use seed 0), the workload's default rate
times each scale, every policy under the workload's engine settings (the same for all). The learned
policies run the registry's champions (train them first: `adapt quickstart`). Targets, on the mean
over seeds:
- ewsjf-mixed: ewsjf has the lowest short-request mean TTFT among the policies whose long-request
  P99 TTFT stays within 1.2x FCFS's, and no fewer tokens/s than FCFS;
- sagesched-mix: sagesched has the lowest mean TTLT of the non-oracle policies;
- jitserve-mix: jitserve has the highest token goodput, and >= 0.85 of jitserve-oracle's (>= 0.80
  at 3x the rate and beyond: `--workloads jitserve-mix --scales 3`);
- slai-tiers: slai's median TTFT is >= 30% below sarathi's with both tiers' P99 TBT within SLO.
A policy that dropped requests is not eligible for a latency headline (goodput counts drops as
failures already), nor is one whose headline's guard fails in any seed (starved long requests, a
missed TBT SLO: checked seed by seed, so one seed's miss is not averaged away). Prints the engine
settings, one table per workload and scale with each policy's guards (served share, worst class's
P99 TTFT, worst class's SLO attainment: what a headline cannot hide), and whether the target was
met.
Where the learned policy has a form that reads true lengths (`CEILING`: SageSched given every
request's true output length), that form runs too, never ranked: how much a perfect predictor
would gain over the best baseline, and how much of that the learned policy reaches.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapt.cli.usage import (
    COUNT,
    OUTPUT,
    POSITIVE_LIST,
    SEED_LIST,
    add_parallel_arguments,
    choice_list,
    write_json,
)
from adapt.registry import CHAMPION, Registry
from adapt.replay.cells import ReplayCell, replay_cells
from adapt.replay.runner import ReplaySetup
from adapt.workloads import WORKLOADS
from experiments.quickstart import (
    CEILING,
    HEADLINES,
    NON_ORACLE_BASELINES,
    ORACLE,
    OWN_POLICY,
    Headline,
    guard,
)
from serving_hooks.policies import PolicySpec


@dataclass(frozen=True)
class Target:
    """A learned policy's claim on its workload (the headline and its guard: the quickstart's)."""

    workload: str
    components: dict[str, str]  # policy parameter -> registered component

    @property
    def policy(self) -> str:
        return OWN_POLICY[self.workload]

    @property
    def headline(self) -> Headline:
        return HEADLINES[self.workload]

    @property
    def oracle(self) -> str | None:
        return ORACLE.get(self.workload)

    @property
    def ceiling(self) -> str | None:
        """The learned policy reading true lengths: shown with the verdict, never a contender."""
        return CEILING.get(self.workload)


TARGETS = (
    Target("ewsjf-mixed", {"meta": "ewsjf-meta-policy"}),
    Target("sagesched-mix", {"history": "semantic-history"}),
    Target("jitserve-mix", {"qrf": "qrf-length", "patterns": "pattern-graph"}),
    Target("slai-tiers", {"offset": "slai-offset"}),
)


def learned_spec(registry: Registry, target: Target) -> str:
    """The learned policy with its champions pinned by version (so every cell runs the same ones)."""
    pins = [
        f"{param}=v{registry.resolve(component, CHAMPION)}" for param, component in target.components.items()
    ]
    return ":".join([target.policy, *pins])


def mean_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Seed means of the numbers the targets read (nested per class); None where any seed has
    none (a mean over the seeds that happen to have a value is not the seeds' mean)."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values = [r[key] for r in runs if r.get(key) is not None]
            out[key] = float(np.mean(values)) if len(values) == len(runs) else None
        elif key == "by_class":
            out[key] = {c: mean_metrics([r[key][c] for r in runs]) for c in value}
    return out


def oracle_share_target(scale: float) -> float:
    """The share of its oracle's goodput jitserve must reach (issue 19): 0.85 up to the default
    rate's 1.5x, 0.80 at 3x it and beyond, where even the oracle drops most requests."""
    return 0.80 if scale >= 3.0 else 0.85


def barred_in_any_seed(
    headline: Headline, runs: list[dict[str, Any]], fcfs: list[dict[str, Any]]
) -> str | None:
    """Why a policy's headline may not win: its guard checked seed by seed against FCFS's run on
    the same seed (a P99 TBT over the SLO in one seed must not pass on the seeds' mean)."""
    for seed_run, seed_fcfs in zip(runs, fcfs, strict=True):
        why = headline.barred(seed_run, seed_fcfs)
        if why is not None:
            return why
    return None


def verdict(
    target: Target,
    table: dict[str, dict[str, Any]],
    scale: float = 1.0,
    barred: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """The target's outcome on the seed means in `table`; `barred` says per policy why its
    headline may not win (`barred_in_any_seed`; default: the guard on the means)."""
    headline = target.headline
    values = {name: headline.value(m) for name, m in table.items()}
    ceiling = target.ceiling
    if barred is None:
        barred = {name: headline.barred(m, table["fcfs"]) for name, m in table.items()}
    allowed = {  # (a value missing in any seed has no seed mean: it cannot rank)
        name
        for name in table
        if barred[name] is None and values[name] is not None and name not in (target.oracle, ceiling)
    }
    pick = min if headline.lower_is_better else max
    contenders = {name: values[name] for name in allowed}
    best = pick(contenders, key=contenders.get) if contenders else None
    baselines = {n: v for n, v in contenders.items() if n in NON_ORACLE_BASELINES}
    best_baseline = pick(baselines, key=baselines.get) if baselines else None
    learned = values[target.policy]
    result = {
        "winner": best,
        "best_baseline": best_baseline,
        "learned": learned,
        "learned_eligible": target.policy in allowed,
        "baseline": None if best_baseline is None else values[best_baseline],
    }
    met = best == target.policy
    if target.workload == "ewsjf-mixed":  # and no fewer tokens/s than FCFS (issue 19)
        result["tps_vs_fcfs"] = table[target.policy]["throughput_tps"] / table["fcfs"]["throughput_tps"] - 1.0
        met = met and result["tps_vs_fcfs"] >= 0.0
    if target.oracle:
        result["of_oracle"] = learned / values[target.oracle] if values[target.oracle] else None
        result["of_oracle_target"] = oracle_share_target(scale)
        met = met and (result["of_oracle"] or 0) >= result["of_oracle_target"]
    if ceiling in table and best_baseline is not None:
        baseline, bound = values[best_baseline], values[ceiling]
        result["ceiling"] = bound
        result["ceiling_gain"] = bound / baseline - 1.0
        # the share of the ceiling's lead over the best baseline the learned policy has
        lead = baseline - bound
        result["ceiling_share_reached"] = (baseline - learned) / lead if lead else None
    if target.workload == "slai-tiers":
        result["vs_sarathi"] = learned / values["sarathi"] - 1.0
        met = target.policy in allowed and result["vs_sarathi"] <= -0.30
    result["met"] = met
    return result


def attainment_by_class(metrics: dict[str, Any]) -> dict[str, float]:
    """Each request class's SLO attainment (classes without SLOs left out). Printed for the
    learned policy and EDF, the deadline-first baseline the issue measures fairness against: a
    policy can raise its worst class above EDF's while it gives up another class."""
    return {
        label: scope["slo_attainment"]
        for label, scope in metrics.get("by_class", {}).items()
        if scope.get("slo_requests") and scope["slo_attainment"] is not None
    }


def engine_settings(target: Target, table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The engine settings the comparison ran at (the workload's, the same for every policy), and
    those each policy really ran at where it declares its own (`sarathi`, `vllm-v0`), read from the
    replays themselves."""
    config = WORKLOADS[target.workload].engine_config()
    engine = {"token_budget": config.token_budget, "max_running": config.max_running}
    own = {name: ran for name, m in table.items() if (ran := {key: int(m[key]) for key in engine}) != engine}
    return {"engine_settings": engine, "own_engine_settings": own}


def _settings_line(settings: dict[str, Any]) -> str:
    engine = settings["engine_settings"]
    line = f"token budget {engine['token_budget']}, max running {engine['max_running']}"
    own = "; ".join(
        f"{name} at {ran['token_budget']} / {ran['max_running']}"
        for name, ran in settings["own_engine_settings"].items()
    )
    return line + (f" (own settings: {own})" if own else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=SEED_LIST, default="1,2,3", help="held-out workload seeds (0 is tuned on)"
    )
    parser.add_argument(
        "--scales", type=POSITIVE_LIST, default="1,1.5", help="multiples of each workload's default rate"
    )
    parser.add_argument("--requests", type=COUNT, help="requests per run (default: the workload's)")
    names = [t.workload for t in TARGETS]
    parser.add_argument("--workloads", type=choice_list(names), default=",".join(names))
    add_parallel_arguments(parser)
    parser.add_argument("--json", type=OUTPUT, metavar="OUT")
    args = parser.parse_args(argv)
    seeds, scales = args.seeds, args.scales
    targets = [t for t in TARGETS if t.workload in args.workloads]
    registry = Registry()

    cells = []
    for target in targets:
        spec = WORKLOADS[target.workload]
        policies = {name: name for name in NON_ORACLE_BASELINES}
        policies[target.policy] = learned_spec(registry, target)
        if target.oracle:
            policies[target.oracle] = target.oracle
        if target.ceiling:
            policies[target.ceiling] = target.ceiling
        num = args.requests or spec.num_requests
        for scale in scales:
            rate = spec.rate * scale
            for seed in seeds:
                setup = ReplaySetup(
                    spec.build(rate, num, seed), spec.info(rate, num, seed), spec.model, spec.gpu, spec.tp
                )
                for name, policy in policies.items():
                    key = (target.workload, scale, seed, name)
                    label = f"{target.workload} x{scale} seed {seed} {name}"
                    cells.append(ReplayCell(key, label, setup, PolicySpec(policy), spec.engine_config()))
    print(f"{len(cells)} replays on {args.jobs} processes", file=sys.stderr)
    runs: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = {}
    for cell, result in zip(cells, replay_cells(cells, jobs=args.jobs, ray=args.ray), strict=True):
        workload, scale, _seed, name = cell.key
        runs.setdefault((workload, scale), {}).setdefault(name, []).append(result.metrics())

    report = []
    for target in targets:
        for scale in scales:
            per_policy = runs[target.workload, scale]
            table = {name: mean_metrics(per_seed) for name, per_seed in per_policy.items()}
            headline = target.headline
            barred = {
                name: barred_in_any_seed(headline, per_seed, per_policy["fcfs"])
                for name, per_seed in per_policy.items()
            }
            outcome = verdict(target, table, scale, barred)
            settings = engine_settings(target, table)
            rate = WORKLOADS[target.workload].rate * scale
            print(f"\n{target.workload} at {rate:g} req/s (x{scale}), seeds {seeds}: {headline.title}")
            print(f"  engine: {_settings_line(settings)}")
            width = max(map(len, table))
            print(f"  {'':<{width}} {'headline':>10}   served / worst P99 TTFT / worst attainment")
            guards = {}
            for name, m in table.items():
                served, worst_ttft, attained = guard(m)
                guards[name] = {"served": served, "worst_ttft_p99": worst_ttft, "worst_attainment": attained}
                flag = "" if barred[name] is None else f"  (not eligible: {barred[name]})"
                value = headline.value(m)
                shown_value = "-" if value is None else f"{value / headline.scale:.3f}"
                attainment = "-" if attained is None else f"{attained:.2f}"
                guarded = f"{served:.0%} / {worst_ttft:.1f} s / {attainment}"
                print(f"  {name:<{width}} {shown_value:>10}   {guarded}{flag}")
            shown = ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in outcome.items()
            )
            by_class = {name: attainment_by_class(table[name]) for name in (target.policy, "edf")}
            if any(by_class.values()):  # what the worst class alone cannot show: who pays
                print(
                    "  SLO attainment by class: "
                    + "; ".join(
                        f"{name} " + ", ".join(f"{c} {v:.2f}" for c, v in classes.items())
                        for name, classes in by_class.items()
                    )
                )
            print(f"  -> {'MET' if outcome['met'] else 'MISSED'}: {shown}")
            report.append(
                {
                    "workload": target.workload,
                    "scale": scale,
                    "rate": rate,
                    **settings,
                    **outcome,
                    "barred": {n: why for n, why in barred.items() if why is not None},
                    "guards": guards,
                    "attainment_by_class": by_class,
                }
            )
    if args.json is not None:
        write_json(args.json, {"seeds": seeds, "results": report})


if __name__ == "__main__":
    main()
