"""What every training pipeline returns, and the one champion/challenger gate they all pass.

Every way a version reaches the registry -- `run_pipeline`, the SLAI and EWSJF tuners, the online
EWSJF tuner, `adapt retrain` -- ends in `register_and_gate` with a `Gate`: the candidate must first
pass its own canaries (`validate`, what a hot-swap slot runs before serving it) and have finite,
plausible held-out metrics (`check_metrics`: a cost model's step times physical, a bound's coverage
near its quantile) -- else it is refused and nothing is registered, let alone promoted; then it is
registered, and promoted only if asked to and the gate says it beats the champion scored on the
same data.
"""

from __future__ import annotations

from dataclasses import dataclass

from adapt.component import ComponentError, LearnedComponent
from adapt.registry import Registry, RegistryError


@dataclass
class TrainOutcome:
    """`version` is None when nothing was registered because the training data had not moved."""

    version: int | None
    promoted: bool
    metrics: dict[str, float]
    champion_metrics: dict[str, float] | None
    policy_config_version: int | None = None


def beats(candidate: float, champion: float | None, *, lower_is_better: bool, margin: float = 0.0) -> bool:
    """Whether a candidate's score improves on the champion's by at least `margin` (relative).
    With no champion, anything beats it."""
    if champion is None:
        return True
    if lower_is_better:
        return candidate < champion * (1.0 - margin)
    return candidate > champion + margin * abs(champion)


@dataclass(frozen=True)
class Gate:
    """The champion/challenger rule: `metric` must beat the champion's by `margin` (relative).

    `feasible`, when set, names a metric that says whether a version meets its hard constraints
    (SLAI: every tier's TBT SLO and keeping up with the load): an infeasible candidate never wins,
    and a feasible one beats an infeasible champion whatever their `metric`."""

    metric: str
    lower_is_better: bool
    margin: float = 0.0
    feasible: str | None = None

    def __post_init__(self) -> None:
        if not self.margin >= 0.0:
            raise ValueError(f"margin: must be >= 0, got {self.margin}")

    def passes(self, candidate: dict[str, float], champion: dict[str, float] | None) -> bool:
        if self.feasible is not None:
            if not candidate.get(self.feasible):
                return False
            if champion is not None and not champion.get(self.feasible):
                return True
        return beats(
            candidate[self.metric],
            None if champion is None else champion[self.metric],
            lower_is_better=self.lower_is_better,
            margin=self.margin,
        )


def latest_data_hash(registry: Registry, name: str) -> str | None:
    """Training-data hash of the newest registered version (None if none): retraining on the same
    data must register nothing new."""
    try:
        versions = registry.versions(name)
    except RegistryError:  # nothing registered yet
        return None
    return versions[-1].tags.get("adapt.data_hash") if versions else None


def check_candidate(candidate: LearnedComponent, metrics: dict[str, float]) -> None:
    """Refuse (ComponentError, one line) a candidate that fails its canaries or whose held-out
    metrics are not finite and plausible: a model that could never serve is not registered."""
    try:
        candidate.validate()
        candidate.check_metrics(metrics)
    except Exception as exc:  # a canary that crashes is a refusal too, as when a slot loads it
        reason = str(exc) if isinstance(exc, ComponentError) else f"{type(exc).__name__}: {exc}"
        raise ComponentError(f"{reason}; candidate not registered") from exc


def register_and_gate(
    registry: Registry,
    candidate: LearnedComponent,
    metrics: dict[str, float],
    champion_metrics: dict[str, float] | None,
    gate: Gate,
    *,
    promote_if_better: bool,
    run_id: str | None = None,
    params: dict[str, object] | None = None,
) -> TrainOutcome:
    """Check the candidate (`check_candidate`), register it (in run `run_id` when training already
    opened one), then promote it when asked and `gate` passes against the champion's metrics
    (scored on the same data); the champion stays otherwise."""
    check_candidate(candidate, metrics)
    version = registry.log(candidate, metrics=metrics, run_id=run_id, params=params)
    promoted = promote_if_better and gate.passes(metrics, champion_metrics)
    if promoted:
        registry.promote(candidate.name, version)
    return TrainOutcome(version, promoted, metrics, champion_metrics)
