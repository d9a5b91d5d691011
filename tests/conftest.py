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
