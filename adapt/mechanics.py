"""The engine contract: every mechanic a policy may rely on, named once, and what each engine does.

A policy decides (`adapt.policy.Plan`) and the engine carries the decision out with its own
mechanics. "Evaluate by replay, deploy the same policy live" holds only if every mechanic a policy
relies on means the same in the replay engine and in vLLM. This table is where that is stated: for
each engine, a mechanic is *honoured* (same meaning as in `MECHANICS`), *refused* (the engine will
not start the policy, with the reason), or *differs* (it runs, but not with the same meaning: a
known gap, named here and logged at start, so that nobody mistakes it for conformance). Today
every engine honours every mechanic it does not refuse; `adapt.conformance` checks that claim
step by step against vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from adapt.policy import Policy

Support = Literal["honoured", "refused", "differs"]


@dataclass(frozen=True)
class Mechanic:
    """One thing an engine does for a policy, and how to tell whether a policy relies on it."""

    name: str
    meaning: str
    relied_on: Callable[[Policy], bool]


def _always(policy: Policy) -> bool:
    return True


MECHANICS: dict[str, Mechanic] = {
    m.name: m
    for m in (
        Mechanic(
            "admission",
            "`Plan.admit`: waiting requests admitted in this order, stopping at the first that does"
            " not fit (running cap, token budget, or its whole known sequence in the free KV blocks);"
            " none in a step that preempted; unlisted requests wait. With prefix caching on, a"
            " request first takes the cached blocks its tokens match (another prompt's or answer's,"
            " or its own before a preemption) and computes only the rest; one that asked for prompt"
            " logprobs takes none",
            _always,
        ),
        Mechanic(
            "running_order",
            "`Plan.running_order`/`Plan.defer`: running requests get tokens in this order; under KV"
            " pressure the last one not yet scheduled is preempted by recompute (the victim rule)",
            _always,
        ),
        Mechanic(
            "preempt_and_drop",
            "`Plan.preempt` frees a running request's KV (recompute later; it sits out the step it"
            " was preempted in, and the policy hears of it after that step's admissions);"
            " `Plan.drop` ends a waiting request, reported to its client as aborted (a plan that"
            " drops a running one is refused: `PolicyError`)",
            _always,
        ),
        Mechanic(
            "async_output",
            "with async scheduling a step's tokens reach the policy after the next step is planned"
            " (`EngineConfig.async_scheduling`, vLLM's default); a request sits a step out only"
            " when its `max_tokens`-th token is in flight, so an answer a stop token ends gets one"
            " decode more",
            _always,
        ),
        Mechanic(
            "token_budget",
            "`Policy.token_budget` replaces the engine's per-step token budget (Sarathi-Serve's chunks)",
            lambda p: p.token_budget is not None,
        ),
        Mechanic(
            "prefill_first",
            "`Policy.prefill_first`: a step with admissible prefills runs only whole prefills (vLLM V0)",
            lambda p: p.prefill_first,
        ),
        Mechanic(
            "oracle",
            "`RequestState.oracle_output_tokens`: the true output length (oracle baselines)",
            lambda p: p.needs_oracle,
        ),
    )
}

# What each engine does with each mechanic (absent: honoured). Reasons say what an operator sees.
ENGINES: dict[str, dict[str, tuple[Support, str]]] = {
    "replay": {},
    "vllm": {
        "prefill_first": (
            "refused",
            "vLLM V1 always mixes prefills and decodes in one step; pick vLLM's default (fcfs) or"
            " sarathi instead of the V0 emulation",
        ),
        "oracle": (
            "refused",
            "it needs true output lengths, which only the replay simulator knows; give it a"
            " predictor or pick another policy",
        ),
    },
}


class UnsupportedPolicy(ValueError):
    """A policy relies on a mechanic the engine refuses: raised before the engine serves it."""


def support(engine: str, mechanic: str) -> tuple[Support, str]:
    return ENGINES[engine].get(mechanic, ("honoured", ""))


def relied_on(policy: Policy) -> list[str]:
    """The mechanics `policy` relies on: the universal ones (every plan uses them), then its own."""
    return [name for name, mechanic in MECHANICS.items() if mechanic.relied_on(policy)]


def check_policy(policy: Policy, engine: str, *, engine_token_budget: float = math.inf) -> list[str]:
    """Raise `UnsupportedPolicy` if `engine` refuses a mechanic `policy` relies on, or the policy's
    token budget exceeds what the engine was started with (a budget can only be lowered per step);
    return the mechanics that differ there, for the engine to log."""
    budget = policy.token_budget
    if budget is not None and budget > engine_token_budget:
        raise UnsupportedPolicy(
            f"policy {policy.name!r} needs a token budget of {budget} per step but the {engine} engine"
            f" was started with {int(engine_token_budget)}; start it with a budget >= {budget}"
            " (vLLM: --max-num-batched-tokens)"
        )
    differs = []
    for name in relied_on(policy):
        status, reason = support(engine, name)
        if status == "refused":
            raise UnsupportedPolicy(f"policy {policy.name!r} cannot run in {engine}: {reason}")
        if status == "differs":
            differs.append(f"{name}: {reason}")
    return differs
