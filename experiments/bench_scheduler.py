"""Scheduler overhead per step inside vLLM (issue: vLLM serving): vLLM's own V1 scheduler versus
`PolicyScheduler` running each policy, in a GPU-free harness.

    .venv/bin/python -m experiments.bench_scheduler [--running 256] [--waiting 1000] [--steps 100]
                                                    [--policies fcfs,sarathi,...] [--json OUT]

The harness builds vLLM's real scheduler objects (`AsyncScheduler` and our subclass) with a KV
cache that exists only as block accounting, the way vLLM's own scheduler tests do, fills
`--running` requests into the batch (64-token prompts, outputs long enough to stay), queues
`--waiting` more behind them, and then times `schedule()` + `update_from_output()` over
`--steps` decode steps, feeding back one sampled token per request as a model runner would. No
model runs, so the figures are the scheduler's own cost per step: `vLLM schedule` is the time in
vLLM's `AsyncScheduler.schedule`, `policy+adapter` what `PolicyScheduler` adds around it (a policy
that caps the batch, like jitserve, makes vLLM's own part cheaper, so whole steps are not the
comparison). Needs a model directory only
for vLLM's config (a tiny one is generated in a temporary directory). A policy with a model
(sagesched's MiniLM, `jitserve:qrf=neural-length@vN`) runs it in its prediction worker as it
would live, on the decoded prompts, so the figure includes sharing the process with it.
`--json OUT` writes `{"settings": {...}, "schedulers": {NAME: {"step_ms", "vllm_ms",
"overhead_ms", "overhead_p99_ms", ...}}}` (NAME `vllm` for vLLM's own scheduler).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adapt.cli.usage import COUNT, NAME_LIST, OUTPUT, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT_TOKENS = 64
BLOCK_SIZE = 16
STOP_TOKEN = 3  # every harness request stops on it (`stop_token_ids`), as a model's EOS ends it


def make_scheduler(
    model_dir: Path,
    scheduler_cls: type,
    max_num_seqs: int,
    num_blocks: int,
    max_num_active_seqs: int | None = None,
    prefix_caching: bool = True,
    async_scheduling: bool = False,
    reserve_full_sequence: bool = True,
) -> Any:
    """vLLM's V1 scheduler (`scheduler_cls`) without a model: `num_blocks` KV blocks of 16 tokens,
    chunked prefill. `async_scheduling` is what a GPU engine runs; whoever steps such a scheduler
    must then keep two steps in flight, as vLLM's engine core does (the next step scheduled before
    the last one's output comes), or it schedules as a synchronous one would.
    `reserve_full_sequence` is vLLM's `scheduler_reserve_full_isl`: admit a request only if its
    whole prompt fits in the free KV blocks."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        scheduler_reserve_full_isl=reserve_full_sequence,
        is_encoder_decoder=False,
        # Only where asked: vLLMs before `max_num_active_seqs` refuse the keyword.
        **({} if max_num_active_seqs is None else {"max_num_active_seqs": max_num_active_seqs}),
    )
    model_config = ModelConfig(model=str(model_dir), dtype="float32", seed=0, max_model_len=2048)
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=prefix_caching
    )
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config
    )
    # vLLM's CPU platform turns async scheduling off while the config is built; the harness has no
    # model to run, so it can take a GPU engine's setting as asked.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


@functools.cache
def _block_hasher() -> Any:
    """vLLM's block hasher, its chain seeded once per process as an engine seeds it at start: the
    same tokens then hash alike in every request made here. (vLLMs before 0.32 draw a random
    seed each time the seed is set, unless PYTHONHASHSEED is; seeded per call, requests made
    in different calls would share nothing.)"""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK_SIZE, hash_fn)


def make_requests(
    count: int,
    start: int,
    seed: int,
    max_tokens: int = 1024,
    prompt_tokens: int = PROMPT_TOKENS,
    prefix: Sequence[int] = (),
    prompt_logprobs: int | None = None,
) -> list[Any]:
    """Random prompts (64 tokens by default) after a `prefix` they all share (a system prompt),
    hashed into blocks as vLLM's engine core does for prefix caching. Each ends at `max_tokens`,
    or earlier where its driver samples `STOP_TOKEN`; with `prompt_logprobs` it asks for its
    prompt's logprobs (and so reads nothing from the prefix cache)."""
    import random

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    hasher = _block_hasher()
    rng = random.Random(seed)
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[STOP_TOKEN], prompt_logprobs=prompt_logprobs
    )
    return [
        Request(
            request_id=f"r{start + i}",
            prompt_token_ids=[*prefix, *(rng.randrange(1, 500) for _ in range(prompt_tokens))],
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )
        for i in range(count)
    ]


def step(scheduler: Any) -> tuple[float, float]:
    """One synchronous engine step without a model: (schedule() seconds, update_from_output()
    seconds)."""
    from vllm.v1.outputs import ModelRunnerOutput

    started = time.perf_counter()
    output = scheduler.schedule()
    scheduled = time.perf_counter()
    ids = list(output.num_scheduled_tokens)
    sampled = []
    for request_id in ids:
        request = scheduler.requests[request_id]
        done_prefill = request.num_computed_tokens >= request.num_prompt_tokens
        sampled.append([7] if done_prefill else [])
    runner_output = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    scheduler.update_from_output(output, runner_output)
    return scheduled - started, time.perf_counter() - scheduled


