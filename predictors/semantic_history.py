"""`semantic-history`: SageSched's output-length distribution from the most similar past prompts.

The component keeps a FIFO window (default 10,000) of recently completed requests -- prompt
embedding, prompt length, output length -- and predicts a new request's output-length distribution
as the empirical distribution of its neighbours' output lengths (paper section 3.1):

- `mode="semantic"` (SageSched): neighbours are the window entries whose prompt embedding has cosine
  similarity >= `threshold` (0.8) with the new prompt, found with a FAISS flat inner-product index.
  With fewer than `min_neighbors` of them -- a warming-up window, or a prompt unlike anything seen --
  the `fallback_neighbors` most similar entries serve as the prior (the paper augments the search
  set with public-dataset requests; `fit` seeds the window with exactly that).
- `mode="length"`: the ablation baseline -- the `fallback_neighbors` entries nearest in prompt length
  (by ratio; among equally near entries the most recent: `predictors.length_neighbours`).
- `mode="point"`: the ablation baseline -- the semantic prediction collapsed to its mean.

A request without prompt text (length-only traces) is predicted by prompt length in every mode.
`observe` adds completions online, so a deployment learns from its own traffic (the window is built
empty on first use: a history may start from nothing); old entries leave the FAISS index in batches
of `window // 64`, keeping eviction cheap per completion. Small query batches run on one OpenMP
thread: on a 2-core machine a single query over 10,000 entries takes 0.40 ms that way and 0.80 ms
on two threads; batches of 20 or more use every core.
Saved as a FAISS index of the window's embeddings plus an npz of its lengths (no pickle).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import numpy as np

from adapt.component import ComponentError, LearnedComponent, data_fingerprint
from adapt.traces import MAX_TOKENS, prompt_hash
from predictors.length_distribution import LengthDistribution, bucket_overlap, crps, wasserstein
from predictors.length_neighbours import LengthNeighbours, nearest_by_ratio

MODES = ("semantic", "length", "point")
COLD_PRIOR_MAX_TOKENS = 2048  # an empty window predicts a uniform length up to this
_SEARCH_MARGIN = 64  # extra FAISS hits fetched so that excluded same-prompt entries do not starve
_PARALLEL_QUERIES = 20  # FAISS switches to BLAS at 20 queries; below that one thread is faster


class SemanticHistory(LearnedComponent):
    """Output-length distributions from a FIFO window of completed requests (see module docstring)."""

    name = "semantic-history"
    primary_metric = "wasserstein"
    lower_is_better = True
    least_data = 10
    data_unit = "distinct prompts"

    def __init__(
        self,
        window: int = 10_000,
        threshold: float = 0.8,
        min_neighbors: int = 5,
        fallback_neighbors: int = 100,
        max_neighbors: int = 256,
        max_support: int = 32,
        mode: str = "semantic",
    ) -> None:
        self.window = window
        self.threshold = threshold
        self.min_neighbors = min_neighbors
        self.fallback_neighbors = fallback_neighbors
        self.max_neighbors = max_neighbors
        self.max_support = max_support
        self.mode = mode

    def _validate_params(self) -> None:
        """Checked when a window is built (`fit`, `load_state`, the first `observe`), not in
        `__init__`: scikit-learn's `set_params` and `clone` store values unchecked."""
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        if (
            self.window < 1
            or self.min_neighbors < 1
            or self.fallback_neighbors < 1
            or self.max_neighbors < self.min_neighbors
        ):
            raise ValueError(
                "window, min_neighbors, fallback_neighbors must be >= 1 and max_neighbors >= min_neighbors"
            )
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold: a cosine similarity in [-1, 1], got {self.threshold!r}")
        if self.max_support < 1:  # 0 made every prediction a distribution of no points
            raise ValueError(f"max_support: expected at least 1 support point, got {self.max_support!r}")

    # ----------------------------------------------------------------- window
    def _reset(self) -> None:
        """An empty window: fitted state, sized by `window` (plus the eviction slack)."""
        import faiss

        from predictors.embedding import DIMENSION

        self._validate_params()
        capacity = self.window + self._slack
        self.prompt_tokens_ = np.zeros(capacity, dtype=np.int64)
        self.output_tokens_ = np.zeros(capacity, dtype=np.int64)
        self.prompt_hash_ = np.zeros(capacity, dtype=np.int64)
        self.has_text_ = np.zeros(capacity, dtype=bool)
        self.next_id_ = 0  # sequence number of the next entry; entry i lives in slot i % capacity
        self.index_ = faiss.IndexIDMap2(faiss.IndexFlatIP(DIMENSION))
        self.index_floor_ = 0  # ids below this have been removed from the FAISS index
        self.by_length_ = LengthNeighbours()  # the window's entries by prompt length (`_by_length`)
        self.length_floor_ = 0  # ids below this have left `by_length_`

    @property
    def _slack(self) -> int:
        """Evicted entries leave the FAISS index in batches of this many."""
        return max(1, self.window // 64)

    @property
    def size(self) -> int:
        """Entries currently in the window (0 before the window is built)."""
        return min(getattr(self, "next_id_", 0), self.window)

    @property
    def _oldest(self) -> int:
        return max(0, self.next_id_ - self.window)

    def _live_ids(self) -> np.ndarray:
        return np.arange(self._oldest, self.next_id_)

    def observe(
        self,
        prompt_tokens: Sequence[int] | np.ndarray,
        output_tokens: Sequence[int] | np.ndarray,
        embeddings: np.ndarray,
        has_text: Sequence[bool] | np.ndarray,
        prompt_hashes: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Add completed requests to the window (rows of `embeddings` without text are ignored).
        Every column is converted and checked before anything changes (`_observed`)."""
        count = len(prompt_tokens)
        prompts, outputs, text, hashes = _observed(
            count, prompt_tokens, output_tokens, embeddings, has_text, prompt_hashes
        )
        if count == 0:
            return
        if not hasattr(self, "index_"):
            self._reset()
        lengths = prompts.tolist()
        ids = np.arange(self.next_id_, self.next_id_ + count)
        first_id = self.next_id_
        # Entries this batch pushes out of the window leave the length index while the ring still
        # holds their lengths.
        self._drop_lengths_below(min(max(0, first_id + count - self.window), first_id))
        first = self.next_id_ % len(self.prompt_tokens_)
        # The entries' slots: a slice unless they wrap round the ring (a policy observes one
        # request per finish, and a slice costs a fraction of an index array).
        slots = (
            slice(first, first + count)
            if first + count <= len(self.prompt_tokens_)
            else ids % len(self.prompt_tokens_)
        )
        self.prompt_tokens_[slots] = prompts
        self.output_tokens_[slots] = outputs
        self.prompt_hash_[slots] = hashes
        self.has_text_[slots] = text
        if text.any():
            self.index_.add_with_ids(np.ascontiguousarray(embeddings[text], dtype=np.float32), ids[text])
        self.next_id_ += count
        for offset, length in enumerate(lengths):
            self.by_length_.add(length, first_id + offset)
        for entry in range(first_id, self._oldest):  # a batch longer than the window: its first
            self.by_length_.remove_oldest(lengths[entry - first_id], entry)
        self.length_floor_ = max(self.length_floor_, self._oldest)
        if self._oldest - self.index_floor_ >= self._slack:
            import faiss

            self.index_.remove_ids(faiss.IDSelectorRange(self.index_floor_, self._oldest))
            self.index_floor_ = self._oldest

    def _drop_lengths_below(self, oldest: int) -> None:
        """Entries below id `oldest` leave `by_length_` (from `length_floor_`, the first still in
        it), their lengths read from the ring: before `observe` writes over them, and before a
        query if `window` was lowered since (`set_params`)."""
        ring = self.prompt_tokens_
        for entry in range(self.length_floor_, oldest):
            self.by_length_.remove_oldest(int(ring[entry % len(ring)]), entry)
        self.length_floor_ = max(self.length_floor_, oldest)

    def copy(self) -> SemanticHistory:
        """An independent copy of the window and its index, so that each policy instance learns
        online on its own. Not `sklearn.base.clone`, which keeps the parameters and drops the window."""
        twin = type(self)(**self.get_params(deep=False))
        if hasattr(self, "index_"):
            import faiss

            for name in ("prompt_tokens_", "output_tokens_", "prompt_hash_", "has_text_"):
                setattr(twin, name, getattr(self, name).copy())
            twin.next_id_, twin.index_floor_ = self.next_id_, self.index_floor_
            twin.index_ = faiss.clone_index(self.index_)
            twin.by_length_, twin.length_floor_ = self.by_length_.copy(), self.length_floor_
        twin.metadata = dict(self.metadata)
        return twin

    # ----------------------------------------------------------- prediction
    def _distribution(self, ids: np.ndarray) -> LengthDistribution:
        samples = self.output_tokens_[ids % len(self.output_tokens_)]
        return LengthDistribution.from_samples(samples, self.max_support)

    def _live(self, column: np.ndarray) -> np.ndarray:
        """`column` at the live ids, in id order: at most two slices of the ring (cheaper than
        indexing it with `_live_ids() % capacity` on every prediction)."""
        start, stop = self._oldest % len(column), self.next_id_ % len(column)
        if start <= stop:
            return column[start:stop]
        return np.concatenate((column[start:], column[:stop]))

    def _by_length(self, prompt_tokens: int, exclude_hash: int = 0) -> np.ndarray:
        """Ids of the `fallback_neighbors` live entries nearest in prompt length
        (`predictors.length_neighbours`), leaving out those of prompt `exclude_hash`."""
        if exclude_hash:  # evaluation on data the window has seen (not a serving path): a scan
            keep = self._live(self.prompt_hash_) != exclude_hash
            lengths, ids = self._live(self.prompt_tokens_)[keep], self._live_ids()[keep]
            return nearest_by_ratio(lengths, ids, prompt_tokens, self.fallback_neighbors)
        self._drop_lengths_below(self._oldest)  # (a no-op unless `window` was lowered)
        return np.array(self.by_length_.nearest(prompt_tokens, self.fallback_neighbors), dtype=np.int64)

    def predict_embedded(
        self,
        prompt_tokens: Sequence[int],
        embeddings: np.ndarray,
        has_text: Sequence[bool] | np.ndarray,
        exclude_hashes: Sequence[int] | None = None,
    ) -> list[LengthDistribution]:
        """Distributions for requests whose prompts are already embedded; one FAISS search for the
        batch. `exclude_hashes` leaves each request's own prompt out of its neighbours (evaluation
        on data the window has seen)."""
        return self.predict_with_matches(prompt_tokens, embeddings, has_text, exclude_hashes)[0]

    def predict_with_matches(
        self,
        prompt_tokens: Sequence[int],
        embeddings: np.ndarray,
        has_text: Sequence[bool] | np.ndarray,
        exclude_hashes: Sequence[int] | None = None,
    ) -> tuple[list[LengthDistribution], np.ndarray]:
        """`predict_embedded`, and per request whether it had enough close neighbours (at least
        `min_neighbors` above the similarity threshold): the share that does is how well the
        window still matches the traffic (`serving_hooks.quality`)."""
        count = len(prompt_tokens)
        matched = np.zeros(count, dtype=bool)
        if self.size == 0:
            return [LengthDistribution.uniform(1, COLD_PRIOR_MAX_TOKENS) for _ in range(count)], matched
        exclude = [0] * count if exclude_hashes is None else list(exclude_hashes)
        has_text = np.asarray(has_text, dtype=bool)
        results: list[LengthDistribution | None] = [None] * count
        semantic = has_text & (self.mode != "length") & (self.index_.ntotal > 0)
        if semantic.any():
            rows = np.flatnonzero(semantic)
            queries = np.ascontiguousarray(embeddings[rows], dtype=np.float32)
            # Enough hits for the prior; rows whose last hit still clears the threshold may have
            # more close neighbours than that and get a range search (rare: a popular prompt).
            k = min(
                self.index_.ntotal,
                self.fallback_neighbors + self._oldest - self.index_floor_ + _SEARCH_MARGIN,
            )
            with _one_thread_if(len(rows) < _PARALLEL_QUERIES):
                sims, hits = self.index_.search(queries, k)
            for row, query, sim, hit in zip(rows, queries, sims, hits, strict=True):
                if k < self.index_.ntotal and sim[-1] >= self.threshold:
                    with _one_thread_if(True):  # one query
                        _, range_sims, range_hits = self.index_.range_search(query[None], self.threshold)
                    order = np.argsort(-range_sims, kind="stable")
                    sim, hit = range_sims[order], range_hits[order]
                keep = hit >= self._oldest  # -1 (no hit) and evicted ids fall out here
                if exclude[row]:
                    keep &= self.prompt_hash_[hit % len(self.prompt_hash_)] != exclude[row]
                sim, hit = sim[keep], hit[keep]
                if hit.size == 0:
                    continue
                close = hit[sim >= self.threshold][: self.max_neighbors]
                matched[row] = close.size >= self.min_neighbors
                chosen = close if matched[row] else hit[: self.fallback_neighbors]
                results[row] = self._distribution(chosen)
        for row in range(count):
            if results[row] is None:
                ids = self._by_length(int(prompt_tokens[row]), exclude[row])
                results[row] = (
                    self._distribution(ids)
                    if ids.size
                    else LengthDistribution.uniform(1, COLD_PRIOR_MAX_TOKENS)
                )
        if self.mode == "point":
            return [LengthDistribution.point(d.mean) for d in results], matched  # type: ignore[union-attr]
        return results, matched  # type: ignore[return-value]

    def predict(self, prompt_tokens: Sequence[int], texts: Sequence[str | None]) -> list[LengthDistribution]:
        """Distributions for raw requests (embeds the texts in one batch)."""
        embeddings, has_text = embed_prompts(texts)
        return self.predict_embedded(prompt_tokens, embeddings, has_text)

    # ------------------------------------------------------- fit / evaluate
    def fit(self, data: Any) -> Self:
        """Seed the window with the last `window` rows of a trace that has prompt text and real
        output lengths (e.g. AlpacaEval); the prior the paper draws from public datasets."""
        self._validate_params()
        texts, prompts, outputs = _columns(data)
        self.require_data(data)
        texts, prompts, outputs = texts[-self.window :], prompts[-self.window :], outputs[-self.window :]
        print(f"semantic-history: embedding {len(set(texts)):,} distinct prompts", file=sys.stderr)
        embeddings, has_text = embed_prompts(texts)
        self._reset()
        self.observe(prompts, outputs, embeddings, has_text, [prompt_hash(t) for t in texts])
        self._record_fit(
            rows=len(texts),
            distinct_prompts=len(set(texts)),
            data_hash=data_fingerprint(np.asarray(prompts), np.asarray(outputs), list(texts)),
        )
        return self

    def data_size(self, data: Any) -> int:
        """Distinct prompts: fewer than ten make every prediction the fallback prior."""
        return len(set(data.prompt_text or ()))

    def evaluate(self, data: Any, exclude_same_prompt: bool = False) -> dict[str, float]:
        """Score predictions for each distinct prompt of `data` against all lengths recorded for it.
        `exclude_same_prompt` hides that prompt's own entries from the window (leave-one-prompt-out,
        for data the window has seen)."""
        texts, prompts, outputs = _columns(data)
        groups: dict[str, list[int]] = {}
        for row, text in enumerate(texts):
            groups.setdefault(text, []).append(row)
        distinct = list(groups)
        first_rows = [groups[t][0] for t in distinct]
        embeddings, has_text = embed_prompts(distinct)
        exclude = [prompt_hash(t) for t in distinct] if exclude_same_prompt else None
        predictions = self.predict_embedded([prompts[r] for r in first_rows], embeddings, has_text, exclude)
        scores: dict[str, list[float]] = {
            "wasserstein": [],
            "crps": [],
            "bucket_overlap": [],
            "mean_abs_error": [],
        }
        for text, predicted in zip(distinct, predictions, strict=True):
            observed = np.asarray([outputs[r] for r in groups[text]], dtype=np.float64)
            scores["wasserstein"].append(wasserstein(predicted, observed))
            scores["crps"].append(crps(predicted, observed))
            scores["bucket_overlap"].append(bucket_overlap(predicted, observed))
            scores["mean_abs_error"].append(abs(predicted.mean - float(observed.mean())))
        metrics = {name: float(np.mean(values)) for name, values in scores.items()}
        metrics["prompts"] = float(len(distinct))
        return metrics

    # ------------------------------------------------------------ save / load
    def save_state(self, directory: Path) -> None:
        import faiss

        if not hasattr(self, "index_"):  # nothing observed yet: saved as the empty window
            self._reset()
        ids = self._live_ids()
        slots = ids % len(self.prompt_tokens_)
        text_ids = ids[self.has_text_[slots]]
        flat = faiss.IndexFlatIP(self.index_.d)
        if text_ids.size:
            flat.add(np.vstack([self.index_.reconstruct(int(i)) for i in text_ids]))
        faiss.write_index(flat, str(directory / "embeddings.faiss"))
        np.savez(
            directory / "window.npz",
            prompt_tokens=self.prompt_tokens_[slots],
            output_tokens=self.output_tokens_[slots],
            prompt_hash=self.prompt_hash_[slots],
            has_text=self.has_text_[slots],
        )

    def load_state(self, directory: Path) -> None:
        import faiss

        flat = faiss.read_index(str(directory / "embeddings.faiss"))
        with np.load(directory / "window.npz", allow_pickle=False) as state:
            arrays = {
                key: state[key] for key in ("prompt_tokens", "output_tokens", "prompt_hash", "has_text")
            }
        has_text = arrays["has_text"].astype(bool)
        if int(has_text.sum()) != flat.ntotal:
            raise ComponentError(f"{directory}: {flat.ntotal} embeddings for {int(has_text.sum())} prompts")
        embeddings = np.zeros((len(has_text), flat.d), dtype=np.float32)
        if flat.ntotal:
            embeddings[has_text] = flat.reconstruct_n(0, flat.ntotal)
        self._reset()
        self.observe(
            arrays["prompt_tokens"], arrays["output_tokens"], embeddings, has_text, arrays["prompt_hash"]
        )

    def validate(self) -> None:
        from predictors.embedding import DIMENSION

        if self.size and self.index_.ntotal > self.window + self._slack:
            raise ComponentError("semantic-history: FAISS index larger than its window")
        probe = self.predict_embedded([16], np.zeros((1, DIMENSION), dtype=np.float32), [False])[0]
        if not (np.all(probe.support > 0) and abs(probe.probs.sum() - 1.0) < 1e-6):
            raise ComponentError("semantic-history: canary prediction is not a length distribution")


@contextmanager
def _one_thread_if(few_queries: bool) -> Iterator[None]:
    """FAISS on one OpenMP thread for a search of few queries (thread start-up costs more than it
    saves there), the caller's thread count restored afterwards. OpenMP keeps that count per calling
    thread, and here torch's and FAISS's OpenMP resolve to one library: torch in this thread read 1
    after a search (and ran its next matrix products at half speed on 2 cores) before the count was
    restored, and a large search no longer raises it past what the process was given."""
    if not few_queries:
        yield
        return
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


def _observed(
    count: int,
    prompt_tokens: Sequence[int] | np.ndarray,
    output_tokens: Sequence[int] | np.ndarray,
    embeddings: np.ndarray,
    has_text: Sequence[bool] | np.ndarray,
    prompt_hashes: Sequence[int] | np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`observe`'s columns as (prompt tokens, output tokens, has text, prompt hashes) arrays for
    the window's ring, refused unless each holds `count` rows (an embedding of DIMENSION numbers
    per row) and each count is whole and in range. Checked before the window changes: a length of
    2**70 failed after the length index had lost an entry, a short column was broadcast over the
    batch, and an output of 0 was saved into a window that `validate` then refused to load."""
    from predictors.embedding import DIMENSION

    prompts = _counts("prompt_tokens", prompt_tokens, count, least=0)
    outputs = _counts("output_tokens", output_tokens, count, least=1)
    flags = np.asarray(has_text, dtype=bool)
    if flags.shape != (count,):
        raise ValueError(f"semantic-history: has_text: expected {count} flags, got shape {flags.shape}")
    if np.shape(embeddings) != (count, DIMENSION):
        raise ValueError(
            f"semantic-history: embeddings: expected shape {(count, DIMENSION)}, got {np.shape(embeddings)}"
        )
    if prompt_hashes is None:
        return prompts, outputs, flags, np.zeros(count, dtype=np.int64)
    hashes = np.asarray(prompt_hashes)
    fits = hashes.size == 0 or hashes.dtype.kind == "i" or (hashes.dtype.kind == "u" and hashes.max() < 2**63)
    if hashes.shape != (count,) or not fits:
        raise ValueError(
            f"semantic-history: prompt_hashes: expected {count} int64 hashes,"
            f" got {hashes.dtype} values of shape {hashes.shape}"
        )
    return prompts, outputs, flags, hashes.astype(np.int64)


