"""The on-disk embedding cache: shared across instances and processes, bounded, keyed by model, and
never a wrong vector or a crash from a damaged file. The model is faked (a vector drawn from the
text's hash) except in the one slow test that checks the real MiniLM round-trips bit for bit."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import sqlite3
import tempfile
from pathlib import Path

import numpy as np
import pytest

from predictors import embedding
from predictors.embedding import DIMENSION, EmbeddingCache, shared_cache
from predictors.embedding_cache import (
    DiskEmbeddingCache,
    content_key,
    default_directory,
    default_max_entries,
    open_default,
)


def fake_vectors(texts) -> np.ndarray:
    """A unit vector per text, a pure function of the text (as the real model is)."""
    rows = []
    for text in texts:
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        vector = np.random.default_rng(seed).standard_normal(DIMENSION)
        rows.append(vector / np.linalg.norm(vector))
    return np.asarray(rows, dtype=np.float32).reshape(len(rows), DIMENSION)


@pytest.fixture
def model_calls(monkeypatch) -> list[list[str]]:
    """Stands in for MiniLM; records each batch it is asked to embed."""
    calls: list[list[str]] = []

    def fake_embed(texts, batch_size=64):
        calls.append(list(texts))
        return fake_vectors(texts)

    monkeypatch.setattr(embedding, "embed", fake_embed)
    return calls


def cache_on(directory: Path, model_id: str = "fake-model", **disk_options) -> EmbeddingCache:
    return EmbeddingCache(disk=DiskEmbeddingCache(directory, **disk_options), model_id=model_id)


def test_a_second_cache_on_the_same_directory_computes_nothing(tmp_path, model_calls):
    first = cache_on(tmp_path)
    vectors = first.embed(["a", "b", "a", "c"])
    assert model_calls == [["a", "b", "c"]]  # distinct misses, one batch
    np.testing.assert_array_equal(vectors, fake_vectors(["a", "b", "a", "c"]))

    second = cache_on(tmp_path)  # another run or process: a fresh in-process layer
    again = second.embed(["c", "a", "b"])
    assert len(model_calls) == 1
    assert (second.disk_hits, second.misses) == (3, 0)
    np.testing.assert_array_equal(again, fake_vectors(["c", "a", "b"]))
    assert again.dtype == np.float32 and again.flags.writeable


def test_lookups_and_computation_are_one_batch_each(tmp_path, model_calls):
    cache_on(tmp_path).embed(["a", "b"])
    cache = cache_on(tmp_path)
    lookups, writes = [], []
    get_many, put_many = cache.disk.get_many, cache.disk.put_many
    cache.disk.get_many = lambda keys, dim: lookups.append(list(keys)) or get_many(keys, dim)
    cache.disk.put_many = lambda vectors: writes.append(dict(vectors)) or put_many(vectors)
    texts = ["a", "x", "b", "y", "x"]
    np.testing.assert_array_equal(cache.embed(texts), fake_vectors(texts))
    assert model_calls[-1] == ["x", "y"]
    assert [len(keys) for keys in lookups] == [4] and [len(batch) for batch in writes] == [2]
    cache.embed(texts)  # all in the in-process layer now: the disk is not asked again
    assert len(lookups) == 1 and len(model_calls) == 2


def test_the_bound_evicts_the_least_recently_used(tmp_path):
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    disk = DiskEmbeddingCache(tmp_path, max_entries=10, touch_after_s=0.0, clock=clock)
    batches = {
        name: {content_key("m", f"{name}{i}"): fake_vectors([f"{name}{i}"])[0] for i in range(5)}
        for name in "abc"
    }
    disk.put_many(batches["a"])
    disk.put_many(batches["b"])
    assert len(disk.get_many(list(batches["a"]), DIMENSION)) == 5  # a is now more recent than b
    disk.put_many(batches["c"])  # 15 rows > 10: evict down to 90% of the bound, oldest first
    assert len(disk) == 9
    assert disk.get_many(list(batches["b"]), DIMENSION) == {}
    assert len(disk.get_many(list(batches["c"]), DIMENSION)) == 5
    assert len(disk.get_many(list(batches["a"]), DIMENSION)) == 4


def test_reads_within_the_touch_interval_do_not_write(tmp_path, model_calls):
    cache_on(tmp_path).embed(["a", "b"])
    database = tmp_path / DiskEmbeddingCache(tmp_path).path.name
    with sqlite3.connect(database) as connection:
        before = connection.execute("SELECT key, used FROM vectors ORDER BY key").fetchall()
    cache_on(tmp_path).embed(["a", "b"])
    with sqlite3.connect(database) as connection:
        assert connection.execute("SELECT key, used FROM vectors ORDER BY key").fetchall() == before


def test_a_file_that_is_not_a_database_is_rebuilt_with_a_warning(tmp_path, model_calls, caplog):
    path = DiskEmbeddingCache(tmp_path).path
    path.write_bytes(b"not a database, just some bytes" * 100)
    with caplog.at_level(logging.WARNING, logger="predictors.embedding_cache"):
        vectors = cache_on(tmp_path).embed(["a", "b"])
    np.testing.assert_array_equal(vectors, fake_vectors(["a", "b"]))
    assert "deleted and rebuilt" in caplog.text
    cache_on(tmp_path).embed(["a", "b"])  # the rebuilt file holds them
    assert len(model_calls) == 1


def test_a_damaged_file_never_gives_a_wrong_vector_or_an_error(tmp_path, model_calls):
    texts = [f"prompt {i} " * 20 for i in range(300)]
    first = cache_on(tmp_path)
    first.embed(texts)
    first.disk.close()
    path = first.disk.path
    raw = bytearray(path.read_bytes())
    assert len(raw) > 100_000
    noise = np.random.default_rng(0).integers(0, 256, size=len(raw) // 3, dtype=np.uint8).tobytes()
    raw[len(raw) // 2 : len(raw) // 2 + len(noise)] = noise  # a stretch of pages overwritten
    path.write_bytes(bytes(raw))
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    np.testing.assert_array_equal(cache_on(tmp_path).embed(texts), fake_vectors(texts))


def test_a_damaged_row_is_a_miss_and_is_rewritten(tmp_path, model_calls, caplog):
    cache_on(tmp_path).embed(["a", "b", "c"])
    path = DiskEmbeddingCache(tmp_path).path
    key_a = content_key("fake-model", "a")
    with sqlite3.connect(path) as connection:
        blob = bytearray(
            connection.execute("SELECT vector FROM vectors WHERE key = ?", (key_a,)).fetchone()[0]
        )
        blob[7] ^= 0x40  # one flipped bit: still 384 finite floats, no longer the stored ones
        connection.execute("UPDATE vectors SET vector = ? WHERE key = ?", (bytes(blob), key_a))
        short = fake_vectors(["b"])[0][:-1].astype("<f4").tobytes()  # a 383-d vector, checksum kept right
        connection.execute(
            "UPDATE vectors SET vector = ?, checksum = ? WHERE key = ?",
            (short, hashlib.blake2b(short, digest_size=8).digest(), content_key("fake-model", "b")),
        )
    cache = cache_on(tmp_path)
    with caplog.at_level(logging.WARNING, logger="predictors.embedding_cache"):
        vectors = cache.embed(["a", "b", "c"])
    np.testing.assert_array_equal(vectors, fake_vectors(["a", "b", "c"]))
    assert model_calls[-1] == ["a", "b"] and cache.disk.rejected_rows == 2
    assert "damaged" in caplog.text
    cache_on(tmp_path).embed(["a", "b", "c"])  # rewritten: read back intact
    assert len(model_calls) == 2


def test_the_model_identity_separates_entries(tmp_path, model_calls):
    cache_on(tmp_path, model_id="model-a").embed(["a", "b"])
    other = cache_on(tmp_path, model_id="model-b")
    other.embed(["a", "b"])
    assert model_calls == [["a", "b"], ["a", "b"]] and other.disk_hits == 0
    assert content_key("model-a", "b") != content_key("model-b", "b")
    assert content_key("ab", "c") != content_key("a", "bc")  # the identity is length-prefixed
    assert "all-MiniLM-L6-v2" in embedding.model_identity()


def test_a_disabled_cache_works_in_process_only(tmp_path, monkeypatch, model_calls):
    monkeypatch.setenv("ADAPT_EMBEDDING_CACHE", "off")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert default_directory() is None and open_default() is None
    shared_cache.cache_clear()
    try:
        cache = shared_cache()
        assert cache.disk is None
        np.testing.assert_array_equal(cache.embed(["a", "a"]), fake_vectors(["a", "a"]))
        assert model_calls == [["a"]] and cache.hits == 1
    finally:
        shared_cache.cache_clear()
    assert list(tmp_path.iterdir()) == []


def test_the_default_directory_is_beside_the_store(tmp_path, monkeypatch):
    from adapt.registry import default_cache_dir

    monkeypatch.delenv("ADAPT_EMBEDDING_CACHE", raising=False)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert default_directory() == tmp_path / "store" / "embedding-cache"
    assert default_directory().parent == default_cache_dir(uri).parent  # next to model-cache
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert default_directory() == Path(tempfile.gettempdir()) / "adapt-embedding-cache"
    monkeypatch.setenv("ADAPT_EMBEDDING_CACHE", str(tmp_path / "mine"))
    assert default_directory() == tmp_path / "mine"


def test_the_bound_comes_from_the_environment(monkeypatch, caplog):
    monkeypatch.setenv("ADAPT_EMBEDDING_CACHE_MAX_ENTRIES", "1234")
    assert default_max_entries() == 1234
    monkeypatch.setenv("ADAPT_EMBEDDING_CACHE_MAX_ENTRIES", "lots")
    with caplog.at_level(logging.WARNING, logger="predictors.embedding_cache"):
        assert default_max_entries() == 150_000
    assert "not a positive integer" in caplog.text


def test_an_unwritable_directory_falls_back_to_computing(tmp_path, model_calls, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = cache_on(blocker / "cache")  # a directory cannot be made under a file
    with caplog.at_level(logging.WARNING, logger="predictors.embedding_cache"):
        np.testing.assert_array_equal(cache.embed(["a"]), fake_vectors(["a"]))
    assert cache.disk.disabled and "off for this process" in caplog.text


def _write_overlapping(directory: str, worker: int) -> None:
    """One concurrent writer: many small transactions over keys the other writer also writes,
    past the bound, so inserts, evictions and reads interleave between the processes."""
    disk = DiskEmbeddingCache(directory, max_entries=300, busy_timeout_s=20.0)
    for batch in range(30):
        texts = [f"text {(batch * 10 + i + worker * 5) % 400}" for i in range(20)]
        keys = [content_key("fake-model", t) for t in texts]
        disk.put_many(dict(zip(keys, fake_vectors(texts), strict=True)))
        disk.get_many(keys[:10], DIMENSION)
    disk.close()


def test_concurrent_writers_from_two_processes_do_not_corrupt(tmp_path):
    context = multiprocessing.get_context("spawn")  # no inherited state at all
    workers = [context.Process(target=_write_overlapping, args=(str(tmp_path), w)) for w in (0, 1)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=60)
    assert [process.exitcode for process in workers] == [0, 0]
    path = DiskEmbeddingCache(tmp_path).path
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        (count,) = connection.execute("SELECT count(*) FROM vectors").fetchone()
        assert int(connection.execute("SELECT value FROM meta WHERE name = 'count'").fetchone()[0]) == count
    assert 0 < count <= 300
    texts = [f"text {i}" for i in range(400)]
    stored = DiskEmbeddingCache(tmp_path).get_many([content_key("fake-model", t) for t in texts], DIMENSION)
    assert len(stored) == count
    for text in texts:
        if (key := content_key("fake-model", text)) in stored:
            np.testing.assert_array_equal(stored[key], fake_vectors([text])[0])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork-only")
def test_a_forked_child_opens_its_own_connection(tmp_path):
    disk = DiskEmbeddingCache(tmp_path)
    disk.put_many({content_key("m", "parent"): fake_vectors(["parent"])[0]})  # the parent's connection
    child = multiprocessing.get_context("fork").Process(
        target=lambda: disk.put_many({content_key("m", "child"): fake_vectors(["child"])[0]})
    )
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    assert len(disk.get_many([content_key("m", "parent"), content_key("m", "child")], DIMENSION)) == 2


class StrictModel:
    """Stands in for MiniLM inside `embed`: like its tokenizer, it refuses a text UTF-8 cannot
    encode (`fake_vectors` encodes each text strictly)."""

    def encode(self, texts, batch_size, normalize_embeddings, show_progress_bar):
        return fake_vectors(texts)


def test_a_lone_surrogate_is_embedded_as_the_replacement_character_and_spares_its_batch(
    tmp_path, monkeypatch
):
    """Valid JSON can carry "\\ud800": one such prompt failed its whole batch, and SageSched left
    every request of the batch on its prior."""
    monkeypatch.setattr(embedding, "_model", StrictModel)
    monkeypatch.setattr(embedding, "_child", None)
    texts = ["fine", "bad \ud800", "\udfff\ud800"]
    expected = fake_vectors(["fine", "bad \ufffd", "\ufffd\ufffd"])
    np.testing.assert_array_equal(embedding.embed(texts), expected)
    np.testing.assert_array_equal(cache_on(tmp_path).embed(texts), expected)  # through both layers


@pytest.mark.slow
def test_real_minilm_vectors_round_trip_bit_for_bit(tmp_path, monkeypatch):
    texts = ["Write a haiku about caching.", "Summarise the plot of Hamlet in one sentence."]
    first = EmbeddingCache(disk=DiskEmbeddingCache(tmp_path))
    computed = first.embed(texts)
    assert first.misses == 2

    def no_model(texts, batch_size=64):
        raise AssertionError("the model was asked again")

    monkeypatch.setattr(embedding, "embed", no_model)
    np.testing.assert_array_equal(EmbeddingCache(disk=DiskEmbeddingCache(tmp_path)).embed(texts), computed)


def test_a_remembered_vector_is_used_in_process_and_never_written_to_disk(tmp_path, model_calls):
    """`adapt serve --embed-prompts`: the engine keeps the vector the API server sent, so a worker
    that embeds the prompt (neural-length) computes nothing; the disk layer stays the model's own."""
    cache = EmbeddingCache(capacity=2, disk=DiskEmbeddingCache(tmp_path), model_id="fake-model")
    sent = fake_vectors(["from the API server"])[0]
    cache.remember("prompt", sent)
    np.testing.assert_array_equal(cache.embed(["prompt"])[0], sent)
    assert model_calls == [] and cache.hits == 1
    for text in ("a", "b", "c"):
        cache.remember(text, fake_vectors([text])[0])  # bounded like computed ones: oldest out
    assert list(cache._vectors) == ["b", "c"]
    assert cache_on(tmp_path).embed(["prompt"]) is not None and model_calls == [["prompt"]]
