"""Replay metrics for the pipelines' gate: the policy a component drives, replayed with the
candidate and with the champion on the same small workload (a fixed seed, so the two runs differ
only in the component).

Each check is called with the pipeline's held-out data too. A check whose workload is built from
prompts and their answers (a length bound's, a semantic history's) draws them from it, so the
candidate is judged on the traffic it was trained for, not on the bundled data's: after a model
change, a bound fitted on the new answers would otherwise be replayed on the old ones and refused
for it.

A few hundred requests keep a check to seconds on two CPU cores; it is a guard against a
candidate that scores well offline but schedules worse, not a study (see `experiments/`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from adapt.registry import Registry
from pipelines.outcome import usable_champion

REPLAY_SEED = 11
REPLAY_JOBS = 300


def _replay(workload: str, rate: float, policy: Any, requests: list[Any] | None = None) -> dict[str, Any]:
    """`policy` on `workload`'s engine, over `requests` (default: the workload's own)."""
    from adapt.replay.cost import roofline
    from adapt.replay.engine import ReplayEngine
    from adapt.workloads import WORKLOADS

    spec = WORKLOADS[workload]
    if requests is None:
        requests = spec.build(rate, REPLAY_JOBS, REPLAY_SEED)
    cost = roofline(spec.model, spec.gpu, tp=spec.tp)
    return ReplayEngine(policy, cost, spec.engine_config()).run(requests).metrics()


def jitserve_goodput(part: str) -> Callable[[Registry, Any, Any], float]:
    """Token goodput of `jitserve` on jitserve-mix at 3.0 jobs/s with the component as its `part`
    ("qrf": the length bound, from qrf-length or neural-length; "patterns": the pattern graph);
    the other part is the registry's champion, or none (also when it cannot be loaded: it must not
    block the retrain of the part that could work without it). For a bound, the mix's latency and
    deadline requests are the held-out prompts at their answers' lengths (`jitserve_mix(answers=)`);
    a pattern graph's held-out programs are not requests, so it is judged on the bundled mix."""
    other = {"qrf": ("patterns", "pattern-graph"), "patterns": ("qrf", "qrf-length")}[part]

    def replay(registry: Registry, component: Any, held_out: Any) -> float:
        from adapt.workloads import jitserve_mix
        from serving_hooks.policies import make_policy

        helper, unusable = usable_champion(registry, other[1])
        if unusable:
            print(f"[replay] {unusable}: replaying without it", file=sys.stderr, flush=True)
        parts = {part: component, other[0]: helper}
        requests = None
        if part == "qrf":
            requests = jitserve_mix(3.0, REPLAY_JOBS, REPLAY_SEED, answers=held_out)
        policy = make_policy("jitserve", **parts)
        return float(_replay("jitserve-mix", 3.0, policy, requests)["goodput_tokens"])

    return replay


def sagesched_ttlt(registry: Registry, history: Any, held_out: Any) -> float:
    """Mean time to last token of `sagesched` on sagesched-mix at 3.0 req/s with this history (the
    policy learns online on its own copy, so the component is not changed). The mix's text requests
    are the held-out prompts at their answers' lengths (`sagesched_mix(answers=)`); its chat and
    summarisation requests, which carry no text, stay the bundled datasets'."""
    from adapt.workloads import sagesched_mix
    from serving_hooks.policies import make_policy

    requests = sagesched_mix(3.0, REPLAY_JOBS, REPLAY_SEED, answers=held_out)
    policy = make_policy("sagesched", history=history)
    return float(_replay("sagesched-mix", 3.0, policy, requests)["ttlt_mean"])
