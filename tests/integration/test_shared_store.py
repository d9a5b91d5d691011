"""The registry, hot-swap slots, store locks and shared Optuna studies against a real shared store:
PostgreSQL behind an `mlflow server` with served artifacts (tests/shared_store.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adapt.hotswap import Slot
from adapt.registry import Registry, StoreLocked
from predictors.slai_offset import SlaiOffset
from tests.shared_store import SharedStore, shared_store

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> SharedStore:
    pytest.importorskip("pgserver")
    with shared_store(tmp_path_factory.mktemp("shared-store")) as started:
        yield started


def test_versions_promotions_and_rollback_through_the_server(store, tmp_path):
    registry = Registry(store.tracking_uri, cache_dir=tmp_path / "cache")
    first = registry.log(SlaiOffset([0.5], [2.0, 6.0]))
    second = registry.log(SlaiOffset([0.9], [4.0, 9.0]))
    registry.promote("slai-offset", first)
    assert registry.load("slai-offset").rule() == {"thresholds": [0.5], "levels": [2.0, 6.0]}
    registry.promote("slai-offset", second)
    assert registry.resolve("slai-offset") == second
    assert registry.rollback("slai-offset") == first
    assert registry.load("slai-offset").rule()["thresholds"] == [0.5]


def test_a_slot_follows_a_promotion_made_by_another_client(store, tmp_path):
    serving = Registry(store.tracking_uri, cache_dir=tmp_path / "serving-cache")
    operator = Registry(store.tracking_uri, cache_dir=tmp_path / "operator-cache")
    base = operator.log(SlaiOffset([0.6], [1.0, 3.0]))
    operator.promote("slai-offset", base)
    slot = Slot(serving, "slai-offset", interval_s=0.5).start()
    try:
        assert slot.version == base
        newer = operator.log(SlaiOffset([0.7], [2.0, 5.0]))
        operator.promote("slai-offset", newer)
        deadline = time.monotonic() + 2 * 0.5 + 10.0  # two intervals, plus a load over HTTP
        while slot.version != newer and time.monotonic() < deadline:
            time.sleep(0.1)
        assert slot.version == newer and slot.get().rule()["thresholds"] == [0.7]
    finally:
        slot.stop()


def test_the_store_lock_excludes_another_process(store, tmp_path):
    registry = Registry(store.tracking_uri, cache_dir=tmp_path / "cache")
    probe = (
        "from adapt.registry import Registry, StoreLocked\n"
        "try:\n"
        f"    with Registry({store.tracking_uri!r}).store_lock('retrain'):\n"
        "        raise SystemExit(0)\n"
        "except StoreLocked:\n"
        "    raise SystemExit(75)\n"
    )
    with registry.store_lock("retrain"):
        held = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
        with pytest.raises(StoreLocked), registry.store_lock("retrain"):
            pass
    assert held.returncode == 75, held.stderr[-2000:]
    free = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert free.returncode == 0, free.stderr[-2000:]


def test_three_tuning_workers_share_one_study_in_postgres(store):
    """Optuna's RDB storage on the shared PostgreSQL: three processes, four trials each, one study
    with twelve distinct trial numbers. The study is created once first, as with `optuna
    create-study` (three workers creating Optuna's tables at the same moment race each other)."""
    import optuna

    optuna.create_study(study_name="shared-bowl", storage=store.database_uri, direction="minimize")
    worker = (
        "from adapt.online import tune\n"
        "from tests.adapt.test_parallel import bowl\n"
        f"tune(bowl, {{'x': (-1.0, 1.0), 'y': (-2.0, 2.0)}}, n_trials=4, storage={store.database_uri!r},"
        " name='shared-bowl', progress=False)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    workers = [
        subprocess.Popen([sys.executable, "-c", worker], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    for process in workers:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
    study = optuna.load_study(study_name="shared-bowl", storage=store.database_uri)
    numbers = [trial.number for trial in study.trials]
    assert sorted(numbers) == list(range(12))
    assert all(trial.state == optuna.trial.TrialState.COMPLETE for trial in study.trials)


def test_tuning_workers_on_one_study_register_its_best_once(store, tmp_path):
    """`adapt tune ewsjf --storage` run by three workers at once: the trials of all three in one
    study, each an MLflow run, and the study's best registered by exactly one of them (the last
    to finish)."""
    import optuna

    from pipelines.ewsjf import STUDY

    optuna.create_study(study_name=STUDY, storage=store.database_uri, direction="minimize")
    command = [
        *(sys.executable, "-m", "adapt.cli", "--tracking-uri", store.tracking_uri, "tune", "ewsjf"),
        *("--storage", store.database_uri, "--trials", "2", "--num-requests", "120", "--jobs", "1"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": store.tracking_uri}
    workers = [
        subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    for process in workers:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
    study = optuna.load_study(study_name=STUDY, storage=store.database_uri)
    assert sorted(t.number for t in study.trials) == list(range(6))
    registry = Registry(store.tracking_uri, cache_dir=tmp_path / "cache")
    versions = registry.versions("ewsjf-meta-policy")
    assert len(versions) == 1
    window = versions[0].tags["adapt.data_window"]
    assert f'"best_trial": {study.best_trial.number}' in window
    experiment = registry.client.get_experiment_by_name("tune-ewsjf")
    trial_runs = registry.client.search_runs([experiment.experiment_id], "tags.kind = 'tuning-trial'")
    assert len(trial_runs) == 6  # every worker's trials, each an MLflow run on the shared server
