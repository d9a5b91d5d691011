"""Fast exact quantile predictions from a fitted quantile-forest model, for per-request use.

`RandomForestQuantileRegressor.predict` is built for batch scoring: every call goes through
scikit-learn's joblib dispatch for `apply` and then, per row, zeroes and scans a weight vector over
*all* training samples, so one row costs ~5 ms on these machines (the JITServe paper reports 7 ms).
A scheduler asks for one bound at a time or a few hundred at a frame boundary, so this module
reads the fitted forest once and answers the same question with numpy only:

1. all trees are stacked into one node table and traversed together, level by level, for every
   row at once (leaves loop to themselves, so `max_depth` rounds suffice);
2. each leaf's training samples are stored as ranks into the sorted training targets, keyed by
   (leaf, rank) in one sorted array; the number of samples <= rank r across a row's leaves is then
   one `searchsorted`, and the k-th smallest of the union of leaves is a vectorised binary search
   over r. A handful of rows is cheaper the direct way: gather the ranks, `np.partition`.

With quantile-forest's defaults (`weighted_quantile=True`, `weighted_leaves=False`,
`aggregate_leaves_first=True`, linear interpolation) the prediction is the linear-interpolated
quantile of the multiset union of the row's leaf samples -- exactly what this computes (tests check
equality with `predict`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_RANK_BITS = 32
_SMALL_BATCH = 4  # up to this many rows, gathering the leaves' samples beats the binary search


class CompiledQuantileForest:
    """Read-only numpy form of a fitted `RandomForestQuantileRegressor` (single output)."""

    def __init__(self, forest: Any) -> None:
        y_leaves = np.asarray(forest.forest_.y_train_leaves)  # (trees, nodes, outputs, samples), 1-based
        if y_leaves.shape[2] != 1:
            raise ValueError("compiled forest: single-output forests only")
        self.y_sorted = np.asarray(forest.forest_.y_train)[0]
        self.n_features = int(forest.n_features_in_)
        left, right, feature, threshold, roots, keys, starts = [], [], [], [], [], [], [0]
        offset = 0
        for t, estimator in enumerate(forest.estimators_):
            tree = estimator.tree_
            nodes = np.arange(tree.node_count)
            leaf = tree.children_left == -1
            left.append(np.where(leaf, nodes, tree.children_left) + offset)
            right.append(np.where(leaf, nodes, tree.children_right) + offset)
            feature.append(np.where(leaf, 0, tree.feature))
            threshold.append(np.where(leaf, np.inf, tree.threshold))
            roots.append(offset)
            for node in range(tree.node_count):
                ranks = y_leaves[t, node, 0]
                ranks = np.sort(ranks[ranks != 0] - 1)
                keys.append(((offset + node) << _RANK_BITS) + ranks)
                starts.append(starts[-1] + len(ranks))
            offset += tree.node_count
        self.left = np.concatenate(left)
        self.right = np.concatenate(right)
        self.feature = np.concatenate(feature)
        self.threshold = np.concatenate(threshold)
        self.roots = np.asarray(roots, dtype=np.int64)
        self.keys = np.concatenate(keys).astype(np.int64)
        self.ranks = self.keys & ((1 << _RANK_BITS) - 1)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.depth = max(estimator.tree_.max_depth for estimator in forest.estimators_)

    def _select(self, leaves: np.ndarray, quantile: float) -> float:
        """One row: gather its leaves' ranks and pick the two order statistics around the quantile."""
        ranks = np.concatenate(
            [
                self.ranks[a:b]
                for a, b in zip(self.starts[leaves].tolist(), self.starts[leaves + 1].tolist(), strict=True)
            ]
        )
        position = quantile * (len(ranks) - 1)
        below = int(position)
        above = min(below + 1, len(ranks) - 1)
        ordered = np.partition(ranks, (below, above))
        low, high = self.y_sorted[ordered[below]], self.y_sorted[ordered[above]]
        return float(low + (high - low) * (position - below))

    def leaves(self, X: np.ndarray) -> np.ndarray:
        """(rows, trees) global leaf ids."""
        node = np.broadcast_to(self.roots, (len(X), len(self.roots))).copy()
        rows = np.arange(len(X))[:, None]
        for _ in range(self.depth):
            go_left = X[rows, self.feature[node]] <= self.threshold[node]
            node = np.where(go_left, self.left[node], self.right[node])
        return node

    def predict(self, X: np.ndarray, quantile: float) -> np.ndarray:
        """The `quantile` of the union of each row's leaf samples, linearly interpolated.

        X is checked as the library's `predict` checks it: unchecked, a row of the wrong width is
        routed on whatever columns the node table indexes and an infinite value down one side of
        every split, each to a plausible number. NaN is refused too, though scikit-learn's trees
        route it to a side learnt in `fit`: this table does not keep that side (a guess differed by
        up to 27 tokens in a probe). A quantile outside [0, 1] has no order statistic to pick."""
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"quantile: expected a number in [0, 1], got {quantile!r}")
        with np.errstate(over="ignore"):  # a value past float32's range becomes inf, refused below
            X = np.asarray(X, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(
                f"X has shape {X.shape}, but the forest was fitted on {self.n_features} features per row"
            )
        if not np.isfinite(X).all():
            raise ValueError("Input X contains NaN, infinity or a value too large for dtype('float32').")
        node = self.leaves(X)
        if len(X) <= _SMALL_BATCH:
            return np.array([self._select(leaves, quantile) for leaves in node])
        base = node.astype(np.int64) << _RANK_BITS
        first = self.starts[node]
        total = (self.starts[node + 1] - first).sum(axis=1)
        position = quantile * (total - 1)
        below = np.floor(position).astype(np.int64)

        def kth(k: np.ndarray) -> np.ndarray:
            lo = np.zeros(len(X), dtype=np.int64)
            hi = np.full(len(X), len(self.y_sorted) - 1, dtype=np.int64)
            while (lo < hi).any():
                mid = (lo + hi) // 2
                count = (np.searchsorted(self.keys, base + mid[:, None], side="right") - first).sum(axis=1)
                enough = count >= k + 1
                hi = np.where(enough, mid, hi)
                lo = np.where(enough, lo, mid + 1)
            return self.y_sorted[lo]

        low = kth(below)
        high = kth(np.minimum(below + 1, total - 1))
        return low + (high - low) * (position - below)
