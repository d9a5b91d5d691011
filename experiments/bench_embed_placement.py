"""Where a live server embeds prompts (issue 22): in the engine's background worker (the default),
or in the API server before the request reaches the engine (`adapt serve --embed-prompts`).

    .venv/bin/python -m experiments.bench_embed_placement [--rate 8] [--requests 200]
        [--max-tokens 64] [--repeats 2] [--placements engine-worker,api-server] [--model DIR]
        [--json OUT]

Each round starts `adapt serve --policy sagesched` once per placement (a fresh server, the
embedding disk cache off so that every prompt costs the model) and drives the same load at it
with `experiments.bench_serve`: the `sagesched-mix` workload's real AlpacaEval prompts at `--rate`
requests/s, Poisson arrivals, streamed. It reads from the server's status how many requests
were first scheduled on their prior (before their embedding came), and from the client the TTFT
and end-to-end latency. Embedding in the API server trades TTFT (each request waits for its
vector) for first decisions made on the prediction. Without `--model` a tiny random model is
generated (DESIGN.md section 6). `--json OUT` writes `{"placements": {NAME: {"share_on_prior",
"ttft_p50", "ttft_p99", "e2e_mean", "ttft_mean", "outside_engine_s", "hold_s", "failed",
"rounds": [...]}}}`, each figure the median of the rounds.

What a replay of the API-server placement charges (`adapt replay --intake-delay S`, S the
server's `prompt_embedder.mean_wait_s`) is checked here too: each server logs its requests
(`--log-dir`), `outside_engine_s` is the client's mean TTFT minus the engine's (first token less
the moment the engine got the request), and `hold_s` is the server's mean hold. If the hold is
what the API server adds, the API-server placement's `outside_engine_s` exceeds the engine
worker's by about `hold_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from adapt.cli.usage import COUNT, OUTPUT, RATE, SEED, choice_list, write_json

PLACEMENTS = ("engine-worker", "api-server")
# per placement, median of the rounds
FIGURES = ("share_on_prior", "ttft_p50", "ttft_p99", "e2e_mean", "ttft_mean", "outside_engine_s", "hold_s")


def engine_ttft_mean(log_dir: Path) -> float | None:
    """Mean TTFT of the finished requests in a server's request log, from the moment the engine got
    each one (`CompletedRequest.arrival_s`) to its first token."""
    ttfts = [
        record["first_token_s"] - record["arrival_s"]
        for path in sorted(log_dir.glob("requests-*.jsonl"))
        for record in map(json.loads, path.read_text().splitlines())
        if record.get("outcome") == "finished" and record.get("first_token_s") is not None
    ]
    return statistics.mean(ttfts) if ttfts else None


def one_run(
    model: str, placement: str, args: argparse.Namespace, workdir: Path, round_index: int
) -> dict[str, Any]:
    """Serve, load, read the status and the server's request log: one placement's figures for one
    round."""
    from adapt.workloads import get_workload
    from experiments.bench_serve import run_load, summarise
    from experiments.quickstart_serve import free_port, stop, wait_for_status
    from serving_hooks.server import server_command
    from serving_hooks.tiny_model import VLLM_CPU_ARGS

    requests = get_workload("sagesched-mix").build(args.rate, args.requests, args.seed)
    port = free_port()
    log_dir = workdir / f"logs-{placement}-{round_index}"
    argv, env = server_command(
        model,
        "sagesched",
        port=port,
        status_file=workdir / f"status-{placement}.json",
        embed_prompts=placement == "api-server",
        log_dir=log_dir,
        extra=VLLM_CPU_ARGS,
    )
    env["ADAPT_EMBEDDING_CACHE"] = "off"
    log_path = workdir / f"server-{placement}.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        if placement == "api-server":  # MiniLM loads in the API server at its first request
            wait_for_status(port, server, log_path, lambda s: s.get("prompt_embedder", {}).get("ready"))
        else:
            wait_for_status(port, server, log_path, lambda s: True)
        url = f"http://127.0.0.1:{port}"
        records = asyncio.run(run_load(url, model, requests, args.max_prompt_words, args.max_tokens))
        client = summarise(records)

        def counted(status: dict[str, Any]) -> bool:
            predictions = status.get("predictions") or {}
            return predictions.get("submitted", 0) + predictions.get("refused", 0) >= client["ok"]

        status = wait_for_status(port, server, log_path, counted, 60)
    finally:
        stop(server)  # its logs' buffers are written out as it stops
    predictions = status["predictions"]
    client_ttft = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    ttft_mean = statistics.mean(client_ttft) if client_ttft else None
    engine_ttft = engine_ttft_mean(log_dir)
    return {
        "share_on_prior": predictions["share_on_prior"],
        "supplied": predictions.get("supplied", 0),
        "mean_wait_s": predictions["mean_wait_s"],
        **{key: client[key] for key in ("ok", "failed", "ttft_p50", "ttft_p99", "e2e_mean")},
        "ttft_mean": ttft_mean,
        "engine_ttft_mean": engine_ttft,
        "outside_engine_s": None if ttft_mean is None or engine_ttft is None else ttft_mean - engine_ttft,
        "hold_s": (status.get("prompt_embedder") or {}).get("mean_wait_s"),
    }


def median_of(rounds: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rounds if r[key] is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=RATE, default=8.0, help="requests per second (Poisson)")
    parser.add_argument("--requests", type=COUNT, default=200)
    parser.add_argument("--max-tokens", type=COUNT, default=64)
    parser.add_argument("--max-prompt-words", type=COUNT, default=200)
    parser.add_argument("--repeats", type=COUNT, default=2, help="rounds, placements round-robin in each")
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument(
        "--placements",
        type=choice_list(PLACEMENTS),
        default=",".join(PLACEMENTS),
        help=f"any of {', '.join(PLACEMENTS)}",
    )
    parser.add_argument("--model", help="model directory (default: a tiny random model made here)")
    parser.add_argument("--json", dest="json_out", type=OUTPUT, metavar="OUT")
    args = parser.parse_args(argv)
    chosen = args.placements
    with tempfile.TemporaryDirectory(prefix="adapt-embed-placement-") as tmp:
        workdir = Path(tmp)
        # The servers follow a registry: an empty one of this run's, unless the caller names one.
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'mlflow.db'}")
        model = args.model
        if model is None:
            from serving_hooks.tiny_model import make_tiny_model

            model = str(make_tiny_model(workdir / "tiny"))
        rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in chosen}
        for round_index in range(args.repeats):
            for placement in chosen:
                result = one_run(model, placement, args, workdir, round_index)
                rounds[placement].append(result)
                print(f"round {round_index + 1}/{args.repeats} {placement}: {json.dumps(result)}", flush=True)
    placements = {
        name: {
            **{key: median_of(runs, key) for key in FIGURES},
            "failed": sum(r["failed"] for r in runs),
            "rounds": runs,
        }
        for name, runs in rounds.items()
    }
    print(f"\nsagesched, {args.requests} requests at {args.rate} req/s, median of {args.repeats} round(s):")
    print(
        f"{'placement':<15} {'on prior':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E mean':>9} {'TTFT mean':>9}"
        f" {'outside':>9} {'hold':>9} {'failed':>7}"
    )
    for name, figures in placements.items():
        cells = [figures[k] for k in FIGURES]
        shown = " ".join(f"{v:>9.3f}" if v is not None else f"{'-':>9}" for v in cells)
        print(f"{name:<15} {shown} {figures['failed']:>7}")
    if args.json_out is not None:
        payload = {"rate": args.rate, "requests": args.requests, "placements": placements}
        write_json(args.json_out, payload)


if __name__ == "__main__":
    main()
