"""`neural-length`: a quantile network over prompt embeddings, the learned-network alternative to
`qrf-length` that the papers compare against (JITServe section 4.1 weighs a BERT-style regressor
against its forest; SageSched against a fine-tuned length classifier).

Inputs per row: the prompt's all-MiniLM-L6-v2 embedding (384 numbers, `predictors.embedding`),
log(1 + prompt tokens) and log(1 + g), the tokens generated so far (both standardised). The target
is log(1 + remaining tokens): quantiles survive a monotone transform, and the log keeps 2-token
and 2,000-token answers on one scale. One output per quantile in `quantiles` (pinball loss,
`predictors.quantile_mlp`), the served bound is `quantile`, with the same split-conformal
calibration as `qrf-length` (`predictors.length_bounds`), so the two are scored alike.

State: `weights.safetensors` (the network) and `scaling.json` (feature standardisation and the
conformal factors). Training needs torch and Lightning; serving runs the network in numpy
(`predictors.quantile_net_arrays`: a torch call from a prediction worker's thread slows a CPU
engine's forward).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from adapt.component import ComponentError, LearnedComponent, data_fingerprint
from predictors import require_fitted
from predictors.embedding import DIMENSION, shared_cache
from predictors.length_bounds import (
    EVAL_POINTS,
    TRAIN_POINTS,
    BoundEvidence,
    apply_scales,
    calibration_rows,
    conformal_scales,
    coverage_metrics,
    refinement_rows,
    request_counts,
)
from predictors.quantile_net_arrays import QuantileNetArrays

WEIGHTS_FILE = "weights.safetensors"
SCALING_FILE = "scaling.json"
NUMERIC_FEATURES = 2  # log1p(prompt tokens), log1p(generated)


class NeuralLength(BoundEvidence, LearnedComponent):
    """Upper bound (quantile `quantile`) on the remaining output length (see module docstring)."""

    name = "neural-length"
    primary_metric = "pinball_loss"
    lower_is_better = True

    def __init__(
        self,
        quantiles: Sequence[float] = (0.5, 0.9, 0.95),
        quantile: float = 0.95,
        hidden: int = 128,
        dropout: float = 0.3,
        epochs: int = 5,
        batch_size: int = 512,
        learning_rate: float = 2e-3,
        weight_decay: float = 1e-4,
        calibration_share: float = 0.2,
        random_state: int = 0,
    ) -> None:
        self.quantiles = quantiles
        self.quantile = quantile
        self.hidden = hidden
        self.dropout = dropout
        self.epochs = epochs
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.calibration_share = calibration_share
        self.random_state = random_state

    def _validate_params(self) -> None:
        """Checked by `fit` and `load_state`, not `__init__`: scikit-learn's `set_params` and
        `clone` store values unchecked."""
        quantiles = [float(q) for q in self.quantiles]
        if not quantiles or quantiles != sorted(set(quantiles)):
            raise ValueError(
                f"quantiles: expected distinct values in ascending order, got {self.quantiles!r}"
            )
        if not all(0.0 < q < 1.0 for q in quantiles):
            raise ValueError(f"quantiles: expected values in (0, 1), got {self.quantiles!r}")
        if float(self.quantile) not in quantiles:
            raise ValueError(f"quantile: {self.quantile!r} must be one of quantiles {tuple(quantiles)}")
        if not 0 <= self.calibration_share < 1:
            raise ValueError(
                f"calibration_share: expected a number in [0, 1), got {self.calibration_share!r}"
            )

    # --------------------------------------------------------------- features
    def features(self, prompt_tokens: Sequence[int], prompt_texts: Sequence[str], generated: Sequence[int]):
        """(rows, 384 + 2) float32: embedding, then the standardised log counts."""
        return self._features(prompt_tokens, shared_cache().embed(list(prompt_texts)), generated)

    def _features(self, prompt_tokens: Sequence[int], vectors: np.ndarray, generated: Sequence[int]):
        numeric = np.column_stack(
            [
                np.log1p(np.asarray(prompt_tokens, dtype=np.float64)),
                np.log1p(np.asarray(generated, dtype=np.float64)),
            ]
        )
        numeric = (numeric - self.mean_) / self.std_
        return np.hstack([vectors, numeric]).astype(np.float32)

    def _new_net(self):
        from predictors.quantile_mlp import QuantileNet

        return QuantileNet(DIMENSION + NUMERIC_FEATURES, self.hidden, len(self.quantiles), self.dropout)

    def _serve(self, weights: dict[str, np.ndarray]) -> None:
        """Serve `weights` (QuantileNet's state by name) with the numpy network, which keeps them."""
        self.net_ = QuantileNetArrays(weights, DIMENSION + NUMERIC_FEATURES, self.hidden, len(self.quantiles))

    def _raw_quantiles(self, rows: np.ndarray) -> np.ndarray:
        """(rows, len(quantiles)) predicted remaining lengths, uncalibrated."""
        return np.expm1(np.clip(self.net_(rows), 0.0, 12.0))

    reads_prompt_text = True  # a bound is a function of the prompt's embedding

    def warm_up(self) -> None:
        """Load the embedding model now (a live prediction worker calls this as the engine starts):
        otherwise it loads on the first prompt, while the engine serves its first requests."""
        from predictors.embedding import load_model

        load_model()

    def predict_bound(
        self,
        prompt_tokens: Sequence[int],
        prompt_texts: Sequence[str],
        generated_tokens: Sequence[int],
        generated_texts: Sequence[str] = (),
        quantile: float | None = None,
    ) -> np.ndarray:
        """Upper bound on the tokens still to come, one per request (>= 1); the same call as
        `QrfLength.predict_bound` so JITServe takes either. `generated_texts` is accepted and
        unused (the network sees the count, not the text); `quantile` must be a trained one."""
        require_fitted(self, "net_")
        wanted = self.quantile if quantile is None else float(quantile)
        if wanted not in self.quantiles:
            raise ValueError(f"neural-length: quantile {wanted} not trained; trained: {self.quantiles}")
        # Checked before any prompt is embedded: -5 tokens was a NaN bound, 1e300 a number.
        prompt, generated = request_counts(prompt_tokens, generated_tokens, prompt_texts=prompt_texts)
        return self._bounds(self.features(prompt, prompt_texts, generated), generated, wanted)

    def _column(self, quantile: float) -> int:
        """The network output that predicts `quantile`. `quantiles` is kept as given (scikit-learn's
        rule) and may be an array, which has no `index`: the position is found on a list."""
        return [float(q) for q in self.quantiles].index(float(quantile))

    def _bounds(self, rows: np.ndarray, generated_tokens: Sequence[int], quantile: float) -> np.ndarray:
        raw = self._raw_quantiles(rows)[:, self._column(quantile)]
        if quantile == self.quantile:
            raw = apply_scales(raw, np.asarray(generated_tokens), self.scales_)
        return np.maximum(1.0, raw)

    # ---------------------------------------------------------- fit / evaluate
    def fit(self, data: Any, logger: Any = None) -> Self:
        """`data`: a Trace with prompt texts and output lengths (the AlpacaEval format; response
        texts are not needed). `logger`: a Lightning logger for the per-epoch losses (the
        pipeline passes an MLFlowLogger on the version's own run)."""
        import torch

        from predictors.quantile_mlp import train_quantile_net

        self._validate_params()
        self.require_data(data)
        data_hash = training_hash(data)
        calibration = None
        if self.calibration_share > 0:
            held = calibration_rows(data.prompt_text, self.calibration_share)
            if held.any() and not held.all():
                calibration = data.take(np.flatnonzero(held))
                data = data.take(np.flatnonzero(~held))
        prompt_tokens, texts, generated, remaining = self._rows(data, TRAIN_POINTS)
        logs = np.column_stack([np.log1p(prompt_tokens), np.log1p(generated)])
        self.mean_, self.std_ = logs.mean(axis=0), np.maximum(logs.std(axis=0), 1e-6)
        print(
            f"neural-length: embedding {len(set(texts)):,} prompts, training on {len(remaining):,} rows",
            file=sys.stderr,
        )

        def tensors(rows: tuple) -> tuple[torch.Tensor, torch.Tensor]:
            *inputs, target = rows
            x = torch.from_numpy(self.features(*inputs))
            return x, torch.from_numpy(np.log1p(target).astype(np.float32))

        validation = tensors(self._rows(calibration, TRAIN_POINTS)) if calibration is not None else None
        net = train_quantile_net(
            self._new_net(),
            tensors((prompt_tokens, texts, generated, remaining)),
            validation,
            quantiles=self.quantiles,
            epochs=self.epochs,
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
            weight_decay=self.weight_decay,
            seed=self.random_state,
            logger=logger,
        )
        self._serve({name: tensor.numpy().copy() for name, tensor in net.state_dict().items()})
        self.scales_ = {}
        if calibration is not None:
            c_prompt, c_texts, c_generated, c_remaining = self._rows(calibration, TRAIN_POINTS)
            raw = self._raw_quantiles(self.features(c_prompt, c_texts, c_generated))
            self.scales_ = conformal_scales(
                c_remaining, raw[:, self._column(self.quantile)], c_generated, self.quantile
            )
        self._record_fit(
            calibration_scales=self.scales_,
            training_rows=len(remaining),
            responses=len(data),
            data_hash=data_hash,
        )
        return self

    def evaluate(self, data: Any) -> dict[str, float]:
        """Coverage and over-estimation after 0, 50, 100 and 200 generated tokens, as `qrf-length`;
        plus `pinball_<q>` (on log lengths) for each trained quantile. Refused unfitted before
        any prompt is embedded."""
        require_fitted(self, "net_")
        prompt_tokens, texts, generated, remaining = self._rows(data, EVAL_POINTS)
        bound = self.predict_bound(prompt_tokens, texts, generated)
        metrics = coverage_metrics(remaining, bound, generated, self.quantile)
        raw = np.log1p(self._raw_quantiles(self.features(prompt_tokens, texts, generated)))
        error = np.log1p(remaining)[:, None] - raw
        for column, q in enumerate(self.quantiles):
            loss = np.maximum(q * error[:, column], (q - 1.0) * error[:, column])
            metrics[f"pinball_{q:g}"] = float(loss.mean())
        return metrics

    @staticmethod
    def _rows(data: Any, points: Sequence[int]) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray]:
        if data.prompt_text is None:
            raise ValueError("neural-length needs prompt texts (an AlpacaEval-format file)")
        index, generated, remaining = refinement_rows(data.output_tokens, points)
        prompt_tokens = np.asarray(data.prompt_tokens)[index]
        return prompt_tokens, [data.prompt_text[i] for i in index], generated, remaining

    # ------------------------------------------------------------ save / load
    def save_state(self, directory: Path) -> None:
        from safetensors.numpy import save_file

        require_fitted(self, "net_")
        save_file(
            {name: np.ascontiguousarray(array) for name, array in self.net_.weights.items()},
            directory / WEIGHTS_FILE,
        )
        scaling = {"mean": self.mean_.tolist(), "std": self.std_.tolist(), "scales": self.scales_}
        (directory / SCALING_FILE).write_text(json.dumps(scaling))

    def load_state(self, directory: Path) -> None:
        from safetensors.numpy import load_file

        self._validate_params()
        try:
            self._serve(load_file(directory / WEIGHTS_FILE))
        except ValueError as error:  # shapes or names that do not match the hyper-parameters
            raise ComponentError(
                f"neural-length: {WEIGHTS_FILE} does not fit the network: {error}"
            ) from error
        scaling = json.loads((directory / SCALING_FILE).read_text())
        self.mean_, self.std_ = np.asarray(scaling["mean"]), np.asarray(scaling["std"])
        self.scales_ = scaling["scales"]

    def validate(self) -> None:
        """A canary through the network and its calibration, on a fixed unit vector in place of an
        embedded prompt: loading a version must not run MiniLM in the loading process -- a live
        engine's, where MiniLM run once slowed vLLM's CPU forward for good (issue 22), while
        `adapt serve --embed-prompts` keeps it in a child process or the API server."""
        vectors = np.full((2, DIMENSION), DIMENSION**-0.5, dtype=np.float32)
        bounds = self._bounds(self._features([12, 12], vectors, [0, 200]), [0, 200], self.quantile)
        if not (np.isfinite(bounds).all() and (bounds >= 1.0).all()):
            raise ComponentError("neural-length: canary bound is not a positive length")


def training_hash(data: Any) -> str:
    """The hash `fit` records for its training data, computable without fitting: retraining on an
    unchanged window can be skipped before a minute of training."""
    return data_fingerprint(np.asarray(data.output_tokens), list(data.prompt_text))
