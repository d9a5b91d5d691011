"""MLflow-backed store of component versions: log, register, promote, roll back, load.

One registered model per component name. Aliases: `champion` (what serving loads), `challenger`,
and `previous` (the champion before the last promotion, what `rollback` restores). Each version is
an MLflow pyfunc model ("models from code": `adapt/pyfunc_model.py`, no pickle) whose artifacts are
the component directory; the SHA-256 of its manifest is a version tag, checked on every load.
Loading resolves an alias to a version number first, so a concurrent promotion can never mix two
versions' files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapt import tracking
from adapt.component import LearnedComponent, manifest_digest, read_component, write_component

log = logging.getLogger("adapt.registry")

CHAMPION, CHALLENGER, PREVIOUS = "champion", "challenger", "previous"
COMPONENTS_EXPERIMENT = "components"
PYFUNC_MODEL_FILE = Path(__file__).with_name("pyfunc_model.py")
HISTORY_TAG = "adapt.champion_history"


class RegistryError(RuntimeError):
    """A registry operation that cannot be done (unknown model, no alias, nothing to roll back)."""


@dataclass(frozen=True)
class VersionInfo:
    name: str
    version: int
    aliases: tuple[str, ...]
    run_id: str | None
    metrics: dict[str, float]
    tags: dict[str, str]
    created_s: float


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=tracking.PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def default_cache_dir(uri: str) -> Path:
    """Where downloaded versions are kept. Beside an embedded store (`mlruns/model-cache`), so
    deleting the store deletes its cache: entries are content-addressed and every fresh store adds
    new ones, which in a shared temp dir would pile up (a qrf-length version is ~400 MB).
    A remote server's versions are cached in the temp dir."""
    if tracking.is_embedded(uri):
        return tracking.artifact_root(uri).parent / "model-cache"
    return Path(tempfile.gettempdir()) / "adapt-model-cache"


