"""EWSJF study (issue: EWSJF), after the paper's section 6 on its mixed workload.

    .venv/bin/python -m experiments.ewsjf_study [--requests N] [--trials N] [--jobs N]
                                                [--ray [ADDRESS]] [--out DIR]

1. Tunes Theta with the Bayesian meta-optimiser (Optuna, reward of equation 5) on replay of
   `ewsjf-mixed` at 40 req/s, layouts refit by Refine-and-Prune on a separate history window.
2. Replays `ewsjf-mixed` (llama-2-13b on 4 x A100-80GB, the paper's setting) at 10-100 req/s under
   fcfs, spf, ewsjf with the default Theta/layout and ewsjf tuned: tokens/s, mean TTFT of short
   requests, P99 TTFT (queueing wait) of long requests, long requests completed.
3. Queue-count study (paper Table 3): k-means with 5/10/30 queues versus Refine-and-Prune, at the
   highest rate, with the tuned scoring weights.
"""

from __future__ import annotations

import argparse
import functools
import sys

from adapt.cli.usage import COUNT, OUTPUT_DIR, add_parallel_arguments, write_json
from adapt.online import tune
from adapt.replay.cells import ReplayCell, replay_cells
from adapt.replay.cost import add_overlap_argument
from adapt.replay.runner import ReplaySetup
from adapt.workloads import WORKLOADS
from pipelines.ewsjf import ewsjf_objective, history_lengths
from predictors.ewsjf_meta import THETA_SPACE, EwsjfMetaPolicy
from serving_hooks.policies import make_policy
from serving_hooks.policies.ewsjf import EWSJF

RATES = (10, 20, 40, 60, 80, 100)


def row(metrics: dict) -> dict:
    short, long = metrics["by_class"]["short"], metrics["by_class"]["long"]
    return {
        "tokens_per_s": metrics["throughput_tps"],
        "short_ttft_mean": short["ttft_mean"],
        "long_ttft_p99": long["ttft_p99"],
        "long_completed": long["completed"],
        "long_total": long["num_requests"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=COUNT, default=2000)
    parser.add_argument("--trials", type=COUNT, default=20)
    add_overlap_argument(parser)
    add_parallel_arguments(parser)
    parser.add_argument("--out", type=OUTPUT_DIR, default="reports/ewsjf")
    parser.add_argument(
        "--decode-attention",
        choices=("sum", "max"),
        default="sum",
        help="max: uneven batches are paced by their longest context (where EWSJF's throughput gain shows)",
    )
    args = parser.parse_args(argv)
    out = args.out
    spec = WORKLOADS["ewsjf-mixed"]
    lengths = history_lengths()

    print(f"tuning Theta at 40 req/s ({args.trials} trials)", file=sys.stderr)
    objective = ewsjf_objective(spec.build(40.0, 1500, 7), lengths)
    result = tune(
        objective,
        THETA_SPACE,
        n_trials=args.trials,
        warm_start=[EwsjfMetaPolicy().get_params()],
        name="ewsjf-study",
        jobs=args.jobs,
    )
    tuned = EwsjfMetaPolicy(**result.params).fit(lengths)
    rewards = [h[2]["reward"] for h in result.history]
    print(
        f"tuned Theta {result.params} -> {len(tuned.queues_)} queues;"
        f" rewards {[round(r, 3) for r in rewards]}",
        file=sys.stderr,
    )

    variants = {
        "fcfs": functools.partial(make_policy, "fcfs"),
        "spf": functools.partial(make_policy, "spf"),
        "ewsjf(default)": EWSJF,
        "ewsjf(tuned)": functools.partial(EWSJF, tuned),
    }
    options = {"decode_attention": args.decode_attention, "overlap": args.overlap}
    cells = [
        ReplayCell((name, rate), f"{rate} req/s {name}", setup, factory, options=options)
        for rate in RATES
        for setup in (
            ReplaySetup(spec.build(float(rate), args.requests, 0), {}, spec.model, spec.gpu, spec.tp),
        )
        for name, factory in variants.items()
    ]
    table: dict[str, dict[int, dict]] = {}
    for cell, replayed in zip(cells, replay_cells(cells, jobs=args.jobs, ray=args.ray), strict=True):
        name, rate = cell.key
        table.setdefault(name, {})[rate] = row(replayed.metrics())

    print("tokens/s | short mean TTFT s | long P99 TTFT s | long done/total")
    print(f"{'policy':<16}" + "".join(f"{r:>34}" for r in RATES))
    for name, rows in table.items():
        cells = [
            f"{x['tokens_per_s']:.0f} | {x['short_ttft_mean']:.2f} | {x['long_ttft_p99']:.1f}"
            f" | {x['long_completed']}/{x['long_total']}"
            for x in (rows[r] for r in RATES)
        ]
        print(f"{name:<16}" + "".join(f"{c:>34}" for c in cells))

    top = RATES[-1]
    setup = ReplaySetup(spec.build(float(top), args.requests, 0), {}, spec.model, spec.gpu, spec.tp)
    print(
        f"\nqueue-count study at {top} req/s (tuned weights):"
        " queues, tokens/s, short mean TTFT, long P99 TTFT"
    )
    layouts = [
        *[
            (f"k-means {k}", EwsjfMetaPolicy(**{**tuned.get_params(), "partition": "kmeans", "k": k}))
            for k in (5, 10, 30)
        ],
        ("refine-and-prune", EwsjfMetaPolicy(**tuned.get_params())),
    ]
    cells = [
        ReplayCell(label, label, setup, functools.partial(EWSJF, meta.fit(lengths)), options=options)
        for label, meta in layouts
    ]
    study = {}
    for (label, meta), replayed in zip(
        layouts, replay_cells(cells, jobs=args.jobs, ray=args.ray), strict=True
    ):
        study[label] = {"queues": len(meta.queues_), **row(replayed.metrics())}
        s = study[label]
        print(
            f"  {label:<18} {s['queues']:>3}  {s['tokens_per_s']:.0f}  {s['short_ttft_mean']:.2f}"
            f"  {s['long_ttft_p99']:.1f}"
        )
    write_json(
        out / "ewsjf_study.json",
        {"tuned": result.params, "rewards": rewards, "table": table, "queue_study": study},
        default=str,
    )
    print(f"json: {out / 'ewsjf_study.json'}")


if __name__ == "__main__":
    main()
