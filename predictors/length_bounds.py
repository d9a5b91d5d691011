"""What every remaining-length *bound* predictor shares (`qrf-length`, `neural-length`).

JITServe re-predicts an upper bound on a request's remaining output every 50 generated tokens.
Both bound predictors are trained and scored the same way, so the comparison between a quantile
forest and a quantile network is on equal terms:

- rows: each response contributes one row per refinement point g it outlives, with target
  "tokens still to come" (`refinement_rows`);
- calibration: a split-conformal factor per refinement point, measured on instructions held out
  of the fit (`calibration_rows`, `conformal_scales`, `apply_scales`), because a model's own high
  quantile under-covers on prompts it has not seen;
- scoring: coverage, mean over-estimation and mean bound after 0/50/100/200 tokens,
  `coverage_error`, the largest miss of the target quantile, and `pinball_loss`, the quantile loss
  the gate compares (`coverage_metrics`): coverage error alone is no score to rank bounds by,
  since a bound ten times too high covers everything and misses a 0.95 quantile by only 0.05;
- evidence: both refuse to fit on fewer than `LEAST_PROMPTS` distinct prompts, and the gate refuses
  a bound whose held-out coverage misses its quantile by more than `COVERAGE_BAND`
  (`check_coverage`): a "0.95 bound" covering 60% of requests is not one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from adapt.component import ComponentError
from adapt.traces import MAX_TOKENS

TRAIN_POINTS: tuple[int, ...] = (0, 50, 100, 200, 400)
EVAL_POINTS: tuple[int, ...] = (0, 50, 100, 200)
MIN_CALIBRATION_ROWS = 30
LEAST_PROMPTS = 10
COVERAGE_BAND = 0.25


def request_counts(
    prompt_tokens: Sequence[float], generated_tokens: Sequence[float], **texts: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, generated tokens) of the requests a bound is asked for, as float64, checked
    where a bound predictor takes them: every column (`texts` too) holds one value per request,
    every count is a finite number in [0, MAX_TOKENS]. Unchecked, log1p makes a negative count NaN
    and 1e300 a feature far outside anything fitted, each a bound that means nothing, and columns
    of different lengths fail deep in numpy or scikit-learn."""
    columns = {"prompt_tokens": prompt_tokens, "generated_tokens": generated_tokens, **texts}
    sizes = {name: len(column) for name, column in columns.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name}: {size}" for name, size in sizes.items())
        raise ValueError(f"expected one value per request in every column, got {listed}")
    counts = []
    for name in ("prompt_tokens", "generated_tokens"):
        values = np.asarray(columns[name], dtype=np.float64)
        bad = ~(np.isfinite(values) & (values >= 0) & (values <= MAX_TOKENS))
        if values.ndim != 1 or bad.any():
            shown = float(values[bad][0]) if values.ndim == 1 else columns[name]
            raise ValueError(f"{name}: expected token counts in [0, {MAX_TOKENS:,}], got {shown!r}")
        counts.append(values)
    return counts[0], counts[1]


def refinement_rows(output_tokens: Sequence[int], points: Sequence[int]) -> tuple[np.ndarray, ...]:
    """(response index, g, remaining) for every response and every point g < its length."""
    totals = np.asarray(output_tokens, dtype=np.int64)
    index, generated = [], []
    for g in points:
        alive = np.flatnonzero(totals > g)
        index.append(alive)
        generated.append(np.full(len(alive), g, dtype=np.int64))
    index_all = np.concatenate(index) if index else np.zeros(0, dtype=np.int64)
    order = np.argsort(index_all, kind="stable")  # response by response, as the texts are read
    index_all, generated_all = index_all[order], np.concatenate(generated)[order]
    return index_all, generated_all, (totals[index_all] - generated_all).astype(np.float64)


