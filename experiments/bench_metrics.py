"""What the `adapt_*` metrics cost a serving engine (issue: what an operator watches).

    .venv/bin/python -m experiments.bench_metrics [--running 256] [--steps 300] [--json OUT]

In the GPU-free scheduler harness of `experiments.bench_scheduler` (vLLM's real scheduler, no
model run), `PolicyScheduler` runs jitserve with `--running` requests in the batch and a queue
behind it, recording metrics as `adapt serve` does: prometheus_client in multiprocess mode, values
written to files in a fresh `PROMETHEUS_MULTIPROC_DIR`. Outputs are 32-96 tokens long, so requests
finish and refill the batch every few steps and the per-request path (SLO outcome, histograms,
quality windows) is exercised, not only the per-step one. Figures:

- `recorder_us_per_step`: time spent inside the recorder's calls (`SchedulerMetrics` methods,
  timed one by one), averaged over all steps, less what timing a call costs by itself (measured on
  an empty method; `timed_us_per_step` keeps it in, an upper bound) -- the metrics' cost on the
  scheduler thread;
- relative to `harness_step_ms`, the same run's mean step (scheduling alone: an upper bound on the
  share, since a real step also runs the model), and to `reference_step_ms`, the fastest measured
  H100 step with 256 decodes (llama-3-8b, 128-token contexts: `experiments/data`);
- `ab_deltas_us_per_step`: mean step with metrics minus mean step without, same requests, for
  `--pairs` alternating pairs of runs -- a sanity check only: on this shared 2-core machine two
  runs of the same code differ by a few hundred microseconds per step, far more than the recorder
  costs, so these deltas show the noise, not the metrics;
- `scrape_ms`: one `/metrics` answer from the multiprocess directory as vLLM builds it
  (`MultiProcessCollector` + `generate_latest`). It runs in the API-server process, not on the
  scheduler's thread; its CPU share is `scrape_ms` per scrape interval (5 s in deploy/prometheus.yml).

With metrics off (`adapt serve --no-metrics`) the scheduler holds no recorder: each hook is one
`is None` test, which this benchmark does not try to resolve from noise.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import types
from pathlib import Path
from typing import Any

from adapt.cli.usage import COUNT, OUTPUT, write_json

POLICY = "jitserve:batch_size=null:waiting_time_s=null"
REFERENCE = Path(__file__).parent / "data" / "steps_h100_llama-3-8b.csv"
OUTPUT_LENGTHS = (32, 48, 64, 80, 96)


def _requests(count: int, start: int) -> list[Any]:
    from experiments.bench_scheduler import make_requests

    share = -(-count // len(OUTPUT_LENGTHS))
    requests = []
    for n, length in enumerate(OUTPUT_LENGTHS):
        requests += make_requests(min(share, count - len(requests)), start + len(requests), n, length)
    return requests


RECORDER_CALLS = ("step", "admitted", "deferred", "preempted", "dropped", "finished", "publish", "due")


def _timed(target: Any, names: tuple[str, ...], spent: list[float]) -> None:
    """Wrap `target`'s methods `names` so the time inside them adds up in spent[0] and the
    calls in spent[1]."""
    for name in names:
        original = getattr(target, name)

        def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started
                spent[1] += 1

        setattr(target, name, timed)


def timer_overhead_s(calls: int = 100_000) -> float:
    """What `_timed` measures for a call that does nothing."""
    probe = types.SimpleNamespace(nothing=lambda: None)
    spent = [0.0, 0]
    _timed(probe, ("nothing",), spent)
    for _ in range(calls):
        probe.nothing()
    return spent[0] / calls


def run(model_dir: Path, running: int, steps: int, metrics_on: bool) -> dict[str, float]:
    from experiments.bench_scheduler import make_scheduler, step
    from serving_hooks.vllm_adapter import PolicyScheduler

    os.environ["ADAPT_POLICY"] = POLICY
    os.environ["ADAPT_METRICS"] = "1" if metrics_on else "0"
    queue = running * 8
    scheduler = make_scheduler(model_dir, PolicyScheduler, running, (running + queue) * 12 + 64)
    spent = [0.0, 0]
    if scheduler.metrics is not None:
        _timed(scheduler.metrics, RECORDER_CALLS, spent)
    for request in _requests(running + queue, 0):
        scheduler.add_request(request)
    for _ in range(40):  # prefill the batch
        step(scheduler)
    spent[:] = [0.0, 0]
    times = []
    for _ in range(steps):
        scheduled, updated = step(scheduler)
        times.append(scheduled + updated)
    overhead = timer_overhead_s()
    return {
        "step_ms": 1000 * statistics.fmean(times),
        "timed_us": 1e6 * spent[0] / steps,
        "recorder_us": 1e6 * max(0.0, spent[0] - spent[1] * overhead) / steps,
        "calls_per_step": spent[1] / steps,
        "running": len(scheduler.running),
    }


def scrape_ms(repeats: int = 20) -> float:
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    started = time.perf_counter()
    for _ in range(repeats):
        generate_latest(registry)
    return 1000 * (time.perf_counter() - started) / repeats


def reference_step_ms(running: int) -> float:
    import pandas as pd

    steps = pd.read_csv(REFERENCE)
    decode = steps[(steps["num_decodes"] == running) & (steps["prefill_tokens"] == 0)]
    return 1000 * float(decode["duration_s"].min())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=COUNT, default=256)
    parser.add_argument("--steps", type=COUNT, default=300)
    parser.add_argument("--pairs", type=COUNT, default=2, help="runs without and with metrics, alternating")
    parser.add_argument("--json", type=OUTPUT, metavar="OUT", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="adapt-bench-metrics-") as tmp:
        # Before prometheus_client is imported (vLLM imports it): values go to mapped files.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(Path(tmp) / "prometheus")
        Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]).mkdir()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from serving_hooks.tiny_model import make_tiny_model

        logging.getLogger("vllm").setLevel(logging.WARNING)
        model_dir = make_tiny_model(Path(tmp) / "tiny")
        pairs = [
            (run(model_dir, args.running, args.steps, False), run(model_dir, args.running, args.steps, True))
            for _ in range(args.pairs)
        ]
        scrape = scrape_ms()
    on = {key: statistics.fmean(with_[key] for _, with_ in pairs) for key in pairs[0][1]}
    reference = reference_step_ms(args.running)
    figures = {
        "running": int(on["running"]),
        "steps": args.steps,
        "recorder_us_per_step": round(on["recorder_us"], 2),
        "timed_us_per_step": round(on["timed_us"], 2),
        "recorder_calls_per_step": round(on["calls_per_step"], 2),
        "harness_step_ms": round(on["step_ms"], 3),
        "share_of_harness_step": round(on["recorder_us"] / 1000 / on["step_ms"], 5),
        "reference_step_ms": round(reference, 3),
        "share_of_reference_step": round(on["recorder_us"] / 1000 / reference, 5),
        "ab_deltas_us_per_step": [
            round(1000 * (with_["step_ms"] - off["step_ms"]), 1) for off, with_ in pairs
        ],
        "scrape_ms": round(scrape, 2),
        "scrape_share_at_5s_interval": round(scrape / 5000, 5),
    }
    print(
        f"{figures['running']} running, {args.steps} steps: metrics cost"
        f" {figures['recorder_us_per_step']:.1f} us per step"
        f" = {100 * figures['share_of_harness_step']:.2f}% of the harness step"
        f" ({figures['harness_step_ms']:.2f} ms, scheduling only),"
        f" {100 * figures['share_of_reference_step']:.2f}% of an H100 256-decode step ({reference:.1f} ms);"
        f" A/B deltas {', '.join(f'{d:+.0f}' for d in figures['ab_deltas_us_per_step'])} us (machine noise);"
        f" a scrape takes {figures['scrape_ms']:.2f} ms in the API-server process"
    )
    if args.json is not None:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
