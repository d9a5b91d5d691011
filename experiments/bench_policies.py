"""Per-step policy overhead: one `on_step` (and consuming the admission order the way an engine
does) with 256 running and 1,000 waiting requests, for every policy.

    .venv/bin/python -m experiments.bench_policies [--steps N] [--policies a,b] [--json OUT]

This is the cost a policy adds to each scheduling step in either engine (the replay engine or
vLLM's scheduler through `serving_hooks.vllm_adapter`); vLLM's own scheduling work is not included.
`--json OUT` writes `{"settings": {...}, "policies": {NAME: {"on_step_us"}}}`.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np

from adapt.cli.usage import COUNT, OUTPUT, choice_list, write_json
from adapt.policy import EngineView, RequestState
from adapt.requests import SLO
from serving_hooks.policies import POLICIES, make_policy


def population(seed: int = 0) -> tuple[list[RequestState], list[RequestState]]:
    rng = np.random.default_rng(seed)
    slos = [SLO(kind="latency", tbt_s=0.1, tier="paying"), SLO(kind="latency", tbt_s=0.5, tier="free"), SLO()]
    states = []
    for i in range(1256):
        state = RequestState(f"r{i}", float(i) * 0.01, int(rng.integers(16, 4096)), 2048, slos[i % 3])
        state.oracle_output_tokens = int(rng.integers(16, 1024))
        states.append(state)
    return states[:1000], states[1000:]


def bench(name: str, steps: int) -> float:
    policy = make_policy(name)
    waiting, running = population()
    now = 20.0
    for state in [*waiting, *running]:
        policy.on_arrival(state, state.arrival_s)
    for state in running:
        policy.on_admit(state, now)
        state.phase = "decode"
        state.tokens_computed = state.prompt_tokens + 10
        state.tokens_generated = 10
        state.last_token_s = now - 0.05
    times = []
    for step in range(steps):
        view = EngineView(now + step * 0.03, waiting, running, 0.7, 2048, 256, 0.03, step)
        start = time.perf_counter()
        plan = policy.on_step(view)
        if plan.admit is not None:
            list(itertools.islice(plan.admit, 64))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=COUNT, default=200)
    parser.add_argument(
        "--policies",
        type=choice_list(POLICIES),
        default=",".join(POLICIES),
        help="comma-separated (default: every policy)",
    )
    parser.add_argument("--json", type=OUTPUT, metavar="OUT", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    names = args.policies
    print(f"{'policy':<12} median on_step (us), 256 running / 1,000 waiting")
    figures = {}
    for name in names:
        figures[name] = {"on_step_us": bench(name, args.steps) * 1e6}
        print(f"{name:<12} {figures[name]['on_step_us']:10.1f}")
    if args.json is not None:
        settings = {"steps": args.steps, "running": 256, "waiting": 1000}
        write_json(args.json, {"settings": settings, "policies": figures})


if __name__ == "__main__":
    main()
