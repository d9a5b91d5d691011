"""Which engine setting each workload's baselines do best with: the bar a learned policy must clear.

    .venv/bin/python -m experiments.engine_settings [--budgets 512,2048] [--seeds 0] [--fast] [--json OUT]

A comparison is only fair when every policy runs under the same engine settings, and only
meaningful when those settings are the ones the baselines do best with: otherwise a learned policy
"wins" against a badly configured engine (a vLLM operator would simply set
`max_num_batched_tokens=512`). This replays every non-oracle baseline on each quickstart workload
at each token budget (vLLM's `max_num_batched_tokens`), with the default cost model, and reports per
budget the best baseline's headline; the budget where that is best is the workload's setting
(`WorkloadSpec.token_budget`). Baselines that need true output lengths (the oracles, and `ltr` and
`trail`, whose default ranker is a noisy oracle) and `vllm-v0` (its own budget and prefill-first)
are left out; `sarathi` is `fcfs` at 512, so it is covered by the 512 budget.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from adapt.cli.usage import COUNT_LIST, OUTPUT, SEED_LIST, write_json
from adapt.replay.engine import EngineConfig
from adapt.replay.runner import ReplaySetup, replay_policy
from adapt.workloads import WORKLOADS
from experiments.quickstart import HEADLINES, SIZES
from serving_hooks.policies import make_policy

BASELINES: tuple[str, ...] = ("fcfs", "spf", "edf", "fastserve", "plas")


def measure(budgets: list[int], seeds: list[int], fast: bool) -> dict:
    """Per workload and budget, each baseline's headline (mean over seeds), and the chosen budget."""
    result: dict = {}
    for workload, headline in HEADLINES.items():
        spec = WORKLOADS[workload]
        rate, num = SIZES[workload][fast]
        setups = [
            ReplaySetup(spec.build(rate, num, s), spec.info(rate, num, s), spec.model, spec.gpu, spec.tp)
            for s in seeds
        ]
        by_budget: dict[int, dict[str, float]] = {}
        for budget in budgets:
            config = EngineConfig(token_budget=budget)
            by_budget[budget] = {}
            for name in BASELINES:
                values = [
                    headline.value(
                        replay_policy(
                            setup, lambda n=name: make_policy(n), label=name, config=config
                        ).metrics()
                    )
                    for setup in setups
                ]
                by_budget[budget][name] = statistics.fmean(values)
                print(f"{workload} budget {budget} {name}: {by_budget[budget][name]:.4g}", file=sys.stderr)
        pick = min if headline.lower_is_better else max
        best = {b: pick(values.items(), key=lambda kv: kv[1]) for b, values in by_budget.items()}
        chosen = pick(best, key=lambda b: best[b][1])
        result[workload] = {
            "headline": headline.title,
            "rate": rate,
            "requests": num,
            "seeds": seeds,
            "baselines": by_budget,
            "best_baseline": {b: {"policy": p, "value": v} for b, (p, v) in best.items()},
            "chosen_budget": chosen,
        }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=COUNT_LIST, default="512,2048", help="token budgets to try")
    parser.add_argument("--seeds", type=SEED_LIST, default="0", help="workload seeds (mean over them)")
    parser.add_argument("--fast", action="store_true", help="the quickstart's --fast sizes")
    parser.add_argument("--json", type=OUTPUT, help="write the measurements here")
    args = parser.parse_args(argv)
    budgets, seeds = args.budgets, args.seeds
    result = measure(budgets, seeds, args.fast)
    print(f"{'workload':<15}" + "".join(f"{f'best baseline at {b}':>34}" for b in budgets) + "   chosen")
    for workload, row in result.items():
        cells = "".join(
            f"{row['best_baseline'][b]['policy'] + ' ' + format(row['best_baseline'][b]['value'], '.4g'):>34}"
            for b in budgets
        )
        print(f"{workload:<15}{cells}   {row['chosen_budget']}")
    if args.json is not None:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
