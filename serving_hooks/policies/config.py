"""`policy-config`: which policy runs and with which parameters, as a versioned component.

Promoting a policy-config swaps the whole policy of a server that follows it
(`adapt serve --follow-policy-config`); rolling it back swaps the previous one back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

from adapt.component import ComponentError, LearnedComponent
from serving_hooks.policies import make_policy


class PolicyConfig(LearnedComponent):
    """Which policy runs and with which parameters, versioned like any model, so a whole policy
    can be promoted, rolled back and hot-swapped. Its state is just its parameters."""

    name = "policy-config"
    primary_metric = "ttlt_mean"

    def __init__(self, policy: str = "fcfs", params: dict[str, Any] | None = None) -> None:
        self.policy = policy
        self.params = params  # None: the policy's defaults

    def fit(self, data: Any = None) -> Self:
        """Nothing to learn: a tuner chooses the parameters (see `adapt tune`)."""
        return self

    def evaluate(self, data: Any = None) -> dict[str, float]:
        return {}

    def save_state(self, directory: Path) -> None:
        """Everything is in the header's params."""

    def load_state(self, directory: Path) -> None:
        """Everything is in the header's params."""

    def validate(self) -> None:
        """The policy must exist and accept the parameters (the canary constructs it)."""
        try:
            make_policy(self.policy, **(self.params or {}))
        except (TypeError, ValueError) as exc:
            raise ComponentError(f"policy-config: {self.policy!r} with {self.params}: {exc}") from exc

    def build(self):
        """A fresh policy instance for this configuration."""
        return make_policy(self.policy, **(self.params or {}))
