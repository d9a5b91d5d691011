"""Replay fidelity against the real engine (issue: vLLM serving): fit `cost-model` from a vLLM
step log, replay the same trace in the simulator, compare every request's TTFT and end-to-end
latency with what the engine measured.

    .venv/bin/python -m experiments.fidelity [--requests 300] [--rate 6] [--policy fcfs]
                                             [--model DIR] [--max-num-seqs 16]

Two real runs of vLLM (in-process engine core, `PolicyScheduler` with `--policy`, the monitor's
request and step logs on), each on its own slice of the bundled Azure conversation trace: real
arrival gaps time-scaled to `--rate`, real prompt and output lengths cut by 4 (clipped) to fit the
tiny model's 1,024-token context (a prompt of exactly that many token ids, an output of exactly
that many tokens). Each request's times are taken as a client gets them: submitted, then its
first token and its end when `engine.step()` returns them. Run A calibrates: `cost-model` is
fitted on its step log. Run B is predicted: its requests (arrival, prompt, output) are replayed
with the same policy, the fitted cost model and the engine's own limits (token budget, max
running, KV blocks), and each request's simulated TTFT and E2E are compared with B's measured
ones. Also reported: the replay with the cost model fitted on B itself (in-sample), the signed
bias, and the step-time error of the fit. Vidur reports under 9% error on end-to-end metrics
(median absolute % error is used here).
Without `--model` a tiny random model is generated (DESIGN.md section 6).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SCALE_TO_CONTEXT = 1024


def workload(requests: int, rate: float, offset: int) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens) from the Azure trace rows [offset, offset + n)."""
    from adapt.traces import load_trace
    from adapt.workloads import bundled
    from adapt.workloads.builders import scale_to_rate

    azure = load_trace(bundled("azure_conv_2023.csv.gz"))
    rows = slice(offset, offset + requests)
    arrivals = scale_to_rate(azure.arrival_s[rows] - azure.arrival_s[offset], rate)
    prompts = np.clip(azure.prompt_tokens[rows] // 4, 8, 700)  # 4x shorter, as the context is
    outputs = np.clip(azure.output_tokens[rows] // 4, 4, SCALE_TO_CONTEXT - 700)
    return [(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs, strict=True)]


def worker(
    model: str, policy: str, rows: list[tuple[float, int, int]], log_dir: str, max_num_seqs: int
) -> None:
    """Serve `rows` open-loop (each added when its arrival time comes); the monitor writes the
    logs. Prints the engine limits the replay must copy."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["ADAPT_POLICY"] = policy
    os.environ["ADAPT_LOG_DIR"] = log_dir
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        max_model_len=SCALE_TO_CONTEXT,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
        enforce_eager=True,
        dtype="float32",
        gpu_memory_utilization=0.3,
        async_scheduling=True,
        scheduler_cls="serving_hooks.vllm_adapter.PolicyScheduler",
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    rng = np.random.default_rng(0)
    pending = list(enumerate(rows))
    seen: dict[str, list[float | None]] = {}  # request id -> [arrival, first token, finish], client side
    started = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - started
        while pending and pending[0][1][0] <= now:
            index, (_, prompt, output) = pending.pop(0)
            tokens = rng.integers(5, 500, size=prompt).tolist()
            params = SamplingParams(max_tokens=output, ignore_eos=True)
            engine.add_request(f"r{index}", {"prompt_token_ids": tokens}, params)
            seen[f"r{index}"] = [time.monotonic() - started, None, None]
        if engine.has_unfinished_requests():
            for out in engine.step():  # what a client would receive, when it would receive it
                times, now = seen[out.request_id], time.monotonic() - started
                if times[1] is None and out.outputs and out.outputs[0].token_ids:
                    times[1] = now
                if out.finished:
                    times[2] = now
        elif pending:
            time.sleep(max(0.0, pending[0][1][0] - (time.monotonic() - started)))
    (Path(log_dir) / "client.json").write_text(json.dumps(seen))
    limits = {
        "token_budget": int(scheduler.max_num_scheduled_tokens),
        "max_running": int(scheduler.max_num_running_reqs),
        "block_size": int(scheduler.block_size),
        "kv_blocks": int(scheduler.kv_cache_manager.block_pool.num_gpu_blocks),
        "policy_errors": scheduler.policy_errors,
    }
    print("LIMITS " + json.dumps(limits), flush=True)


def serve_and_log(model: str, policy: str, rows: list, log_dir: Path, max_num_seqs: int) -> dict[str, Any]:
    spec = log_dir / "workload.json"
    spec.write_text(json.dumps(rows))
    command = [
        sys.executable, "-m", "experiments.fidelity", "--worker", str(spec), "--model", model,
        "--policy", policy, "--max-num-seqs", str(max_num_seqs),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("LIMITS "):
            return json.loads(line[len("LIMITS ") :])
    raise RuntimeError(f"engine run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def real_requests(log_dir: Path) -> list[dict[str, Any]]:
    """Each request's lengths (the engine's request log) with its times as the client saw them:
    arrival when it was submitted, first token and finish when `engine.step()` returned them."""
    client = json.loads((log_dir / "client.json").read_text())
    records = []
    for path in sorted(log_dir.glob("requests-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for record in records:  # the engine core's id is the client's plus "-<random suffix>"
        client_id = record["request_id"].rsplit("-", 1)[0]
        record["arrival_s"], record["first_token_s"], record["finish_s"] = client[client_id]
    return sorted(records, key=lambda r: r["arrival_s"])


def fit_cost_model(log_dir: Path, kv_capacity: int) -> tuple[Any, float]:
    """The cost model fitted on every step of a run, and its step-time MAPE on the last 20%
    when fitted on the first 80% (the pipeline's split)."""
    import pandas as pd

    from pipelines.cost_model import load_step_log
    from predictors.cost_model import FittedCostModel

    frame = pd.concat([load_step_log(p) for p in sorted(log_dir.glob("steps-*.jsonl"))], ignore_index=True)
    cut = int(len(frame) * 0.8)
    held_out = FittedCostModel(kv_capacity).fit(frame.iloc[:cut]).evaluate(frame.iloc[cut:])["mape"]
    return FittedCostModel(kv_capacity).fit(frame), held_out


def replay_errors(
    real: list[dict[str, Any]], cost: Any, limits: dict[str, Any], policy: str
) -> dict[str, float]:
    """Median absolute % error of simulated vs measured TTFT and E2E, over finished requests."""
    from adapt.replay.engine import EngineConfig, ReplayEngine
    from adapt.requests import Request
    from serving_hooks.policies import make_policy_from_spec

    requests = [
        Request(r["request_id"], r["arrival_s"], r["prompt_tokens"], r["output_tokens"])
        for r in real
        if r.get("finish_s") is not None
    ]
    config = EngineConfig(
        token_budget=limits["token_budget"],
        max_running=limits["max_running"],
        block_size=limits["block_size"],
        kv_capacity_tokens=limits["kv_blocks"] * limits["block_size"],
        max_model_len=SCALE_TO_CONTEXT,
    )
    simulated = {
        r.request_id: r
        for r in ReplayEngine(make_policy_from_spec(policy), cost, config).run(requests).records
    }
    errors: dict[str, list[float]] = {"ttft": [], "e2e": []}  # signed: (simulated - real) / real
    for record in real:
        sim = simulated.get(record["request_id"])
        if record.get("finish_s") is None or sim is None or sim.finish_s is None:
            continue
        for key, end in (("ttft", "first_token_s"), ("e2e", "finish_s")):
            measured = record[end] - record["arrival_s"]
            predicted = getattr(sim, end) - sim.arrival_s
            if measured > 0:
                errors[key].append((predicted - measured) / measured)
    return {
        "ttft_error": float(np.median(np.abs(errors["ttft"]))),
        "e2e_error": float(np.median(np.abs(errors["e2e"]))),
        "ttft_bias": float(np.median(errors["ttft"])),
        "e2e_bias": float(np.median(errors["e2e"])),
        "requests": len(errors["e2e"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=6.0)
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--model", help="model directory (default: a generated tiny model)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rows = json.loads(Path(args.worker).read_text())
        worker(args.model, args.policy, rows, str(Path(args.worker).parent), args.max_num_seqs)
        return
    with tempfile.TemporaryDirectory(prefix="adapt-fidelity-") as tmp:
        model = args.model
        if model is None:
            from serving_hooks.tiny_model import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny"))
        runs = {}
        for name, offset in (("A (calibration)", 0), ("B (predicted)", 5000)):
            log_dir = Path(tmp) / name.split()[0]
            log_dir.mkdir()
            print(
                f"run {name}: {args.requests} requests at {args.rate} req/s, policy {args.policy} ...",
                flush=True,
            )
            limits = serve_and_log(
                model, args.policy, workload(args.requests, args.rate, offset), log_dir, args.max_num_seqs
            )
            runs[name] = (log_dir, limits)
        (dir_a, limits), (dir_b, _) = runs["A (calibration)"], runs["B (predicted)"]
        kv = limits["kv_blocks"] * limits["block_size"]
        cost_a, step_error_a = fit_cost_model(dir_a, kv)
        cost_b, _ = fit_cost_model(dir_b, kv)
        real = real_requests(dir_b)
        print(
            f"engine limits {limits}; cost-model step-time MAPE"
            f" (fit on 80% of run A's steps): {step_error_a:.3f}"
        )
        print(
            f"{'replay of run B with':<30}{'TTFT |err|':>12}{'E2E |err|':>11}{'TTFT bias':>11}"
            f"{'E2E bias':>10}{'requests':>10}   (medians; bias = signed (sim - real) / real)"
        )
        for label, cost in (("cost model fitted on run A", cost_a), ("cost model fitted on run B", cost_b)):
            result = replay_errors(real, cost, limits, args.policy)
            print(
                f"{label:<30}{result['ttft_error']:>12.3f}{result['e2e_error']:>11.3f}"
                f"{result['ttft_bias']:>+11.3f}{result['e2e_bias']:>+10.3f}{result['requests']:>10}"
            )
        measured = [
            (r["first_token_s"] - r["arrival_s"], r["finish_s"] - r["arrival_s"])
            for r in real
            if r.get("finish_s")
        ]
        ttft, e2e = np.median(measured, axis=0)
        print(f"run B measured: TTFT median {ttft * 1000:.1f} ms, E2E median {e2e * 1000:.1f} ms")


if __name__ == "__main__":
    main()
