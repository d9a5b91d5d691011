"""Policy registry: the names users type (DESIGN.md section 7) mapped to policy classes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapt.mechanics import UnsupportedPolicy, check_policy
from adapt.policy import Policy
from adapt.registry import Registry, load_reference
from adapt.tracking import tracking_uri
from serving_hooks.policies.baselines import (
    EDF,
    FCFS,
    LTR,
    PLAS,
    SPF,
    FastServe,
    Sarathi,
    SJFOracle,
    Trail,
    VllmV0,
)
from serving_hooks.policies.ewsjf import EWSJF
from serving_hooks.policies.ewsjf_online import OnlineEWSJF
from serving_hooks.policies.jitserve import JITServe, JITServeOracle
from serving_hooks.policies.params import check_params
from serving_hooks.policies.sagesched import SageSched
from serving_hooks.policies.slai import SLAI, SLAIFixed

BASELINE_POLICIES: dict[str, Callable[..., Policy]] = {
    "fcfs": FCFS,
    "vllm-v0": VllmV0,
    "sarathi": Sarathi,
    "spf": SPF,
    "edf": EDF,
    "sjf-oracle": SJFOracle,
    "ltr": LTR,
    "trail": Trail,
    "fastserve": FastServe,
    "plas": PLAS,
}
LEARNED_POLICIES: dict[str, Callable[..., Policy]] = {
    "ewsjf": EWSJF,
    "ewsjf-online": OnlineEWSJF,
    "slai": SLAI,
    "slai-fixed": SLAIFixed,
    "sagesched": SageSched,
    "jitserve": JITServe,
    "jitserve-oracle": JITServeOracle,
}
POLICIES: dict[str, Callable[..., Policy]] = {**BASELINE_POLICIES, **LEARNED_POLICIES}
BASELINES: tuple[str, ...] = tuple(BASELINE_POLICIES)


def make_policy(name: str, **params: Any) -> Policy:
    """A fresh policy instance (policies keep per-replay state, so never share one).

    A learned component given by registry reference -- an alias such as `champion` or a version
    `vN`, as a user types it (`jitserve:qrf=v2`) -- is loaded here, so policies only ever receive
    component instances (or their parameters) and never look anything up themselves."""
    if name not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; expected one of {', '.join(POLICIES)}")
    policy_class = POLICIES[name]
    check_params(policy_class, params)
    for attribute, component in getattr(policy_class, "components", {}).items():
        if isinstance(params.get(attribute), str):
            params[attribute] = load_reference(component, params[attribute])
    return policy_class(**params)


def servable_policies() -> list[str]:
    """Policies whose default configuration vLLM does not refuse (`adapt.mechanics`): all but those
    that read true output lengths (the oracles, and ltr/trail whose default ranker is a noisy
    oracle) and vLLM V0's prefill-first emulation."""
    servable = []
    for name in POLICIES:
        try:
            check_policy(make_policy(name), "vllm")
        except UnsupportedPolicy:
            continue
        servable.append(name)
    return servable


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`name` or `name:key=value:key=value` (values parsed as JSON when they parse, else strings),
    e.g. `sarathi:order=spf` or `slai-fixed:offset=5`, so the CLI can name configured variants."""
    import json

    name, *assignments = spec.strip().split(":")
    params: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"policy {spec!r}: expected key=value after ':', got {assignment!r}")
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    if name not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; expected one of {', '.join(POLICIES)}")
    return name, params


def make_policy_from_spec(spec: str) -> Policy:
    name, params = parse_policy_spec(spec)
    try:
        return make_policy(name, **params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"policy {spec!r}: {exc}") from exc


@dataclass(frozen=True)
class PolicySpec:
    """A policy factory that pickles: the spec string a user types (`jitserve:qrf=v3:patterns=v2`),
    so a replay cell can cross to a worker process and build its policy there.

    Components pinned to a version (`vN`) are loaded once per process and store, then handed to
    every policy built from them: a version never changes, and policies copy what they update
    (SageSched its history window). Aliases are resolved afresh each time (they move)."""

    spec: str

    def __call__(self) -> Policy:
        name, params = parse_policy_spec(self.spec)
        for attribute, component in getattr(POLICIES[name], "components", {}).items():
            reference = params.get(attribute)
            if isinstance(reference, str) and reference[:1] == "v" and reference[1:].isdigit():
                params[attribute] = _pinned_component(tracking_uri(), component, int(reference[1:]))
        try:
            return make_policy(name, **params)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"policy {self.spec!r}: {exc}") from exc

    def __str__(self) -> str:
        return self.spec


@functools.lru_cache(maxsize=8)
def _pinned_component(store: str, component: str, version: int) -> Any:
    return Registry(store).load(component, version=version)
