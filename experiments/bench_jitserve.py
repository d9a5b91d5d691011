"""JITServe benchmarks: the QRF bound per request, one GMAX planning step, pattern matching.

    .venv/bin/python -m experiments.bench_jitserve [--waiting 10000] [--repeats 20] [--json OUT]

Prints medians of:
- `qrf-length` bound for one request and per request in a batch of 500, through our compiled
  forest and through quantile-forest's own `predict` (the issue's targets: < 1 ms single,
  < 0.1 ms batched; the paper reports 7 ms);
- one GMAX frame (priorities of every request, cutoff, length-sorted window, admission order,
  preemption check) over `--waiting` waiting plus 256 running requests whose bounds are already
  cached (target < 20 ms for 10,000; the paper schedules thousands in 20 ms);
- `pattern-graph` matching of a partial program against 500 stored graphs (paper: < 5 ms).
Components are fitted on the bundled data first (about 20 s). `--json OUT` writes
`{"settings": {...}, "ms": {"qrf_single", "qrf_single_library", "qrf_per_request_of_500",
"qrf_per_request_of_500_library", "gmax_frame", "pattern_match"}}`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from adapt.cli.usage import COUNT, OUTPUT, write_json
from adapt.policy import EngineView, RequestState
from adapt.requests import SLO
from adapt.traces import load_trace, split_by_instruction
from adapt.workloads import bundled
from adapt.workloads.compound import generate_graphs
from predictors.pattern_graph import PatternGraph
from predictors.qrf_length import QrfLength
from serving_hooks.policies.jitserve import JITServe


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def bench_qrf(repeats: int) -> dict[str, float]:
    train, test = split_by_instruction(load_trace(bundled("alpaca_eval_lengths.jsonl.gz")))
    qrf = QrfLength(generated_features=0).fit(train)
    prompts, texts = list(test.prompt_tokens[:500]), list(test.prompt_text[:500])
    generated, empty = [0] * 500, [""] * 500
    single = median_ms(
        lambda: qrf.predict_bound(prompts[:1], texts[:1], generated[:1], empty[:1]), repeats * 10
    )
    batch = median_ms(lambda: qrf.predict_bound(prompts, texts, generated, empty), repeats) / 500
    rows = qrf.features(prompts, texts, generated, empty)
    library_single = median_ms(lambda: qrf.forest_.predict(rows[:1], quantiles=qrf.quantile), repeats * 5)
    library_batch = median_ms(lambda: qrf.forest_.predict(rows, quantiles=qrf.quantile), repeats) / 500
    print(
        f"qrf-length bound, single request     {single:8.3f} ms"
        f"   (quantile-forest predict: {library_single:.3f} ms)"
    )
    print(
        f"qrf-length bound, per request of 500 {batch:8.4f} ms"
        f"   (quantile-forest predict: {library_batch:.4f} ms)"
    )
    return {
        "qrf_single": single,
        "qrf_single_library": library_single,
        "qrf_per_request_of_500": batch,
        "qrf_per_request_of_500_library": library_batch,
    }


def bench_gmax(waiting: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    slos = [SLO(kind="latency", ttft_s=2.0, tbt_s=0.1), SLO(kind="deadline", deadline_s=20.0), SLO()]
    policy = JITServe(batch_size=256, frame_steps=1)
    queue, running = [], []
    for i in range(waiting + 256):
        request = RequestState(
            f"r{i}", float(rng.uniform(0, 4)), int(rng.integers(10, 4000)), 8192, slos[i % 3]
        )
        policy.on_arrival(request, 4.0)
        request.cache["jit_bound"] = (float(rng.integers(10, 1000)), 0)
        if i < waiting:
            queue.append(request)
        else:
            request.phase, request.tokens_computed = "decode", request.prompt_tokens
            running.append(request)
    policy._unscored.clear()
    view = EngineView(5.0, queue, running, 0.95, 512, 256, 0.03, step_index=0)

    def frame() -> None:
        view.step_index += 1
        plan = policy.on_step(view)
        next(iter(plan.admit), None)

    ms = median_ms(frame, repeats)
    print(f"GMAX frame, {waiting:,} waiting + 256 running  {ms:8.2f} ms")
    return ms


def bench_patterns(repeats: int) -> float:
    patterns = PatternGraph(max_graphs=500).fit(generate_graphs(2000, 1000))
    graph = next(g for g in generate_graphs(50, 2000) if len(g.stages) >= 4)
    ms = median_ms(lambda: patterns.stage_share(graph.stages[:3], graph.stages[3]), repeats * 10)
    print(f"pattern-graph match, 500 stored graphs  {ms:8.3f} ms")
    return ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=COUNT, default=10_000)
    parser.add_argument("--repeats", type=COUNT, default=20)
    parser.add_argument("--json", type=OUTPUT, metavar="OUT", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    ms = {
        **bench_qrf(args.repeats),
        "gmax_frame": bench_gmax(args.waiting, args.repeats),
        "pattern_match": bench_patterns(args.repeats),
    }
    if args.json is not None:
        settings = {"waiting": args.waiting, "running": 256, "repeats": args.repeats}
        write_json(args.json, {"settings": settings, "ms": ms})


if __name__ == "__main__":
    main()
