"""The component catalogue: every learned component the CLI can train, evaluate and retrain.

`adapt train NAME`, `adapt evaluate NAME`, `adapt retrain` and the quickstart read this table, so
adding a component is its predictor module, its pipeline function and one entry here (plus the
entry-point line in pyproject.toml that lets the registry load it by name). Each entry adapts the
CLI's options to its pipeline; the pipelines themselves share one runner and one gate
(`pipelines.runner`, `pipelines.outcome.Gate`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from adapt.registry import Registry
from adapt.replay.cost import DEFAULT_OVERLAP
from pipelines import cost_model, ewsjf, jitserve, neural_length, retrain, semantic_history, slai
from pipelines.outcome import TrainOutcome


@dataclass(frozen=True)
class TrainOptions:
    """What `adapt train` accepts (its flags under the same names); each entry reads the options
    that apply to its component (`CatalogueEntry.options`), and the CLI refuses the others."""

    data: str | None = None
    test_share: float = 0.3
    promote_if_better: bool = False
    margin: float = 0.0
    replay: bool = True
    rate: float | None = None
    num_requests: int | None = None
    trials: int = 20
    overlap: str = DEFAULT_OVERLAP
    jobs: int = 1


# Every entry reads these (the gate's); `CatalogueEntry.options` lists the others an entry reads.
SHARED_OPTIONS = frozenset({"promote_if_better", "margin"})
PROMPT_OPTIONS = frozenset({"data", "test_share", "replay"})
TUNING_OPTIONS = frozenset({"rate", "num_requests", "trials", "overlap", "jobs"})


@dataclass(frozen=True)
class CatalogueEntry:
    """One component: how to train it from CLI options, score a registered version on a data file
    (`evaluate`, optional), and refit it from a serving log directory (`retrain`, optional:
    components tuned on replay are retrained by `adapt tune`). `options`: the `TrainOptions` its
    `train` reads beyond `SHARED_OPTIONS`, so that `adapt train` refuses a flag it would ignore."""

    name: str
    summary: str
    data_help: str
    train: Callable[[Registry, TrainOptions], TrainOutcome]
    evaluate: Callable[..., dict[str, float]] | None = None
    retrain: retrain.Retrainer | None = None
    needs_data: bool = False
    options: frozenset[str] = frozenset()


def _train_cost_model(registry: Registry, o: TrainOptions) -> TrainOutcome:
    return cost_model.train_cost_model(
        registry, o.data, promote_if_better=o.promote_if_better, margin=o.margin
    )


def _train_slai_offset(registry: Registry, o: TrainOptions) -> TrainOutcome:
    return slai.train_slai_offset(
        registry,
        rate=slai.TUNE_RATE if o.rate is None else o.rate,
        num_requests=slai.TUNE_REQUESTS if o.num_requests is None else o.num_requests,
        trials=o.trials,
        overlap=o.overlap,
        promote_if_better=o.promote_if_better,
        margin=o.margin,
        jobs=o.jobs,
    )


def _train_ewsjf_meta(registry: Registry, o: TrainOptions) -> TrainOutcome:
    return ewsjf.train_ewsjf_meta(registry, promote_if_better=o.promote_if_better, margin=o.margin)


def _prompt_trainer(train: Callable[..., TrainOutcome]) -> Callable[[Registry, TrainOptions], TrainOutcome]:
    """Components trained on a prompt/response file with instructions held out."""

    def run(registry: Registry, o: TrainOptions) -> TrainOutcome:
        return train(
            registry,
            o.data,
            test_share=o.test_share,
            promote_if_better=o.promote_if_better,
            margin=o.margin,
            replay=o.replay,
        )

    return run


def _train_pattern_graph(registry: Registry, o: TrainOptions) -> TrainOutcome:
    return jitserve.train_pattern_graph(
        registry, o.data, promote_if_better=o.promote_if_better, margin=o.margin, replay=o.replay
    )


PROMPTS_HELP = "a prompt/response file (alpaca format; default: the bundled AlpacaEval slice)"

CATALOGUE: dict[str, CatalogueEntry] = {
    entry.name: entry
    for entry in (
        CatalogueEntry(
            "cost-model",
            "per-step batch time fitted to a real engine's step log",
            "a step log (CSV/JSONL/parquet, the columns of adapt.steplog)",
            _train_cost_model,
            retrain=retrain.retrain_cost_model,
            needs_data=True,
            options=frozenset({"data"}),
        ),
        CatalogueEntry(
            "slai-offset",
            "SLAI's KV-pressure-dependent decode offset, tuned by Optuna on replay of slai-tiers",
            "none (tuned on replay; --rate, --num-requests, --trials, --overlap)",
            _train_slai_offset,
            options=TUNING_OPTIONS,
        ),
        CatalogueEntry(
            "ewsjf-meta-policy",
            "EWSJF's queue layout (Refine-and-Prune) under the champion's scoring weights",
            "none (a fresh ewsjf-mixed history of prompt lengths)",
            _train_ewsjf_meta,
            retrain=retrain.retrain_ewsjf_layout,
        ),
        CatalogueEntry(
            "semantic-history",
            "SageSched's output-length distributions from similar past prompts (MiniLM + FAISS)",
            PROMPTS_HELP,
            _prompt_trainer(semantic_history.train_semantic_history),
            evaluate=semantic_history.evaluate_semantic_history,
            retrain=retrain.prompt_retrainer(
                "semantic-history", semantic_history.train_semantic_history, "wasserstein"
            ),
            options=PROMPT_OPTIONS,
        ),
        CatalogueEntry(
            "qrf-length",
            "JITServe's quantile-forest upper bound on the remaining output length",
            PROMPTS_HELP,
            _prompt_trainer(jitserve.train_qrf_length),
            evaluate=jitserve.evaluate_qrf_length,
            retrain=retrain.prompt_retrainer("qrf-length", jitserve.train_qrf_length, "pinball_loss"),
            options=PROMPT_OPTIONS,
        ),
        CatalogueEntry(
            "neural-length",
            "the learned-network alternative to qrf-length: a quantile MLP on prompt embeddings",
            PROMPTS_HELP,
            _prompt_trainer(neural_length.train_neural_length),
            evaluate=neural_length.evaluate_neural_length,
            retrain=retrain.prompt_retrainer(
                "neural-length", neural_length.train_neural_length, "pinball_loss"
            ),
            options=PROMPT_OPTIONS,
        ),
        CatalogueEntry(
            "pattern-graph",
            "JITServe's matcher of compound programs against past execution patterns",
            "a JSONL of program graphs (default: generated programs)",
            _train_pattern_graph,
            evaluate=jitserve.evaluate_pattern_graph,
            retrain=retrain.retrain_pattern_graph,
            options=frozenset({"data", "replay"}),
        ),
    )
}


def entry(name: str) -> CatalogueEntry:
    if name not in CATALOGUE:
        raise ValueError(f"unknown component {name!r}; expected one of {', '.join(CATALOGUE)}")
    return CATALOGUE[name]


def evaluable() -> list[str]:
    return [name for name, e in CATALOGUE.items() if e.evaluate is not None]


def retrainers() -> dict[str, retrain.Retrainer]:
    """What `adapt retrain` refits, in catalogue order."""
    return {name: e.retrain for name, e in CATALOGUE.items() if e.retrain is not None}
