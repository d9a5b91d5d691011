"""Bayesian optimisation of policy parameters with Optuna's ask/tell interface.

Ask/tell (rather than `study.optimize`) keeps the loop in our hands: `tune` drives offline
tuning (each trial a replay), `OnlineTuner` online tuning inside a running engine, where the
caller judges each trial on live traffic (`ewsjf-online`: paired windows, `adapt.paired`). Each
trial can be logged as an MLflow run so `mlflow ui` shows the reward curve next to the resulting
model versions.
Storage defaults to in-memory; pass an RDB URL (e.g. `sqlite:///mlruns/optuna.db` or PostgreSQL)
so several machines can work one study.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from adapt.parallel import run_cells

Objective = Callable[[dict[str, float]], tuple[float, dict[str, Any]]]
# Trials asked before any is told: what lets a batch run on several cores. Fixed, not the number
# of processes, so that a study's trials and result are the same on any machine.
TRIAL_BATCH = 4


@dataclass
class TuneResult:
    """The study's best (over every worker's trials, in a shared study), this worker's own trials,
    and whether this worker was the last one running (`finished_last`: no trial of the study is
    still open), which is the one worker that should act on the study's result."""

    params: dict[str, float]
    value: float
    history: list[tuple[dict[str, float], float, dict[str, Any]]] = field(default_factory=list)
    best_trial: int = 0
    best_metrics: dict[str, Any] = field(default_factory=dict)
    finished_last: bool = True


def tune(
    objective: Objective,
    space: dict[str, tuple[float, float]],
    *,
    n_trials: int,
    seed: int = 0,
    warm_start: Sequence[dict[str, float]] = (),
    name: str = "adapt",
    storage: str | None = None,
    sampler: str = "tpe",
    mlflow_experiment: str | None = None,
    progress: bool = True,
    jobs: int = 1,
) -> TuneResult:
    """Minimise `objective(params) -> (value, metrics)` over a box `space` in `n_trials` trials.

    `warm_start` points (e.g. the current champion, or a paper's defaults) are evaluated first.
    Trials are asked `TRIAL_BATCH` at a time and evaluated on up to `jobs` processes (the
    objective must then pickle: a module-level function or a dataclass with `__call__`), then told
    together; the batch does not depend on `jobs`, so neither does the result.
    """
    import optuna
    from optuna.trial import TrialState

    if n_trials < 1:
        raise ValueError(f"n_trials: must be >= 1, got {n_trials}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    chosen = (
        optuna.samplers.GPSampler(seed=seed)
        if sampler == "gp"
        else optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    )
    study = optuna.create_study(
        study_name=name, storage=storage, sampler=chosen, direction="minimize", load_if_exists=True
    )
    for point in warm_start:
        study.enqueue_trial({k: v for k, v in point.items() if k in space}, skip_if_exists=True)
    logger = _TrialLogger(mlflow_experiment, name) if mlflow_experiment else None
    history = []
    for first in range(0, n_trials, TRIAL_BATCH):
        trials = [study.ask() for _ in range(min(TRIAL_BATCH, n_trials - first))]
        points = [{key: t.suggest_float(key, *bounds) for key, bounds in space.items()} for t in trials]
        outcomes = run_cells(objective, points, jobs=jobs, progress=False)
        for index, (trial, params, (value, metrics)) in enumerate(
            zip(trials, points, outcomes, strict=True), start=first
        ):
            trial.set_user_attr("metrics", _plain(metrics))  # the best's metrics, whoever ran it
            study.tell(trial, value)
            history.append((params, value, metrics))
            if logger is not None:
                logger.log(index, params, value, metrics)
            if progress:
                shown = ", ".join(f"{k}={v:.3g}" for k, v in params.items())
                print(
                    f"  trial {index + 1}/{n_trials}: {value:.4g}  ({shown})  best {study.best_value:.4g}",
                    file=sys.stderr,
                )
    best = study.best_trial
    still_open = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    return TuneResult(
        dict(best.params),
        float(best.value),
        history,
        best_trial=best.number,
        best_metrics=dict(best.user_attrs.get("metrics", {})),
        finished_last=not still_open,
    )


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    """The JSON-safe numbers of a trial's metrics (what Optuna's storage can keep)."""
    return {
        k: float(v) if isinstance(v, float | int) and not isinstance(v, bool) else v
        for k, v in metrics.items()
        if v is None or isinstance(v, bool | int | float | str)
    }


