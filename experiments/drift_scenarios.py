"""The drift study's scenarios: for each drift workload, the learned part it stales, and how the
study fits that part, serves it, retrains it with hindsight and corrupts it.

`experiments.drift_study` runs the same three arms for every scenario (stale, loop, oracle); what
differs per learned part is here, as the answers to five questions:

- `champion(registry, seed)`: register and promote what served before the shift, fitted by the
  component's real pipeline on pre-shift traffic (a layout: prompt lengths drawn with another
  seed; a bound: the first model's answers to AlpacaEval's training instructions, which are also
  most of the prompts served, as a model's regular prompts would be);
- `policy(registry)`: the serving policy over the registry's champions (its slots then follow them);
- `oracle(size, seed, registry, requests, shift_s)`: the version an oracle swaps in at the shift;
- `bad_candidate(registry, data_dir, margin, at_s)`: put a deliberately bad candidate, fitted on
  garbled lengths (long and short swapped), through the same gate the loop's retrain uses, judged
  on the clean logged data; what the gate did, as a `Decision`;
- `headline(result)`: (arrival, value) of each request the headline counts.

`record_steps` says whether the loop's gate needs the served engine's step logs (a layout's gate
replays the logged requests on that engine), `log_prompts` whether the retrain needs the prompts'
texts in the request logs (a length bound is fitted on prompts and their answers' lengths).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adapt.component import ComponentError
from adapt.registry import Registry
from adapt.replay.cost import roofline
from adapt.replay.engine import ReplayEngine
from adapt.replay.metrics import ReplayResult, goodput_tokens
from adapt.requests import Request
from adapt.workloads import WORKLOADS, WorkloadSpec
from adapt.workloads.drift import TERSE_MODEL, VERBOSE_MODEL, model_answers, pre_shift_lengths
from experiments.drift_windows import mean_after
from pipelines.ewsjf import train_ewsjf_meta
from pipelines.jitserve import qrf_length_spec, train_pattern_graph, train_qrf_length
from pipelines.replay_loop import Decision
from pipelines.retrain import prompt_responses, request_logs, served_shares
from pipelines.runner import Split, run_pipeline
from predictors.ewsjf_meta import EwsjfMetaPolicy
from predictors.qrf_length import QrfLength
from serving_hooks.policies import make_policy
from serving_hooks.policies.ewsjf import EWSJF

TRAIN_LENGTHS = 2000  # prompt lengths the layout champion and the oracle's refits are fitted on
POST_SHARE = 1 / 3  # the end of a drift workload that is wholly post-shift (after a ramp too)
ORACLE_FITS = 4  # post-shift layouts the layout oracle picks the best of, with hindsight


@dataclass(frozen=True)
class Size:
    """How long one replay runs, how often the loop retrains, and how many logs it reads."""

    duration_s: float
    window_s: float
    history: int  # request logs (windows) a retrain reads

    def num_requests(self, spec: WorkloadSpec) -> int:
        return round(spec.rate * self.duration_s)


def swapped(lengths: np.ndarray) -> np.ndarray:
    """The deliberately bad training data: each length replaced by 8192 / length, so long ones
    look short and short ones long (a garbled length column)."""
    return np.maximum(1.0, np.round(8192.0 / np.maximum(np.asarray(lengths, dtype=np.float64), 1.0)))


class Scenario(ABC):
    """A drift workload and the learned part it stales (see module doc)."""

    stales: str  # the component
    metric: str  # the headline, as the study's table names it
    higher_is_better: bool
    record_steps: bool = False
    log_prompts: bool = False

    def __init__(self, workload: str) -> None:
        self.workload = workload

    @property
    def spec(self) -> WorkloadSpec:
        return WORKLOADS[self.workload]

    def engine(self, registry: Registry, record_steps: bool = False) -> ReplayEngine:
        """The workload's engine serving `policy(registry)`."""
        spec = self.spec
        cost = roofline(spec.model, spec.gpu, tp=spec.tp)
        return ReplayEngine(self.policy(registry), cost, spec.engine_config(record_steps=record_steps))

    @abstractmethod
    def champion(self, registry: Registry, seed: int) -> None: ...

    @abstractmethod
    def policy(self, registry: Registry) -> Any: ...

    @abstractmethod
    def oracle(
        self, size: Size, seed: int, registry: Registry, requests: list[Request], shift_s: float
    ) -> Any: ...

    @abstractmethod
    def bad_candidate(self, registry: Registry, data_dir: Path, margin: float, at_s: float) -> Decision: ...

    @abstractmethod
    def headline(self, result: ReplayResult) -> tuple[np.ndarray, np.ndarray]: ...


