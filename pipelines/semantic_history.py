"""`adapt train semantic-history` and `adapt evaluate semantic-history`.

Training splits a prompt/response file by instruction (`instruction_split`, 30% held out, so no
prompt is on both sides), seeds the window with the training rows, and scores the held-out
prompts' predicted distributions against the lengths recorded for them -- next to the two ablation
baselines on the same window (length-only neighbours, a point prediction), so every registered
version carries its own comparison. The gate is the held-out Wasserstein distance.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapt.registry import Registry
from adapt.traces import Trace, load_trace, split_by_instruction
from pipelines.outcome import TrainOutcome
from pipelines.replay_checks import sagesched_ttlt
from pipelines.runner import PipelineSpec, Split, run_pipeline
from predictors.semantic_history import MODES, SemanticHistory

BASELINE_MODES = tuple(m for m in MODES if m != "semantic")
LEAST_TEST_PROMPTS = 5  # held-out instructions a prompt/response pipeline's gate needs


def default_data() -> Path:
    from adapt.workloads import bundled

    return bundled("alpaca_eval_lengths.jsonl.gz")


def load_prompt_responses(data: str | Path | Trace | None, component: str = "semantic-history") -> Trace:
    """A prompt/response trace (default: the bundled AlpacaEval slice) that has prompt texts."""
    trace = data if isinstance(data, Trace) else load_trace(data or default_data())
    if trace.prompt_text is None:
        raise ValueError(f"{trace.name}: {component} needs prompt texts (an alpaca-format file)")
    return trace


def evaluate_with_baselines(
    history: SemanticHistory, test: Trace, exclude_same_prompt: bool
) -> dict[str, float]:
    """The history's metrics, plus `<mode>_<metric>` for each baseline mode on the same window."""
    metrics = history.evaluate(test, exclude_same_prompt=exclude_same_prompt)
    for mode in BASELINE_MODES:
        baseline = history.copy()
        baseline.mode = mode
        scores = baseline.evaluate(test, exclude_same_prompt=exclude_same_prompt)
        metrics.update({f"{mode}_{k}": v for k, v in scores.items() if k != "prompts"})
    return metrics


def instruction_window(trace: Trace, data: Any, test_share: float) -> Callable[[Trace], Split]:
    """The split every prompt/response pipeline uses: by instruction, `test_share` held out."""

    def split(window: Trace) -> Split:
        train, test = split_by_instruction(window, test_share)
        source = (
            data if isinstance(data, str | Path) else (trace.name if data is not None else default_data())
        )
        return Split(
            train,
            test,
            {
                "source": str(source),
                "train_rows": len(train),
                "test_rows": len(test),
                "test_share": test_share,
            },
        )

    return split


def train_semantic_history(
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
    """Gate: held-out Wasserstein distance; replay metric: sagesched's mean TTLT on sagesched-mix
    whose text requests are the held-out prompts. The champion may have seen the test prompts
    (other data), so each prompt's own rows are left out of its neighbours when it is scored."""
    trace = load_prompt_responses(data)
    spec = PipelineSpec(
        "semantic-history",
        "wasserstein",
        lower_is_better=True,
        build=SemanticHistory,
        split=instruction_window(trace, data, test_share),
        evaluate=lambda model, test: evaluate_with_baselines(model, test, exclude_same_prompt=False),
        evaluate_champion=lambda model, test: model.evaluate(test, exclude_same_prompt=True),
        replay=sagesched_ttlt,
        replay_metric="replay_ttlt_mean",
        replay_lower_is_better=True,
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


def evaluate_semantic_history(
    registry: Registry, data: str | Path | Trace, *, alias: str = "champion", version: int | None = None
) -> dict[str, float]:
    """Metrics of a registered version on any prompt/response file, leave-one-prompt-out: a
    prompt's own rows never count as its neighbours, whether or not the window holds them."""
    history = registry.load("semantic-history", alias=alias, version=version)
    return evaluate_with_baselines(history, load_prompt_responses(data), exclude_same_prompt=True)
