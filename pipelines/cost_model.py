"""`adapt train cost-model --data STEPLOG`: calibrate the replay engine's step time on a real engine.

The step log (CSV, JSONL or parquet with the columns of `adapt.steplog.STEP_LOG_COLUMNS`)
is split by time -- the first 80% of steps train, the last 20% test -- so the held-out error is an
honest forecast; at least `FittedCostModel.least_data` (20) steps must train and `LEAST_TEST` (10)
be held out, so a log of fewer than 50 steps is refused. The candidate is logged and registered;
with `--promote-if-better` it becomes the champion only if its held-out MAPE beats the champion's
on the same steps by `margin`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from adapt.registry import Registry
from adapt.steplog import load_step_log
from pipelines.outcome import TrainOutcome, usable_champion
from pipelines.runner import PipelineSpec, Split, run_pipeline
from predictors.cost_model import FittedCostModel

LEAST_TEST = 10

if TYPE_CHECKING:  # pandas loads when a step log is read, not when the CLI builds its parser
    import pandas as pd


def train_cost_model(
    registry: Registry,
    data: str | Path | pd.DataFrame,
    *,
    kv_capacity: int | None = None,
    promote_if_better: bool = False,
    margin: float = 0.0,
    skip_unchanged: bool = False,
) -> TrainOutcome:
    """Fit on the first 80% of the steps, evaluate on the rest, register, gate on held-out MAPE.
    `kv_capacity` defaults to the champion's (the engine did not change size), else 50,000.
    With `skip_unchanged`, nothing is registered when the data equals the latest version's."""
    import pandas as pd

    frame = data if isinstance(data, pd.DataFrame) else load_step_log(data)
    champion, _ = usable_champion(registry, "cost-model")  # an unloadable one must not block its refit
    if kv_capacity is None:
        kv_capacity = champion.kv_capacity if champion is not None else 50_000
    source = "dataframe" if isinstance(data, pd.DataFrame) else str(data)

    def split(steps: pd.DataFrame) -> Split:
        cut = int(len(steps) * 0.8)
        window = {"source": source, "train_steps": cut, "test_steps": len(steps) - cut}
        return Split(steps.iloc[:cut], steps.iloc[cut:], window)

    spec = PipelineSpec(
        "cost-model", "mape", lower_is_better=True, build=FittedCostModel, split=split, least_test=LEAST_TEST
    )
    return run_pipeline(
        spec,
        registry,
        frame,
        promote_if_better=promote_if_better,
        margin=margin,
        skip_unchanged=skip_unchanged,
        kv_capacity=kv_capacity,
    )
