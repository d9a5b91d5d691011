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
from collections.abc import Mapping
from numbers import Integral
from pathlib import Path
from typing import Any, Self

import numpy as np

from adapt.component import ComponentError, LearnedComponent, data_fingerprint
from adapt.steplog import ARRIVALS, STEP_FIELDS, STEP_LOG_COLUMNS, StepBatch, attention_work
from predictors import require_fitted

FEATURES: tuple[str, ...] = (
    "intercept", "tokens", "sampled", "attn_units", "kv_read", "num_decodes", ARRIVALS
)  # fmt: skip
MAX_STEP_S = 3600.0  # no engine step of any model on any hardware takes an hour
STEP_LOG_KEYS = frozenset({*STEP_LOG_COLUMNS, "start_s"})  # what `predict` takes


def _design(columns: Mapping[str, Any]) -> np.ndarray:
    """Feature matrix from step-log columns (arrays or scalars of equal length): the step's
    features combined exactly as the roofline combines them (`adapt.steplog.attention_work`).

    Every STEP_FIELDS column must be there and hold counts >= 0; only ARRIVALS may be absent (logs
    from before arrivals were counted, and the replay engine's, which has none: c6 = 0). A missing
    or misspelt column used to read as zeros, fitting or asking the model as if that work had not
    been done; a negative count is no step's."""
    missing = [name for name in STEP_FIELDS if name not in columns]
    if missing:
        raise ValueError(
            f"cost-model: step column(s) {', '.join(missing)} missing (only {ARRIVALS} may be absent)"
        )
    names = (*STEP_FIELDS, ARRIVALS) if ARRIVALS in columns else STEP_FIELDS
    raw = np.empty((len(names), np.size(columns["tokens"])))
    for row, name in enumerate(names):
        raw[row] = columns[name]  # a scalar is broadcast over the steps
    counts = (raw >= 0).all(axis=1)  # NaN is no count either
    if not counts.all():
        row = int(np.argmin(counts))
        raise ValueError(f"cost-model: {names[row]}: expected counts >= 0, got {float(raw[row].min())!r}")
    batch = StepBatch(*raw[: len(STEP_FIELDS)])
    attn, kv_read = attention_work(batch)
    arrivals = raw[-1] if ARRIVALS in columns else np.zeros(raw.shape[1])
    return np.column_stack(
        [np.ones(raw.shape[1]), batch.tokens, batch.sampled, attn, kv_read, batch.num_decodes, arrivals]
    )


def _step_columns(log: Mapping[str, Any]) -> dict[str, Any]:
    """The columns of a step log the model reads. A log may hold more -- its start times, the
    policy's time, a measurement's notes (the bundled H100 logs' `gpu`, `eager_s`) -- so scoring a
    log (`evaluate`, `speed_factor`) hands `predict` only these: `predict` refuses a key that is
    no step-log column, where a misspelt `arrivals` would otherwise predict no intake at all."""
    return {name: log[name] for name in (*STEP_FIELDS, ARRIVALS) if name in log}


