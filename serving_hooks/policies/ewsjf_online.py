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
earlier online tuner score it, with U the window's mean TTFT over the mean TTFT of its two
incumbent neighbours (1 for the incumbent; a candidate that halves TTFT gains 0.5). Online the
weights default to the latency term alone (`ONLINE_WEIGHTS`; `weights` restores the paper's):
C, L and S describe the layout, not the service, and they prefer few queues whatever the traffic
-- this repository's offline layout gate was moved to replayed TTFT after they preferred a stale
3-queue layout to refits that served short requests 3-4x faster (`pipelines.ewsjf.train_ewsjf_meta`);
in a paired scoring candidate they cancel anyway (same layout). U is the mean TTFT over all
requests, not short ones alone: a live server has no size labels, and EWSJF's short-first score
moves the mean mostly through its many short requests.

A request counts in the window it arrived in (not the one that admitted it, which would reward an
arm that leaves its long requests to the next one). First tokens are read when they come (the
admitted requests are checked each step), and a window is scored once all its arrivals have one,
or `CENSOR_LAG` windows after it closed, the still-waiting ones counted with their wait so far.

A hot-swapped champion (`use_component`, e.g. `adapt serve` following the registry) becomes the
incumbent at once and the comparison restarts: windows in flight were measured against the old
incumbent. An adoption restarts it the same way. Trials are logged to MLflow only when
`mlflow_experiment` is given (off by default: a server should not write a run per candidate
unless asked).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adapt.online import OnlineTuner
from adapt.paired import AdoptionRule, Verdict, incumbent_contrasts, paired_contrasts
from adapt.policy import EngineView, Plan, RequestState
from predictors.ewsjf_meta import (
    SCORING_SPACE,
    EwsjfMetaPolicy,
    equation5,
    layout_group_terms,
)
from serving_hooks.policies.ewsjf import EWSJF

NOISE_WINDOWS = 64  # incumbent windows kept for the noise estimate (a long-running server)
CENSOR_LAG = 4  # windows after which a window is scored even if some of its requests still wait
ONLINE_WEIGHTS = (0.0, 0.0, 0.0, 1.0)  # equation 5's lambdas online: the latency term alone


@dataclass(eq=False)
class Window:
    """One window of `window` arrivals served by one arm."""

    arm: str  # "incumbent" or "candidate"
    start_s: float
    lengths: dict[int, list[int]] = field(default_factory=dict)  # queue -> prompt lengths routed
    arrivals: int = 0
    waiting: dict[str, RequestState] = field(default_factory=dict)  # arrivals without a first token
    ttft_sum: float = 0.0
    ttft_count: int = 0
    terms: dict[str, float] | None = None  # equation 5's layout terms, set when the window closes

    @property
    def complete(self) -> bool:
        return self.terms is not None and not self.waiting

    def record(self, request: RequestState, ttft: float | None) -> None:
        """`request` has its first token after `ttft` seconds (None: it ended without one)."""
        del self.waiting[request.id]
        if ttft is not None:
            self.ttft_sum += ttft
            self.ttft_count += 1

    @property
    def ttft_mean(self) -> float:
        return self.ttft_sum / self.ttft_count if self.ttft_count else float("nan")


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
        window: int = 200,
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
        super().__init__(meta, **kwargs)
        self.window, self.pairs, self.layout_every = window, pairs, layout_every
        self.rule = AdoptionRule(z=z)
        self.weights = weights
        self._recent: deque[int] = deque(maxlen=refit_windows * window)
        self._tags: dict[str, Window] = {}  # arrivals still without a first token -> their window
        self._prefilling: dict[str, RequestState] = {}  # those of them admitted
        self._closed: deque[Window] = deque()  # closed windows not yet censored
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
        self._restart(self.meta, 0.0)

    # ------------------------------------------------------------ incumbents
    def use_component(self, attribute: str, component: Any) -> None:
        """A new champion becomes the incumbent and the comparison restarts (module doc)."""
        self._restart(component, self._window.start_s)
        self.tuner.restart(self.incumbent.get_params())

    def _restart(self, meta: EwsjfMetaPolicy, now: float) -> None:
        """Serve `meta` (a copy: the champion object is never changed) as the incumbent and forget
        every window and candidate measured against the previous one."""
        self.incumbent = _copy(meta, meta.queues_)
        self._install(self.incumbent)
        self._incumbent_windows: deque[Window] = deque(maxlen=NOISE_WINDOWS)
        self._pending: list[Candidate] = []  # complete sets of windows awaiting their scores
        self._candidate: Candidate | None = None
        self._proposed = 0
        self._window = Window("incumbent", now)
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
        window.waiting[request.id] = request
        self._tags[request.id] = window
        self._recent.append(request.prompt_tokens)
        if window.arrivals >= self.window:
            self._next_window(now)

    def on_admit(self, request: RequestState, now: float) -> None:
        super().on_admit(request, now)
        if request.id in self._tags:
            self._prefilling[request.id] = request

    def on_step(self, view: EngineView) -> Plan:
        """First tokens are read here, from the requests admitted since (a handful: those in
        prefill), so a window is scored a prefill after its last request starts, not after its
        longest answer ends."""
        for request in [r for r in self._prefilling.values() if r.first_token_s is not None]:
            self._record(request, request.first_token_s - request.arrival_s, view.now)
        return super().on_step(view)

    def on_finish(self, request: RequestState, now: float) -> None:
        super().on_finish(request, now)
        if request.id in self._tags:
            first = request.first_token_s
            self._record(request, None if first is None else first - request.arrival_s, now)

    def _record(self, request: RequestState, ttft: float | None, now: float) -> None:
        self._prefilling.pop(request.id, None)
        window = self._tags.pop(request.id)
        window.record(request, ttft)
        if window.complete:
            self._judge_ready(now)

    def _censor(self, window: Window, now: float) -> None:
        """Score `window` now: a request still without a first token counts with its wait so far
        (a lower bound), so an overloaded server, whose long requests can wait minutes, still
        judges candidates; every window is censored at the same lag, whichever arm served it."""
        for request in list(window.waiting.values()):
            first = request.first_token_s
            wait = now - request.arrival_s if first is None else first - request.arrival_s
            self._prefilling.pop(request.id, None)
            del self._tags[request.id]
            window.record(request, wait)

    def _next_window(self, now: float) -> None:
        """Close the current window, censor the one closed `CENSOR_LAG` windows ago, and open the
        next window, of the other arm."""
        closing = self._window
        groups = [np.asarray(v, dtype=np.float64) for v in closing.lengths.values()]
        closing.terms = layout_group_terms(groups, len(self.queues), self.meta.max_queues)
        self.windows_closed += 1
        self._closed.append(closing)
        if len(self._closed) > CENSOR_LAG:
            self._censor(self._closed.popleft(), now)
        if closing.arm == "incumbent":
            if self._candidate is None:
                self._candidate = self._propose()
                self._candidate.neighbours.append(closing)
            self._window = Window("candidate", now)
            self._candidate.windows.append(self._window)
            self._install(self._candidate.meta)
        else:
            self._window = Window("incumbent", now)
            self._incumbent_windows.append(self._window)
            candidate = self._candidate
            assert candidate is not None
            candidate.neighbours.append(self._window)
            if len(candidate.windows) == self.pairs:
                self._pending.append(candidate)
                self._candidate = None
            self._install(self.incumbent)
        self._judge_ready(now)

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
        """Equation 5 of `window` minus the mean of its neighbours', U relative to their TTFT."""
        reference = max((left.ttft_mean + right.ttft_mean) / 2, 1e-6)

        def reward(w: Window) -> float:
            assert w.terms is not None
            return equation5({**w.terms, "latency": w.ttft_mean / reference}, self.weights)

        return reward(window) - (reward(left) + reward(right)) / 2

    def _judge_ready(self, now: float) -> None:
        """Judge the pending candidates in order, as soon as all their windows are complete."""
        while self._pending and all(
            w.complete for w in (*self._pending[0].windows, *self._pending[0].neighbours)
        ):
            candidate = self._pending.pop(0)
            verdict = self._verdict(candidate)
            if candidate.trial is not None:
                self.tuner.tell(candidate.trial, candidate.params, verdict.score, _record(verdict))
            self.evaluations.append({"at_s": now, "kind": candidate.kind, **_record(verdict)})
            if verdict.adopt:
                self._adopt(candidate, verdict, now)
                return

    def _verdict(self, candidate: Candidate) -> Verdict:
        contrasts = paired_contrasts(candidate.windows, candidate.neighbours, self.contrast)
        complete = []
        for window in self._incumbent_windows:  # the complete run of windows from the oldest kept
            if not window.complete:
                break
            complete.append(window)
        noise = incumbent_contrasts(complete, self.contrast)
        finite = [c for c in contrasts if np.isfinite(c)]  # a window whose requests all aborted
        return self.rule.judge(finite or [float("-inf")], [e for e in noise if np.isfinite(e)])

    def _adopt(self, candidate: Candidate, verdict: Verdict, now: float) -> None:
        for other in (*self._pending, self._candidate):
            if other is not None and other.trial is not None:
                self.tuner.abandon(other.trial)
        self.adoptions.append(
            {
                "at_s": now,
                "kind": candidate.kind,
                "queues": [[q.low, q.high] for q in candidate.meta.queues_],
                **_record(verdict),
            }
        )
        self._restart(candidate.meta, now)
        self.tuner.restart(self.incumbent.get_params())

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "window": self.window,
            "pairs": self.pairs,
            "evaluations": len(self.evaluations),
            "adoptions": len(self.adoptions),
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
