"""`qrf-length`: JITServe's upper bound on a request's *remaining* output length.

A quantile regression forest (quantile-forest's `RandomForestQuantileRegressor`) predicts a high
quantile (default 0.95) of the remaining length from features of the prompt and of what has been
generated so far, so the bound can be re-predicted every `refine_every` (50) tokens and tightens as
the answer unfolds (paper section 4.1). Features, all cheap to compute per request:

- log(1 + prompt tokens), tokens generated so far g and log(1 + g);
- the prompt's words and word bigrams, hashed into `prompt_features` buckets;
- the generated text's words, hashed into `generated_features` buckets (0 turns them off: the
  replay simulator knows how many tokens a request generated but not their text, so the bound
  `jitserve` uses there is refined on the count alone and can be trained on lengths only).

Training rows come from prompt/response pairs: each response contributes one row per refinement
point g in `TRAIN_POINTS` that it outlives (g = 0 is the prediction on arrival). Lengths are in
MiniLM WordPiece tokens (`adapt.tokenizer`), the prefix text is the response cut after g tokens.
The forest's own high quantile under-covers on unseen instructions (coverage ~0.90 at q = 0.95 on
AlpacaEval), so `fit` holds out `calibration_share` of the training instructions and applies a
split-conformal factor per refinement point (`calibration.json`). Saved with skops (no pickle),
loaded with an explicit list of trusted types. Predictions go
through `predictors.compiled_forest` (exact, numpy only, ~10x faster per request than the
library's `predict`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from adapt.component import ComponentError, LearnedComponent, data_fingerprint
from predictors import require_fitted
from predictors.compiled_forest import CompiledQuantileForest
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

FOREST_FILE = "forest.skops"
SCALES_FILE = "calibration.json"
TRUSTED_TYPES = [
    "quantile_forest._quantile_forest.RandomForestQuantileRegressor",
    "quantile_forest._quantile_forest_fast.QuantileForest",
    "scipy.sparse._csc.csc_matrix",  # the training leaves of a forest fitted with sparse_pickle
    "sklearn.tree._tree.Tree",
]


class QrfLength(BoundEvidence, LearnedComponent):
    """Upper bound (quantile `quantile`) on the remaining output length (see module docstring)."""

    name = "qrf-length"
    primary_metric = "pinball_loss"
    lower_is_better = True

    def __init__(
        self,
        quantile: float = 0.95,
        n_estimators: int = 40,
        max_depth: int = 12,
        min_samples_leaf: int = 20,
        prompt_features: int = 128,
        generated_features: int = 32,
        refine_every: int = 50,
        calibration_share: float = 0.2,
        random_state: int = 0,
    ) -> None:
        self.quantile = quantile
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.min_samples_leaf = min_samples_leaf
        self.prompt_features = prompt_features
        self.generated_features = generated_features
        self.refine_every = refine_every
        self.calibration_share = calibration_share
        self.random_state = random_state

    def _validate_params(self) -> None:
        """Checked by `fit` and `load_state`, not `__init__`: scikit-learn's `set_params` and
        `clone` store values unchecked."""
        if not 0.5 <= self.quantile < 1.0:
            raise ValueError(f"quantile: expected a high quantile in [0.5, 1), got {self.quantile!r}")
        if not 0 <= self.calibration_share < 1:
            raise ValueError(
                f"calibration_share: expected a number in [0, 1), got {self.calibration_share!r}"
            )

    # --------------------------------------------------------------- features
    def features(
        self,
        prompt_tokens: Sequence[int],
        prompt_texts: Sequence[str],
        generated_tokens: Sequence[int],
        generated_texts: Sequence[str],
    ) -> np.ndarray:
        """One row per request (the scikit-learn X this forest is fitted on). The hashing
        vectorizers are stateless and cost ~1 us to build (their transform ~300 us), so they are
        built per call rather than kept as derived state. Counts and column lengths are checked
        first (`length_bounds.request_counts`); no requests give no rows."""
        from sklearn.feature_extraction.text import HashingVectorizer

        prompt, generated = request_counts(
            prompt_tokens, generated_tokens, prompt_texts=prompt_texts, generated_texts=generated_texts
        )
        g = generated.astype(np.float32)
        blocks = [np.column_stack([np.log1p(prompt.astype(np.float32)), g, np.log1p(g)])]
        for n, ngrams, texts in (
            (self.prompt_features, (1, 2), prompt_texts),
            (self.generated_features, (1, 1), generated_texts),
        ):
            if n:
                vectorizer = HashingVectorizer(
                    n_features=n, ngram_range=ngrams, alternate_sign=False, norm="l2"
                )
                # (the vectorizer raises StopIteration on an empty batch)
                blocks.append(vectorizer.transform(list(texts)).toarray() if len(texts) else np.zeros((0, n)))
        return np.hstack(blocks).astype(np.float32)

    @property
    def reads_prompt_text(self) -> bool:
        """Whether a bound depends on the prompt's words (a serving engine must then supply them)."""
        return self.prompt_features > 0

    def predict_bound(
        self,
        prompt_tokens: Sequence[int],
        prompt_texts: Sequence[str],
        generated_tokens: Sequence[int],
        generated_texts: Sequence[str],
        quantile: float | None = None,
    ) -> np.ndarray:
        """Upper bound on the tokens still to come, one per request (>= 1). A forest predicts any
        `quantile` in [0, 1], so a caller may ask for another than the one it was configured with
        (`experiments.jitserve_study` takes the median as LTR's point prediction).

        Only the configured `self.quantile` is calibrated: the split-conformal factors `fit`
        measured (`scales_`) hold for that quantile alone. Any other is the forest's own quantile,
        which under-covers on unseen prompts (~0.90 at q = 0.95), and it is not ordered with the
        calibrated one: a bound at 0.951 can be below the bound at 0.95. Refusing other quantiles
        would drop that legitimate median; rescaling them would be a calibration nobody measured."""
        require_fitted(self, "forest_")
        rows = self.features(prompt_tokens, prompt_texts, generated_tokens, generated_texts)
        return self._bound(rows, quantile)

    def _bound(self, rows: np.ndarray, quantile: float | None = None) -> np.ndarray:
        wanted = self.quantile if quantile is None else quantile
        raw = self._forest_quantile(rows, wanted)
        if wanted == self.quantile:
            raw = apply_scales(raw, rows[:, 1], self.scales_)  # rows[:, 1] is g
        return np.maximum(1.0, raw)

    # ---------------------------------------------------------- fit / evaluate
    def fit(self, data: Any) -> Self:
        """`data`: a Trace of prompt/response pairs with `output_text` (the AlpacaEval format)."""
        from quantile_forest import RandomForestQuantileRegressor

        self._validate_params()
        self.require_data(data)
        calibration = None
        if self.calibration_share > 0:
            held = calibration_rows(data.prompt_text, self.calibration_share)
            if held.any() and not held.all():
                calibration = data.take(np.flatnonzero(held))
                data = data.take(np.flatnonzero(~held))
        X, y, _ = self._training_rows(data, TRAIN_POINTS)
        self.forest_ = RandomForestQuantileRegressor(
            n_estimators=self.n_estimators,
            max_depth=self.max_depth,
            min_samples_leaf=self.min_samples_leaf,
            max_samples_leaf=None,
            random_state=self.random_state,
            n_jobs=-1,
        ).fit(X, y, sparse_pickle=True)  # leaves are padded to the largest: stored sparse, 1.4 GB -> 3 MB
        self.forest_.n_jobs = 1
        self._compiled = None  # the numpy form of forest_ (compiled_forest), built on first use
        self.scales_ = {}
        if calibration is not None:
            self.scales_ = self._conformal_scales(calibration)
        self._record_fit(
            calibration_scales=self.scales_,
            training_rows=len(y),
            responses=len(data),
            data_hash=data_fingerprint(np.asarray(data.output_tokens), list(data.prompt_text)),
        )
        return self

    def _conformal_scales(self, calibration: Any) -> dict[str, float]:
        """Prompts in the calibration rows were not used to fit the forest, so the factors
        measure how far the forest's own quantile misses (`length_bounds.conformal_scales`)."""
        X, y, points = self._training_rows(calibration, TRAIN_POINTS)
        return conformal_scales(y, self._forest_quantile(X, self.quantile), points, self.quantile)

    def _forest_quantile(self, rows: np.ndarray, quantile: float) -> np.ndarray:
        """The forest's own (uncalibrated) quantile, through its numpy form, built on first use;
        every bound, and so `evaluate`, passes here."""
        require_fitted(self, "forest_")
        if self._compiled is None:
            self._compiled = CompiledQuantileForest(self.forest_)
        return self._compiled.predict(rows, quantile)

    def evaluate(self, data: Any) -> dict[str, float]:
        """Coverage and over-estimation after 0, 50, 100 and 200 generated tokens
        (`length_bounds.coverage_metrics`); `pinball_loss` is the gate's metric."""
        X, y, points = self._training_rows(data, EVAL_POINTS)
        return coverage_metrics(y, self._bound(X), points, self.quantile)

    def _training_rows(self, data: Any, points: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        texts = data.columns.get("output_text") if getattr(data, "columns", None) else None
        if data.prompt_text is None or (texts is None and self.generated_features):
            raise ValueError(
                "qrf-length needs prompt and response texts (an AlpacaEval-format file with `output`;"
                " with generated_features=0, prompt texts and response lengths suffice)"
            )
        index, generated, remaining = refinement_rows(data.output_tokens, points)
        prefixes = response_prefixes(texts, points) if self.generated_features else None
        prompt_tokens = np.asarray(data.prompt_tokens)[index]
        prompt_texts = [data.prompt_text[i] for i in index]
        generated_texts = [prefixes[g][i] if prefixes else "" for i, g in zip(index, generated, strict=True)]
        X = self.features(prompt_tokens, prompt_texts, generated, generated_texts)
        return X, remaining, generated

    # ------------------------------------------------------------ save / load
    def save_state(self, directory: Path) -> None:
        import skops.io

        require_fitted(self, "forest_")
        skops.io.dump(self.forest_, directory / FOREST_FILE)
        (directory / SCALES_FILE).write_text(json.dumps(self.scales_))

    def load_state(self, directory: Path) -> None:
        import skops.io

        self._validate_params()
        untrusted = set(skops.io.get_untrusted_types(file=directory / FOREST_FILE)) - set(TRUSTED_TYPES)
        if untrusted:
            raise ComponentError(f"qrf-length: refusing types {sorted(untrusted)} in {FOREST_FILE}")
        self.forest_ = skops.io.load(directory / FOREST_FILE, trusted=TRUSTED_TYPES)
        self.forest_.n_jobs = 1
        self._compiled = None
        scales_file = directory / SCALES_FILE
        self.scales_ = json.loads(scales_file.read_text()) if scales_file.exists() else {}

    def validate(self) -> None:
        bound = self.predict_bound([12], ["write a short poem about the sea"], [0], [""])
        if not (np.isfinite(bound).all() and bound[0] >= 1.0):
            raise ComponentError("qrf-length: canary bound is not a positive length")


def response_prefixes(texts: Sequence[str], points: Sequence[int]) -> dict[int, list[str]]:
    """For each g in `points`, every response cut after its first g MiniLM tokens ("" for g = 0)."""
    from adapt.tokenizer import minilm_offsets

    ends = minilm_offsets(texts)
    return {
        g: [
            text[: offsets[min(g, len(offsets)) - 1]] if g and offsets else ""
            for text, offsets in zip(texts, ends, strict=True)
        ]
        for g in points
    }
