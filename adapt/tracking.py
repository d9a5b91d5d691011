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


def client(uri: str | None = None):
    """An MlflowClient on the resolved URI, creating `mlruns/` for the embedded default."""
    import logging

    from mlflow.tracking import MlflowClient

    uri = tracking_uri(uri)
    if is_embedded(uri):
        artifact_root(uri).parent.mkdir(parents=True, exist_ok=True)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)
