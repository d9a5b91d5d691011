"""`adapt train neural-length` and `adapt evaluate neural-length`.

Same data, split and gate as `qrf-length` (instructions split 70/30, the 0.95 bound's pinball
loss on the held-out instructions, its coverage within the band), so the two bound predictors are
directly comparable. The network's per-epoch pinball losses go to the version's own MLflow run
through Lightning's `MLFlowLogger`: the run is opened before training and the registered version is
logged into it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adapt.registry import Registry
from adapt.traces import Trace
from pipelines.outcome import TrainOutcome
from pipelines.replay_checks import jitserve_goodput
from pipelines.runner import PipelineSpec, run_pipeline
from pipelines.semantic_history import LEAST_TEST_PROMPTS, instruction_window, load_prompt_responses
from predictors.neural_length import NeuralLength, training_hash


def train_neural_length(
    registry: Registry,
    data: str | Path | Trace | None = None,
    *,
    test_share: float = 0.3,
    promote_if_better: bool = False,
    margin: float = 0.0,
    skip_unchanged: bool = False,
    replay: bool = False,
    **params: Any,
) -> TrainOutcome:
    """Gate: held-out pinball loss; replay metric: jitserve's token goodput with this bound."""
    trace = load_prompt_responses(data, "neural-length")

    def fit(candidate: NeuralLength, train: Trace, registry: Registry) -> str:
        from lightning.pytorch.loggers import MLFlowLogger

        run_id = registry.new_run("neural-length")
        candidate.fit(train, logger=MLFlowLogger(tracking_uri=registry.tracking_uri, run_id=run_id))
        return run_id

    spec = PipelineSpec(
        "neural-length",
        "pinball_loss",
        lower_is_better=True,
        build=NeuralLength,
        split=instruction_window(trace, data, test_share),
        fit=fit,
        training_hash=training_hash,  # checked before a minute of training
        replay=jitserve_goodput("qrf"),
        replay_metric="replay_goodput_tokens",
        least_test=LEAST_TEST_PROMPTS,
    )
    return run_pipeline(
        spec,
        registry,
        trace,
        promote_if_better=promote_if_better,
        margin=margin,
        skip_unchanged=skip_unchanged,
        replay=replay,
        **params,
    )


def evaluate_neural_length(
    registry: Registry, data: str | Path | Trace, *, alias: str = "champion", version: int | None = None
) -> dict[str, float]:
    """Coverage and over-estimation of a registered version on any prompt/response file."""
    model = registry.load("neural-length", alias=alias, version=version)
    return model.evaluate(load_prompt_responses(data, "neural-length"))
