"""MLflow-backed store of component versions: log, register, promote, roll back, load.

One registered model per component name. Aliases: `champion` (what serving loads), `challenger`,
and `previous` (the champion before the last promotion, what `rollback` restores). Each version is
an MLflow pyfunc model ("models from code": `adapt/pyfunc_model.py`, no pickle) whose artifacts are
the component directory; the SHA-256 of its manifest is a version tag, checked on every load.
Loading resolves an alias to a version number first, so a concurrent promotion can never mix two
versions' files.

Robustness: a download is verified against the recorded checksums before it enters the cache, so a
damaged store never leaves a damaged cache entry behind (repair the store and the next load is
fine), and a cache entry damaged later is downloaded again once. A long-lived registry notices when
its sqlite file is replaced underneath it (a restore from backup: a new inode) and reconnects
(`reconnect_if_replaced`). `store_lock` is an exclusive lock on the store itself, for jobs that
must not run twice against one store (`adapt retrain`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapt import tracking
from adapt.component import (
    ArtifactMismatch,
    ComponentError,
    LearnedComponent,
    manifest_digest,
    read_component,
    verify_artifacts,
    write_component,
)

log = logging.getLogger("adapt.registry")

CHAMPION, CHALLENGER, PREVIOUS = "champion", "challenger", "previous"
COMPONENTS_EXPERIMENT = "components"
PYFUNC_MODEL_FILE = Path(__file__).with_name("pyfunc_model.py")
HISTORY_TAG = "adapt.champion_history"
LOCK_PREFIX = "adapt-lock."  # registered models that are locks on a server-backed store, not models


class RegistryError(RuntimeError):
    """A registry operation that cannot be done (unknown model, no alias, nothing to roll back)."""


class StoreLocked(RegistryError):
    """Another process holds this store's lock (`Registry.store_lock`)."""


class ChampionMoved(RegistryError):
    """A rollback decided on an earlier read of the aliases finds the champion, or the version it
    would go back to, changed since (`Registry.rollback(expect_champion=...)`): a newer promotion
    or a rollback made already, which acting on the old decision would undo or repeat."""


class BrokenVersion(RegistryError):
    """A version that exists but cannot be loaded however often it is tried (no checksum, no
    component files): a hot-swap slot refuses it rather than retry it as an unreachable store."""


