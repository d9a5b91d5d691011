"""Equation 5 of the EWSJF paper and its structural terms, by hand: compactness C = 1 - mean CV
inside queues, balance L = 1 / (1 + CV of queue loads), proliferation S = queues / max_queues,
R = l1 C + l2 L - l3 S - l4 U."""

from __future__ import annotations

import numpy as np
import pytest

from predictors.ewsjf_meta import (
    EwsjfMetaPolicy,
    QueueSpec,
    equation5,
    layout_group_terms,
    layout_terms,
)

LENGTHS = np.arange(10.0, 400.0, 7.0)


def test_the_layout_terms_by_hand():
    # Queue A holds 10 and 30 (mean 20, population std 10: CV 0.5), queue B four 100s (CV 0):
    # C = 1 - (0.5 + 0) / 2 = 0.75. Loads 2 and 4 (mean 3, std 1: CV 1/3): L = 1 / (4/3) = 0.75.
    # Two queues of at most eight: S = 0.25.
    terms = layout_group_terms([np.array([10.0, 30.0]), np.full(4, 100.0)], num_queues=2, max_queues=8)
    assert terms == pytest.approx(
        {"compactness": 0.75, "balance": 0.75, "proliferation": 0.25, "queues": 2.0}
    )
    # A queue of one request has no spread to count; one queue is perfectly balanced.
    alone = layout_group_terms([np.array([7.0])], num_queues=1, max_queues=4)
    assert alone == pytest.approx({"compactness": 1.0, "balance": 1.0, "proliferation": 0.25, "queues": 1.0})


def test_lengths_are_routed_to_the_queue_whose_low_end_they_reach():
    queues = [QueueSpec(1, 49, 25, 0.5), QueueSpec(50, 200, 100, 0.5)]
    lengths = np.array([10.0, 30.0, 100.0, 100.0, 100.0, 100.0])
    by_hand = layout_group_terms([np.array([10.0, 30.0]), np.full(4, 100.0)], 2, 8)
    assert layout_terms(queues, lengths, max_queues=8) == pytest.approx(by_hand)
    below = layout_terms(queues, np.array([0.0, 10.0, 30.0, 100.0]), max_queues=8)  # 0 joins queue 1
    assert below == pytest.approx(layout_group_terms([np.array([0.0, 10.0, 30.0]), np.array([100.0])], 2, 8))


def test_equation5_by_hand():
    terms = {"compactness": 0.75, "balance": 0.75, "proliferation": 0.25}
    assert equation5(terms) == pytest.approx(0.75 + 0.75 - 0.25)  # no latency term: a layout alone
    assert equation5({**terms, "latency": 0.5}, (1.0, 2.0, 3.0, 4.0)) == pytest.approx(
        0.75 + 1.5 - 0.75 - 2.0
    )


@pytest.mark.parametrize(
    "params",
    [{"max_queues": 0}, {"max_queues": 2.5}, {"k": 0, "partition": "kmeans"}, {"k": True}],
    ids=["no-queues", "half-a-queue", "no-clusters", "a-boolean"],
)
def test_a_queue_or_cluster_count_that_is_not_a_whole_number_from_one_is_refused_by_name(params):
    """max_queues = 0 used to fail deep in pruning (argmin of nothing), k = 0 to run k = 1."""
    name = next(iter(params))
    with pytest.raises(ValueError, match=rf"{name}: expected a whole number >= 1, got {params[name]!r}"):
        EwsjfMetaPolicy(**params).fit(LENGTHS)


def test_a_table_of_lengths_is_refused_rather_than_fitted_or_scored_flattened():
    table = LENGTHS.reshape(-1, 2)
    with pytest.raises(ValueError, match=r"1-D window of prompt lengths, got shape \(28, 2\)"):
        EwsjfMetaPolicy().fit(table)
    with pytest.raises(ValueError, match="1-D window"):
        EwsjfMetaPolicy().fit(LENGTHS).evaluate(table)
