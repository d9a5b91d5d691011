"""`adapt train cost-model --data STEPLOG`: calibrate the replay engine's step time on a real engine.

The step log (CSV, JSONL or parquet with the columns of `adapt.steplog.STEP_LOG_COLUMNS`)
is split by time -- the first 80% of steps train, the last 20% test -- so the held-out error is an
honest forecast. The candidate is logged and registered; with `--promote-if-better` it becomes the
champion only if its held-out MAPE beats the champion's on the same steps by `margin`.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from adapt.registry import Registry
from adapt.steplog import STEP_LOG_COLUMNS
from adapt.traces import TraceError
from pipelines.slai import TrainOutcome
from predictors.cost_model import FittedCostModel


def load_step_log(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    if not path.is_file():
        raise TraceError(path, "no such file")
    suffixes = "".join(path.suffixes)
    if ".parquet" in suffixes:
        frame = pd.read_parquet(path)
    elif ".jsonl" in suffixes:
        frame = pd.read_json(path, lines=True)
    else:
        frame = pd.read_csv(path)
    required = {"tokens", "duration_s"}
    missing = required - set(frame.columns)
    if missing:
        raise TraceError(path, f"missing column(s) {', '.join(sorted(missing))}", line=1)
    for column in frame.columns:
        if column in STEP_LOG_COLUMNS and (frame[column] < 0).any():
            raise TraceError(path, "negative values", field=column)
    if "start_s" in frame.columns:
        frame = frame.sort_values("start_s", kind="stable")
    return frame.reset_index(drop=True)


def train_cost_model(
    registry: Registry,
    data: str | Path,
    *,
    kv_capacity: int = 50_000,
    promote_if_better: bool = False,
    margin: float = 0.0,
) -> TrainOutcome:
    frame = load_step_log(data)
    cut = int(len(frame) * 0.8)
    train, test = frame.iloc[:cut], frame.iloc[cut:]
    candidate = FittedCostModel(kv_capacity=kv_capacity).fit(train)
    candidate.metadata["data_window"] = {"file": str(data), "train_steps": cut, "test_steps": len(test)}
    metrics = candidate.evaluate(test)
    version = registry.log(candidate, metrics=metrics)
    champion_version = registry.resolve("cost-model", missing_ok=True)
    champion_metrics = None
    if champion_version is not None:
        champion_metrics = registry.load("cost-model", version=champion_version).evaluate(test)
    promoted = False
    if promote_if_better and (
        champion_metrics is None or metrics["mape"] < champion_metrics["mape"] * (1 - margin)
    ):
        registry.promote("cost-model", version)
        promoted = True
    return TrainOutcome(version, promoted, metrics, champion_metrics)
