"""Real-engine throughput at saturation (issue: vLLM serving): vLLM's default scheduler versus
`PolicyScheduler` with each policy, on the same model and the same burst of requests.

    .venv/bin/python -m experiments.bench_throughput [--requests 768] [--max-tokens 128]
        [--max-num-seqs 64] [--policies fcfs,sarathi,...] [--model DIR] [--repeats 1] [--embedded]
        [--json OUT]

Every request arrives at once (the queue never empties: saturation), prompts are 16-256 filler
words, each generates exactly `--max-tokens` tokens (ignore_eos). Each configuration runs in its
own process (a fresh engine, `VLLM_ENABLE_V1_MULTIPROCESSING=0` so the scheduler lives in it);
throughput is output tokens per second of wall time from the first submission to the last
finish, and the table gives it relative to vLLM's default. Without `--model` a tiny random model is
generated (DESIGN.md section 6) -- on a CPU its forward pass is cheap, so scheduling shows more
than it would next to a real model on a GPU. Policies that cap the batch on purpose (jitserve's B)
trade throughput for goodput; the table says how many ran at most. With `--repeats N` the
configurations run round-robin, each round starting one configuration later than the last, and
each policy's ratio is taken against the default *of the same round* (a drift in machine speed
hits both), the median and the spread of the N ratios reported;
`--json OUT` writes `{"policies": {NAME: {"tok_per_s", "ratio_to_default", "round_ratios", ...}}}`.
"predicted" counts the model results delivered (or arrived with their request) and the table says
where model batches failed: a model that fails costs no CPU, and the figure would then measure a
policy without its model.
"on prior" is the share of requests a policy first scheduled on its prior, before its model's
prediction came back (`adapt.predictions`): in a burst of hundreds at once, nearly all. "cut
short" counts requests that ended before `--max-tokens` (dropped by the policy), "preempted" the
preemptions (the policy's and vLLM's own; each recomputes its request's tokens). Prompts are the
same every round, so the runs keep no disk cache of embeddings (each embeds its prompts).
With `--embedded` every request arrives with its prompt's vector, computed once in this process
before any run (what `adapt serve --embed-prompts` sends from the API server): the figure is then
the engine's with the embedding work moved off it, which on a GPU node runs beside it; on a small
CPU it would take the same cores, and the figure leaves that out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from adapt.cli.usage import COUNT, NAME_LIST, OUTPUT, write_json

DEFAULT = "vllm-default"


def burst_prompts(requests: int) -> list[str]:
    """The burst's prompts, the same in every run: 16-256 filler words each."""
    import random

    rng = random.Random(0)
    words = ["the", "request", "queue", "token", "model", "batch", "cache", "step"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(16, 256))) for _ in range(requests)]


def worker(
    model: str, policy: str, requests: int, max_tokens: int, max_num_seqs: int, vectors: str | None = None
) -> None:
    """One engine, one burst; prints one JSON line. `vectors`: a .npy of the prompts' vectors, each
    request sent with its own (as `adapt serve --embed-prompts` sends it from the API server)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Every round sends the same prompts: a disk cache of embeddings would serve the second round's
    # from the first, and the benchmark would no longer see what embedding costs the engine.
    os.environ["ADAPT_EMBEDDING_CACHE"] = "off"
    extra = {}
    if policy != DEFAULT:
        os.environ["ADAPT_POLICY"] = policy
        extra["scheduler_cls"] = "serving_hooks.vllm_adapter.PolicyScheduler"
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        dtype="float32",
        gpu_memory_utilization=0.3,
        async_scheduling=True,
        **extra,
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    preemptions = _count_preemptions(scheduler)
    prompts = burst_prompts(requests)
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * requests
    if vectors is not None:
        import numpy as np

        from serving_hooks.xargs import EMBEDDING_FIELD, encode_embedding

        params = [
            SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, extra_args={EMBEDDING_FIELD: encode_embedding(v)}
            )
            for v in np.load(vectors)
        ]
    engine.add_request("warmup", "the request", SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    started = time.perf_counter()
    for i, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, request_params)
    tokens, finished, most_running = 0, 0, 0
    cut_short = 0  # ended before max_tokens (EOS is ignored): dropped by the policy, not served
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished += 1
                tokens += len(output.outputs[0].token_ids)
                cut_short += len(output.outputs[0].token_ids) < max_tokens
        most_running = max(most_running, len(scheduler.running))
    wall = time.perf_counter() - started
    queues = getattr(scheduler, "prediction_queues", [])  # only a PolicyScheduler has any
    predictions = scheduler.prediction_summary() if queues else None
    report = {
        "policy": policy,
        "tokens": tokens,
        "finished": finished,
        "cut_short": cut_short,
        "preemptions": preemptions[0],
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "most_running": most_running,
        "policy_errors": getattr(scheduler, "policy_errors", 0),
        # Share of requests first scheduled on their prior (the model's answer not back yet).
        "on_prior": None if predictions is None else predictions["share_on_prior"],
        # Results the model delivered or that came with their request: a model that failed every
        # batch costs no CPU, and its "throughput" would measure no model at all.
        "predicted": None if predictions is None else predictions["delivered"] + predictions["supplied"],
        "prediction_errors": sum(getattr(q, "errors", 0) for q in queues),
    }
    print("RESULT " + json.dumps(report), flush=True)


def _count_preemptions(scheduler) -> list[int]:
    """A one-item list that counts the scheduler's preemptions from now on: every one, the
    policy's and vLLM's own under KV pressure, goes through `_preempt_request`, and each is a
    recompute the policy's tokens/s pays for."""
    count = [0]
    preempt = scheduler._preempt_request

    def counted(*args, **kwargs):
        count[0] += 1
        return preempt(*args, **kwargs)

    scheduler._preempt_request = counted
    return count


