"""Training pipelines for JITServe's two learned parts: `qrf-length` and `pattern-graph`.

`adapt train qrf-length`: split a prompt/response file by instruction (30% held out), fit the
forest (with its split-conformal calibration), score coverage and over-estimation on the held-out
instructions, register, and promote when `pinball_loss` (the quantile loss, which rewards a bound
that is tight as well as calibrated) beats the champion's on the same rows.
The bundled AlpacaEval slice has response lengths but not texts, so on it the bound is refined on
the generated-token count alone (`generated_features=0`), which is also all the replay can offer.

`adapt train pattern-graph`: fit on compound programs -- a JSONL file of graphs (`--data`), or
2,000 generated programs (`adapt.workloads.compound`) with 300 others, from another seed, as
the held-out set -- and gate on the mean stage-share error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adapt.programs import ProgramGraph, read_graphs
from adapt.registry import Registry
from adapt.traces import Trace
from pipelines.outcome import TrainOutcome
from pipelines.replay_checks import jitserve_goodput
from pipelines.runner import PipelineSpec, Split, run_pipeline
from pipelines.semantic_history import LEAST_TEST_PROMPTS, instruction_window, load_prompt_responses
from predictors.pattern_graph import PatternGraph
from predictors.qrf_length import QrfLength

GENERATED_TRAIN = (2000, 1000)  # (programs, seed)
GENERATED_TEST = (300, 2000)


def _has_response_text(trace: Trace) -> bool:
    return bool(getattr(trace, "columns", None)) and trace.columns.get("output_text") is not None


def qrf_length_spec(trace: Trace, data: Any = None, test_share: float = 0.3) -> PipelineSpec:
    """How `qrf-length` is split, scored, gated and replay-checked on `trace`: by instruction, on
    the held-out pinball loss, with jitserve's goodput on the held-out traffic. `data` is only
    where `trace` came from (a path, the trace itself, or None for the bundled data), recorded on
    the version as its source."""

    def evaluate_champion(champion: QrfLength, test: Trace) -> dict[str, float] | None:
        # A champion that reads generated text cannot be scored on lengths-only data.
        return (
            champion.evaluate(test) if champion.generated_features == 0 or _has_response_text(test) else None
        )

    return PipelineSpec(
        "qrf-length",
        "pinball_loss",
        lower_is_better=True,
        build=QrfLength,
        split=instruction_window(trace, data, test_share),
        evaluate_champion=evaluate_champion,
        replay=jitserve_goodput("qrf"),
        replay_metric="replay_goodput_tokens",
        least_test=LEAST_TEST_PROMPTS,
    )


def train_qrf_length(
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
    trace = load_prompt_responses(data, "qrf-length")
    # Count-only: JITServe refines a bound from the prompt and the number of tokens generated; it
    # has no generated text to give a forest that learned from it (`_check_bound_source`).
    params.setdefault("generated_features", 0)
    return run_pipeline(
        qrf_length_spec(trace, data, test_share),
        registry,
        trace,
        promote_if_better=promote_if_better,
        margin=margin,
        skip_unchanged=skip_unchanged,
        replay=replay,
        **params,
    )


def evaluate_qrf_length(
    registry: Registry, data: str | Path | Trace, *, alias: str = "champion", version: int | None = None
) -> dict[str, float]:
    """Coverage and over-estimation of a registered version on any prompt/response file."""
    model = registry.load("qrf-length", alias=alias, version=version)
    return model.evaluate(load_prompt_responses(data, "qrf-length"))


def _graphs(data: str | Path | None) -> tuple[list[ProgramGraph], list[ProgramGraph], str]:
    """(train, test, source): a graph file split 80/20 in file order, or generated programs."""
    if data is not None:
        graphs = read_graphs(data)
        if len(graphs) < 10:
            raise ValueError(f"{data}: need at least 10 programs, found {len(graphs)}")
        cut = int(len(graphs) * 0.8)
        return graphs[:cut], graphs[cut:], str(data)
    from adapt.workloads.compound import generate_graphs

    train, test = generate_graphs(*GENERATED_TRAIN), generate_graphs(*GENERATED_TEST)
    return train, test, "generated: chatbot-compound, deep-research, agentic-codegen"


def train_pattern_graph(
    registry: Registry,
    data: str | Path | None = None,
    *,
    promote_if_better: bool = False,
    margin: float = 0.0,
    skip_unchanged: bool = False,
    replay: bool = False,
    **params: Any,
) -> TrainOutcome:
    """Gate: held-out stage-share error; replay metric: jitserve's token goodput with this graph."""

    def split(source: str | Path | None) -> Split:
        train, test, description = _graphs(source)
        window = {"source": description, "train_programs": len(train), "test_programs": len(test)}
        return Split(train, test, window)

    spec = PipelineSpec(
        "pattern-graph",
        "share_error",
        lower_is_better=True,
        build=PatternGraph,
        split=split,
        replay=jitserve_goodput("patterns"),
        replay_metric="replay_goodput_tokens",
    )
    return run_pipeline(
        spec,
        registry,
        data,
        promote_if_better=promote_if_better,
        margin=margin,
        skip_unchanged=skip_unchanged,
        replay=replay,
        **params,
    )


def evaluate_pattern_graph(
    registry: Registry, data: str | Path, *, alias: str = "champion", version: int | None = None
) -> dict[str, float]:
    return registry.load("pattern-graph", alias=alias, version=version).evaluate(read_graphs(data))
