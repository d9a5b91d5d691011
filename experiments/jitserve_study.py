"""JITServe study (issue: JITServe), after the paper's section 6.2: token goodput on `jitserve-mix`.

    .venv/bin/python -m experiments.jitserve_study [--rates 2.0,2.5,3.0] [--requests 1500]
                                                    [--seeds 0,1,2] [--components fit|champion]
                                                    [--ablations] [--jobs N] [--ray [ADDRESS]]
                                                    [--out reports/jitserve]

Replays, at each rate and seed, `fcfs`, `sarathi` (512-token chunks), `edf`, `edf` with a 512-token
budget, `plas`, `ltr` (noisy oracle: true length x lognormal(0, 0.5)), `ltr+qrf` (ranked by the
QRF median), `jitserve` and `jitserve-oracle` (true lengths and true stage shares). `fit` trains
`qrf-length` on the bundled AlpacaEval train split and `pattern-graph` on generated programs (a
seed the workload never uses); `champion` loads both from the registry. Goodput counts tokens
(DESIGN.md section 4): a latency request's on-time output tokens, a deadline request's prompt +
output if done in 20 s, a compound program's tokens if its last call is done by 20 s per stage.
Writes `jitserve_study.json` and `.md` to --out and prints the table.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapt.cli.usage import COUNT, OUTPUT_DIR, RATE_LIST, SEED_LIST, add_parallel_arguments, write_json
from adapt.policy import Policy, RequestState
from adapt.replay.cells import ReplayCell, replay_cells
from adapt.replay.cost import DEFAULT_OVERLAP, add_overlap_argument
from adapt.replay.runner import ReplaySetup
from adapt.traces import load_trace
from adapt.workloads import WORKLOADS, bundled, jitserve_mix
from serving_hooks.policies import make_policy

NON_ORACLE = ("fcfs", "sarathi", "edf", "edf (512-token budget)", "plas", "ltr+qrf", "jitserve")


def fit_pattern_graph() -> Any:
    """The pattern graph `adapt train pattern-graph` fits by default (generated programs)."""
    from adapt.workloads.compound import generate_graphs
    from pipelines.jitserve import GENERATED_TRAIN
    from predictors.pattern_graph import PatternGraph

    return PatternGraph().fit(generate_graphs(*GENERATED_TRAIN))


def fit_components() -> tuple[Any, Any]:
    from adapt.traces import split_by_instruction
    from predictors.qrf_length import QrfLength

    train, _ = split_by_instruction(load_trace(bundled("alpaca_eval_lengths.jsonl.gz")))
    qrf = QrfLength(generated_features=0).fit(train)
    return qrf, fit_pattern_graph()


def load_components(spec: str) -> tuple[Any, Any]:
    if spec == "fit":
        return fit_components()
    from adapt.registry import load_reference

    return load_reference("qrf-length", spec), load_reference("pattern-graph", spec)


@dataclass(frozen=True)
class QrfMedian:
    """LTR's point prediction from the same forest: its median (q = 0.5) on arrival. A class, not
    a closure, so the policy pickles to a replay worker."""

    qrf: Any

    def __call__(self, request: RequestState) -> float:
        text = request.prompt_text or ""
        return float(self.qrf.predict_bound([request.prompt_tokens], [text], [0], [""], quantile=0.5)[0])


def ablations(qrf: Any, patterns: Any) -> dict[str, Callable[[], Policy]]:
    """`jitserve` with one part switched off at a time (`--ablations`)."""

    def jit(**params: Any) -> Callable[[], Policy]:
        return functools.partial(make_policy, "jitserve", **{"qrf": qrf, "patterns": patterns, **params})

    return {
        "ablation: fixed cutoff p = 0.95": jit(cutoffs=(0.95,)),
        "ablation: with preemption (gain > stall + victim's goodput)": jit(preempt=True),
        "ablation: no admission control": jit(waiting_time_s=None),
        "ablation: batch = engine max (256)": jit(batch_size=None),
        "ablation: no pattern graph (phi = 1)": jit(patterns=None),
        "ablation: no QRF (online quantile)": jit(qrf=None),
    }


def edf_512() -> Policy:
    """EDF with Sarathi-Serve's 512-token chunks: the deadline-aware baseline at JITServe's budget."""
    policy = make_policy("edf")
    policy.token_budget = 512
    return policy


def policies(qrf: Any, patterns: Any) -> dict[str, Callable[[], Policy]]:
    """The baselines and jitserve: picklable factories, so each replay builds its own instance."""
    return {
        "fcfs": functools.partial(make_policy, "fcfs"),
        "sarathi": functools.partial(make_policy, "sarathi"),
        "edf": functools.partial(make_policy, "edf"),
        "edf (512-token budget)": edf_512,
        "plas": functools.partial(make_policy, "plas"),
        "ltr(noisy oracle)": functools.partial(make_policy, "ltr"),
        "ltr+qrf": functools.partial(make_policy, "ltr", predict=QrfMedian(qrf)),
        "jitserve": functools.partial(make_policy, "jitserve", qrf=qrf, patterns=patterns),
        "jitserve-oracle": functools.partial(make_policy, "jitserve-oracle"),
    }


def run_study(
    rates: list[float],
    num_requests: int,
    seeds: list[int],
    qrf: Any,
    patterns: Any,
    with_ablations: bool = False,
    overlap: str = DEFAULT_OVERLAP,
    jobs: int | None = None,
    ray: str | None = None,
) -> dict[str, Any]:
    """Every policy (and ablation) at every rate and seed, on `jobs` processes."""
    spec = WORKLOADS["jitserve-mix"]
    cells = []
    for rate in rates:
        for seed in seeds:
            requests = jitserve_mix(rate, num_requests, seed)
            setup = ReplaySetup(requests, spec.info(rate, num_requests, seed), spec.model, spec.gpu, spec.tp)
            variants = policies(qrf, patterns)
            if with_ablations:
                variants.update(ablations(qrf, patterns))
            for label, build in variants.items():
                name = f"{rate} req/s seed {seed} {label}"
                cells.append(
                    ReplayCell((label, rate, seed), name, setup, build, options={"overlap": overlap})
                )
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for cell, result in zip(cells, replay_cells(cells, jobs=jobs, ray=ray), strict=True):
        label, rate, seed = cell.key
        metrics = result.metrics()
        runs.setdefault(label, {}).setdefault(str(rate), []).append(
            {
                "seed": seed,
                "goodput_tokens": metrics["goodput_tokens"],
                "slo_attainment": metrics["slo_attainment"],
                "dropped": metrics["dropped"],
                "by_class": {
                    k: {"slo_attainment": v["slo_attainment"], "goodput_tokens": v["goodput_tokens"]}
                    for k, v in metrics.get("by_class", {}).items()
                },
            }
        )
    table = {
        label: {
            rate: float(np.mean([r["goodput_tokens"] for r in per_seed]))
            for rate, per_seed in by_rate.items()
        }
        for label, by_rate in runs.items()
    }
    attainment = {
        label: {
            rate: {
                kind: float(np.mean([r["by_class"][kind]["slo_attainment"] for r in per_seed]))
                for kind in ("latency", "deadline", "compound")
            }
            for rate, per_seed in by_rate.items()
        }
        for label, by_rate in runs.items()
    }
    info = spec.info(rates[-1], num_requests, seeds[0])
    return {
        "workload": info,
        "rates": rates,
        "seeds": seeds,
        "table": table,
        "attainment": attainment,
        "runs": runs,
    }


def markdown(study: dict[str, Any]) -> str:
    rates = [str(r) for r in study["rates"]]
    table, attainment = study["table"], study["attainment"]
    seeds = len(study["seeds"])
    oracle = table["jitserve-oracle"]
    head = " | ".join(f"goodput (M tokens) @ {r} req/s" for r in rates)
    lines = [f"Token goodput, mean of {seeds} seeds; (x.xx) = share of jitserve-oracle; then SLO attainment"]
    lines += ["", f"| policy | {head} | attained latency/deadline/compound @ {rates[-1]} |"]
    lines.append("|---|" + "---|" * (len(rates) + 1))
    for label, by_rate in table.items():
        cells = []
        for rate in rates:
            value = by_rate[rate]
            best = max(table[p][rate] for p in NON_ORACLE)
            text = f"{value / 1e6:.3f} ({value / oracle[rate]:.2f})"
            cells.append(f"**{text}**" if label in NON_ORACLE and value == best else text)
        a = attainment[label][rates[-1]]
        cells.append(f"{a['latency']:.2f} / {a['deadline']:.2f} / {a['compound']:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=RATE_LIST, default="2.0,2.5,3.0")
    parser.add_argument("--requests", type=COUNT, default=1500, help="jobs per run (compound jobs add calls)")
    parser.add_argument("--seeds", type=SEED_LIST, default="0,1,2")
    parser.add_argument("--components", default="fit", help="fit (bundled data), champion, or vN")
    parser.add_argument("--ablations", action="store_true", help="also run jitserve with parts switched off")
    add_overlap_argument(parser)
    add_parallel_arguments(parser)
    parser.add_argument("--out", type=OUTPUT_DIR, default="reports/jitserve")
    args = parser.parse_args(argv)
    out = args.out
    qrf, patterns = load_components(args.components)
    study = run_study(
        args.rates,
        args.requests,
        args.seeds,
        qrf,
        patterns,
        args.ablations,
        args.overlap,
        args.jobs,
        args.ray,
    )
    write_json(out / "jitserve_study.json", study)
    text = markdown(study)
    (out / "jitserve_study.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
