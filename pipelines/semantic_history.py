"""`adapt train semantic-history` and `adapt evaluate semantic-history`.

Training splits a prompt/response file by instruction (`instruction_split`, 30% held out, so no
prompt is on both sides), seeds the window with the training rows, and scores the held-out
prompts' predicted distributions against the lengths recorded for them -- next to the two ablation
baselines on the same window (length-only neighbours, a point prediction), so every registered
version carries its own comparison. The gate is the held-out Wasserstein distance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adapt.registry import Registry
from adapt.traces import Trace, load_trace
from pipelines.outcome import TrainOutcome, latest_data_hash, register_and_gate
from predictors.semantic_history import MODES, SemanticHistory, split_by_instruction

BASELINE_MODES = tuple(m for m in MODES if m != "semantic")


def default_data() -> Path:
    from experiments.workloads import bundled

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
        baseline = history.clone()
        baseline.mode = mode
        scores = baseline.evaluate(test, exclude_same_prompt=exclude_same_prompt)
        metrics.update({f"{mode}_{k}": v for k, v in scores.items() if k != "prompts"})
    return metrics


def train_semantic_history(
    registry: Registry,
    data: str | Path | Trace | None = None,
    *,
    test_share: float = 0.3,
    promote_if_better: bool = False,
    margin: float = 0.0,
    skip_unchanged: bool = False,
    **params: Any,
) -> TrainOutcome:
    trace = load_prompt_responses(data)
    train, test = split_by_instruction(trace, test_share)
    candidate = SemanticHistory(**params).fit(train)
    if skip_unchanged and candidate.metadata["data_hash"] == latest_data_hash(registry, "semantic-history"):
        return TrainOutcome(None, False, {}, None)
    source = data if isinstance(data, str | Path) else (trace.name if data is not None else default_data())
    candidate.metadata["data_window"] = {
        "source": str(source),
        "train_rows": len(train),
        "test_rows": len(test),
        "test_share": test_share,
    }
    metrics = evaluate_with_baselines(candidate, test, exclude_same_prompt=False)
    champion = registry.champion("semantic-history")
    # The champion may have seen the test prompts (other data): leave each prompt's own rows out.
    champion_metrics = champion.evaluate(test, exclude_same_prompt=True) if champion is not None else None
    return register_and_gate(
        registry,
        candidate,
        metrics,
        champion_metrics,
        "wasserstein",
        lower_is_better=True,
        promote_if_better=promote_if_better,
        margin=margin,
    )


def evaluate_semantic_history(
    registry: Registry, data: str | Path | Trace, *, alias: str = "champion", version: int | None = None
) -> dict[str, float]:
    """Metrics of a registered version on any prompt/response file, leave-one-prompt-out: a
    prompt's own rows never count as its neighbours, whether or not the window holds them."""
    history = registry.load("semantic-history", alias=alias, version=version)
    return evaluate_with_baselines(history, load_prompt_responses(data), exclude_same_prompt=True)
