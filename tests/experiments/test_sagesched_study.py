"""The SageSched study runs every policy, ablation and ceiling on the same requests and tables them."""

from __future__ import annotations

import numpy as np

from experiments.sagesched_study import NON_ORACLE, markdown, policies, run_study
from predictors.semantic_history import SemanticHistory


def small_history() -> SemanticHistory:
    history = SemanticHistory(fallback_neighbors=5)
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(10, 2000, 50).tolist(), rng.integers(5, 800, 50).tolist()
    history.observe(prompts, outputs, np.zeros((50, 384), np.float32), [False] * 50)
    return history


def test_the_ceilings_read_true_lengths_and_the_contenders_do_not():
    built = {label: build() for label, build in policies(small_history()).items()}
    ceilings = {label for label in built if label.startswith("ceiling:")}
    assert len(ceilings) == 3
    assert all(built[label].needs_oracle for label in ceilings)
    assert not any(built[label].needs_oracle for label in NON_ORACLE)
    assert {built[label].true_lengths for label in ceilings} == {"all", "text", "no-text"}


def test_a_small_study_tables_every_policy_at_every_rate():
    study = run_study([3.0, 4.5], 40, small_history(), seeds=[1], jobs=1)
    assert set(study["table"]) == set(policies(small_history()))
    assert study["workload"]["token_budget"] == 512  # the workload's own setting
    for label, by_rate in study["table"].items():
        assert set(by_rate) == {"3.0", "4.5"}, label
        assert all(np.isfinite(v) and v > 0 for v in by_rate.values()), label
    text = markdown(study)
    assert "ceiling: true lengths, requests with text" in text and text.count("**") >= 4
