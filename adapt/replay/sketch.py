"""A mergeable quantile sketch: weighted values in log-spaced buckets.

A replay emits one TBT sample per output token -- hundreds of millions for a million-request trace
-- so keeping them to take a percentile at the end would make memory grow with the trace, not with
what is in flight. Bucket i holds the values in (gamma^(i-1), gamma^i] with gamma = (1+a)/(1-a), and
a quantile answers with the bucket's midpoint 2 gamma^i / (gamma + 1), within relative error `a` of
the exact inverted-CDF quantile (the idea of DDSketch: Masson, Rim and Lee, VLDB 2019). Memory is one
entry per bucket touched, at most ~log(max/min) / (2a); two sketches merge by adding counts, so the
replicas of a cluster (or the cells of a sweep) combine exactly as one run would. Each bucket also
keeps its smallest and largest value and the answer is clamped to them, so a bucket holding one
distinct value (a step time every request in a run shares) answers it exactly.
"""

from __future__ import annotations

import math
from array import array

import numpy as np

DEFAULT_RELATIVE_ACCURACY = 1e-4
# Single values are buffered and bucketed in batches: one numpy call per batch, not per token.
_FLUSH_AT = 65_536


class QuantileSketch:
    """Weighted values; `quantile(q)` within `relative_accuracy` of the exact one. Values <= 0 (a
    token delivered with its predecessor) are counted exactly in a zero bucket."""

    def __init__(self, relative_accuracy: float = DEFAULT_RELATIVE_ACCURACY) -> None:
        if not 0 < relative_accuracy < 1:
            raise ValueError(f"relative_accuracy: must be in (0, 1), got {relative_accuracy}")
        self.relative_accuracy = relative_accuracy
        self._log_gamma = math.log((1 + relative_accuracy) / (1 - relative_accuracy))
        self._weights: dict[int, float] = {}
        self._range: dict[int, tuple[float, float]] = {}
        self._zero = 0.0
        self._pending = array("d")

    def add(self, value: float) -> None:
        """One value of weight 1 (buffered)."""
        self._pending.append(value)
        if len(self._pending) >= _FLUSH_AT:
            self._flush()

    def add_many(self, values: np.ndarray, weight: float = 1.0) -> None:
        """Every value in `values`, each with `weight` (a run of decode steps: each step time counts
        once per request that decoded in it)."""
        values = np.asarray(values, dtype=np.float64).ravel()
        positive = values[values > 0]
        self._zero += weight * (values.size - positive.size)
        if positive.size == 0:
            return
        positive = np.sort(positive)
        buckets, starts, counts = np.unique(
            np.ceil(np.log(positive) / self._log_gamma), return_index=True, return_counts=True
        )
        lows, highs = positive[starts], positive[starts + counts - 1]
        for bucket, count, low, high in zip(
            buckets.astype(np.int64).tolist(), counts.tolist(), lows.tolist(), highs.tolist(), strict=True
        ):
            self._add_bucket(bucket, weight * count, low, high)

    def _add_bucket(self, bucket: int, weight: float, low: float, high: float) -> None:
        self._weights[bucket] = self._weights.get(bucket, 0.0) + weight
        seen = self._range.get(bucket)
        self._range[bucket] = (low, high) if seen is None else (min(seen[0], low), max(seen[1], high))

    def merge(self, other: QuantileSketch) -> None:
        if other.relative_accuracy != self.relative_accuracy:
            raise ValueError("cannot merge sketches of different relative accuracy")
        other._flush()
        self._zero += other._zero
        for bucket, weight in other._weights.items():
            self._add_bucket(bucket, weight, *other._range[bucket])

    @property
    def total_weight(self) -> float:
        self._flush()
        return self._zero + sum(self._weights.values())

    def quantile(self, q: float) -> float | None:
        """The q-th percentile (0-100) by the inverted CDF, as `weighted_percentile` takes it;
        None when empty."""
        self._flush()
        total = self._zero + sum(self._weights.values())
        if total <= 0:
            return None
        target = q / 100.0 * total
        if self._zero >= target and self._zero > 0:
            return 0.0
        buckets = sorted(self._weights)
        cumulative = self._zero + np.cumsum([self._weights[b] for b in buckets])
        index = min(int(np.searchsorted(cumulative, target, side="left")), len(buckets) - 1)
        bucket = buckets[index]
        middle = 2.0 * math.exp(bucket * self._log_gamma) / (math.exp(self._log_gamma) + 1.0)
        low, high = self._range[bucket]
        return min(max(middle, low), high)

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = np.frombuffer(self._pending, dtype=np.float64).copy(), array("d")
            self.add_many(pending)
