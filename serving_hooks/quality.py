"""How good the learned parts are on the traffic a server sees now, over sliding windows of
finished requests.

A component's registered metrics say how good it was on its held-out data; these say how good it
is right now, which is what a retrain schedule or a rollback should act on:
- `BoundWindow`, for a remaining-length *bound* (`qrf-length`, `pattern-graph`): coverage, the
  share of finished requests whose served output length stayed within the bound in force when they
  finished, and the mean over-estimation ratio bound / actual length;
- `RankWindow`, for a length *estimate* (`semantic-history`'s predicted mean): the Spearman rank
  correlation of predicted and actual lengths -- a policy that orders by predicted length needs
  the order right more than the values;
- `drift_alarm`: online coverage more than a margin below the held-out coverage the registry
  recorded for the serving version (`held_out_coverage`).

Windows count requests, not seconds, so a quiet server keeps its last verdict instead of going
blank. An observation costs O(1); the rank correlation is computed only when asked for
(O(n log n), a few times a minute). Publishing these numbers is `serving_hooks.metrics`' job.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import numpy as np

DEFAULT_WINDOW = 500
LEAST_FOR_RANKS = 10  # fewer pairs than this give no rank correlation worth showing


class BoundWindow:
    """Coverage and over-estimation of a length bound over the last `size` finished requests."""

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"window size: must be >= 1, got {size}")
        self._items: deque[tuple[bool, float]] = deque(maxlen=size)
        self._covered = 0
        self._ratio_sum = 0.0

    def observe(self, actual_tokens: int, bound_tokens: float) -> None:
        """A finished request that generated `actual_tokens` under a bound of `bound_tokens` on
        its total output. Requests without output say nothing about a length bound: ignored."""
        if actual_tokens <= 0:
            return
        if len(self._items) == self._items.maxlen:
            covered, ratio = self._items[0]
            self._covered -= covered
            self._ratio_sum -= ratio
        item = (actual_tokens <= bound_tokens, bound_tokens / actual_tokens)
        self._items.append(item)  # the deque drops the oldest itself
        self._covered += item[0]
        self._ratio_sum += item[1]

    @property
    def count(self) -> int:
        return len(self._items)

    @property
    def coverage(self) -> float | None:
        return self._covered / len(self._items) if self._items else None

    @property
    def overestimate(self) -> float | None:
        return self._ratio_sum / len(self._items) if self._items else None


class ShareWindow:
    """The share of the last `size` requests for which something held (e.g. SageSched found enough
    close neighbours in its semantic history)."""

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"window size: must be >= 1, got {size}")
        self._items: deque[bool] = deque(maxlen=size)

    def observe(self, held: bool) -> None:
        self._items.append(bool(held))

    @property
    def count(self) -> int:
        return len(self._items)

    @property
    def share(self) -> float | None:
        return sum(self._items) / len(self._items) if self._items else None


class RankWindow:
    """Spearman rank correlation of predicted vs actual lengths over the last `size` requests."""

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"window size: must be >= 1, got {size}")
        self._pairs: deque[tuple[float, float]] = deque(maxlen=size)

    def observe(self, actual_tokens: int, predicted_tokens: float) -> None:
        if actual_tokens > 0:
            self._pairs.append((predicted_tokens, float(actual_tokens)))

    @property
    def count(self) -> int:
        return len(self._pairs)

    def correlation(self) -> float | None:
        """None with fewer than LEAST_FOR_RANKS pairs or when either side is constant."""
        if len(self._pairs) < LEAST_FOR_RANKS:
            return None
        from scipy.stats import spearmanr

        predicted, actual = np.asarray(self._pairs).T
        if np.ptp(predicted) == 0 or np.ptp(actual) == 0:  # no order to agree on
            return None
        return float(spearmanr(predicted, actual).statistic)


def held_out_coverage(metrics: Mapping[str, float]) -> float | None:
    """The registered held-out coverage of a bound: the mean of its `coverage_at_<g>` metrics
    (`predictors.length_bounds.coverage_metrics`, one per refinement point g). Online, a request's
    bound is the one refined last, at whichever point it reached, so the points are pooled."""
    values = [v for k, v in metrics.items() if k.startswith("coverage_at_")]
    return sum(values) / len(values) if values else None


def drift_alarm(window: BoundWindow, held_out: float | None, margin: float, least_requests: int) -> bool:
    """True when the window holds at least `least_requests` requests and its coverage is more than
    `margin` below `held_out` (no alarm without a held-out figure to compare with)."""
    coverage = window.coverage
    if held_out is None or coverage is None or window.count < least_requests:
        return False
    return coverage < held_out - margin