# Promote and rollback wait this long for each other (`Registry._aliases_lock`).
ALIASES_WAIT_S = 30.0


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
        embedded = tracking.is_embedded(self.tracking_uri)
        self._store_file = Path(self.tracking_uri.removeprefix("sqlite:///")) if embedded else None
        self._store_identity = self._identity()

    # ------------------------------------------------------------- connection
    def _identity(self) -> tuple[int, int] | None:
        """(device, inode) of the sqlite file: a restore that replaces the file changes it, while
        ordinary writes (which change its mtime) do not. None for a server-backed store."""
        if self._store_file is None:
            return None
        try:
            stat = os.stat(self._store_file)
        except FileNotFoundError:
            raise RegistryError(f"{self._store_file}: the store's database file is gone") from None
        return stat.st_dev, stat.st_ino

    def reconnect_if_replaced(self) -> bool:
        """Reconnect when the sqlite file was replaced since this registry connected (MLflow's
        pooled connections would go on reading the old, deleted file and never see a later
        promotion); True when it did. A server-backed store needs nothing: every request is a
        new HTTP call, so a restarted server is seen at the next one."""
        identity = self._identity()
        if identity == self._store_identity:
            return False
        tracking.dispose_connections(self.tracking_uri)
        self.client = tracking.client(self.tracking_uri)
        self._store_identity = identity
        log.warning("%s: the store's database file was replaced; reconnected", self._store_file)
        return True

    @contextlib.contextmanager
    def store_lock(self, purpose: str, stale_after_s: float = 6 * 3600) -> Iterator[None]:
        """Hold an exclusive, non-blocking lock named `purpose` on this store, or raise StoreLocked.

        A sqlite store: `flock` on `<db>.<purpose>.lock` beside the database, whatever directory
        the job runs from (released by the OS if the holder dies). A server-backed store has no
        file to lock, and MLflow's API no compare-and-set; what it does have is a unique name per
        registered model, enforced by the server's database. So the lock is a registered model
        `adapt-lock.<purpose>`: creating it is the atomic test-and-set (a second creator fails),
        deleting it releases it. A holder that died leaves it behind; one older than
        `stale_after_s` is taken over -- the one window where two could both hold it is two
        processes taking over the same stale lock at once."""
        if self._store_file is not None:
            path = self._store_file.with_name(f"{self._store_file.name}.{purpose}.lock")
            with open(path, "w") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise StoreLocked(f"{path}: another {purpose} holds this store") from None
                yield
            return
        with self._model_lock(purpose, stale_after_s):
            yield

    @contextlib.contextmanager
    def _model_lock(self, purpose: str, stale_after_s: float) -> Iterator[None]:
        """The server-backed form of `store_lock` (any store works; tests use sqlite). Only MLflow's
        "already exists" means another holder: any other error (a server down, a 403) is raised as a
        RegistryError, since read as a held lock it would pass for a second retrain (which exits
        EXIT_LOCKED) and make promote and rollback wait in vain for a holder that is not there."""
        from mlflow.exceptions import MlflowException

        name = f"{LOCK_PREFIX}{purpose}"
        holder = f"{socket.gethostname()}:{os.getpid()}:{time.time():.3f}"

        def take() -> bool:
            """True when this process now holds the lock, False when another one does."""
            try:
                self.client.create_registered_model(name, tags={"holder": holder, "since": str(time.time())})
            except MlflowException as exc:
                # A sqlite store and a REST store's client (from the server's JSON) both name it so.
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise RegistryError(
                        f"{self.tracking_uri}: cannot take the {purpose} lock: {exc.message}"
                    ) from exc
                return False
            return True

        if not take():
            held = self._lock_tags(name)
            if time.time() - float(held.get("since", 0.0)) < stale_after_s:
                raise StoreLocked(
                    f"{self.tracking_uri}: another {purpose} holds this store ({held.get('holder')})"
                )
            log.warning("%s: taking over the stale %s lock of %s", name, purpose, held.get("holder"))
            with contextlib.suppress(MlflowException):
                self.client.delete_registered_model(name)
            if not take():
                raise StoreLocked(f"{self.tracking_uri}: another {purpose} took this store first")
        try:
            yield
        finally:
            with contextlib.suppress(MlflowException):
                if self.client.get_registered_model(name).tags.get("holder") == holder:
                    self.client.delete_registered_model(name)

    def _lock_tags(self, name: str) -> dict[str, str]:
        """The tags of a lock model found held; {} when it was released meanwhile (as good as stale).
        Any other error is no answer, and must not pass for a stale lock that is then taken over."""
        from mlflow.exceptions import MlflowException

        try:
            return dict(self.client.get_registered_model(name).tags)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise RegistryError(
                    f"{self.tracking_uri}: cannot read the lock {name}: {exc.message}"
                ) from exc
            return {}

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
        _check_promoted_alias(alias)
        self._version(name, version)  # fails clearly if missing
        if alias != CHAMPION:
            self.client.set_registered_model_alias(name, alias, str(version))
            return
        with self._aliases_lock(name):
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

    def rollback(
        self, name: str, *, expect_champion: int | None = None, expect_target: int | None = None
    ) -> int:
        """Make the previous champion the champion again; returns the version now serving.
        Versions deleted since they were champion are passed over. A caller that decided from an
        earlier read of the aliases (a drift watch) names the champion and the target it decided
        on; they are read again under the aliases lock, and if either changed since (another watch
        rolled back, a retrain promoted) nothing moves and ChampionMoved says so: acting anyway
        would roll back twice, or undo that promotion."""
        from mlflow.exceptions import MlflowException

        with self._aliases_lock(name):
            current = self.resolve(name, CHAMPION, missing_ok=True)
            if expect_champion is not None and current != expect_champion:
                now = "unset" if current is None else f"v{current}"
                raise ChampionMoved(
                    f"{name}: the champion is {now} now, not v{expect_champion}; not rolled back"
                )
            history = self._rollback_history(name, current)
            target = history[-1]
            if expect_target is not None and target != expect_target:
                raise ChampionMoved(
                    f"{name}: v{current} goes back to v{target} now, not v{expect_target}; not rolled back"
                )
            self.client.set_registered_model_alias(name, CHAMPION, str(target))
            before = history[-2] if len(history) > 1 else None
            if before is None:
                with contextlib.suppress(MlflowException):  # deleting a version takes its aliases along
                    self.client.delete_registered_model_alias(name, PREVIOUS)
            else:
                self.client.set_registered_model_alias(name, PREVIOUS, str(before))
            self.client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history))
        log.info("rolled back %s: champion %s -> %s", name, current, target)
        return target

    def _rollback_history(self, name: str, current: int | None) -> list[int]:
        """The champion history less the champion `current` and the versions deleted since they
        were champion: its last entry is what a rollback restores."""
        history = self._history(name)
        if current is not None and history and history[-1] == current:
            history.pop()
        existing = {int(mv.version) for mv in self.client.search_model_versions(f"name = '{name}'")}
        deleted = [v for v in history if v not in existing]
        if deleted:
            log.warning("%s: versions %s were deleted; rollback passes over them", name, deleted)
            history = [v for v in history if v in existing]
        if not history:
            raise RegistryError(f"{name}: no previous champion to roll back to")
        return history

    @contextlib.contextmanager
    def _aliases_lock(self, name: str) -> Iterator[None]:
        """Promote and rollback each read the champion history and write it back: run at once
        (a drift watch rolling back while a retrain promotes), one's write would undo the
        other's. Each holds this store lock for those few calls, waiting up to `ALIASES_WAIT_S`
        for the other; a holder that died is stale after a minute (a sqlite store's lock goes
        with its process at once)."""
        deadline = time.monotonic() + ALIASES_WAIT_S
        with contextlib.ExitStack() as stack:
            while True:
                try:
                    stack.enter_context(self.store_lock(f"aliases-{name}", stale_after_s=60))
                    break
                except StoreLocked:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            yield

    def tag_version(self, name: str, version: int, key: str, value: str) -> None:
        """Set a tag on one version, e.g. why it was rolled back (`pipelines.watch`), so whoever
        looks at it before promoting it again (`adapt models show`) sees that it did badly."""
        self._version(name, version)  # fails clearly if missing
        self.client.set_model_version_tag(name, str(version), key, value)

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
    def version_metrics(self, name: str, version: int) -> dict[str, float]:
        """The metrics logged with a version (its held-out scores), e.g. for a server to compare
        what it measures online with (`serving_hooks.quality`)."""
        mv = self._version(name, version)
        return dict(self.client.get_run(mv.run_id).data.metrics) if mv.run_id else {}

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
        """Local directory of a version's component files (cached), and its recorded manifest
        digest. A fresh download enters the cache only once it matches that digest."""
        import mlflow

        mv = self._version(name, version)
        digest = mv.tags.get("adapt.manifest_sha256")
        if not digest:
            raise BrokenVersion(f"{name} v{version}: no manifest checksum recorded; not an adapt component")
        # Content-addressed: two stores' "version 3" never share a cache entry.
        target = self.cache_dir / name / f"v{version}-{digest[:16]}"
        if not (target / "component").is_dir():
            staging = Path(tempfile.mkdtemp(prefix="adapt-dl-", dir=self._mkcache()))
            try:
                mlflow.set_tracking_uri(self.tracking_uri)
                local = Path(
                    mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(staging))
                )
                found = next(local.rglob("component.json"), None)
                if found is None:
                    raise BrokenVersion(f"{name} v{version}: no component files in {mv.source}")
                try:
                    verify_artifacts(found.parent, digest)
                except ComponentError as exc:
                    raise type(exc)(
                        f"{name} v{version}: the store's copy ({mv.source}) fails verification, not"
                        f" cached: {str(exc).removeprefix(f'{found.parent}: ')}"
                    ) from None
                target.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):  # another process cached it first
                    found.parent.rename(target / "component")
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return target / "component", digest

    def _evict(self, entry: Path) -> None:
        """Remove a cache entry: renamed away first, so no reader finds it half deleted."""
        doomed = Path(tempfile.mkdtemp(prefix="adapt-evict-", dir=self._mkcache()))
        with contextlib.suppress(OSError):  # another process evicted it first
            entry.rename(doomed / "entry")
        shutil.rmtree(doomed, ignore_errors=True)

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
        try:
            component = read_component(directory, digest)
        except ArtifactMismatch as exc:  # the cached copy changed since it was verified: fetch it again
            log.warning("%s v%s: cached copy damaged (%s); downloading it again", name, version, exc)
            self._evict(directory.parent)
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
        """Registered components (not the locks `store_lock` keeps on a server-backed store)."""
        return sorted(
            m.name for m in self.client.search_registered_models() if not m.name.startswith(LOCK_PREFIX)
        )