def run(model: str, policy: str, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        "-m",
        "experiments.bench_throughput",
        "--worker",
        policy,
        "--model",
        model,
        "--requests",
        str(args.requests),
        "--max-tokens",
        str(args.max_tokens),
        "--max-num-seqs",
        str(args.max_num_seqs),
        *(["--vectors", args.vectors] if args.vectors else []),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{policy}: no result (exit {done.returncode}):\n{done.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=COUNT, default=768)
    parser.add_argument("--max-tokens", type=COUNT, default=128)
    parser.add_argument("--max-num-seqs", type=COUNT, default=64)
    parser.add_argument("--policies", type=NAME_LIST, help="comma-separated (default: every servable policy)")
    parser.add_argument(
        "--repeats", type=COUNT, default=1, help="rounds over all configurations (median taken)"
    )
    parser.add_argument("--model", help="model directory (default: a generated tiny model)")
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="requests arrive with their prompts' vectors (embedded before the burst, untimed)",
    )
    parser.add_argument("--json", type=OUTPUT, metavar="OUT", help="write the table as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--vectors", help=argparse.SUPPRESS)  # --embedded: the workers' .npy
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.model, args.worker, args.requests, args.max_tokens, args.max_num_seqs, args.vectors)
        return
    with tempfile.TemporaryDirectory(prefix="adapt-throughput-") as tmp:
        if args.embedded:  # here, once: no run's engine process embeds the burst
            import numpy as np

            from predictors.embedding import embed

            args.vectors = str(Path(tmp) / "vectors.npy")
            np.save(args.vectors, embed(burst_prompts(args.requests)))
        model = args.model
        if model is None:
            from serving_hooks.tiny_model import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny"))
        print(
            f"{args.requests} requests at once, {args.max_tokens} output tokens each, max_num_seqs"
            f" {args.max_num_seqs}, {args.repeats} round(s) over all configurations (median)"
            + (", prompts embedded before the burst (untimed)" if args.embedded else "")
        )
        from serving_hooks.policies import servable_policies

        configs = [DEFAULT, *(args.policies or servable_policies())]
        runs: dict[str, list[dict]] = {policy: [] for policy in configs}
        for repeat in range(args.repeats):  # round robin, so a drift in machine speed hits all alike
            for policy in round_order(configs, repeat):
                runs[policy].append(run(model, policy, args))
                print(
                    f"  run {repeat + 1}: {policy} {runs[policy][-1]['tokens_per_s']:.1f} tokens/s",
                    flush=True,
                )
        report = summarise(runs)
        width = max(20, 5 * args.repeats + 2)  # "0.95/" per round
        print(
            f"{'scheduler':<40}{'tokens/s':>10}{'vs default':>12}{'rounds':>{width}}{'most running':>14}"
            f"{'errors':>8}{'on prior':>10}{'predicted':>10}{'cut short':>11}{'preempted':>11}"
        )
        for policy, row in report.items():
            rounds = "/".join(f"{r:.2f}" for r in row["round_ratios"])
            print(
                f"{policy:<40}{row['tok_per_s']:>10.1f}{row['ratio_to_default']:>12.3f}{rounds:>{width}}"
                f"{row['most_running']:>14}{row['policy_errors']:>8}"
                + (f"{row['on_prior']:>10.2f}" if row["on_prior"] is not None else f"{'-':>10}")
                + (f"{row['predicted']:>10}" if row["predicted"] is not None else f"{'-':>10}")
                + f"{row['cut_short']:>11}"
                + (f"{row['preemptions']:>11}" if row["preemptions"] is not None else f"{'-':>11}")
                + (f"  {row['prediction_errors']} failed model batches" if row["prediction_errors"] else "")
                + ("" if row["finished"] == args.requests else f"  only {row['finished']} finished"),
                flush=True,
            )
        if args.json is not None:
            names = ("requests", "max_tokens", "max_num_seqs", "repeats", "embedded")
            settings = {k: getattr(args, k) for k in names}
            write_json(args.json, {"settings": settings, "policies": report})


def round_order(configs: list[str], repeat: int) -> list[str]:
    """Round `repeat`'s order: each round starts one configuration later than the last, so over
    len(configs) rounds each takes every place once -- a run's place in a round (after a run that
    left the machine busy, say) is not always the same configuration's."""
    shift = repeat % len(configs)
    return configs[shift:] + configs[:shift]


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration: the median tokens/s over rounds, and its ratio to the default's run of
    the same round for every round (median and all of them)."""
    base = runs[DEFAULT]
    report = {}
    for policy, results in runs.items():
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(results, base, strict=True)]
        middle = sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2]
        report[policy] = {
            "tok_per_s": middle["tokens_per_s"],
            "ratio_to_default": statistics.median(ratios),
            "round_ratios": ratios,
            "most_running": middle["most_running"],
            "policy_errors": max(r["policy_errors"] for r in results),
            "finished": min(r["finished"] for r in results),
            "on_prior": middle.get("on_prior"),
            "predicted": middle.get("predicted"),
            "prediction_errors": max(r.get("prediction_errors", 0) for r in results),
            # A policy that drops requests (jitserve's GMAX) serves fewer tokens in the same time:
            # its ratio then measures its decisions, not the engine's speed. (From the round with
            # the median tokens/s, like `tok_per_s`; the ratio's median may be another round's.)
            "cut_short": middle["cut_short"],
            "preemptions": middle.get("preemptions"),
        }
    return report


if __name__ == "__main__":
    main()
