"""Policy registry: the names users type (DESIGN.md section 7) mapped to policy classes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapt.policy import Policy
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

POLICIES: dict[str, Callable[..., Policy]] = {
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

BASELINES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str, **params: Any) -> Policy:
    """A fresh policy instance (policies keep per-replay state, so never share one)."""
    if name not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; expected one of {', '.join(POLICIES)}")
    return POLICIES[name](**params)
