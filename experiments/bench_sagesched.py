"""SageSched's per-request and per-step costs on this machine.

    .venv/bin/python -m experiments.bench_sagesched [--repeats N]

- embedding: all-MiniLM-L6-v2 on CPU, one prompt alone (median over instructions) and per prompt
  when all 678 AlpacaEval instructions are embedded in batches of 64;
- retrieval: one FAISS search plus building the neighbours' distribution, per request, with a
  full 10,000-entry window (paper: 0.15 ms; target here < 0.5 ms), alone and in batches of 64;
- Gittins refresh: re-indexing 1,000 running requests at once (what a step does when all of them
  cross a bucket boundary together -- the worst case), and the index alone without the Python loop.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from adapt.cli.usage import COUNT
from adapt.policy import RequestState
from adapt.requests import SLO
from adapt.traces import load_trace
from adapt.workloads import bundled
from predictors.embedding import embed
from predictors.semantic_history import SemanticHistory, embed_prompts
from serving_hooks.policies.sagesched import SageSched, gittins_index


def timed(fn, repeats: int) -> float:
    """Median wall time of `fn()` in seconds."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=COUNT, default=20)
    args = parser.parse_args(argv)
    trace = load_trace(bundled("alpaca_eval_lengths.jsonl.gz"))
    prompts = list(dict.fromkeys(trace.prompt_text))
    embed(prompts[:4])  # load the model outside the timings
    cycle = iter(range(10**9))
    single = timed(lambda: embed([prompts[next(cycle) % len(prompts)]]), args.repeats)
    batch = timed(lambda: embed(prompts), 1) / len(prompts)
    print(f"embedding, 1 prompt alone          {single * 1e3:8.2f} ms")
    print(f"embedding, per prompt in a batch 64 {batch * 1e3:8.2f} ms")

    rng = np.random.default_rng(0)
    history = SemanticHistory()
    vectors, has_text = embed_prompts(trace.prompt_text)
    rows = rng.integers(0, len(trace), size=history.window)  # fill the whole window
    history.observe(trace.prompt_tokens[rows], trace.output_tokens[rows], vectors[rows], has_text[rows])
    queries = vectors[rng.integers(0, len(trace), size=64)]
    one = timed(lambda: history.predict_embedded([20], queries[:1], [True]), args.repeats)
    many = timed(lambda: history.predict_embedded([20] * 64, queries, [True] * 64), args.repeats) / 64
    print(f"retrieval (window {history.size:,}), 1 request     {one * 1e3:8.3f} ms")
    print(f"retrieval (window {history.size:,}), per request/64 {many * 1e3:8.3f} ms")

    policy = SageSched(history=history)
    running = []
    for i in range(1000):
        state = RequestState(f"r{i}", 0.0, int(rng.integers(16, 2048)), 4096, SLO())
        state.tokens_generated = int(rng.integers(0, 800))
        state.cache["sage_distribution"] = history.predict_embedded([20], queries[i % 64][None], [True])[0]
        running.append(state)
    refresh = timed(lambda: policy._refresh(running), args.repeats)
    width = 32
    costs = np.sort(rng.uniform(1, 1e6, size=(1000, width)), axis=1)
    probs = rng.dirichlet(np.ones(width), size=1000)
    attained = rng.uniform(0, 5e5, size=1000)
    index_only = timed(lambda: gittins_index(costs, probs, attained), args.repeats)
    print(
        f"Gittins refresh of 1,000 running requests {refresh * 1e3:8.2f} ms"
        f" (index alone {index_only * 1e3:.2f} ms)"
    )


if __name__ == "__main__":
    main()