class LayoutDrift(Scenario):
    """Chat traffic that gains long-input summarisation: stales EWSJF's queue layout, judged by
    the short requests' mean TTFT."""

    stales = "ewsjf-meta-policy"
    metric = "short-request mean TTFT (s)"
    higher_is_better = False
    record_steps = True  # the layout's gate replays the logged requests on the served engine

    def champion(self, registry: Registry, seed: int) -> None:
        train_ewsjf_meta(
            registry, lengths=pre_shift_lengths(TRAIN_LENGTHS, 1000 + seed), promote_if_better=True
        )

    def policy(self, registry: Registry) -> Any:
        return EWSJF(registry.champion(self.stales))

    def oracle(
        self, size: Size, seed: int, registry: Registry, requests: list[Request], shift_s: float
    ) -> Any:
        """With hindsight: the champion or one of `ORACLE_FITS` layouts fitted (same Theta) on
        post-shift prompt lengths -- the last third of the scenario, after the shift and any ramp,
        drawn with other seeds -- whichever gives the best headline replaying this run's own
        post-shift requests. One refit alone is no reference: Refine-and-Prune's layout varies a
        lot with its sample (on 500 post-shift lengths, 15 queues with six for the chat range from
        one sample, 10 with chat and short summaries merged into one queue from another), and a
        bad draw serves short requests worse than the stale layout."""
        spec, champion = self.spec, registry.champion(self.stales)
        num_requests = size.num_requests(spec)
        after = [
            dataclasses.replace(r, arrival_s=r.arrival_s - shift_s)
            for r in requests
            if r.arrival_s >= shift_s
        ]
        start = (1 - POST_SHARE) * num_requests / spec.rate
        candidates = [champion]
        for k in range(ORACLE_FITS):
            other = spec.build(spec.rate, num_requests, 100 * (k + 1) + seed)
            lengths = np.array([r.prompt_tokens for r in other if r.arrival_s >= start], dtype=np.float64)
            candidates.append(EwsjfMetaPolicy(**champion.get_params()).fit(lengths))
        cost = roofline(spec.model, spec.gpu, tp=spec.tp)

        def served(meta: Any) -> float:
            result = ReplayEngine(EWSJF(meta), cost, spec.engine_config()).run(after)
            return mean_after(*self.headline(result), 0.0)

        return (max if self.higher_is_better else min)(candidates, key=served)

    def bad_candidate(self, registry: Registry, data_dir: Path, margin: float, at_s: float) -> Decision:
        """A layout fitted on the logged prompt lengths, swapped, gated on a replay of the clean
        logged requests on the engine the layout retrain's gate uses there."""
        logs = request_logs(data_dir)
        lengths = np.concatenate([log.prompt_tokens for log in logs])
        outcome = train_ewsjf_meta(
            registry,
            lengths=swapped(lengths),
            promote_if_better=True,
            margin=margin,
            replay=served_shares(registry, data_dir, logs)[0],
        )
        ours = outcome.metrics.get("replay_ttft_mean", math.nan)
        theirs = (outcome.champion_metrics or {}).get("replay_ttft_mean", math.nan)
        detail = f"replayed mean TTFT {ours:.3f} s vs the champion's {theirs:.3f} s"
        return Decision(
            at_s, self.stales, "registered", outcome.version, outcome.promoted, detail, "bad-candidate"
        )

    def headline(self, result: ReplayResult) -> tuple[np.ndarray, np.ndarray]:
        """The short (chat) requests' TTFT."""
        table = result.table
        arrival = table.column("arrival_s")
        labels = np.array(table.vocabulary("label"), dtype=object)[table.column("label")]
        short = labels == "short"
        return arrival[short], (table.column("first_token_s") - arrival)[short]


