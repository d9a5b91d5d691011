"""`ewsjf-online`: EWSJF whose meta-optimiser runs while it serves (KDD'26's online tuner).

It serves with an *incumbent* meta-policy (the registered champion, or the default layout) and
tries *candidates* against it on the live traffic, in the paired design of `adapt.paired`: windows
of `window` arrivals alternate incumbent and candidate, I C I C ... I, `pairs` candidate windows per
candidate, and a candidate replaces the incumbent only when its mean paired contrast beats the
noise measured on the incumbent's own windows (a one-sided z-test, `z`). The earlier tuner scored
every window against the first one, so at steady load it chased window-to-window noise and under
overload the growing backlog made every later trial look worse; here both cancel in the pairs.

Candidates come in two kinds:
- *scoring*: equation 4's weights (`SCORING_SPACE`) asked of Optuna (`adapt.online.OnlineTuner`),
  told the paired score; the layout stays the incumbent's;
- *layout*: every `layout_every`-th candidate (the first of each cycle; 0: never) is the
  incumbent's Theta with its queue layout refitted by Refine-and-Prune -- the offline trainer's
  `EwsjfMetaPolicy.fit` -- on the prompt lengths of the last `refit_windows` windows. This is what
  lets the server follow a shift in the length mix (chat gaining long summarisation prompts) with
  queues for the new lengths, judged by the same paired test.

Switching arms between windows installs the arm's meta-policy; a different layout re-routes every
waiting request into the new queues (`EWSJF.relayout`), so none is lost.

The contrast is equation 5's, R = l1 C + l2 L - l3 S - l4 U, as the offline meta-optimiser and the
earlier online tuner score it. Online the weights default to the latency term alone
(`ONLINE_WEIGHTS`; `weights` restores the paper's): C, L and S describe the layout, not the
service, and prefer few queues whatever the traffic -- this repository's offline layout gate was
moved to replayed TTFT after they preferred a stale 3-queue layout to refits that served short
requests 3-4x faster (`pipelines.ewsjf.train_ewsjf_meta`); in a scoring candidate they cancel anyway.

U, the user latency, is what the earlier tuner took as the window's mean TTFT; here it is the
*growth of the waiting line* over the window per arrival, (waiting at close - waiting at open) /
arrivals, lower is better (a candidate that admits 0.2 more requests per arrival than its
neighbours gains 0.2). By Little's law the waiting line integrates to the mean queueing wait --
the part of TTFT a schedule decides -- and its growth is what the arm serving the window does to
it. Two other readings were tried on the drift scenario and failed: crediting each request's TTFT
to the window it arrived in turned better layouts into worse scores (when waits are as long as a
window, an incumbent window's arrivals are mostly served in the next, candidate, window and vice
versa), and a level such as the mean number waiting persists from window to window, so its paired
contrast cancels the very effect it should measure. The growth is known when the window closes
(no waiting for answers to finish), costs O(1) per arrival, and at light load it is ~0 for every
arm, so nothing is adopted where nothing waits. It counts requests, not tokens, so like SJF it
favours serving short prompts first; EWSJF's urgency term (kept positive) still bounds the wait
of long ones, and the study reports their TTFT next to the short requests'.

A hot-swapped champion (`use_component`, e.g. `adapt serve` following the registry) becomes the
incumbent at once and the comparison restarts: windows in flight were measured against the old
incumbent. An adoption restarts it the same way. Trials are logged to MLflow only when
`mlflow_experiment` is given (off by default: a server should not write a run per candidate
unless asked).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adapt.online import OnlineTuner
from adapt.paired import AdoptionRule, Verdict, incumbent_contrasts, paired_contrasts
from adapt.policy import RequestState
from predictors.ewsjf_meta import (
    SCORING_SPACE,
    EwsjfMetaPolicy,
    equation5,
    layout_group_terms,
)
from serving_hooks.policies.ewsjf import EWSJF

# Incumbent contrasts kept for the noise estimate: the latest, so that it follows the load (the
# growth of the waiting line is ~0 +- 0.005 per arrival at light load, +- 0.1 near saturation).
NOISE_SAMPLES = 32
ONLINE_WEIGHTS = (0.0, 0.0, 0.0, 1.0)  # equation 5's lambdas online: the latency term alone


@dataclass(eq=False)
class Window:
    """One window of `window` arrivals served by one arm."""

    arm: str  # "incumbent" or "candidate"
    waiting_at_start: int
    lengths: dict[int, list[int]] = field(default_factory=dict)  # queue -> prompt lengths routed
    arrivals: int = 0
    growth: float = math.nan  # requests added to the waiting line per arrival (set at close)
    terms: dict[str, float] | None = None  # equation 5's layout terms, set when the window closes


@dataclass(eq=False)
class Candidate:
    """A meta-policy under test, its windows and the incumbent windows around them."""

    meta: EwsjfMetaPolicy
    kind: str  # "scoring" or "layout"
    trial: Any = None  # the Optuna trial of a scoring candidate
    params: dict[str, float] = field(default_factory=dict)
    windows: list[Window] = field(default_factory=list)
    neighbours: list[Window] = field(default_factory=list)


class OnlineEWSJF(EWSJF):
    """EWSJF tuning its own meta-policy on live traffic by paired windows (module doc)."""

    name = "ewsjf-online"
    components = {"meta": "ewsjf-meta-policy"}  # noqa: RUF012  (the starting incumbent)

    def __init__(
        self,
        meta: EwsjfMetaPolicy | dict[str, Any] | None = None,
        *,
        window: int = 100,
        pairs: int = 3,
        z: float = 2.0,
        layout_every: int = 2,
        refit_windows: int = 4,
        seed: int = 0,
        weights: tuple[float, float, float, float] = ONLINE_WEIGHTS,
        mlflow_experiment: str | None = None,
        **kwargs: Any,
    ) -> None:
        for key, value in (("window", window), ("pairs", pairs), ("refit_windows", refit_windows)):
            if int(value) != value or value < 1:
                raise ValueError(f"{key}: expected an integer >= 1, got {value!r}")
        if int(layout_every) != layout_every or layout_every < 0:
            raise ValueError(f"layout_every: expected an integer >= 0, got {layout_every!r}")
        if len(weights) != 4 or not all(math.isfinite(w) and w >= 0 for w in weights):
            raise ValueError(f"weights: expected 4 finite numbers >= 0 (lambda_1..4), got {weights!r}")
        super().__init__(meta, **kwargs)
        self.window, self.pairs, self.layout_every = window, pairs, layout_every
        self.rule = AdoptionRule(z=z)
        self.weights = weights
        self._recent: deque[int] = deque(maxlen=refit_windows * window)
        self._noise: deque[float] = deque(maxlen=NOISE_SAMPLES)  # the traffic's: kept across incumbents
        self.evaluations: list[dict[str, Any]] = []  # every judged candidate, in order
        self.adoptions: list[dict[str, Any]] = []
        self.windows_closed = 0
        self.tuner = OnlineTuner(
            SCORING_SPACE,
            self.meta.get_params(),
            seed=seed,
            name="ewsjf-online",
            mlflow_experiment=mlflow_experiment,
        )
        self._restart(self.meta)

    # ------------------------------------------------------------ incumbents
    def use_component(self, attribute: str, component: Any) -> None:
        """A new champion becomes the incumbent and the comparison restarts (module doc)."""
        self._restart(component)
        self.tuner.restart(self.incumbent.get_params())

    def _restart(self, meta: EwsjfMetaPolicy) -> None:
        """Serve `meta` (a copy: the champion object is never changed) as the incumbent and forget
        every window and candidate measured against the previous one."""
        self.incumbent = _copy(meta, meta.queues_)
        if "registry_version" in meta.metadata:  # a champion: the status names the version it serves
            self.incumbent.metadata["registry_version"] = meta.metadata["registry_version"]
        self._install(self.incumbent)
        self._incumbent_windows: deque[Window] = deque(maxlen=3)  # the latest, for the noise
        self._pending: Candidate | None = None  # all its windows served; its last neighbour open
        self._candidate: Candidate | None = None
        self._proposed = 0
        self._window = Window("incumbent", len(self._where))
        self._incumbent_windows.append(self._window)

    def _install(self, meta: EwsjfMetaPolicy) -> None:
        if [(q.low, q.high) for q in meta.queues_] != [(q.low, q.high) for q in self.meta.queues_]:
            self.relayout(meta.queues_)
        self.meta = meta

    # ------------------------------------------------------------ windows
    def on_arrival(self, request: RequestState, now: float) -> None:
        super().on_arrival(request, now)
        window = self._window
        window.lengths.setdefault(id(self._where[request.id]), []).append(request.prompt_tokens)
        window.arrivals += 1
        self._recent.append(request.prompt_tokens)
        if window.arrivals >= self.window:
            self._next_window(now)

    def _next_window(self, now: float) -> None:
        """Close the current window and open the next, of the other arm."""
        closing = self._window
        groups = [np.asarray(v, dtype=np.float64) for v in closing.lengths.values()]
        closing.terms = layout_group_terms(groups, len(self.queues), self.meta.max_queues)
        closing.growth = (len(self._where) - closing.waiting_at_start) / closing.arrivals
        self.windows_closed += 1
        if closing.arm == "incumbent" and len(self._incumbent_windows) == 3:
            self._noise.extend(incumbent_contrasts(self._incumbent_windows, self.contrast))
        if self._judge(now):
            return  # a new incumbent, and a fresh incumbent window
        if closing.arm == "incumbent":
            if self._candidate is None:
                self._candidate = self._propose()
                self._candidate.neighbours.append(closing)
            self._window = Window("candidate", len(self._where))
            self._candidate.windows.append(self._window)
            self._install(self._candidate.meta)
        else:
            self._window = Window("incumbent", len(self._where))
            self._incumbent_windows.append(self._window)
            candidate = self._candidate
            assert candidate is not None
            candidate.neighbours.append(self._window)
            if len(candidate.windows) == self.pairs:
                self._pending, self._candidate = candidate, None
            self._install(self.incumbent)

    def _propose(self) -> Candidate:
        """The first candidate of every `layout_every` is a refitted layout, when the recent
        lengths give one that differs from the incumbent's; the others come from Optuna."""
        self._proposed += 1
        layout_turn = self.layout_every and self._proposed % self.layout_every == 1 % self.layout_every
        if layout_turn and len(self._recent) >= max(self.window, EwsjfMetaPolicy.least_data):
            refit = EwsjfMetaPolicy(**self.incumbent.get_params()).fit(np.fromiter(self._recent, float))
            if [(q.low, q.high) for q in refit.queues_] != [(q.low, q.high) for q in self.incumbent.queues_]:
                return Candidate(refit, "layout")
        trial, params = self.tuner.ask()
        meta = _copy(self.incumbent, self.incumbent.queues_)
        meta.set_params(**params)
        return Candidate(meta, "scoring", trial, params)

    # ------------------------------------------------------------ judging
    def contrast(self, window: Window, left: Window, right: Window) -> float:
        """Equation 5 of `window` minus the mean of its neighbours' (U: the waiting line's growth)."""

        def reward(w: Window) -> float:
            assert w.terms is not None
            return equation5({**w.terms, "latency": w.growth}, self.weights)

        return reward(window) - (reward(left) + reward(right)) / 2

    def _judge(self, now: float) -> bool:
        """Judge the candidate whose last incumbent neighbour has just closed, if any; whether it
        was adopted."""
        candidate = self._pending
        if candidate is None or candidate.neighbours[-1].terms is None:
            return False
        self._pending = None
        verdict = self._verdict(candidate)
        if candidate.trial is not None:
            self.tuner.tell(candidate.trial, candidate.params, verdict.score, _record(verdict))
        self.evaluations.append({"at_s": now, "kind": candidate.kind, **_record(verdict)})
        if verdict.adopt:
            self._adopt(candidate, verdict, now)
        return verdict.adopt

    def _verdict(self, candidate: Candidate) -> Verdict:
        contrasts = paired_contrasts(candidate.windows, candidate.neighbours, self.contrast)
        return self.rule.judge(contrasts, self._noise)

    def _adopt(self, candidate: Candidate, verdict: Verdict, now: float) -> None:
        """Judged as its last neighbour closes, before the next candidate is proposed: no other
        candidate is in flight."""
        self.adoptions.append(
            {
                "at_s": now,
                "kind": candidate.kind,
                "queues": [[q.low, q.high] for q in candidate.meta.queues_],
                **_record(verdict),
            }
        )
        self._restart(candidate.meta)
        self.tuner.restart(self.incumbent.get_params())

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "window": self.window,
            "pairs": self.pairs,
            "evaluations": len(self.evaluations),
            "adoptions": len(self.adoptions),
            # the latest adoption (engine time, kind, layout, verdict): what an operator watches for
            "last_adoption": self.adoptions[-1] if self.adoptions else None,
        }


def _copy(meta: EwsjfMetaPolicy, queues: list[Any]) -> EwsjfMetaPolicy:
    copy = EwsjfMetaPolicy(**meta.get_params())
    copy.queues_ = list(queues)
    return copy


def _record(verdict: Verdict) -> dict[str, Any]:
    return {
        "score": verdict.score,
        "threshold": verdict.threshold,
        "noise_rms": verdict.noise_rms,
        "noise_samples": verdict.noise_samples,
        "pairs": verdict.pairs,
        "adopted": verdict.adopt,
    }
