"""What every training pipeline returns, and the one champion/challenger gate they all pass.

Every way a version reaches the registry -- `run_pipeline`, the SLAI and EWSJF tuners, the online
EWSJF tuner, `adapt retrain` -- ends in `register_and_gate` with a `Gate`: the candidate must first
pass its own canaries (`validate`, what a hot-swap slot runs before serving it) and have finite,
plausible held-out metrics (`check_metrics`: a cost model's step times physical, a bound's coverage
near its quantile) -- else it is refused and nothing is registered, let alone promoted; then it is
registered, and promoted only if asked to and the gate says it beats the champion scored on the
same data.

A promotion can fail after the registration (the aliases lock busy, the store unreachable, the job
killed), and a retrain skips data its latest version was trained on: the gate's decision is logged
with the version (`GATE_METRIC`) and a done promotion tagged on it (`PROMOTED_TAG`), so a pass on
the same data finishes one left undone (`unchanged`).
"""

from __future__ import annotations

from dataclasses import dataclass

from adapt.component import ComponentError, LearnedComponent
from adapt.registry import BrokenVersion, Registry, RegistryError, VersionInfo

GATE_METRIC = "gate_promote"  # logged with each version: 1.0 when its gate decided to promote it
PROMOTED_TAG = "adapt.promoted"  # set on a version once that promotion is done


@dataclass
class TrainOutcome:
    """`version` is None when nothing was registered because the training data had not moved.
    `note`: what a reader of the result should know beyond the metrics (a champion that could not
    be loaded, a promotion finished late)."""

    version: int | None
    promoted: bool
    metrics: dict[str, float]
    champion_metrics: dict[str, float] | None
    policy_config_version: int | None = None
    note: str = ""


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


def usable_champion(registry: Registry, name: str) -> tuple[LearnedComponent | None, str]:
    """The champion to compare a candidate with, and why there is none to use ("" when there is
    one, or none was ever promoted). A champion that cannot be loaded (`BrokenVersion`: no checksum
    or files; `ComponentError`: a schema this code no longer reads, a failing canary) is no
    champion: servers refuse it too, and held against every candidate it would fail each retrain
    that could replace it. A store that does not answer is not the champion's fault: that error is
    raised."""
    try:
        return registry.champion(name), ""
    except (ComponentError, BrokenVersion) as exc:
        return None, f"the {name} champion cannot be loaded ({type(exc).__name__}: {exc})"


def latest_version(registry: Registry, name: str) -> VersionInfo | None:
    """The newest registered version (None if none): retraining on its data registers nothing new."""
    try:
        versions = registry.versions(name)
    except RegistryError:  # nothing registered yet
        return None
    return versions[-1] if versions else None


def trained_on(version: VersionInfo, data_hash: str | None) -> bool:
    """Whether `version` was trained on the data with this hash."""
    return version.tags.get("adapt.data_hash") == data_hash


def unchanged(registry: Registry, latest: VersionInfo) -> TrainOutcome:
    """A pass on the data `latest` was trained on registers nothing. But if `latest`'s gate decided
    to promote it and the promotion was never done (`PROMOTED_TAG` missing), it is promoted now:
    skipped as unchanged, it would never be. Versions registered before the decision was logged
    carry no `GATE_METRIC` and are skipped, as they always were: whether their promotion was lost
    or was rolled back since cannot be told, and promoting a rolled-back version is worse."""
    if latest.metrics.get(GATE_METRIC) != 1.0 or PROMOTED_TAG in latest.tags:
        return TrainOutcome(None, False, {}, None)
    promote(registry, latest.name, latest.version)
    metrics = {key: value for key, value in latest.metrics.items() if key != GATE_METRIC}
    note = "promoted now: it passed its gate in an earlier pass whose promotion failed"
    return TrainOutcome(latest.version, True, metrics, None, note=note)


def promote(registry: Registry, name: str, version: int) -> None:
    """Promote `version` and record on it that the promotion is done (see `unchanged`)."""
    registry.promote(name, version)
    registry.tag_version(name, version, PROMOTED_TAG, "true")


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
    promoted = promote_if_better and gate.passes(metrics, champion_metrics)
    logged = {**metrics, GATE_METRIC: float(promoted)}  # with the version, so a lost promotion is redone
    version = registry.log(candidate, metrics=logged, run_id=run_id, params=params)
    if promoted:
        promote(registry, candidate.name, version)
    return TrainOutcome(version, promoted, metrics, champion_metrics)
