"""Where MLflow keeps runs and models: the embedded default, or a shared server.

Default: `sqlite:///<project>/mlruns/mlflow.db` with artifacts under `<project>/mlruns/artifacts`
(MLflow 3 refuses the old file store). `MLFLOW_TRACKING_URI` points everything at a shared
`mlflow server` instead (e.g. PostgreSQL-backed), whose own artifact store then applies.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def mlruns_dir() -> Path:
    """`mlruns/` of the source checkout when running from one, else of the working directory."""
    root = PROJECT_ROOT if (PROJECT_ROOT / "pyproject.toml").is_file() else Path.cwd()
    return root / "mlruns"


def default_tracking_uri() -> str:
    return f"sqlite:///{mlruns_dir() / 'mlflow.db'}"


def tracking_uri(explicit: str | None = None) -> str:
    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def is_embedded(uri: str) -> bool:
    """A local sqlite store (the default or any other file): artifacts live beside the db."""
    return uri.startswith("sqlite:///")


def artifact_root(uri: str) -> Path:
    return Path(uri.removeprefix("sqlite:///")).parent / "artifacts"


def ensure_experiment(client, name: str, uri: str) -> str:
    """Id of experiment `name`, created if missing (artifacts beside the embedded db). Two
    processes creating it at once is fine: the loser reads the winner's experiment."""
    from mlflow.exceptions import MlflowException

    existing = client.get_experiment_by_name(name)
    if existing is not None:
        return existing.experiment_id
    location = artifact_root(uri).as_uri() if is_embedded(uri) else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:
        existing = client.get_experiment_by_name(name)
        if existing is None:
            raise
        return existing.experiment_id


def dispose_connections(uri: str) -> None:
    """Close the database connections MLflow pools for `uri`, so the next query opens the database
    anew (e.g. a sqlite file replaced by a restore). MLflow keeps one SQLAlchemy engine per URI and
    process, shared by every client, in its stores' `_engine_map`: a fresh MlflowClient alone
    would keep reading the old file."""
    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as RegistryStore
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as TrackingStore

    for store in (TrackingStore, RegistryStore):
        engine = getattr(store, "_engine_map", {}).get(uri)
        if engine is not None:
            engine.dispose()


def client(uri: str | None = None):
    """An MlflowClient on the resolved URI. For a local sqlite store, the directory is created on
    first use and the schema is created/migrated under an exclusive file lock, so two processes
    starting together do not race on MLflow's table creation."""
    import fcntl
    import logging

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    uri = tracking_uri(uri)
    if not is_embedded(uri):
        return MlflowClient(tracking_uri=uri, registry_uri=uri)
    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            mlflow_client = MlflowClient(tracking_uri=uri, registry_uri=uri)
            # Both stores create/migrate the schema on first use: do it here, once, under the lock.
            mlflow_client.search_experiments(max_results=1)
            mlflow_client.search_registered_models(max_results=1)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return mlflow_client