def _flat_params(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            flat.update(_flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _check_promoted_alias(alias: str) -> None:
    """Refuse `previous` (in any case), which promote and rollback set together with the champion
    history under the aliases lock (set alone, a rollback would restore a version that never was
    champion), and a case variant of another alias this module names (`Champion`): a separate
    alias that looks like the real one while the champion stays where it was."""
    if alias.lower() == PREVIOUS:
        raise RegistryError(
            f"alias {alias!r}: {PREVIOUS!r} is set by promote and rollback (the champion before the"
            " last promotion); promote to champion instead, or roll back"
        )
    for reserved in (CHAMPION, CHALLENGER):
        if alias != reserved and alias.lower() == reserved:
            raise RegistryError(f"alias {alias!r}: aliases are case-sensitive; did you mean {reserved!r}?")


def version_of(reference: str) -> int | None:
    """The version a reference a user types names (`v3` -> 3); None for an alias (`champion`)."""
    return int(reference[1:]) if reference[:1] == "v" and reference[1:].isdigit() else None


def load_reference(name: str, reference: str) -> LearnedComponent:
    """A component from the default store by a reference a user types: an alias (`champion`) or
    a version (`v3`), as policy parameters take them (`jitserve:qrf=v2`)."""
    registry = Registry()
    version = version_of(reference)
    if version is not None:
        return registry.load(name, version=version)
    return registry.load(name, alias=reference)
