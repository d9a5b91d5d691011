"""`neural-length` versus `qrf-length` (issue: pipelines, item 5): the two remaining-length bounds
JITServe can run on, trained and scored alike on held-out real prompts.

    .venv/bin/python -m experiments.length_bounds [--data FILE] [--rate 3.0] [--requests 1500]
                                                  [--seeds 0] [--no-replay] [--json OUT]

`--data`: a prompt/response file (default: the bundled AlpacaEval slice, lengths only; the full
`../shared/data/prompts/alpaca_eval_outputs.jsonl.gz` also has response texts, which adds a
forest that reads the generated text). Instructions are split 70/30, so no test prompt was seen.
Prints, per predictor: fit time; coverage of the 0.95 bound, mean over-estimation (bound / true
remaining) and mean bound after 0/50/100/200 generated tokens; the cost of one bound (a new
prompt, and a refresh whose prompt embedding is cached) and per request in a batch of 500; then
`jitserve`'s token goodput on `jitserve-mix` with each bound (and with none: the online quantile).
`--json OUT` writes the same figures: `{"data", "train", "held_out", "predictors": {LABEL: {"fit_s",
"new_prompt_ms", "refresh_ms", "per_request_ms", "coverage_at_G", "overestimate_at_G",
"bound_mean_at_G", ...}}, "goodput": {LABEL: tokens} | null}`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from adapt.cli.usage import COUNT, OUTPUT, RATE, SEED_LIST, write_json
from adapt.traces import load_trace
from adapt.workloads import bundled

POINTS = (0, 50, 100, 200)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def fit_predictors(train: Any) -> dict[str, tuple[Any, float]]:
    from predictors.neural_length import NeuralLength
    from predictors.qrf_length import QrfLength

    candidates: dict[str, Callable[[], Any]] = {
        "qrf-length (count only)": lambda: QrfLength(generated_features=0)
    }
    if train.columns.get("output_text") is not None:
        candidates["qrf-length (count + generated text)"] = QrfLength
    candidates["neural-length"] = NeuralLength
    fitted = {}
    for label, make in candidates.items():
        started = time.perf_counter()
        fitted[label] = (make().fit(train), time.perf_counter() - started)
        print(f"  fitted {label} in {fitted[label][1]:.1f} s", flush=True)
    return fitted


def latency_ms(model: Any, test: Any) -> tuple[float, float, float]:
    """(new prompt, refresh, per request of 500) in ms. A new prompt gets a text never seen, so
    the network pays for its embedding; the forest hashes words either way."""
    texts, tokens = list(test.prompt_text[:500]), list(test.prompt_tokens[:500])
    counter = iter(range(10**9))

    def new_prompt() -> None:
        model.predict_bound(tokens[:1], [f"{texts[0]} #{next(counter)}"], [0], [""])

    fresh = median_ms(new_prompt, 30)
    refresh = median_ms(lambda: model.predict_bound(tokens[:1], texts[:1], [50], [""]), 200)
    batch = median_ms(lambda: model.predict_bound(tokens, texts, [0] * 500, [""] * 500), 10) / 500
    return fresh, refresh, batch


def replay_goodput(bounds: dict[str, Any], rate: float, requests: int, seeds: list[int]) -> dict[str, float]:
    from adapt.replay.cost import roofline
    from adapt.replay.engine import ReplayEngine
    from adapt.workloads import WORKLOADS, jitserve_mix
    from experiments.jitserve_study import fit_pattern_graph
    from serving_hooks.policies import make_policy

    patterns = fit_pattern_graph()
    spec = WORKLOADS["jitserve-mix"]
    cost = roofline(spec.model, spec.gpu, tp=spec.tp)
    goodput: dict[str, list[float]] = {}
    for seed in seeds:
        workload = jitserve_mix(rate, requests, seed)
        for label, bound in {**bounds, "none (online quantile)": None}.items():
            policy = make_policy("jitserve", qrf=bound, patterns=patterns)
            metrics = ReplayEngine(policy, cost).run(workload).metrics()
            goodput.setdefault(label, []).append(metrics["goodput_tokens"])
            print(f"  replay seed {seed} {label:<36} goodput {metrics['goodput_tokens']:>10,}", flush=True)
    return {label: float(np.mean(values)) for label, values in goodput.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(bundled("alpaca_eval_lengths.jsonl.gz")))
    parser.add_argument("--rate", type=RATE, default=3.0, help="jitserve-mix job rate for the replay")
    parser.add_argument("--requests", type=COUNT, default=1500, help="jobs per replay")
    parser.add_argument("--seeds", type=SEED_LIST, default="0")
    parser.add_argument("--no-replay", action="store_true")
    parser.add_argument("--json", type=OUTPUT, metavar="OUT", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    from adapt.traces import split_by_instruction

    train, test = split_by_instruction(load_trace(args.data), 0.3)
    print(f"{args.data}: {len(train):,} training responses, {len(test):,} held out", flush=True)
    fitted = fit_predictors(train)
    results: dict[str, dict[str, float]] = {}
    for label, (model, seconds) in fitted.items():
        quality = {key: float(value) for key, value in model.evaluate(test).items()}
        costs = zip(("new_prompt_ms", "refresh_ms", "per_request_ms"), latency_ms(model, test), strict=True)
        results[label] = {"fit_s": seconds, **dict(costs), **quality}
    print("\n".join(["", *tables(results)]))
    goodput = None
    if not args.no_replay:
        seeds = args.seeds
        bounds = {label: model for label, (model, _) in fitted.items()}
        goodput = replay_goodput(bounds, args.rate, args.requests, seeds)
        print(
            f"\njitserve token goodput on jitserve-mix at {args.rate} req/s,"
            f" {args.requests} jobs, seeds {seeds}"
        )
        for label, value in goodput.items():
            print(f"  {label:<36} {value / 1e6:.3f} M tokens")
    if args.json is not None:
        report = {
            "data": args.data,
            "train": len(train),
            "held_out": len(test),
            "predictors": results,
            "goodput": goodput,
        }
        write_json(args.json, report)
        print(f"wrote {args.json}")


def tables(results: dict[str, dict[str, float]]) -> list[str]:
    """The printed tables: quality after each point of generation, then what a bound costs."""
    head = "after " + "/".join(str(g) for g in POINTS)  # one column per figure, its points in the cell
    lines = [f"| predictor | fit s | coverage {head} | over-estimation {head} | mean bound {head} |"]
    lines.append("|---|---|---|---|---|")
    costs = ["| predictor | new prompt ms | refresh ms | per request of 500 ms |", "|---|---|---|---|"]
    for label, figures in results.items():
        cells = [
            " / ".join(f"{figures[f'{k}_at_{g}']:.{d}f}" for g in POINTS)
            for k, d in (("coverage", 3), ("overestimate", 1), ("bound_mean", 0))
        ]
        lines.append(f"| {label} | {figures['fit_s']:.1f} | " + " | ".join(cells) + " |")
        costs.append(
            f"| {label} | {figures['new_prompt_ms']:.2f} | {figures['refresh_ms']:.3f} |"
            f" {figures['per_request_ms']:.4f} |"
        )
    return [*lines, "", *costs]


if __name__ == "__main__":
    main()