def bench(model_dir: Path, policy: str | None, running: int, waiting: int, steps: int) -> dict[str, float]:
    """Per-step times (ms) with `policy` (None: plain vLLM). `policy+adapter` is the time
    `schedule()` spends outside vLLM's own `Scheduler.schedule` (timed by wrapping it for the
    run): mirroring state, the policy's `on_step`, and applying its plan."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if policy is None:  # vLLM's scheduler for a synchronous engine, as this harness steps it
        cls = Scheduler
    else:
        from serving_hooks.vllm_adapter import PolicyScheduler

        os.environ["ADAPT_POLICY"] = policy
        cls = PolicyScheduler
    blocks = (running + waiting) * (PROMPT_TOKENS + steps + 64) // BLOCK_SIZE + 64
    scheduler = make_scheduler(model_dir, cls, running, blocks)
    for request in make_requests(running, 0, 0):
        scheduler.add_request(request)
    for _ in range(20):  # prefill the running set
        step(scheduler)
        if len(scheduler.running) >= running and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running
        ):
            break
    for request in make_requests(waiting, running, 1):
        scheduler.add_request(request)
    inner: list[float] = []
    vllm_schedule = Scheduler.schedule  # AsyncScheduler and the adapter inherit it

    def timed_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return vllm_schedule(self, *args, **kwargs)
        finally:
            inner.append(time.perf_counter() - started)

    queues = getattr(scheduler, "prediction_queues", [])  # only a PolicyScheduler has any
    before = _delivered(scheduler)  # results before the timed steps (the running prompts went first)
    Scheduler.schedule = timed_schedule
    try:
        times = [step(scheduler) for _ in range(steps)]
        predicted = None if before is None else _delivered(scheduler) - before
    finally:
        Scheduler.schedule = vllm_schedule
        scheduler.shutdown()  # its prediction worker must not go on computing through the next run
    overhead = [(total - own) * 1000 for (total, _), own in zip(times, inner, strict=True)]
    return {
        "step_ms": statistics.median(a + b for a, b in times) * 1000,
        "vllm_ms": statistics.median(inner) * 1000,
        "overhead_ms": statistics.median(overhead),
        "overhead_p99_ms": sorted(overhead)[int(0.99 * (len(overhead) - 1))],
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "errors": getattr(scheduler, "policy_errors", 0),
        # results the policy's model delivered during the timed steps: a model that fails costs
        # nothing, and the overhead would then be the policy's without it
        "predicted": predicted,
        "prediction_errors": sum(getattr(q, "errors", 0) for q in queues),
    }


def _delivered(scheduler: Any) -> int | None:
    """Results the policy's model calls have handed over so far (None: it makes none)."""
    if not getattr(scheduler, "prediction_queues", None):
        return None
    summary = scheduler.prediction_summary()
    return summary["delivered"] + summary["supplied"]


def main(argv: list[str] | None = None) -> None:
    from serving_hooks.policies import servable_policies

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=COUNT, default=256)
    parser.add_argument("--waiting", type=COUNT, default=1000)
    parser.add_argument("--steps", type=COUNT, default=100)
    parser.add_argument("--policies", type=NAME_LIST, default=",".join(servable_policies()))
    parser.add_argument("--model", help="a model directory for vLLM's config (default: a tiny one)")
    parser.add_argument("--json", type=OUTPUT, metavar="OUT", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    logging.getLogger("adapt").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="adapt-bench-") as tmp:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from serving_hooks.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny")
        print(f"{args.running} running + {args.waiting} waiting, {args.steps} decode steps; ms per step")
        print(
            f"{'scheduler':<24}{'step':>8}{'vLLM schedule':>15}{'policy+adapter':>16}{'p99':>8}"
            f"{'running':>9}{'waiting':>9}"
        )
        report = {}
        for policy in [None, *args.policies]:
            r = bench(model_dir, policy, args.running, args.waiting, args.steps)
            report["vllm" if policy is None else policy] = r
            label = "vllm (AsyncScheduler)" if policy is None else f"adapt: {policy}"
            print(
                f"{label:<24}{r['step_ms']:>8.3f}{r['vllm_ms']:>15.3f}{r['overhead_ms']:>16.3f}"
                f"{r['overhead_p99_ms']:>8.3f}{r['running']:>9}{r['waiting']:>9}"
                + (f"  ({r['errors']} policy errors)" if r["errors"] else "")
                + ("" if r["predicted"] is None else f"  predicted {r['predicted']}")
                + (f"  ({r['prediction_errors']} failed model batches)" if r["prediction_errors"] else ""),
                flush=True,
            )
    if args.json is not None:
        settings = {"running": args.running, "waiting": args.waiting, "steps": args.steps}
        write_json(args.json, {"settings": settings, "schedulers": report})


if __name__ == "__main__":
    main()
