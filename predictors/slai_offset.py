"""`slai-offset`: SLAI's dynamic decode offset as a learned function of KV-cache usage.

SLAI marks a decode critical once `now >= last_token + TBT_slo - offset * mean_batch_time`. A small
offset defers decodes longer (more room for prefills, lower TTFT) but keeps their KV resident
longer; a large one protects TBT and frees memory sooner. The paper's rule is two levels: 5 below
96% KV usage, 10 above. This component generalises it to a step function over KV usage --
`thresholds` (ascending) and `levels` (one more than thresholds) -- whose values are tuned with
Optuna on replay (`fit`) to minimise median TTFT subject to every tier's P99 TBT meeting its SLO.
The rule given to `__init__` serves until then (a policy-config rebuilds a tuned offset that way,
from `rule()`); the tuned one is fitted state (`thresholds_`, `levels_`), saved as JSON.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from adapt.component import ComponentError, LearnedComponent

PAPER_THRESHOLDS: tuple[float, ...] = (0.96,)
PAPER_LEVELS: tuple[float, ...] = (5.0, 10.0)
RULE_FILE = "rule.json"


class SlaiOffset(LearnedComponent):
    """offset(kv_usage) = levels[i] for the first threshold above kv_usage (levels[-1] past all)."""

    name = "slai-offset"
    primary_metric = "ttft_p50"
    lower_is_better = True

    def __init__(
        self,
        thresholds: Sequence[float] = PAPER_THRESHOLDS,
        levels: Sequence[float] = PAPER_LEVELS,
    ) -> None:
        self.thresholds = thresholds
        self.levels = levels

    def _rule(self) -> tuple[Sequence[float], Sequence[float]]:
        """The tuned rule once fitted, else the one given: an offset serves unfitted too (the
        paper's rule by default, or a rule a policy-config recorded)."""
        if hasattr(self, "thresholds_"):
            return self.thresholds_, self.levels_
        return self.thresholds, self.levels

    def rule(self) -> dict[str, list[float]]:
        """The rule in effect as `__init__` arguments: what a policy-config records, so that the
        policy rebuilds this offset without its artifact."""
        thresholds, levels = self._rule()
        return {"thresholds": [float(t) for t in thresholds], "levels": [float(v) for v in levels]}

    def __call__(self, kv_usage: float) -> float:
        thresholds, levels = self._rule()
        return float(levels[bisect.bisect_right(thresholds, kv_usage)])

    def fit(
        self, data: Callable[[SlaiOffset], dict[str, Any]], n_trials: int = 20, seed: int = 0, jobs: int = 1
    ) -> Self:
        """Tune a two-level rule with Optuna. `data` evaluates a candidate offset (a replay of the
        target workload) and returns its metrics including `feasible` (all tiers' P99 TBT within
        SLO and the load kept up with), `tbt_excess` (how far from feasible) and `ttft_p50`; see
        `pipelines.slai.ReplayObjective`. `jobs` > 1 evaluates trials side by side (`data` must
        then pickle); the tuned rule is the same for any `jobs`."""
        from adapt.online import tune

        objective = _OffsetTrial(data)
        space = {"threshold": (0.5, 0.99), "low": (0.0, 15.0), "extra": (0.0, 20.0)}
        paper = {"threshold": 0.96, "low": 5.0, "extra": 5.0}
        best = tune(
            objective, space, n_trials=n_trials, seed=seed, warm_start=[paper], name="slai-offset", jobs=jobs
        )
        self.thresholds_ = [best.params["threshold"]]
        self.levels_ = [best.params["low"], best.params["low"] + best.params["extra"]]
        self._record_fit(tuning={"trials": n_trials, "best_value": best.value, "seed": seed})
        return self

    def evaluate(self, data: Callable[[SlaiOffset], dict[str, Any]]) -> dict[str, float]:
        metrics = data(self)
        return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float | bool)}

    def save_state(self, directory: Path) -> None:
        """The tuned rule, if any; the one given to `__init__` is in the header's params."""
        if hasattr(self, "thresholds_"):
            (directory / RULE_FILE).write_text(json.dumps(self.rule()))

    def load_state(self, directory: Path) -> None:
        """An artifact without `rule.json` serves its params' rule: it was never fitted, or it was
        written when the tuned rule was still stored as the params."""
        path = directory / RULE_FILE
        if path.is_file():
            rule = json.loads(path.read_text())
            self.thresholds_, self.levels_ = rule["thresholds"], rule["levels"]

    def validate(self) -> None:
        thresholds, levels = (list(values) for values in self._rule())
        if len(levels) != len(thresholds) + 1:
            raise ComponentError("slai-offset: need exactly one more level than thresholds")
        if thresholds != sorted(thresholds) or not all(0 <= t <= 1 for t in thresholds):
            raise ComponentError(f"slai-offset: thresholds must be ascending in [0, 1], got {thresholds}")
        if not all(0 <= v <= 100 for v in levels):
            raise ComponentError(f"slai-offset: levels must be in [0, 100] batch times, got {levels}")

    def describe(self) -> str:
        return json.dumps(self.rule())


@dataclass(frozen=True)
class _OffsetTrial:
    """One Optuna trial's objective: the candidate rule's median TTFT, plus a penalty that puts
    every infeasible rule behind every feasible one (and nearer-feasible ones first)."""

    data: Callable[[SlaiOffset], dict[str, Any]]

    def __call__(self, params: dict[str, float]) -> tuple[float, dict[str, Any]]:
        candidate = SlaiOffset([params["threshold"]], [params["low"], params["low"] + params["extra"]])
        metrics = self.data(candidate)
        penalty = 0.0 if metrics["feasible"] else 1e3 * (1 + metrics["tbt_excess"])
        return metrics["ttft_p50"] + penalty, metrics
