"""The LearnedComponent contract and its safe on-disk format.

A component follows scikit-learn's estimator contract (hyper-parameters are the `__init__`
arguments, stored unchanged; `get_params`/`set_params`; `fit` validates them and returns self;
fitted state ends in `_`; `sklearn.base.clone` gives a fresh unfitted copy) and can also
`evaluate`, `save`, `load` and `validate` itself. What makes it a *versioned model* is the
directory `save` writes:

    component.json   name, schema version, hyper-parameters, metadata (data window, data hash)
    MANIFEST.json    SHA-256 of every other file, written by `write_component`
    <state files>    only formats that load without running code: .json, .npz (allow_pickle=False),
                     .parquet, .faiss, .safetensors, .skops (with an explicit trusted-type list)

`read_component` refuses a directory with a file of any other kind (a pickle would run code on
load), a checksum mismatch, a schema version it does not know, or a component whose `validate()`
fails. The class to instantiate is looked up by name in a fixed table, never imported from a path
found in the artifact (`component_class`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

SAFE_SUFFIXES: frozenset[str] = frozenset({".json", ".npz", ".parquet", ".faiss", ".safetensors", ".skops"})
MANIFEST = "MANIFEST.json"
HEADER = "component.json"


class ComponentError(ValueError):
    """A component artifact that must not be served: unsafe, corrupted, or failing validation."""


class ArtifactMismatch(ComponentError):
    """Files on disk that differ from the checksums recorded when they were written: a copy
    damaged or altered since (a fresh copy from the store may be intact)."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_fingerprint(*arrays_or_texts: Any) -> str:
    """A short hash of training data, recorded in metadata so retraining on unchanged data is a no-op."""
    digest = hashlib.sha256()
    for item in arrays_or_texts:
        if hasattr(item, "tobytes"):
            digest.update(item.tobytes())
        else:
            digest.update(json.dumps(item, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


class LearnedComponent(ABC):
    """Base class of every learned part of a scheduler.

    Subclasses set `name` (the registered-model name), `schema_version`, `primary_metric` and
    `lower_is_better` (what the champion/challenger gate compares), `least_data` and `data_unit`
    (the least training data a fit means anything on, counted by `data_size`), and implement the
    five methods; `check_metrics` adds their own plausibility bounds to the gate.
    `get_params`/`set_params` read the `__init__` signature, so `__init__` must only
    store its arguments under their own names: the header `save` writes, `read_component` and
    `sklearn.base.clone` all rebuild a component from `get_params()`. They are written here rather
    than inherited from `sklearn.base.BaseEstimator`, whose import (~1.3 s) every command, test
    and vLLM engine that touches a component or a policy would otherwise pay; scikit-learn's own
    parameter checks hold for them (`tests/predictors/test_estimator_conformance.py`).
    """

    name: ClassVar[str]
    schema_version: ClassVar[int] = 1
    primary_metric: ClassVar[str] = ""
    lower_is_better: ClassVar[bool] = True
    least_data: ClassVar[int] = 1
    data_unit: ClassVar[str] = "rows"

    @classmethod
    def _param_names(cls) -> list[str]:
        signature = inspect.signature(cls.__init__)
        return sorted(
            p.name
            for p in signature.parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The `__init__` arguments by name; with `deep`, also `name__param` of those that are
        estimators themselves (scikit-learn's rule)."""
        params: dict[str, Any] = {}
        for name in self._param_names():
            value = getattr(self, name)
            if deep and hasattr(value, "get_params") and not isinstance(value, type):
                params.update({f"{name}__{key}": v for key, v in value.get_params().items()})
            params[name] = value
        return params

    def set_params(self, **params: Any) -> Self:
        """Set `__init__` arguments (`name__param` reaches into a nested estimator); unchecked until
        `fit`, as in scikit-learn."""
        valid = set(self._param_names())
        nested: dict[str, dict[str, Any]] = {}
        for key, value in params.items():
            name, nested_key, sub = key.partition("__")
            if name not in valid:
                raise ValueError(
                    f"invalid parameter {name!r} for {type(self).__name__}; valid: {', '.join(sorted(valid))}"
                )
            if nested_key:
                nested.setdefault(name, {})[sub] = value
            else:
                setattr(self, name, value)
        for name, sub_params in nested.items():
            getattr(self, name).set_params(**sub_params)
        return self

    def __sklearn_tags__(self) -> Any:
        """scikit-learn's default estimator tags (what `BaseEstimator` gives), for its tools such as
        `check_is_fitted`; scikit-learn is imported only when one of them asks."""
        from sklearn.utils import Tags, TargetTags

        return Tags(estimator_type=None, target_tags=TargetTags(required=False))

    @property
    def metadata(self) -> dict[str, Any]:
        """The training-data window and hash, the registry version: facts about one fitted
        artifact, so neither a hyper-parameter nor something `clone` may carry over. Created on
        first use because scikit-learn's `__init__` convention leaves no room to set it there."""
        try:
            return self._metadata
        except AttributeError:
            self._metadata: dict[str, Any] = {}
            return self._metadata

    @metadata.setter
    def metadata(self, value: dict[str, Any]) -> None:
        self._metadata = value

    def _record_fit(self, **facts: Any) -> None:
        """Start `metadata` afresh with the facts of the fit just made: a refit is a new artifact,
        so the registry version, save time and data window of a version it was loaded as must
        not survive it (`registry_version` would name the old version for the new model)."""
        self.metadata = dict(facts)

    def data_size(self, data: Any) -> int:
        """How much training data `data` holds, in `data_unit`s."""
        return len(data)

    def require_data(self, data: Any, *, least: int | None = None, part: str = "training data") -> None:
        """Refuse `data` holding fewer than `least` (default `least_data`) `data_unit`s, in one
        line: a model fitted (or a gate scored) on less would be registered on no evidence."""
        need = self.least_data if least is None else least
        have = self.data_size(data)
        if have < need:
            raise ValueError(f"{self.name}: {part} has {have} {self.data_unit}; needs at least {need}")

    def check_metrics(self, metrics: Mapping[str, float | None]) -> None:
        """Refuse held-out metrics no working model would score (the pipelines' gate asks before
        registering): here, any NaN or infinite one. Components add their physical bounds."""
        bad = sorted(k for k, v in metrics.items() if v is not None and not math.isfinite(float(v)))
        if bad:
            raise ComponentError(f"{self.name}: held-out metric(s) not finite: {', '.join(bad)}")

    @abstractmethod
    def fit(self, data: Any) -> Self: ...

    @abstractmethod
    def evaluate(self, data: Any) -> dict[str, float]: ...

    @abstractmethod
    def save_state(self, directory: Path) -> None:
        """Write the fitted state into `directory` (safe formats only)."""

    @abstractmethod
    def load_state(self, directory: Path) -> None:
        """Read the fitted state written by `save_state`."""

    def validate(self) -> None:  # noqa: B027  (optional hook: most components add canaries)
        """Canary checks before a swap; raise ComponentError when the component must not serve."""

    def save(self, directory: str | Path) -> Path:
        return write_component(self, Path(directory))

    @classmethod
    def load(cls, directory: str | Path) -> Self:
        component = read_component(Path(directory))
        if not isinstance(component, cls):
            raise ComponentError(f"{directory}: holds a {component.name!r}, not a {cls.name!r}")
        return component


ENTRY_POINT_GROUP = "adapt.components"
_REGISTERED: dict[str, type[LearnedComponent]] = {}


def registry_version(component: LearnedComponent | None) -> int | str | None:
    """The registry version `component` was loaded as, as a policy's `describe()` reports it:
    "in-memory" for one fitted in this process and never loaded from the registry, None for none."""
    if component is None:
        return None
    return component.metadata.get("registry_version", "in-memory")


def register_component(cls: type[LearnedComponent]) -> type[LearnedComponent]:
    """Make a component class loadable by its `name` in this process (a class decorator), for
    components that are not installed under the `adapt.components` entry-point group."""
    _REGISTERED[cls.name] = cls
    return cls


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP)}


def known_components() -> list[str]:
    return sorted({*_REGISTERED, *_entry_points()})


def component_class(name: str) -> type[LearnedComponent]:
    """The class registered under `name`: a trusted table (installed entry points, then
    `register_component`), never a path found in the artifact. The module is imported only now,
    so reading a policy-config does not import FAISS or torch."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    point = _entry_points().get(name)
    if point is None:
        raise ComponentError(f"unknown component {name!r}; known: {', '.join(known_components())}")
    cls = point.load()
    if not (isinstance(cls, type) and issubclass(cls, LearnedComponent)) or cls.name != name:
        raise ComponentError(f"entry point {name!r} -> {point.value} is not the LearnedComponent {name!r}")
    return cls


def _numpy_to_json(value: Any) -> Any:
    """`json.dumps`'s fallback for numpy values, which a parameter may well be: a scalar as its
    Python number, an array as (nested) lists. numpy is imported only when one turns up."""
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _header_params(component: LearnedComponent) -> dict[str, Any]:
    """The hyper-parameters as the header stores them and `read_component` passes them back to
    `__init__`. A value JSON cannot hold is refused by name: written with `str` as the fallback,
    `kv_capacity=np.int64(50_000)` came back as the string '50000'."""
    params = {}
    for name, value in component.get_params(deep=False).items():
        try:
            params[name] = json.loads(json.dumps(value, default=_numpy_to_json))
        except (TypeError, ValueError) as exc:  # ValueError: a circular reference
            raise ComponentError(
                f"{component.name}: parameter {name}={value!r} cannot be saved as JSON ({exc})"
            ) from None
    return params


def write_component(component: LearnedComponent, directory: Path) -> Path:
    """Save state, then the header, then a manifest with the SHA-256 of every file."""
    params = _header_params(component)  # before anything is written: it may refuse a parameter
    directory.mkdir(parents=True, exist_ok=True)
    component.save_state(directory)
    header = {
        "name": component.name,
        "schema_version": component.schema_version,
        "params": params,
        # saved_at last: metadata loaded with a version holds that version's time
        "metadata": {**component.metadata, "saved_at": time.time()},
    }
    # default=str reaches only the metadata: facts for people, never passed back to a constructor
    (directory / HEADER).write_text(json.dumps(header, indent=2, sort_keys=True, default=str))
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    unsafe = [p.name for p in files if p.suffix not in SAFE_SUFFIXES]
    if unsafe:
        raise ComponentError(
            f"{component.name}: save_state wrote files in unsafe formats: {', '.join(unsafe)}"
        )
    manifest = {str(p.relative_to(directory)): sha256_file(p) for p in files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return directory


def manifest_digest(directory: Path) -> str:
    """SHA-256 of the manifest itself: recorded in the registry so a rewritten manifest is caught."""
    return sha256_file(directory / MANIFEST)


def verify_artifacts(directory: Path, expected_manifest_sha256: str | None = None) -> dict[str, str]:
    """Check every file against the manifest; refuse unknown, missing, unsafe or altered files."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise ComponentError(f"{directory}: no {MANIFEST}; refusing an artifact without checksums")
    if expected_manifest_sha256 is not None and sha256_file(manifest_path) != expected_manifest_sha256:
        raise ArtifactMismatch(f"{directory}: {MANIFEST} does not match the checksum recorded at log time")
    manifest: dict[str, str] = json.loads(manifest_path.read_text())
    present = {
        str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST
    }
    unsafe = sorted(name for name in present if Path(name).suffix not in SAFE_SUFFIXES)
    if unsafe:
        raise ComponentError(
            f"{directory}: unsafe artifact(s) that would need code to load (e.g. pickle): {', '.join(unsafe)}"
        )
    if present != set(manifest):
        extra, missing = sorted(present - set(manifest)), sorted(set(manifest) - present)
        raise ArtifactMismatch(
            f"{directory}: files differ from the manifest (extra {extra}, missing {missing})"
        )
    for name, digest in manifest.items():
        if sha256_file(directory / name) != digest:
            raise ArtifactMismatch(f"{directory}: checksum mismatch for {name}")
    return manifest


def _init_params(cls: type[LearnedComponent], params: dict[str, Any], where: str) -> dict[str, Any]:
    """A header's hyper-parameters, checked against `cls.__init__` before it sees them. One it
    does not take (an artifact of a newer or another version of the class) is refused: dropped,
    it would serve a model configured otherwise than the one evaluated. One missing -- an older
    artifact written before the class took it -- gets its default, as scikit-learn gives any
    parameter not passed; a new default that changes what an old artifact did needs a new
    `schema_version`."""
    known = cls._param_names()
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ComponentError(
            f"{where}: unknown parameter(s) {', '.join(unknown)}; {cls.__name__} takes {', '.join(known)}"
        )
    return params


def read_component(directory: Path, expected_manifest_sha256: str | None = None) -> LearnedComponent:
    """Verify, instantiate by name, load state, validate."""
    verify_artifacts(directory, expected_manifest_sha256)
    header = json.loads((directory / HEADER).read_text())
    cls = component_class(header["name"])
    if "schema_version" not in header:
        raise ComponentError(f"{directory}: {header['name']} header has no schema_version")
    version = header["schema_version"]
    if type(version) is not int or version != cls.schema_version:  # not 1.0, "1" or true
        raise ComponentError(
            f"{directory}: {header['name']} schema version {version!r} is not"
            f" the supported {cls.schema_version}"
        )
    component = cls(**_init_params(cls, header.get("params", {}), f"{directory}: {header['name']}"))
    component.metadata = dict(header.get("metadata", {}))
    component.load_state(directory)
    try:
        component.validate()
    except ComponentError:
        raise
    except Exception as exc:  # a canary that crashes is a failed validation, not a crash of the caller
        raise ComponentError(f"{header['name']}: validation raised {type(exc).__name__}: {exc}") from exc
    return component