def calibration_rows(texts: Sequence[str], share: float) -> np.ndarray:
    """True for the rows held out to calibrate the bound, chosen by instruction like
    `instruction_split` but from other bits of the hash, so the two splits are independent."""
    from adapt.traces import prompt_hash

    cut = int(share * 1000)
    return np.array([(prompt_hash(t) // 1000) % 1000 < cut for t in texts], dtype=bool)


def conformal_scales(
    remaining: np.ndarray, raw_bound: np.ndarray, generated: np.ndarray, quantile: float
) -> dict[str, float]:
    """Split-conformal correction per refinement point g: the factor c_g such that a share
    `quantile` of the calibration rows satisfy remaining <= c_g * raw bound (the quantile of their
    ratios, rounded up). 1.0 where fewer than MIN_CALIBRATION_ROWS rows reach g."""
    scales = {}
    for g in TRAIN_POINTS:
        ratios = remaining[generated == g] / np.maximum(1.0, raw_bound[generated == g])
        n = len(ratios)
        if n < MIN_CALIBRATION_ROWS:
            scales[str(g)] = 1.0
            continue
        rank = min(n - 1, int(np.ceil((n + 1) * quantile)) - 1)
        scales[str(g)] = float(np.partition(ratios, rank)[rank])
    return scales


def apply_scales(raw_bound: np.ndarray, generated: np.ndarray, scales: dict[str, float]) -> np.ndarray:
    """The calibrated bound: the scale of the last calibration point at or below g applies. A g
    below 0 (or NaN) has no such point: unchecked, it indexed -1 and took the largest g's scale."""
    generated = np.asarray(generated)
    bad = ~(generated >= 0)
    if bad.any():
        raise ValueError(f"generated tokens: expected counts >= 0, got {float(generated[bad][0])!r}")
    if not scales:
        return raw_bound
    at = np.searchsorted(np.asarray(TRAIN_POINTS), generated, side="right") - 1
    return raw_bound * np.asarray([scales[str(p)] for p in TRAIN_POINTS])[at]


def coverage_metrics(
    remaining: np.ndarray, bound: np.ndarray, generated: np.ndarray, quantile: float
) -> dict[str, float]:
    """Coverage (share of remaining <= bound), mean over-estimation (bound / remaining) and mean
    bound at each of EVAL_POINTS; `coverage_error` is the largest |coverage - quantile|, and
    `pinball_loss` the mean quantile (pinball) loss at `quantile` over every row.

    The pinball loss is what the gate ranks two bounds by: it is a proper scoring rule for a
    quantile (its expectation is least at the true one), so it rewards a bound that is both
    calibrated and tight. Coverage error is not: when the served model's answers got half as long
    (AlpacaEval, GPT-4 1106-preview -> 0613), the stale bound covered every held-out answer and
    missed 0.95 by 0.05, a refit on the new answers by 0.077, so a gate on coverage error kept the
    stale one; their pinball losses are 31.0 and 18.6 (`tests/pipelines/test_retrain.py`)."""
    from sklearn.metrics import mean_pinball_loss  # scoring only: a serving process never needs it

    metrics: dict[str, float] = {}
    for g in EVAL_POINTS:
        mask = generated == g
        if mask.any():
            metrics[f"coverage_at_{g}"] = float(np.mean(remaining[mask] <= bound[mask]))
            metrics[f"overestimate_at_{g}"] = float(np.mean(bound[mask] / remaining[mask]))
            metrics[f"bound_mean_at_{g}"] = float(np.mean(bound[mask]))
    metrics["coverage_error"] = max(
        abs(metrics[f"coverage_at_{g}"] - quantile) for g in EVAL_POINTS if f"coverage_at_{g}" in metrics
    )
    metrics["pinball_loss"] = float(mean_pinball_loss(remaining, bound, alpha=quantile))
    return metrics


class BoundEvidence:
    """The evidence rules of a bound predictor (a mixin before `LearnedComponent`): fitted on at
    least LEAST_PROMPTS distinct prompts, registered only with held-out coverage within
    COVERAGE_BAND of its quantile at every refinement point (`coverage_error` is the largest miss)."""

    name: str
    quantile: float
    least_data = LEAST_PROMPTS
    data_unit = "distinct prompts"

    def data_size(self, data: Any) -> int:
        """Distinct prompts (0 without prompt texts): what a bound learnt across prompts has seen."""
        return len(set(data.prompt_text or ()))

    def check_metrics(self, metrics: Mapping[str, float | None]) -> None:
        super().check_metrics(metrics)  # type: ignore[misc]
        miss = metrics["coverage_error"]
        if not miss <= COVERAGE_BAND:  # type: ignore[operator]
            raise ComponentError(
                f"{self.name}: held-out coverage misses its quantile {self.quantile} by {miss:.3f}"
                f" (allowed: {COVERAGE_BAND}); not a {self.quantile} bound"
            )