class BoundDrift(Scenario):
    """The served model's answers get shorter: stales JITServe's length bound (`qrf-length`),
    judged by token goodput per request (`goodput_tokens`; every request counted, a compound call
    by its own arrival, which follows its parents')."""

    stales = "qrf-length"
    metric = "token goodput per request"
    higher_is_better = True
    log_prompts = True  # the bound is refitted on the logged prompts and their answers' lengths

    def champion(self, registry: Registry, seed: int) -> None:
        """The bound `adapt train qrf-length` fits on the first model's answers (on the training
        instructions, gated on the held-out ones) and the default pattern graph, both by their
        pipelines. Neither depends on the seed: one champion per model."""
        train_qrf_length(registry, model_answers(VERBOSE_MODEL), promote_if_better=True)
        train_pattern_graph(registry, promote_if_better=True)

    def policy(self, registry: Registry) -> Any:
        return make_policy(
            "jitserve", qrf=registry.champion(self.stales), patterns=registry.champion("pattern-graph")
        )

    def oracle(
        self, size: Size, seed: int, registry: Registry, requests: list[Request], shift_s: float
    ) -> Any:
        """The bound refitted, as the champion was, on the new model's answers to the training
        instructions: what a retrain knowing the shift, with far more of the new traffic than a
        window holds, would promote (as `experiments.bound_staleness`'s fresh arm)."""
        return QrfLength(generated_features=0).fit(model_answers(TERSE_MODEL, "train"))

    def bad_candidate(self, registry: Registry, data_dir: Path, margin: float, at_s: float) -> Decision:
        """A bound fitted on the logged answers' lengths swapped, scored and replay-checked on the
        clean held-out requests by `qrf-length`'s own pipeline. A bound that misses its quantile by
        more than the coverage band is refused before it is registered."""
        data = prompt_responses(data_dir).trace
        if data is None:
            return Decision(at_s, self.stales, "no data", None, False, "no logged prompts", "bad-candidate")
        spec = qrf_length_spec(data, data)  # the second names the source on the version

        def garbled(trace: Any) -> Split:
            split = spec.split(trace)
            train = dataclasses.replace(
                split.train, output_tokens=swapped(split.train.output_tokens).astype(int)
            )
            return dataclasses.replace(split, train=train)

        try:
            outcome = run_pipeline(
                dataclasses.replace(spec, split=garbled),
                registry,
                data,
                promote_if_better=True,
                margin=margin,
                replay=True,
                generated_features=0,
            )
        except ComponentError as refused:
            return Decision(at_s, self.stales, "refused", None, False, str(refused), "bad-candidate")
        ours = outcome.metrics.get("pinball_loss", math.nan)
        theirs = (outcome.champion_metrics or {}).get("pinball_loss", math.nan)
        detail = f"held-out pinball loss {ours:.1f} vs the champion's {theirs:.1f}"
        return Decision(
            at_s, self.stales, "registered", outcome.version, outcome.promoted, detail, "bad-candidate"
        )

    def headline(self, result: ReplayResult) -> tuple[np.ndarray, np.ndarray]:
        table = result.table
        return table.column("arrival_s"), goodput_tokens(table).astype(np.float64)


SCENARIOS: dict[str, Scenario] = {
    "drift-chat-to-summaries": LayoutDrift("drift-chat-to-summaries"),
    "drift-chat-to-summaries-gradual": LayoutDrift("drift-chat-to-summaries-gradual"),
    "drift-shorter-answers": BoundDrift("drift-shorter-answers"),
}
