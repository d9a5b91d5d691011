"""`cost-model`: per-step batch time fitted to a real engine's step log.

The replay engine's roofline is an assumption about hardware efficiency; this component replaces it
with what an engine actually measured. It regresses step duration on the features every step log
records (the same ones the roofline uses):

    duration = c0 + c1 * tokens + c2 * sampled + c3 * attention_units + c4 * kv_read + c5 * decodes
               + c6 * arrivals

`arrivals` (`adapt.steplog.ARRIVALS`) counts the requests whose intake ran before the next step; c6
is the replay engine's `arrival_overhead_s`, charged between steps rather than to a batch. On the
CPU engine with a tiny model it is larger than a whole decode step (~3 ms against ~2.5 ms), and
without it replay missed every arrival's intake. Logs without the column fit c6 = 0. All with
non-negative coefficients (non-negative least squares: every feature can only add time), so
it extrapolates sanely to batches bigger than those seen. Six coefficients need far more than six
steps to mean anything, so it refuses fewer than `least_data` (20); and a step time is physical only
when positive and under `MAX_STEP_S` (an hour): a model predicting otherwise on held-out steps or on
its canaries -- fitted to a log of zeros or of 1e300s -- never reaches the registry. Saved as JSON.
It offers the cost-model interface of the replay engine (`time`, `decode_run_times`, `kv_capacity_tokens`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Self

import numpy as np

from adapt.component import ComponentError, LearnedComponent, data_fingerprint
from adapt.steplog import ARRIVALS, STEP_FIELDS, StepBatch, attention_work

FEATURES: tuple[str, ...] = (
    "intercept", "tokens", "sampled", "attn_units", "kv_read", "num_decodes", ARRIVALS
)  # fmt: skip
MAX_STEP_S = 3600.0  # no engine step of any model on any hardware takes an hour


def _design(columns: dict[str, Any]) -> np.ndarray:
    """Feature matrix from step-log columns (arrays or scalars of equal length): the step's
    features combined exactly as the roofline combines them (`adapt.steplog.attention_work`)."""
    tokens = np.atleast_1d(np.asarray(columns["tokens"], dtype=np.float64))
    n = len(tokens)

    def col(name: str) -> np.ndarray:
        return np.broadcast_to(np.asarray(columns.get(name, 0.0), dtype=np.float64), (n,))

    batch = StepBatch(tokens, *(col(name) for name in STEP_FIELDS[1:]))
    attn, kv_read = attention_work(batch)
    return np.column_stack(
        [np.ones(n), tokens, batch.sampled, attn, kv_read, batch.num_decodes, col(ARRIVALS)]
    )


class FittedCostModel(LearnedComponent):
    """Linear non-negative model of step time; `kv_capacity_tokens` is the engine's KV size."""

    name = "cost-model"
    primary_metric = "mape"
    lower_is_better = True
    least_data = 20
    data_unit = "steps"

    def __init__(self, kv_capacity: int = 50_000) -> None:
        self.kv_capacity = kv_capacity

    def fit(self, data: dict[str, Any]) -> Self:
        """`data`: step-log columns (`adapt.steplog.STEP_LOG_COLUMNS`), e.g. a DataFrame or dict."""
        from scipy.optimize import nnls

        self.require_data(data["duration_s"])
        X = _design(data)
        y = np.asarray(data["duration_s"], dtype=np.float64)
        # Scale columns so NNLS is well conditioned, then unscale the coefficients.
        scale = np.maximum(np.abs(X).max(axis=0), 1e-12)
        coef, _ = nnls(X / scale, y)
        self.coef_ = coef / scale
        self.metadata.update(
            data_hash=data_fingerprint(X, y), data_window={"steps": len(y)}, trained_on="step log"
        )
        return self

    def predict(self, data: dict[str, Any]) -> np.ndarray:
        if not hasattr(self, "coef_"):
            raise ComponentError("cost-model: not fitted")
        return _design(data) @ self.coef_

    def speed_factor(self, data: dict[str, Any]) -> float:
        """How slow the machine ran in a step log against this model: its steps' measured time over
        the time this model gives the same batches (1.2: every step took 20% longer, e.g. another
        process shared the cores). A ratio of sums, so long steps weigh as much as they last."""
        predicted = float(self.predict(data).sum())
        if not predicted > 0:
            raise ComponentError("cost-model: no step time predicted for this log")
        return float(np.asarray(data["duration_s"], dtype=np.float64).sum()) / predicted

    def at_speed(self, factor: float) -> FittedCostModel:
        """This model on a machine running `factor` times as slow: every step and every arrival's
        intake takes `factor` times as long. The model is linear in its coefficients, so that is
        the same fit with each coefficient scaled; this model is left as it is."""
        if not hasattr(self, "coef_"):
            raise ComponentError("cost-model: not fitted")
        if not (np.isfinite(factor) and factor > 0):
            raise ValueError(f"cost-model: a speed factor must be finite and > 0, got {factor}")
        scaled = FittedCostModel(self.kv_capacity)
        scaled.coef_ = self.coef_ * factor
        return scaled

    def evaluate(self, data: dict[str, Any]) -> dict[str, float]:
        y = np.asarray(data["duration_s"], dtype=np.float64)
        pred = self.predict(data)
        ape = np.abs(pred - y) / np.maximum(y, 1e-9)
        residual = np.sum((y - pred) ** 2)
        total = np.sum((y - y.mean()) ** 2)
        return {
            "mape": float(ape.mean()),
            "median_ape": float(np.median(ape)),
            "r2": float(1 - residual / total) if total > 0 else 1.0,
            "steps": float(len(y)),
            "predicted_min_s": float(pred.min()),
            "predicted_max_s": float(pred.max()),
        }

    def check_metrics(self, metrics: dict[str, float | None]) -> None:
        """Finite metrics, and every held-out step predicted to take a physical time."""
        super().check_metrics(metrics)
        low, high = metrics["predicted_min_s"], metrics["predicted_max_s"]
        if not (low > 0 and high < MAX_STEP_S):  # type: ignore[operator]
            raise ComponentError(
                f"cost-model: held-out step times predicted {low:.4g}..{high:.4g} s; a step takes"
                f" more than 0 and less than {MAX_STEP_S:.0f} s"
            )

    # -------------------------------------------------- replay-engine interface
    def time(self, batch) -> np.ndarray | float:
        columns = {name: getattr(batch, name) for name in STEP_FIELDS}
        out = self.predict(columns)
        return float(out[0]) if np.ndim(batch.tokens) == 0 else out

    def decode_run_times(
        self, num_decodes: int, context_sum: int, context_max: int, steps: int
    ) -> np.ndarray:
        i = np.arange(steps, dtype=np.float64)
        return self.predict(
            {
                "tokens": np.full(steps, float(num_decodes)),
                "sampled": float(num_decodes),
                "num_decodes": float(num_decodes),
                "decode_ctx_sum": context_sum + num_decodes * i,
            }
        )

    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity

    @property
    def arrival_overhead_s(self) -> float:
        if not hasattr(self, "coef_"):
            raise ComponentError("cost-model: not fitted")
        return float(self.coef_[FEATURES.index(ARRIVALS)])

    # ------------------------------------------------------------ persistence
    def save_state(self, directory: Path) -> None:
        if not hasattr(self, "coef_"):
            raise ComponentError("cost-model: not fitted")
        (directory / "coefficients.json").write_text(
            json.dumps({"features": list(FEATURES), "coef": self.coef_.tolist()}, indent=2)
        )

    def load_state(self, directory: Path) -> None:
        data = json.loads((directory / "coefficients.json").read_text())
        features, coef = tuple(data["features"]), list(data["coef"])
        if features == FEATURES[:-1]:  # saved before arrivals were logged: no intake cost known
            features, coef = FEATURES, [*coef, 0.0]
        if features != FEATURES:
            raise ComponentError(f"cost-model: unexpected features {data['features']}")
        self.coef_ = np.asarray(coef, dtype=np.float64)

    def validate(self) -> None:
        """Canaries: finite, positive, and more work never takes less time."""
        if not hasattr(self, "coef_") or not np.all(np.isfinite(self.coef_)) or np.any(self.coef_ < 0):
            raise ComponentError("cost-model: coefficients must be finite and non-negative")
        small = self.predict({"tokens": 1, "sampled": 1, "num_decodes": 1, "decode_ctx_sum": 100})
        big = self.predict({"tokens": 2048, "sampled": 1, "prefill_attn_units": 2048 * 1024.5})
        if not (0 < small[0] <= big[0] < MAX_STEP_S):
            raise ComponentError(
                f"cost-model: canary step times {small[0]:.4g}s / {big[0]:.4g}s are implausible"
                f" (positive, more work not faster, under {MAX_STEP_S:.0f} s)"
            )