class Registry:
    """`Registry(tracking_uri=None)`: the embedded sqlite store under mlruns/ unless told otherwise."""

    def __init__(self, tracking_uri: str | None = None, cache_dir: str | Path | None = None) -> None:
        self.tracking_uri = tracking.tracking_uri(tracking_uri)
        self.client = tracking.client(self.tracking_uri)
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir(self.tracking_uri)

    # ------------------------------------------------------------------ write
    def log(
        self,
        component: LearnedComponent,
        metrics: dict[str, float] | None = None,
        register: bool = True,
        *,
        params: dict[str, Any] | None = None,
        run_name: str | None = None,
        experiment: str = COMPONENTS_EXPERIMENT,
        run_id: str | None = None,
    ) -> int | None:
        """Log the component as an MLflow run + pyfunc model; register it as a new version.
        Returns the version number (None when `register=False`). `run_id`: log into a run made
        by `new_run` (where training already logged its curves) instead of a fresh one."""
        import mlflow

        experiment_id = tracking.ensure_experiment(self.client, experiment, self.tracking_uri)
        with tempfile.TemporaryDirectory(prefix="adapt-log-") as tmp:
            directory = write_component(component, Path(tmp) / "component")
            digest = manifest_digest(directory)
            meta = component.metadata
            tags = {
                "adapt.component": component.name,
                "adapt.schema_version": str(component.schema_version),
                "adapt.data_window": json.dumps(meta.get("data_window")),
                "adapt.data_hash": str(meta.get("data_hash")),
                "adapt.git_commit": _git_commit(),
                "adapt.manifest_sha256": digest,
            }
            mlflow.set_tracking_uri(self.tracking_uri)
            started = (
                mlflow.start_run(run_id=run_id)
                if run_id
                else mlflow.start_run(experiment_id=experiment_id, run_name=run_name or component.name)
            )
            with started as run:
                mlflow.set_tags(tags)
                logged_params = {**_flat_params(component.get_params()), **(params or {})}
                if logged_params:
                    mlflow.log_params({k: str(v)[:500] for k, v in logged_params.items()})
                if metrics:
                    mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None})
                info = mlflow.pyfunc.log_model(
                    name="model",
                    python_model=str(PYFUNC_MODEL_FILE),
                    artifacts={"component": str(directory)},
                    pip_requirements=["adapt-sched"],
                    tags=tags,
                )
                run_id = run.info.run_id
        if not register:
            return None
        self._ensure_registered_model(component.name)
        version = self.client.create_model_version(
            component.name, source=info.model_uri, run_id=run_id, tags=tags, model_id=info.model_id
        )
        log.info("logged %s version %s (run %s)", component.name, version.version, run_id)
        return int(version.version)

    def new_run(self, run_name: str, experiment: str = COMPONENTS_EXPERIMENT) -> str:
        """An empty run for a training job that logs while it trains (Lightning's MLflow logger);
        pass its id to `log` so the curves and the registered version share one run."""
        experiment_id = tracking.ensure_experiment(self.client, experiment, self.tracking_uri)
        return self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def _ensure_registered_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException:
            try:
                self.client.create_registered_model(name, tags={HISTORY_TAG: "[]"})
            except MlflowException:
                self.client.get_registered_model(name)  # created concurrently: fine

    def promote(self, name: str, version: int, alias: str = CHAMPION) -> None:
        """Point `alias` at `version`. Promoting a new champion keeps the old one as `previous`."""
        self._version(name, version)  # fails clearly if missing
        if alias != CHAMPION:
            self.client.set_registered_model_alias(name, alias, str(version))
            return
        current = self.resolve(name, CHAMPION, missing_ok=True)
        if current == version:
            return
        history = self._history(name)
        if current is not None:
            self.client.set_registered_model_alias(name, PREVIOUS, str(current))
        history.append(int(version))
        self.client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history[-50:]))
        self.client.set_registered_model_alias(name, CHAMPION, str(version))
        log.info("promoted %s version %s to champion (previous: %s)", name, version, current)

    def rollback(self, name: str) -> int:
        """Make the previous champion the champion again; returns the version now serving."""
        history = self._history(name)
        current = self.resolve(name, CHAMPION, missing_ok=True)
        if current is not None and history and history[-1] == current:
            history.pop()
        if not history:
            raise RegistryError(f"{name}: no previous champion to roll back to")
        target = history[-1]
        self.client.set_registered_model_alias(name, CHAMPION, str(target))
        before = history[-2] if len(history) > 1 else None
        if before is None:
            self.client.delete_registered_model_alias(name, PREVIOUS)
        else:
            self.client.set_registered_model_alias(name, PREVIOUS, str(before))
        self.client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history))
        log.info("rolled back %s: champion %s -> %s", name, current, target)
        return target

    def _history(self, name: str) -> list[int]:
        from mlflow.exceptions import MlflowException

        try:
            model = self.client.get_registered_model(name)
        except MlflowException as exc:
            raise RegistryError(f"{name}: no such registered model ({exc.error_code})") from exc
        return [int(v) for v in json.loads(model.tags.get(HISTORY_TAG, "[]"))]

    def _version(self, name: str, version: int):
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version(name, str(version))
        except MlflowException as exc:
            raise RegistryError(f"{name}: no version {version} ({exc.error_code})") from exc

    # ------------------------------------------------------------------- read
    def resolve(self, name: str, alias: str = CHAMPION, *, missing_ok: bool = False) -> int | None:
        """The version number an alias points at (None if unset and `missing_ok`)."""
        from mlflow.exceptions import MlflowException

        try:
            return int(self.client.get_model_version_by_alias(name, alias).version)
        except MlflowException as exc:
            if missing_ok and exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise RegistryError(f"{name}@{alias}: {exc.message}") from exc

    def champion(self, name: str) -> LearnedComponent | None:
        """The serving champion, loaded and verified; None when no version has been promoted."""
        version = self.resolve(name, CHAMPION, missing_ok=True)
        return None if version is None else self.load(name, version=version)

    def download(self, name: str, version: int) -> tuple[Path, str]:
        """Local directory of a version's component files (cached), and its recorded manifest digest."""
        import mlflow

        mv = self._version(name, version)
        digest = mv.tags.get("adapt.manifest_sha256")
        if not digest:
            raise RegistryError(f"{name} v{version}: no manifest checksum recorded; not an adapt component")
        # Content-addressed: two stores' "version 3" never share a cache entry.
        target = self.cache_dir / name / f"v{version}-{digest[:16]}"
        if not (target / "component").is_dir():
            staging = Path(tempfile.mkdtemp(prefix="adapt-dl-", dir=self._mkcache()))
            mlflow.set_tracking_uri(self.tracking_uri)
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(staging)))
            found = next(local.rglob("component.json"), None)
            if found is None:
                raise RegistryError(f"{name} v{version}: no component files in {mv.source}")
            target.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # another process cached it first
                found.parent.rename(target / "component")
            shutil.rmtree(staging, ignore_errors=True)
        return target / "component", digest

    def _mkcache(self) -> Path:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        return self.cache_dir

    def load(self, name: str, alias: str | None = CHAMPION, version: int | None = None) -> LearnedComponent:
        """Load a version (or the version an alias points at), verified and validated."""
        if version is None:
            if alias is None:
                raise RegistryError("load: give an alias or a version")
            version = self.resolve(name, alias)
        directory, digest = self.download(name, int(version))  # type: ignore[arg-type]
        component = read_component(directory, digest)
        component.metadata["registry_version"] = int(version)  # type: ignore[arg-type]
        return component

    def versions(self, name: str) -> list[VersionInfo]:
        self._history(name)  # a clear error for an unknown name
        versions = self.client.search_model_versions(f"name = '{name}'")
        aliases: dict[str, list[str]] = {}
        model = self.client.get_registered_model(name)
        for alias, version in (model.aliases or {}).items():
            aliases.setdefault(str(version), []).append(alias)
        infos = []
        for mv in sorted(versions, key=lambda v: int(v.version)):
            metrics = self.client.get_run(mv.run_id).data.metrics if mv.run_id else {}
            infos.append(
                VersionInfo(
                    name=name,
                    version=int(mv.version),
                    aliases=tuple(sorted(aliases.get(str(mv.version), []))),
                    run_id=mv.run_id,
                    metrics=dict(metrics),
                    tags=dict(mv.tags),
                    created_s=mv.creation_timestamp / 1000.0,
                )
            )
        return infos

    def names(self) -> list[str]:
        return sorted(m.name for m in self.client.search_registered_models())


def _flat_params(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            flat.update(_flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_reference(name: str, reference: str) -> LearnedComponent:
    """A component from the default store by a reference a user types: an alias (`champion`) or
    a version (`v3`), as policy parameters take them (`jitserve:qrf=v2`)."""
    registry = Registry()
    if reference.startswith("v") and reference[1:].isdigit():
        return registry.load(name, version=int(reference[1:]))
    return registry.load(name, alias=reference)
