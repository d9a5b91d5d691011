"""`ewsjf-meta-policy`: EWSJF's learned queue layout and scoring meta-parameters (KDD'26, sec. 4).

Two things are learned, on two time scales:
- the queue layout, by Refine-and-Prune on a window of prompt lengths (`fit`):
    1. coarse k-means with k = 3 (short / medium / long regimes);
    2. recursive refinement: split a cluster at its largest gap between consecutive sorted lengths
       while that gap exceeds `alpha` times the cluster's mean gap and the cluster is wider than
       `min_width`;
    3. pruning: while there are more than `max_queues`, merge the adjacent pair with the lowest
       scheduling utility U = (rho_i + rho_{i+1}) / (|mean_{i+1} - mean_i| + eps), rho = share of
       requests (equation 3);
  (`partition="kmeans"` with `k` clusters instead is the paper's Table 3 comparison);
- the meta-parameters Theta of the context-aware score (equation 4): `w_urg(b) = a_u * b + b_u`,
  `w_fair(b) = a_f * b + b_f` of a queue's mean prompt length b, `w_base`, plus `alpha`, the
  bubble width and the empty-queue threshold; tuned by Bayesian optimisation (`adapt tune ewsjf`).
Saved as JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from numbers import Integral
from pathlib import Path
from typing import Any, Self

import numpy as np

from adapt.component import ComponentError, LearnedComponent, data_fingerprint
from predictors import require_fitted

EPS = 1e-6
REWARD_WEIGHTS = (1.0, 1.0, 1.0, 1.0)  # lambda_1..4 of equation 5
# Theta's search box for the offline meta-optimiser; the online one tunes the scoring subset.
SCORING_SPACE: dict[str, tuple[float, float]] = {
    "a_u": (-1e-3, 1e-3),
    "b_u": (0.01, 10.0),
    "a_f": (-1e-3, 1e-3),
    "b_f": (0.0, 2.0),
    "w_base": (0.0, 5.0),
}
THETA_SPACE: dict[str, tuple[float, float]] = {
    **SCORING_SPACE,
    "alpha": (1.5, 20.0),
    "bubble_width": (16.0, 512.0),
}


def equation5(terms: dict[str, float], weights: tuple[float, float, float, float] = REWARD_WEIGHTS) -> float:
    """The meta-optimiser's reward R = l1 * C + l2 * L - l3 * S - l4 * U (compactness, load
    balance, queue proliferation, user latency). A layout judged on its own has no latency term."""
    l1, l2, l3, l4 = weights
    return (
        l1 * terms["compactness"]
        + l2 * terms["balance"]
        - l3 * terms["proliferation"]
        - l4 * terms.get("latency", 0.0)
    )


@dataclass(frozen=True)
class QueueSpec:
    """A contiguous prompt-length interval [low, high] with the mean and share of its requests."""

    low: float
    high: float
    mean: float
    share: float


def _gap_split(values: np.ndarray, alpha: float, min_width: float) -> list[np.ndarray]:
    """Stage 2: split recursively at the largest significant gap (equation 2).

    Gaps are taken between consecutive *distinct* lengths (token counts repeat a lot, and zero gaps
    would make every 1-token step look significant), and a split is only made when both sides stay
    at least `min_width` tokens wide -- the paper's minimum queue width.
    """
    if len(values) < 3 or values[-1] - values[0] < 2 * min_width:
        return [values]
    distinct = np.unique(values)
    gaps = np.diff(distinct)
    if len(gaps) == 0:
        return [values]
    mean_gap = gaps.mean()
    # A split after distinct[j] leaves [distinct[0], distinct[j]] and [distinct[j+1], distinct[-1]].
    allowed = (distinct[:-1] - distinct[0] >= min_width) & (distinct[-1] - distinct[1:] >= min_width)
    allowed &= gaps > alpha * mean_gap
    if not allowed.any():
        return [values]
    j = int(np.argmax(np.where(allowed, gaps, -np.inf)))
    cut = int(np.searchsorted(values, distinct[j], side="right"))
    return _gap_split(values[:cut], alpha, min_width) + _gap_split(values[cut:], alpha, min_width)


def utility(a: np.ndarray, b: np.ndarray, total: int) -> float:
    """Equation 3 for two adjacent clusters."""
    return (len(a) / total + len(b) / total) / (abs(float(b.mean()) - float(a.mean())) + EPS)


def _prune(clusters: list[np.ndarray], max_queues: int, total: int) -> list[np.ndarray]:
    """Stage 3: merge the lowest-utility adjacent pair until at most `max_queues` remain."""
    clusters = list(clusters)
    while len(clusters) > max_queues:
        scores = [utility(clusters[i], clusters[i + 1], total) for i in range(len(clusters) - 1)]
        i = int(np.argmin(scores))
        clusters[i : i + 2] = [np.concatenate([clusters[i], clusters[i + 1]])]
    return clusters


def kmeans_1d(values: np.ndarray, k: int, seed: int = 0) -> list[np.ndarray]:
    """k-means on one dimension, clusters returned sorted by position (sorted values inside)."""
    from sklearn.cluster import KMeans

    k = max(1, min(k, len(np.unique(values))))
    labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(values.reshape(-1, 1))
    clusters = [np.sort(values[labels == c]) for c in range(k)]
    return sorted((c for c in clusters if len(c)), key=lambda c: c[0])


def refine_and_prune(
    lengths: np.ndarray, alpha: float, min_width: float, max_queues: int, seed: int = 0
) -> list[np.ndarray]:
    values = np.sort(np.asarray(lengths, dtype=np.float64))
    refined = [
        part for cluster in kmeans_1d(values, 3, seed) for part in _gap_split(cluster, alpha, min_width)
    ]
    return _prune(refined, max_queues, len(values))


def layout_terms(queues: list[QueueSpec], lengths: np.ndarray, max_queues: int) -> dict[str, float]:
    """Equation 5's structural terms for a layout and the lengths routed to it: compactness C
    (1 - mean coefficient of variation inside queues), load balance L (1 / (1 + CV of queue
    loads)), proliferation S (queues / max_queues)."""
    lows = [q.low for q in queues]
    index = np.clip(np.searchsorted(lows, lengths, side="right") - 1, 0, len(queues) - 1)
    groups = [lengths[index == i] for i in range(len(queues))]
    return layout_group_terms([g for g in groups if len(g)], len(queues), max_queues)


def layout_group_terms(groups: list[np.ndarray], num_queues: int, max_queues: int) -> dict[str, float]:
    """The same terms from the prompt lengths already grouped by queue (the policy's live queues)."""
    cvs = [float(g.std() / g.mean()) for g in groups if len(g) > 1 and g.mean() > 0]
    loads = np.array([len(g) for g in groups], dtype=np.float64)
    balance = 1.0 / (1.0 + float(loads.std() / loads.mean())) if len(loads) > 1 else 1.0
    return {
        "compactness": 1.0 - min(1.0, float(np.mean(cvs))) if cvs else 1.0,
        "balance": balance,
        "proliferation": num_queues / max_queues,
        "queues": float(num_queues),
    }


def _lengths(data: Any) -> np.ndarray:
    """A window of prompt lengths as a 1-D array. A table of them is refused here: fitted, it
    failed deep in the layout with an IndexError; evaluated, it was silently flattened."""
    lengths = np.asarray(data, dtype=np.float64)
    if lengths.ndim != 1:
        raise ValueError(
            f"ewsjf-meta-policy: expected a 1-D window of prompt lengths, got shape {lengths.shape}"
        )
    return lengths


class EwsjfMetaPolicy(LearnedComponent):
    """Queue layout + scoring meta-parameters. Hyper-parameters are Theta and the partitioning."""

    name = "ewsjf-meta-policy"
    primary_metric = "reward"
    lower_is_better = False
    least_data = 3
    data_unit = "prompt lengths"

    def __init__(
        self,
        a_u: float = 0.0,
        b_u: float = 1.0,
        a_f: float = 0.0,
        b_f: float = 0.1,
        w_base: float = 1.0,
        alpha: float = 3.0,
        min_width: float = 16.0,
        max_queues: int = 32,
        bubble_width: float = 64.0,
        empty_threshold: int = 2000,
        partition: str = "refine-and-prune",
        k: int = 5,
        seed: int = 0,
    ) -> None:
        self.a_u, self.b_u, self.a_f, self.b_f, self.w_base = a_u, b_u, a_f, b_f, w_base
        self.alpha, self.min_width, self.max_queues = alpha, min_width, max_queues
        self.bubble_width, self.empty_threshold = bubble_width, empty_threshold
        self.partition, self.k, self.seed = partition, k, seed

    def _validate_params(self) -> None:
        """Checked by `fit`, not `__init__`: scikit-learn's `set_params` and `clone` store values
        unchecked, so a bad value is reported where it is used."""
        if self.partition not in ("refine-and-prune", "kmeans"):
            raise ValueError(f"partition: expected refine-and-prune or kmeans, got {self.partition!r}")
        # max_queues = 0 failed deep in pruning (argmin of nothing); k = 0 silently ran k = 1
        for name in ("max_queues", "k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise ValueError(f"{name}: expected a whole number >= 1, got {value!r}")

    def fit(self, data: Any) -> Self:
        """`data`: a window of prompt lengths (array-like)."""
        self._validate_params()
        lengths = _lengths(data)
        self.require_data(lengths)
        if self.partition == "kmeans":
            clusters = kmeans_1d(np.sort(lengths), self.k, self.seed)
        else:
            clusters = refine_and_prune(lengths, self.alpha, self.min_width, self.max_queues, self.seed)
        total = len(lengths)
        self.queues_ = [
            QueueSpec(float(c[0]), float(c[-1]), float(c.mean()), len(c) / total) for c in clusters
        ]
        self._record_fit(data_hash=data_fingerprint(lengths), data_window={"prompts": total})
        return self

    # Equation 4's weights as functions of a queue's mean prompt length.
    def w_urg(self, mean_len: float) -> float:
        """Kept strictly positive: the urgency term is what makes EWSJF starvation-free."""
        return max(1e-3, self.a_u * mean_len + self.b_u)

    def w_fair(self, mean_len: float) -> float:
        return max(0.0, self.a_f * mean_len + self.b_f)

    def evaluate(self, data: Any) -> dict[str, float]:
        """Layout quality on a window of prompt lengths: compactness and balance (equation 5's
        C and L terms) and the queue count."""
        require_fitted(self, "queues_")
        return layout_terms(self.queues_, _lengths(data), self.max_queues)

    def save_state(self, directory: Path) -> None:
        require_fitted(self, "queues_")
        (directory / "queues.json").write_text(json.dumps([asdict(q) for q in self.queues_], indent=2))

    def load_state(self, directory: Path) -> None:
        self.queues_ = [QueueSpec(**q) for q in json.loads((directory / "queues.json").read_text())]

    def validate(self) -> None:
        if not getattr(self, "queues_", None):
            raise ComponentError("ewsjf-meta-policy: no queues (not fitted)")
        lows = [q.low for q in self.queues_]
        if lows != sorted(lows) or any(q.low > q.high for q in self.queues_):
            raise ComponentError("ewsjf-meta-policy: queues must be sorted, non-empty intervals")
        if any(b.low < a.high for a, b in zip(self.queues_, self.queues_[1:], strict=False)):
            raise ComponentError("ewsjf-meta-policy: queues overlap")
        if not all(np.isfinite(v) for v in (self.a_u, self.b_u, self.a_f, self.b_f, self.w_base)):
            raise ComponentError("ewsjf-meta-policy: non-finite meta-parameters")