class _TrialLogger:
    """One MLflow run per trial, in one experiment, tagged with the study name."""

    def __init__(self, experiment: str, study: str) -> None:
        from adapt import tracking

        self.client = tracking.client()
        self.experiment_id = tracking.ensure_experiment(self.client, experiment, tracking.tracking_uri())
        self.study = study

    def log(self, index: int, params: dict[str, float], value: float, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param

        run = self.client.create_run(
            self.experiment_id,
            run_name=f"{self.study}-trial-{index}",
            tags={"kind": "tuning-trial", "study": self.study},
        )
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float | bool)}
        numeric["objective"] = value
        try:
            self.client.log_batch(
                run.info.run_id,
                metrics=[Metric(k, v, 0, index) for k, v in numeric.items()],
                params=[Param(k, repr(v)) for k, v in params.items()],
            )
        finally:
            self.client.set_terminated(run.info.run_id)
        logging.getLogger("adapt.online").debug("logged trial %s", index)


class OnlineTuner:
    """Ask/tell proposals for online tuning inside a running engine, relative to an incumbent.

    The caller runs each candidate on live traffic however it likes and tells the tuner a score
    *relative to the incumbent* (e.g. the paired contrast of `adapt.paired`); the incumbent itself
    enters the study as a finished trial of score 0, so the sampler starts from what the server
    already trusts instead of spending live traffic to re-measure it. When the incumbent changes,
    `restart` opens a fresh study anchored on the new one: the old scores were relative to the old
    incumbent and would mislead the sampler. Optuna is consulted once per candidate, never per
    request. Each told trial can be logged as an MLflow run (off unless `mlflow_experiment`).
    """

    def __init__(
        self,
        space: dict[str, tuple[float, float]],
        incumbent: dict[str, float],
        *,
        seed: int = 0,
        name: str = "online",
        storage: str | None = None,
        mlflow_experiment: str | None = None,
    ) -> None:
        self.space, self.seed, self.name, self.storage = space, seed, name, storage
        self.logger = _TrialLogger(mlflow_experiment, name) if mlflow_experiment else None
        self.history: list[tuple[dict[str, float], float, dict[str, Any]]] = []
        self.restarts = -1  # studies opened so far, less one
        self.restart(incumbent)

    def restart(self, incumbent: dict[str, float]) -> None:
        """A fresh study whose one finished trial is `incumbent` (clipped into the box) at 0."""
        import optuna
        from optuna.distributions import FloatDistribution

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.restarts += 1
        self.study = optuna.create_study(
            study_name=f"{self.name}-{self.restarts}",
            storage=self.storage,
            sampler=optuna.samplers.TPESampler(seed=self.seed + self.restarts, n_startup_trials=3),
            direction="maximize",
        )
        anchor = {k: min(max(float(incumbent[k]), lo), hi) for k, (lo, hi) in self.space.items()}
        distributions = {k: FloatDistribution(lo, hi) for k, (lo, hi) in self.space.items()}
        self.study.add_trial(optuna.trial.create_trial(params=anchor, distributions=distributions, value=0.0))

    def ask(self) -> tuple[Any, dict[str, float]]:
        """A new trial and its parameters."""
        trial = self.study.ask()
        return trial, {key: trial.suggest_float(key, low, high) for key, (low, high) in self.space.items()}

    def tell(self, trial: Any, params: dict[str, float], value: float, metrics: dict[str, Any]) -> None:
        """The trial's score relative to the incumbent (higher is better)."""
        self.study.tell(trial, value)
        self.history.append((params, value, metrics))
        if self.logger is not None:
            self.logger.log(len(self.history) - 1, params, -value, {"reward": value, **metrics})