def _counts(name: str, values: Sequence[int] | np.ndarray, count: int, least: int) -> np.ndarray:
    """`values` as int64, refused unless there are `count` of them, each a whole number in
    [least, MAX_TOKENS] (a token count, as `adapt.traces` reads them)."""
    array = np.asarray(values)
    if array.shape != (count,):
        raise ValueError(f"semantic-history: {name}: expected {count} counts, got shape {array.shape}")
    try:
        numbers = array.astype(np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            f"semantic-history: {name}: expected token counts, got {array.dtype} values"
        ) from None
    whole = np.isfinite(numbers) & (numbers == np.round(numbers))
    bad = ~(whole & (numbers >= least) & (numbers <= MAX_TOKENS))
    if bad.any():
        raise ValueError(
            f"semantic-history: {name}: expected whole counts in [{least}, {MAX_TOKENS:,}],"
            f" got {array[bad].tolist()[0]!r}"
        )
    return numbers.astype(np.int64)


def embed_prompts(texts: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings (zero rows where there is no text) and the has-text mask, in one batch, through the
    process-wide cache (repeated prompts, evaluations and ablations embed each text once)."""
    from predictors.embedding import DIMENSION, shared_cache

    has_text = np.array([bool(t) for t in texts], dtype=bool)
    embeddings = np.zeros((len(texts), DIMENSION), dtype=np.float32)
    if has_text.any():
        present = [t for t in texts if t]
        embeddings[has_text] = shared_cache().embed(present)
    return embeddings, has_text


def _columns(data: Any) -> tuple[list[str], list[int], list[int]]:
    """(texts, prompt tokens, output tokens) of a Trace with prompt text."""
    texts = getattr(data, "prompt_text", None)
    if texts is None:
        raise ValueError(
            "semantic-history needs prompt texts (an alpaca-format file or a request log with text)"
        )
    return list(texts), [int(x) for x in data.prompt_tokens], [int(x) for x in data.output_tokens]
