"""The steps every training pipeline takes, in one place.

    split the data window (by time or by prompt: no leakage) -> fit -> evaluate on the held-out
    part -> score the champion on the same held-out part -> (replay: run the policy the component
    drives with the candidate, then with the champion) -> register -> gate -> promote

A component's pipeline is a `PipelineSpec`: how to split its data, how to build and fit it, how to
score it and which metric the gate compares, and optionally a replay metric. `run_pipeline` runs the
steps, prints each with its duration, and records the durations on the version's MLflow run
(`seconds_<step>`). A split whose training part is smaller than the component's `least_data`, or
whose held-out part is smaller than the spec's `least_test`, is refused before fitting: a gate
scored on a handful of rows promotes noise. Nothing is registered before every scoring step has
succeeded and the candidate has passed `pipelines.outcome.check_candidate`, and nothing is promoted
unless the primary metric beats the champion's by `margin` *and* the replay metric (when measured)
is not worse than the champion's by more than `replay_tolerance` -- so a step that fails, or a
candidate that scores well offline but schedules worse, leaves the champion untouched. A champion
that cannot be loaded is no champion (`pipelines.outcome.usable_champion`): the candidate is
compared with nothing, and the outcome's note says so.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from adapt.component import LearnedComponent
from adapt.registry import Registry
from pipelines.outcome import (
    Gate,
    TrainOutcome,
    beats,
    latest_version,
    register_and_gate,
    trained_on,
    unchanged,
    usable_champion,
)


@dataclass
class Split:
    """Training and held-out data, and the window description recorded on the version."""

    train: Any
    test: Any
    window: dict[str, Any]


@dataclass
class PipelineSpec:
    """What differs between components' pipelines (see module docstring).

    `fit(candidate, train, registry)` returns the MLflow run it logged into while training (or
    None); by default `candidate.fit(train)`. `evaluate_champion` returns None when the champion
    cannot be scored on this data (then the candidate is compared with nothing). `training_hash`
    lets an unchanged window be skipped before fitting. `replay(registry, component, held_out)`
    returns `replay_metric` for the policy the component drives (`held_out`: the split's test part,
    for a check that builds its workload from the data). `least_test`: the least held-out data,
    in the component's `data_unit`, whose scores the gate may trust.
    """

    component: str
    metric: str
    lower_is_better: bool
    build: Callable[..., LearnedComponent]
    split: Callable[[Any], Split]
    evaluate: Callable[[Any, Any], dict[str, float]] = field(default=lambda model, test: model.evaluate(test))
    evaluate_champion: Callable[[Any, Any], dict[str, float] | None] | None = None
    fit: Callable[[Any, Any, Registry], str | None] | None = None
    training_hash: Callable[[Any], str] | None = None
    replay: Callable[[Registry, Any, Any], float] | None = None
    replay_metric: str = ""
    replay_lower_is_better: bool = False
    least_test: int = 1


class _Steps:
    """Progress lines and durations of a pipeline's steps."""

    def __init__(self, component: str) -> None:
        self.component = component
        self.seconds: dict[str, float] = {}

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        print(f"[{self.component}] {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - started
        print(f"[{self.component}] {name} done in {self.seconds[name]:.1f} s", file=sys.stderr, flush=True)


def run_pipeline(
    spec: PipelineSpec,
    registry: Registry,
    data: Any,
    *,
    promote_if_better: bool = False,
    margin: float = 0.0,
    skip_unchanged: bool = False,
    replay: bool = False,
    replay_tolerance: float = 0.02,
    **params: Any,
) -> TrainOutcome:
    """Run `spec` on `data`; `params` go to `spec.build`. Returns what was registered (version
    None when `skip_unchanged` found the window already registered, unless that version's
    promotion was left undone: `pipelines.outcome.unchanged`)."""
    steps = _Steps(spec.component)
    with steps.step("split"):
        split = spec.split(data)
    latest = latest_version(registry, spec.component) if skip_unchanged else None
    if (
        latest is not None
        and spec.training_hash is not None
        and trained_on(latest, spec.training_hash(split.train))
    ):
        return unchanged(registry, latest)
    candidate = spec.build(**params)
    candidate.require_data(split.train, part="training part")
    candidate.require_data(split.test, least=spec.least_test, part="held-out part")
    run_id = None
    with steps.step("fit"):
        if spec.fit is not None:
            run_id = spec.fit(candidate, split.train, registry)
        else:
            candidate.fit(split.train)
    if latest is not None and trained_on(latest, candidate.metadata.get("data_hash")):
        return unchanged(registry, latest)
    candidate.metadata["data_window"] = split.window
    with steps.step("evaluate"):
        metrics = spec.evaluate(candidate, split.test)
    champion, unusable = usable_champion(registry, spec.component)
    champion_metrics = None
    if champion is not None:
        with steps.step("evaluate champion"):
            champion_metrics = (spec.evaluate_champion or spec.evaluate)(champion, split.test)
    replay_holds = True
    if replay and spec.replay is not None:
        with steps.step(f"replay ({spec.replay_metric})"):
            metrics[spec.replay_metric] = spec.replay(registry, candidate, split.test)
            if champion_metrics is not None:
                champion_metrics[spec.replay_metric] = spec.replay(registry, champion, split.test)
        if champion_metrics is not None:
            ours, theirs = metrics[spec.replay_metric], champion_metrics[spec.replay_metric]
            lower = spec.replay_lower_is_better
            replay_holds = not beats(theirs, ours, lower_is_better=lower, margin=replay_tolerance)
            if not replay_holds:
                print(
                    f"[{spec.component}] replay: {spec.replay_metric} {ours:.4g} is worse than the"
                    f" champion's {theirs:.4g}: not promoting",
                    file=sys.stderr,
                )
    metrics.update(
        {f"seconds_{name.split(' (')[0].replace(' ', '_')}": value for name, value in steps.seconds.items()}
    )
    outcome = register_and_gate(
        registry,
        candidate,
        metrics,
        champion_metrics,
        Gate(spec.metric, spec.lower_is_better, margin),
        promote_if_better=promote_if_better and replay_holds,
        run_id=run_id,
    )
    return replace(outcome, note=f"{unusable}: compared with nothing" if unusable else "")
