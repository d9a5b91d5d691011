"""A real shared store for tests: PostgreSQL (the `pgserver` wheel: server binaries that pip
installs, no system service) behind a real `mlflow server` with served artifacts, on loopback.

This is the set-up the README's "Sharing one MLflow store and one Optuna study across machines"
section describes, started per test session: an MLflow tracking server whose backend store is
PostgreSQL, and the PostgreSQL URL itself for Optuna's RDB storage (a study shared by several
tuning workers).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from experiments.quickstart_serve import free_port

SERVER_START_TIMEOUT_S = 120.0


class MlflowServer:
    """`mlflow server` on a fixed loopback port over a backend store, with served artifacts; it can
    be stopped and started again on the same port (a registry outage, as its clients see it)."""

    def __init__(self, backend_uri: str, artifacts: Path, log: Path) -> None:
        self.backend_uri, self.artifacts, self.log = backend_uri, artifacts, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            self.backend_uri,
            "--serve-artifacts",
            "--artifacts-destination",
            f"file://{self.artifacts}",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "2",
        ]
        with open(self.log, "a") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        _wait_healthy(self.url, self._process, self.log)

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None


@dataclass(frozen=True)
class SharedStore:
    tracking_uri: str  # http://127.0.0.1:PORT, the MLflow server
    database_uri: str  # postgresql+psycopg2://.../optuna, Optuna's storage (its own database)
    server: MlflowServer  # to stop and restart it


def postgres_uri(server, database: str = "postgres") -> str:
    """SQLAlchemy's URL for a database of a pgserver instance (over its unix socket), with the
    psycopg2 driver."""
    return server.get_uri(database).replace("postgresql://", "postgresql+psycopg2://", 1)


@contextmanager
def shared_store(root: Path) -> Iterator[SharedStore]:
    """Start PostgreSQL in `root/pg` and an MLflow server on it; stop both on exit."""
    import pgserver

    database = pgserver.get_server(root / "pg", cleanup_mode="stop")
    # MLflow and Optuna both keep their schema version in an `alembic_version` table: one database each.
    database.psql("CREATE DATABASE mlflow;")
    database.psql("CREATE DATABASE optuna;")
    server = MlflowServer(postgres_uri(database, "mlflow"), root / "artifacts", root / "mlflow-server.log")
    try:
        server.start()
        yield SharedStore(server.url, postgres_uri(database, "optuna"), server)
    finally:
        server.stop()
        database.cleanup()


def _wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(
        f"mlflow server not healthy after {SERVER_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
    )
