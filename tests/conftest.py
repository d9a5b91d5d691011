"""Shared fixtures: paths to the real data in ../shared/data and small generated workloads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    path = SHARED_DATA / "traces"
    if not path.is_dir():
        pytest.skip("../shared/data is not next to this checkout")
    return path


@pytest.fixture(autouse=True)
def _isolated_mlflow(tmp_path, monkeypatch):
    """Never write to the checkout's mlruns/ from a test."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")


@pytest.fixture(autouse=True, scope="session")
def _isolated_embedding_cache(tmp_path_factory):
    """Never write the on-disk embedding cache into the checkout's mlruns/ either: one directory for
    the session (its tests, and the CLI subprocesses they start, share the vectors), resolved anew
    by the process-wide cache."""
    from predictors.embedding import shared_cache

    previous = os.environ.get("ADAPT_EMBEDDING_CACHE")
    os.environ["ADAPT_EMBEDDING_CACHE"] = str(tmp_path_factory.mktemp("embedding-cache"))
    shared_cache.cache_clear()
    yield
    shared_cache.cache_clear()
    if previous is None:
        os.environ.pop("ADAPT_EMBEDDING_CACHE", None)
    else:
        os.environ["ADAPT_EMBEDDING_CACHE"] = previous
