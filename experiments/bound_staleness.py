"""Does a stale length bound cost JITServe goodput? (issue 26: which learned part a drift stales)

The drift a length predictor meets most often in practice is a model upgrade: the same prompts,
answered at other lengths. AlpacaEval has exactly that, for real: the answers of 24 models to the
same 678 instructions. Here the server's model changes from `--old` to `--new` (default: GPT-4
0613 -> GPT-4 1106-preview, median answer 252 -> 471 WordPiece tokens), and `jitserve` serves the
new model's traffic with

- `stale`: a `qrf-length` fitted on the old model's answers (what a champion would be);
- `fresh`: the same forest fitted on the new model's answers (what a retrain would promote);
- `online quantile`: no learned bound (JITServe's fallback: a running quantile of finished lengths);
- `oracle`: `jitserve-oracle`, the true lengths (an upper reference).

Both forests are fitted on the training instructions (`split_by_instruction`) and judged on the
held-out ones: their bound's coverage of the new answers, and jitserve's token goodput on
`jitserve-mix` (its engine settings, the pattern graph fitted as `jitserve_study` does) whose
latency and deadline requests are held-out instructions answered at the new model's lengths.
If `stale` loses little to `fresh`, a drift scenario for this part would show nothing a retrain
loop could win back, whatever the loop does.

    .venv/bin/python -m experiments.bound_staleness [--old G,...] [--new G,...] [--rates 2.0,3.0]
                                                    [--requests 1500] [--seeds 1,2,3] [--json OUT]

`--json OUT`: `{"old", "new", "coverage": {"stale", "fresh"}, "cells": [{"rate", "seed",
"goodput": {ARM: tokens}, "served": {ARM: share}}], "mean": {RATE: {ARM: tokens}},
"stale_over_fresh": {RATE: [per seed]}}`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from adapt.cli.usage import COUNT, NAME_LIST, OUTPUT, RATE_LIST, SEED_LIST, write_json
from adapt.replay.cost import roofline
from adapt.replay.engine import ReplayEngine
from adapt.workloads import WORKLOADS, jitserve_mix
from adapt.workloads.drift import TERSE_MODEL, VERBOSE_MODEL, model_answers
from experiments.jitserve_study import fit_pattern_graph
from predictors.qrf_length import QrfLength
from serving_hooks.policies import make_policy

OLD = TERSE_MODEL  # the default drift: answers get longer (`--old`/`--new` swapped: shorter)
NEW = VERBOSE_MODEL
ARMS = ("stale", "fresh", "online quantile", "oracle")


def policies(stale: Any, fresh: Any, patterns: Any) -> dict[str, Any]:
    return {
        "stale": make_policy("jitserve", qrf=stale, patterns=patterns),
        "fresh": make_policy("jitserve", qrf=fresh, patterns=patterns),
        "online quantile": make_policy("jitserve", patterns=patterns),
        "oracle": make_policy("jitserve-oracle"),
    }


def run(
    old: tuple[str, ...], new: tuple[str, ...], rates: list[float], requests: int, seeds: list[int]
) -> dict[str, Any]:
    started = time.perf_counter()
    stale = QrfLength(generated_features=0).fit(model_answers(old, "train"))
    fresh = QrfLength(generated_features=0).fit(model_answers(new, "train"))
    patterns = fit_pattern_graph()
    new_answers = model_answers(new, "test")
    coverage = {
        "stale": float(stale.evaluate(new_answers)["coverage_at_0"]),
        "fresh": float(fresh.evaluate(new_answers)["coverage_at_0"]),
    }
    print(
        f"forests fitted in {time.perf_counter() - started:.0f} s; coverage of the new answers on"
        f" arrival (q = 0.95): stale {coverage['stale']:.3f}, fresh {coverage['fresh']:.3f}",
        file=sys.stderr,
        flush=True,
    )
    spec = WORKLOADS["jitserve-mix"]
    cost = roofline(spec.model, spec.gpu, tp=spec.tp)
    cells = []
    for rate in rates:
        for seed in seeds:
            workload = jitserve_mix(rate, requests, seed, answers=new_answers)  # the new model's traffic
            goodput, served = {}, {}
            for arm, policy in policies(stale, fresh, patterns).items():
                metrics = ReplayEngine(policy, cost, spec.engine_config()).run(workload).metrics()
                goodput[arm] = int(metrics["goodput_tokens"])
                served[arm] = 1.0 - metrics["dropped"] / metrics["num_requests"]
            cells.append({"rate": rate, "seed": seed, "goodput": goodput, "served": served})
            print(
                f"rate {rate} seed {seed}: "
                + ", ".join(f"{arm} {goodput[arm] / 1e6:.3f} M" for arm in ARMS)
                + f"; stale / fresh {goodput['stale'] / goodput['fresh']:.3f}",
                file=sys.stderr,
                flush=True,
            )
    mean, ratios = per_rate(cells, "goodput", ARMS, rates)
    return {
        "old": list(old),
        "new": list(new),
        "coverage": coverage,
        "cells": cells,
        "mean": mean,
        "stale_over_fresh": ratios,
    }


def per_rate(
    cells: list[dict[str, Any]], metric: str, arms: tuple[str, ...], rates: list[float]
) -> tuple[dict[str, dict[str, float]], dict[str, list[float]]]:
    """Each arm's `metric` averaged over the seeds of a rate, and stale over fresh per seed: the
    summary of a staleness study (this one's, and `experiments.history_staleness`'s)."""
    mean = {
        str(rate): {arm: float(np.mean([c[metric][arm] for c in cells if c["rate"] == rate])) for arm in arms}
        for rate in rates
    }
    ratios = {
        str(rate): [c[metric]["stale"] / c[metric]["fresh"] for c in cells if c["rate"] == rate]
        for rate in rates
    }
    return mean, ratios


def staleness_table(
    report: dict[str, Any], arms: tuple[str, ...], rate_heading: str, value: Callable[[float], str]
) -> str:
    """A markdown table: each arm's mean per rate (written by `value`), and stale over fresh per seed."""
    rows = [
        f"| {rate_heading} | {' | '.join(arms)} | stale / fresh per seed |",
        "|---" * (len(arms) + 2) + "|",
    ]
    for rate, means in report["mean"].items():
        ratios = ", ".join(f"{r:.3f}" for r in report["stale_over_fresh"][rate])
        rows.append(f"| {rate} | " + " | ".join(value(means[arm]) for arm in arms) + f" | {ratios} |")
    return "\n".join(rows)


def table(report: dict[str, Any]) -> str:
    """Mean token goodput per rate (M tokens), and stale over fresh per seed."""
    return staleness_table(report, ARMS, "job rate", lambda tokens: f"{tokens / 1e6:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--old", type=NAME_LIST, default=",".join(OLD), help="generators of the model before the upgrade"
    )
    parser.add_argument(
        "--new", type=NAME_LIST, default=",".join(NEW), help="generators of the model after it"
    )
    parser.add_argument(
        "--rates", type=RATE_LIST, default="2.0,3.0", help="jitserve-mix job rates (its default is 2.0)"
    )
    parser.add_argument("--requests", type=COUNT, default=1500, help="jobs per replay")
    parser.add_argument("--seeds", type=SEED_LIST, default="1,2,3")
    parser.add_argument("--json", type=OUTPUT, default=None)
    args = parser.parse_args(argv)
    report = run(tuple(args.old), tuple(args.new), args.rates, args.requests, args.seeds)
    print(f"old {', '.join(report['old'])} -> new {', '.join(report['new'])}")
    coverage = report["coverage"]
    print(f"coverage of the new answers: stale {coverage['stale']:.3f}, fresh {coverage['fresh']:.3f}")
    print(table(report))
    if args.json is not None:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
