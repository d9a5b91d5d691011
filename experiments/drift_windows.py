"""The drift study's arithmetic: a headline per window of simulated time, the headline after a
shift, and the time until the retraining loop is back within a tolerance of the oracle.

Requests are assigned to the window their arrival falls in (a request's latency belongs to the
traffic it came with, not to when it finished), and a window's headline is the mean of its
requests' values. Kept apart from the study so these rules are tested on hand-computed cases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def window_means(arrival_s: np.ndarray, values: np.ndarray, window_s: float, num_windows: int) -> list[float]:
    """Mean of `values` over the requests arriving in [k * window_s, (k + 1) * window_s), for
    k = 0 .. num_windows - 1 (NaN for a window with none; NaN values are left out)."""
    if not window_s > 0:
        raise ValueError(f"window_s: must be > 0, got {window_s}")
    index = np.floor(np.asarray(arrival_s, dtype=np.float64) / window_s).astype(np.int64)
    values = np.asarray(values, dtype=np.float64)
    means = []
    for k in range(num_windows):
        chosen = values[(index == k) & ~np.isnan(values)]
        means.append(float(chosen.mean()) if len(chosen) else math.nan)
    return means


def mean_after(arrival_s: np.ndarray, values: np.ndarray, shift_s: float) -> float:
    """Mean of `values` over every request arriving at or after `shift_s` (the windows after the
    shift pooled, so a sparse window does not weigh as much as a full one)."""
    values = np.asarray(values, dtype=np.float64)
    chosen = values[(np.asarray(arrival_s) >= shift_s) & ~np.isnan(values)]
    return float(chosen.mean()) if len(chosen) else math.nan


def mean_before(arrival_s: np.ndarray, values: np.ndarray, shift_s: float) -> float:
    """Mean of `values` over the requests arriving before `shift_s`."""
    values = np.asarray(values, dtype=np.float64)
    chosen = values[(np.asarray(arrival_s) < shift_s) & ~np.isnan(values)]
    return float(chosen.mean()) if len(chosen) else math.nan


def within(value: float, reference: float, tolerance: float, higher_is_better: bool) -> bool:
    """Whether `value` is no worse than `reference` by more than `tolerance` (relative)."""
    if higher_is_better:
        return value >= reference * (1.0 - tolerance)
    return value <= reference * (1.0 + tolerance)


def recovery_s(
    loop: Sequence[float],
    oracle: Sequence[float],
    window_s: float,
    shift_s: float,
    *,
    tolerance: float = 0.05,
    higher_is_better: bool = False,
    sustained: bool = False,
) -> float | None:
    """Seconds from the shift to the start of the first window that starts at or after it and
    whose loop headline is within `tolerance` of the oracle's (None: no such window). With
    `sustained`, the first such window from which every later window is within too: a loop that
    is close in the first window, before the stale part has done harm, and falls behind later
    has not recovered. Windows without a value on either side are skipped."""
    found = None
    for k, (ours, best) in enumerate(zip(loop, oracle, strict=True)):
        start = k * window_s
        if start < shift_s - 1e-9 or math.isnan(ours) or math.isnan(best):
            continue
        if within(ours, best, tolerance, higher_is_better):
            if found is None:
                found = start - shift_s
                if not sustained:
                    return found
        elif sustained:
            found = None
    return found
