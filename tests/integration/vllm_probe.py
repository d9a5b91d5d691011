"""Run a real vLLM engine (tiny model) under an adapt policy; print the order requests finished in.

    .venv/bin/python tests/integration/vllm_probe.py MODEL_DIR POLICY_SPEC [MAX_NUM_SEQS]

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so a test-only policy
registered below is visible to the scheduler. Output: one JSON line {"order": [...], "errors": N},
plus what a sagesched history learned.
"""

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


from adapt.policy import Policy
from serving_hooks.policies.baselines import FCFS


class ExplodingPolicy(Policy):
    """Raises on every step: the adapter must fall back to FCFS and keep serving."""

    name = "explode"

    def on_step(self, view):
        raise RuntimeError("policy bug")


class FailingArrivalPolicy(FCFS):
    """Raises for every arrival, so its queue stays empty: the adapter must still serve them."""

    name = "explode-arrival"

    def on_arrival(self, request, now):
        raise RuntimeError("arrival bug")


def main(model: str, spec: str, max_num_seqs: int = 1) -> None:
    from serving_hooks import policies

    policies.POLICIES["explode"] = ExplodingPolicy
    policies.POLICIES["explode-arrival"] = FailingArrivalPolicy
    os.environ["ADAPT_POLICY"] = spec
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        dtype="float32",
        gpu_memory_utilization=0.3,
        scheduler_cls="serving_hooks.vllm_adapter.PolicyScheduler",
        async_scheduling=True,
    )
    engine = llm.llm_engine
    short = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("blocker", "the request", SamplingParams(max_tokens=64, ignore_eos=True))
    engine.add_request("long", "the request queue " * 60, short)
    engine.add_request("short", "the request", short)
    order, deadline, most_running = [], time.time() + 120, 0
    scheduler = engine.engine_core.engine_core.scheduler
    while engine.has_unfinished_requests() and time.time() < deadline:
        order.extend(out.request_id for out in engine.step() if out.finished)
        most_running = max(most_running, len(scheduler.running))
        # Every prediction (sagesched's embeddings) lands before the next step: what a policy
        # learns here must not hinge on how fast this machine embeds beside the engine.
        for queue in scheduler.prediction_queues:
            assert queue.drain(timeout_s=120), "a prediction did not come back within 120 s"
    report = {"order": order, "errors": scheduler.policy_errors, "most_running": most_running}
    if hasattr(scheduler.adapt_policy, "frames"):  # jitserve: GMAX frames planned inside the engine
        report["frames"] = scheduler.adapt_policy.frames
    history = getattr(scheduler.adapt_policy, "history", None)
    if history is not None:  # sagesched: what it learned online from the prompts it was given
        report["history_size"] = history.size
        report["history_texts"] = int(history.index_.ntotal)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