class FittedCostModel(LearnedComponent):
    """Linear non-negative model of step time; `kv_capacity_tokens` is the engine's KV size."""

    name = "cost-model"
    primary_metric = "mape"
    lower_is_better = True
    least_data = 20
    data_unit = "steps"

    def __init__(self, kv_capacity: int = 50_000) -> None:
        self.kv_capacity = kv_capacity

    def _validate_params(self) -> None:
        """Checked by `fit` and `load_state`, not `__init__`: scikit-learn's `set_params` and
        `clone` store values unchecked. A capacity that is not a whole number of tokens (a string
        once loaded unchecked) would only fail inside the replay engine."""
        capacity = self.kv_capacity
        if isinstance(capacity, bool) or not isinstance(capacity, Integral) or capacity < 1:
            raise ValueError(f"kv_capacity: expected a whole number of tokens >= 1, got {capacity!r}")

    def fit(self, data: dict[str, Any]) -> Self:
        """`data`: step-log columns (`adapt.steplog.STEP_LOG_COLUMNS`), e.g. a DataFrame or dict."""
        from scipy.optimize import nnls

        self._validate_params()
        self.require_data(data["duration_s"])
        X = _design(data)
        y = np.asarray(data["duration_s"], dtype=np.float64)
        # Scale columns so NNLS is well conditioned, then unscale the coefficients.
        scale = np.maximum(np.abs(X).max(axis=0), 1e-12)
        coef, _ = nnls(X / scale, y)
        self.coef_ = coef / scale
        self._record_fit(
            data_hash=data_fingerprint(X, y), data_window={"steps": len(y)}, trained_on="step log"
        )
        return self

    def predict(self, data: Mapping[str, Any]) -> np.ndarray:
        """Seconds for each step of `data`, step-log columns (`_design`). A key that is no
        step-log column is refused: it is a misspelling, not a feature this model has."""
        require_fitted(self, "coef_")
        unknown = sorted(set(data) - STEP_LOG_KEYS)
        if unknown:
            raise ValueError(
                f"cost-model: unknown step column(s) {', '.join(map(str, unknown))};"
                f" expected {', '.join(STEP_LOG_COLUMNS)}"
            )
        return _design(data) @ self.coef_

    def speed_factor(self, data: dict[str, Any]) -> float:
        """How slow the machine ran in a step log against this model: its steps' measured time over
        the time this model gives the same batches (1.2: every step took 20% longer, e.g. another
        process shared the cores). A ratio of sums, so long steps weigh as much as they last."""
        predicted = float(self.predict(_step_columns(data)).sum())
        if not predicted > 0:
            raise ComponentError("cost-model: no step time predicted for this log")
        return float(np.asarray(data["duration_s"], dtype=np.float64).sum()) / predicted

    def at_speed(self, factor: float) -> FittedCostModel:
        """This model on a machine running `factor` times as slow: every step and every arrival's
        intake takes `factor` times as long. The model is linear in its coefficients, so that is
        the same fit with each coefficient scaled; this model is left as it is."""
        require_fitted(self, "coef_")
        if not (np.isfinite(factor) and factor > 0):
            raise ValueError(f"cost-model: a speed factor must be finite and > 0, got {factor}")
        scaled = FittedCostModel(self.kv_capacity)
        scaled.coef_ = self.coef_ * factor
        return scaled

    def evaluate(self, data: dict[str, Any]) -> dict[str, float]:
        """Errors on a held-out step log. `r2` is scikit-learn's `r2_score`: on steps that all
        took the same time it is 1.0 only for a model that predicts that time exactly, else 0.0
        (not 1.0 for any model, as it was)."""
        y = np.asarray(data["duration_s"], dtype=np.float64)
        if not len(y):
            raise ValueError("cost-model: no steps to evaluate")
        pred = self.predict(_step_columns(data))
        ape = np.abs(pred - y) / np.maximum(y, 1e-9)
        residual = np.sum((y - pred) ** 2)
        total = np.sum((y - y.mean()) ** 2)
        return {
            "mape": float(ape.mean()),
            "median_ape": float(np.median(ape)),
            "r2": float(1 - residual / total) if total > 0 else float(residual == 0),
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
        decodes = StepBatch(  # decode-only steps: no prefill work
            tokens=np.full(steps, float(num_decodes)),
            sampled=float(num_decodes),
            num_decodes=float(num_decodes),
            decode_ctx_sum=context_sum + num_decodes * i,
            decode_ctx_max=context_max + i,
        )
        return self.predict(decodes._asdict())

    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity

    @property
    def arrival_overhead_s(self) -> float:
        require_fitted(self, "coef_")
        return float(self.coef_[FEATURES.index(ARRIVALS)])

    # ------------------------------------------------------------ persistence
    def save_state(self, directory: Path) -> None:
        require_fitted(self, "coef_")
        (directory / "coefficients.json").write_text(
            json.dumps({"features": list(FEATURES), "coef": self.coef_.tolist()}, indent=2)
        )

    def load_state(self, directory: Path) -> None:
        self._validate_params()
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
        small = self.predict(
            StepBatch(tokens=1, sampled=1, num_decodes=1, decode_ctx_sum=100, decode_ctx_max=100)._asdict()
        )
        big = self.predict(StepBatch(tokens=2048, sampled=1, prefill_attn_units=2048 * 1024.5)._asdict())
        if not (0 < small[0] <= big[0] < MAX_STEP_S):
            raise ComponentError(
                f"cost-model: canary step times {small[0]:.4g}s / {big[0]:.4g}s are implausible"
                f" (positive, more work not faster, under {MAX_STEP_S:.0f} s)"
            )
