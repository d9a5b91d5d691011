"""`adapt train neural-length` and `adapt evaluate neural-length`.

Same data, split and gate as `qrf-length` (instructions split 70/30, coverage error of the 0.95
bound on the held-out instructions), so the two bound predictors are directly comparable. The
network's per-epoch pinball losses go to the version's own MLflow run through Lightning's
`MLFlowLogger`: the run is opened before training and the registered version is logged into it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from adapt.registry import Registry
from adapt.traces import Trace
from pipelines.outcome import TrainOutcome, latest_data_hash, register_and_gate
from pipelines.semantic_history import load_prompt_responses
from predictors.neural_length import NeuralLength, training_hash
from predictors.semantic_history import split_by_instruction


def train_neural_length(
    registry: Registry,
    data: str | Path | Trace | None = None,
    *,
    test_share: float = 0.3,
    promote_if_better: bool = False,
    margin: float = 0.0,
    skip_unchanged: bool = False,
    **params: Any,
) -> TrainOutcome:
    from lightning.pytorch.loggers import MLFlowLogger

    trace = load_prompt_responses(data, "neural-length")
    train, test = split_by_instruction(trace, test_share)
    candidate = NeuralLength(**params)
    if skip_unchanged and training_hash(train) == latest_data_hash(registry, "neural-length"):
        return TrainOutcome(None, False, {}, None)  # checked before spending a minute on training
    print(
        f"neural-length: training on {len(train):,} responses, scoring on {len(test):,} held out",
        file=sys.stderr,
    )
    run_id = registry.new_run("neural-length")
    candidate.fit(train, logger=MLFlowLogger(tracking_uri=registry.tracking_uri, run_id=run_id))
    candidate.metadata["data_window"] = {
        "source": str(data if isinstance(data, str | Path) else trace.name),
        "train_rows": len(train),
        "test_rows": len(test),
        "test_share": test_share,
    }
    metrics = candidate.evaluate(test)
    champion = registry.champion("neural-length")
    return register_and_gate(
        registry,
        candidate,
        metrics,
        champion.evaluate(test) if champion is not None else None,
        "coverage_error",
        lower_is_better=True,
        promote_if_better=promote_if_better,
        margin=margin,
        run_id=run_id,
    )


def evaluate_neural_length(
    registry: Registry, data: str | Path | Trace, *, alias: str = "champion", version: int | None = None
) -> dict[str, float]:
    """Coverage and over-estimation of a registered version on any prompt/response file."""
    model = registry.load("neural-length", alias=alias, version=version)
    return model.evaluate(load_prompt_responses(data, "neural-length"))
