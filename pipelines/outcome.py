"""What every training pipeline returns, and the champion/challenger comparisons they share."""

from __future__ import annotations

from dataclasses import dataclass

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


def latest_data_hash(registry: Registry, name: str) -> str | None:
    """Training-data hash of the newest registered version (None if none): retraining on the same
    data must register nothing new."""
    try:
        versions = registry.versions(name)
    except RegistryError:  # nothing registered yet
        return None
    return versions[-1].tags.get("adapt.data_hash") if versions else None


def register_and_gate(
    registry: Registry,
    candidate,
    metrics: dict[str, float],
    champion_metrics: dict[str, float] | None,
    metric: str,
    *,
    lower_is_better: bool,
    promote_if_better: bool,
    margin: float = 0.0,
    run_id: str | None = None,
) -> TrainOutcome:
    """Register the candidate (in run `run_id` when training already opened one), then promote it
    when asked and its `metric` beats the champion's (scored on the same held-out data) by
    `margin`; the champion stays otherwise."""
    version = registry.log(candidate, metrics=metrics, run_id=run_id)
    promoted = promote_if_better and beats(
        metrics[metric],
        None if champion_metrics is None else champion_metrics[metric],
        lower_is_better=lower_is_better,
        margin=margin,
    )
    if promoted:
        registry.promote(candidate.name, version)
    return TrainOutcome(version, promoted, metrics, champion_metrics)
