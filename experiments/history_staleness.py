"""Does a stale semantic history cost SageSched anything? (issue 26: which learned part a drift stales)

The counterpart of `experiments.bound_staleness` for SageSched's learned part. The server's model
changes from `--old` to `--new` (default: phi-2 -> Yi-34B-Chat, AlpacaEval's tersest and most
verbose answerers, median answer 67 -> 490 WordPiece tokens, to the same instructions), and
`sagesched` serves `sagesched-mix` whose text requests are held-out instructions answered at the new
model's lengths (`sagesched_mix(answers=)`), with

- `stale`: a `semantic-history` seeded with the old model's answers to the training instructions
  (what a champion would be), learning online from then on as the policy always does;
- `fresh`: seeded with the new model's answers (what a retrain would promote);
- `stale, frozen`: the stale history with online learning off (`learn_online=False`): what the
  staleness would cost if the policy did not heal its own window;
- `spf, victim newest`: the best non-oracle baseline on this workload (`docs/fairness.md`);
- `true text lengths`: SageSched told the true length of every request with text (the ceiling a
  perfect retrain could reach).

Headline: mean time to last token (lower is better), at the workload's rate and 1.5x it, held-out
seeds. If `stale` loses little to `fresh`, a drift scenario for this part would show nothing a
retrain loop could win back.

    .venv/bin/python -m experiments.history_staleness [--old G,...] [--new G,...] [--rates 3.0,4.5]
                                                      [--requests 2000] [--seeds 1,2,3] [--jobs N]
                                                      [--json OUT]

`--json OUT`: `{"old", "new", "cells": [{"rate", "seed", "ttlt_mean": {ARM: s}}],
"mean": {RATE: {ARM: s}}, "stale_over_fresh": {RATE: [per seed]}}`.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any

from adapt.cli.usage import COUNT, NAME_LIST, OUTPUT, RATE_LIST, SEED_LIST, write_json
from adapt.replay.cells import ReplayCell, replay_cells
from adapt.replay.runner import ReplaySetup
from adapt.workloads import WORKLOADS, sagesched_mix
from adapt.workloads.drift import model_answers
from experiments.bound_staleness import per_rate, staleness_table
from predictors.semantic_history import SemanticHistory
from serving_hooks.policies import make_policy

OLD = ("phi-2",)  # the default drift: answers get longer (`--old`/`--new` swapped: shorter)
NEW = ("Yi-34B-Chat",)
ARMS = ("stale", "fresh", "stale, frozen", "spf, victim newest", "true text lengths")


def policies(stale: SemanticHistory, fresh: SemanticHistory) -> dict[str, Any]:
    """Picklable factories: a replay worker builds its own instance (and its own history copy)."""
    sage = functools.partial(make_policy, "sagesched")
    return {
        "stale": functools.partial(sage, history=stale),
        "fresh": functools.partial(sage, history=fresh),
        "stale, frozen": functools.partial(sage, history=stale, learn_online=False),
        "spf, victim newest": functools.partial(make_policy, "spf", victim="newest"),
        "true text lengths": functools.partial(sage, history=fresh, true_lengths="text"),
    }


def run(
    old: tuple[str, ...],
    new: tuple[str, ...],
    rates: list[float],
    requests: int,
    seeds: list[int],
    jobs: int | None = None,
) -> dict[str, Any]:
    started = time.perf_counter()
    stale = SemanticHistory().fit(model_answers(old, "train"))
    fresh = SemanticHistory().fit(model_answers(new, "train"))
    new_answers = model_answers(new, "test")
    print(f"histories seeded in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    spec = WORKLOADS["sagesched-mix"]
    config = spec.engine_config()
    cells = []
    for rate in rates:
        for seed in seeds:
            workload = sagesched_mix(rate, requests, seed, answers=new_answers)  # the new model's traffic
            setup = ReplaySetup(workload, spec.info(rate, requests, seed), spec.model, spec.gpu, spec.tp)
            for arm, build in policies(stale, fresh).items():
                name = f"{rate} req/s seed {seed} {arm}"
                cells.append(ReplayCell((rate, seed, arm), name, setup, build, config))
    ttlt: dict[tuple[float, int], dict[str, float]] = {}
    for cell, result in zip(cells, replay_cells(cells, jobs=jobs), strict=True):
        rate, seed, arm = cell.key
        ttlt.setdefault((rate, seed), {})[arm] = float(result.metrics()["ttlt_mean"])
    rows = [{"rate": rate, "seed": seed, "ttlt_mean": by_arm} for (rate, seed), by_arm in ttlt.items()]
    mean, ratios = per_rate(rows, "ttlt_mean", ARMS, rates)
    return {"old": list(old), "new": list(new), "cells": rows, "mean": mean, "stale_over_fresh": ratios}


def table(report: dict[str, Any]) -> str:
    """Mean TTLT per rate (s), and stale over fresh per seed (above 1: the stale history costs)."""
    return staleness_table(report, ARMS, "req/s", lambda seconds: f"{seconds:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--old", type=NAME_LIST, default=",".join(OLD), help="generators of the model before the change"
    )
    parser.add_argument(
        "--new", type=NAME_LIST, default=",".join(NEW), help="generators of the model after it"
    )
    parser.add_argument(
        "--rates", type=RATE_LIST, default="3.0,4.5", help="sagesched-mix rates (its default is 3.0)"
    )
    parser.add_argument("--requests", type=COUNT, default=2000, help="requests per replay")
    parser.add_argument("--seeds", type=SEED_LIST, default="1,2,3")
    parser.add_argument("--jobs", type=COUNT, default=None, help="replay processes (default: one per core)")
    parser.add_argument("--json", type=OUTPUT, default=None)
    args = parser.parse_args(argv)
    report = run(tuple(args.old), tuple(args.new), args.rates, args.requests, args.seeds, args.jobs)
    print(f"old {', '.join(report['old'])} -> new {', '.join(report['new'])}; mean TTLT (s)")
    print(table(report))
    if args.json is not None:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
