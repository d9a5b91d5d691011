"""Discrete output-length distributions, and the scores that say how good a predicted one is.

SageSched predicts a *distribution* of output lengths rather than one number, because the same
prompt yields different lengths run to run. A prediction is the empirical distribution of the
lengths of similar past requests, compressed to at most `max_support` points so that a Gittins
index over it stays O(K) per request. Scores compare a prediction with the lengths actually seen for
the same prompt (in AlpacaEval: the responses of 24 different models):

- `wasserstein`: W1 between the two distributions, in tokens (lower is better).
- `crps`: continuous ranked probability score of each observed length, averaged (tokens, lower).
- `bucket_overlap`: sum over 20 length buckets of min(predicted mass, observed mass); for a point
  prediction it is the observed mass in the bucket the point falls into -- the "bucket hit" view of
  the SageSched paper (section 2, Fig. 2a: 34.1% for a DistilBERT point predictor).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

BUCKETS = 20
BUCKET_WIDTH = 100  # tokens; the last bucket is open-ended (>= 1,900)
_QUANTILE_GRID = np.linspace(0.0025, 0.9975, 200)


@functools.cache
def _equal_count_bins(size: int, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Edges and counts of `bins` equal-count bins over `size` sorted samples. Cached: predictions
    draw on a handful of neighbour counts, and `linspace` costs more than the rest of a prediction."""
    edges = np.linspace(0, size, bins + 1).astype(np.int64)
    edges.flags.writeable = False
    counts = np.diff(edges)
    counts.flags.writeable = False
    return edges, counts


@dataclass(frozen=True)
class LengthDistribution:
    """Support points (ascending, tokens) and their probabilities (summing to 1)."""

    support: np.ndarray
    probs: np.ndarray

    @classmethod
    def from_samples(cls, samples: np.ndarray, max_support: int = 32) -> LengthDistribution:
        """The empirical distribution of `samples`; with more distinct values than `max_support`,
        equal-mass bins represented by their mean (which keeps the mean exact)."""
        values = np.sort(np.asarray(samples, dtype=np.float64))
        if values.size == 0:
            raise ValueError("from_samples: no samples")
        # np.unique(values, return_counts=True) without its second sort (this runs per prediction)
        first = np.empty(values.size, dtype=bool)
        first[0] = True
        np.not_equal(values[1:], values[:-1], out=first[1:])
        if np.count_nonzero(first) <= max_support:
            return cls(values[first], np.diff(np.flatnonzero(first), append=values.size) / values.size)
        edges, counts = _equal_count_bins(values.size, max_support)
        return cls(np.add.reduceat(values, edges[:-1]) / counts, counts / values.size)

    @classmethod
    def point(cls, value: float) -> LengthDistribution:
        return cls(np.array([float(value)]), np.array([1.0]))

    @classmethod
    def uniform(cls, low: float, high: float, points: int = 32) -> LengthDistribution:
        support = np.unique(np.round(np.linspace(low, high, points)))
        return cls(support, np.full(support.size, 1.0 / support.size))

    def mix(self, other: LengthDistribution, weight_other: float) -> LengthDistribution:
        """(1 - w) * self + w * other (the paper's robustness ablation mixes in a uniform 1:4)."""
        support = np.concatenate([self.support, other.support])
        probs = np.concatenate([self.probs * (1.0 - weight_other), other.probs * weight_other])
        order = np.argsort(support, kind="stable")
        return LengthDistribution(support[order], probs[order])

    @property
    def mean(self) -> float:
        return float(self.support @ self.probs)

    def quantile(self, q: np.ndarray | float) -> np.ndarray:
        """Left-continuous inverse CDF: the smallest support point with CDF >= q."""
        cdf = np.cumsum(self.probs)
        index = np.searchsorted(cdf, np.asarray(q) - 1e-12, side="left")
        return self.support[np.minimum(index, self.support.size - 1)]


def wasserstein(predicted: LengthDistribution, observed: np.ndarray) -> float:
    """W1 distance (tokens) between a predicted distribution and observed lengths, by quantiles."""
    observed_q = np.quantile(np.asarray(observed, dtype=np.float64), _QUANTILE_GRID, method="inverted_cdf")
    return float(np.mean(np.abs(predicted.quantile(_QUANTILE_GRID) - observed_q)))


def crps(predicted: LengthDistribution, observed: np.ndarray) -> float:
    """Mean CRPS of the observed lengths: E|X - y| - E|X - X'| / 2 for X, X' ~ predicted."""
    x, p = predicted.support, predicted.probs
    spread = float(p @ np.abs(x[:, None] - x[None, :]) @ p)
    y = np.asarray(observed, dtype=np.float64)
    return float(np.mean(np.abs(x[None, :] - y[:, None]) @ p) - spread / 2.0)


def bucket_masses(support: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Mass in each of the BUCKETS length buckets of BUCKET_WIDTH tokens (last one open)."""
    index = np.minimum((np.asarray(support) // BUCKET_WIDTH).astype(np.int64), BUCKETS - 1)
    return np.bincount(index, weights=probs, minlength=BUCKETS)


def bucket_overlap(predicted: LengthDistribution, observed: np.ndarray) -> float:
    observed = np.asarray(observed, dtype=np.float64)
    truth = bucket_masses(observed, np.full(observed.size, 1.0 / observed.size))
    return float(np.minimum(bucket_masses(predicted.support, predicted.probs), truth).sum())
