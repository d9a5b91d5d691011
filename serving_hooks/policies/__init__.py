"""Policy registry: the names users type (DESIGN.md section 7) mapped to policy classes."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapt.component import ComponentError
from adapt.mechanics import UnsupportedPolicy, check_policy
from adapt.policy import Policy
from adapt.registry import CHAMPION, Registry, RegistryError, load_reference, version_of
from adapt.tracking import tracking_uri
from serving_hooks.policies.baselines import (
    EDF,
    FCFS,
    LTR,
    PLAS,
    SPF,
    FastServe,
    Sarathi,
    SJFOracle,
    Trail,
    VllmV0,
)
from serving_hooks.policies.ewsjf import EWSJF
from serving_hooks.policies.ewsjf_online import OnlineEWSJF
from serving_hooks.policies.jitserve import JITServe, JITServeOracle
from serving_hooks.policies.params import check_params
from serving_hooks.policies.sagesched import SageSched
from serving_hooks.policies.slai import SLAI, SLAIFixed

BASELINE_POLICIES: dict[str, Callable[..., Policy]] = {
    "fcfs": FCFS,
    "vllm-v0": VllmV0,
    "sarathi": Sarathi,
    "spf": SPF,
    "edf": EDF,
    "sjf-oracle": SJFOracle,
    "ltr": LTR,
    "trail": Trail,
    "fastserve": FastServe,
    "plas": PLAS,
}
LEARNED_POLICIES: dict[str, Callable[..., Policy]] = {
    "ewsjf": EWSJF,
    "ewsjf-online": OnlineEWSJF,
    "slai": SLAI,
    "slai-fixed": SLAIFixed,
    "sagesched": SageSched,
    "jitserve": JITServe,
    "jitserve-oracle": JITServeOracle,
}
POLICIES: dict[str, Callable[..., Policy]] = {**BASELINE_POLICIES, **LEARNED_POLICIES}
BASELINES: tuple[str, ...] = tuple(BASELINE_POLICIES)


def make_policy(name: str, **params: Any) -> Policy:
    """A fresh policy instance (policies keep per-replay state, so never share one).

    A learned component given by registry reference -- an alias such as `champion` or a version
    `vN`, as a user types it (`jitserve:qrf=v2`), or another component the policy takes in that
    place (`Policy.alternatives`) as `NAME@vN` / `NAME@alias` (`jitserve:qrf=neural-length@v1`) --
    is loaded here, so policies only ever receive component instances (or their parameters) and
    never look anything up themselves."""
    if name not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; expected one of {', '.join(POLICIES)}")
    policy_class = POLICIES[name]
    check_params(policy_class, params)
    for attribute in getattr(policy_class, "components", {}):
        if isinstance(params.get(attribute), str):
            component, reference = component_reference(policy_class, attribute, params[attribute])
            params[attribute] = load_reference(component, reference)
    return policy_class(**params)


def component_reference(policy_class: Any, attribute: str, reference: str) -> tuple[str, str]:
    """(registered component, version or alias) a policy parameter names: `v3` or `champion` for
    the attribute's own component, `NAME@v3` for an alternative the policy lists for it."""
    own = policy_class.components[attribute]
    name, sep, version = reference.rpartition("@")
    if not sep:
        return own, reference
    allowed = (own, *getattr(policy_class, "alternatives", {}).get(attribute, ()))
    if name not in allowed:
        raise ValueError(f"{attribute}: {name!r} cannot serve there; expected one of {', '.join(allowed)}")
    return name, version


def servable_policies() -> list[str]:
    """Policies whose default configuration vLLM does not refuse (`adapt.mechanics`): all but those
    that read true output lengths (the oracles, and ltr/trail whose default ranker is a noisy
    oracle) and vLLM V0's prefill-first emulation."""
    servable = []
    for name in POLICIES:
        try:
            check_policy(make_policy(name), "vllm")
        except UnsupportedPolicy:
            continue
        servable.append(name)
    return servable


POLICY_CONFIG = "policy-config"


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`name` or `name:key=value:key=value` (values parsed as JSON when they parse, else strings),
    e.g. `sarathi:order=spf` or `slai-fixed:offset=5`, so the CLI can name configured variants.

    `policy-config@vN` / `policy-config@ALIAS` names a registered `policy-config` (what a tuner
    registered, what `adapt serve --follow-policy-config` serves once promoted): its policy and
    parameters, read from the registry, so the exact version an operator is about to promote can
    be replayed first. It takes no `key=value`: another configuration is another version. Reading
    one opens the registry (the default store), so parsing such a spec does I/O; `adapt replay` pins
    an alias to its version before it starts (`pin_policy_config`), while `adapt serve --policy
    policy-config@ALIAS` resolves it once, when its engine starts (`--follow-policy-config` follows
    the champion)."""

    reference = _policy_config_reference(spec)
    if reference is not None:
        config = registered_policy_config(reference)
        return config.policy, dict(config.params or {})
    name, *assignments = spec.strip().split(":")
    params: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"policy {spec!r}: expected key=value after ':', got {assignment!r}")
        if key in params:  # not the last one silently: which of two values was meant is unknown
            raise ValueError(f"policy {spec!r}: {key} given twice")
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    if name not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; expected one of {', '.join(POLICIES)}")
    return name, params


def component_references(name: str, params: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Per learned component of policy `name` with `params` (as a spec parses): the registered
    component and the reference the policy serves it from -- the version or alias the spec names
    (`qrf=v3`, `qrf=neural-length@champion`), else `champion`. Left out: a component the spec
    turns off (`qrf=null`) or hands over as an instance. One reading for both engines: `adapt
    serve`'s slots follow these references (a version stays pinned) and `adapt replay` pins them
    to the versions they name at its start, so a spec replays with the versions it would serve."""
    policy_class = POLICIES[name]
    references = {}
    for attribute, component in getattr(policy_class, "components", {}).items():
        given = params.get(attribute, CHAMPION)
        if isinstance(given, str):
            references[attribute] = component_reference(policy_class, attribute, given)
        elif attribute not in params:
            references[attribute] = (component, CHAMPION)
    return references


def spec_references(spec: str) -> dict[str, tuple[str, str]]:
    """`component_references` of a spec string (a `policy-config@REF` reads its version)."""
    return component_references(*parse_policy_spec(spec))


def make_policy_from_spec(spec: str) -> Policy:
    """The policy a spec string names (`PolicySpec`: pinned versions loaded once per process)."""
    return PolicySpec(spec)()


@dataclass(frozen=True)
class PolicySpec:
    """A policy factory that pickles: the spec string a user types (`jitserve:qrf=v3:patterns=v2`),
    so a replay cell can cross to a worker process and build its policy there.

    Components pinned to a version (`vN`) are loaded once per process and store, then handed to
    every policy built from them: a version never changes, and policies copy what they update
    (SageSched its history window). Aliases are resolved afresh each time (they move)."""

    spec: str
    # The versions the spec's component aliases (`champion` where it names none) pointed at when
    # `adapt replay` started (`pinned_aliases`): what `adapt serve` would serve, held fixed.
    pins: tuple[tuple[str, str], ...] = ()

    def __call__(self) -> Policy:
        name, params = parse_policy_spec(self.spec)
        for attribute, version in self.pins:
            given = params.get(attribute, CHAMPION)
            if isinstance(given, str) and version_of(given.rpartition("@")[2]) is None:
                params[attribute] = version
        try:
            for attribute in getattr(POLICIES[name], "components", {}):
                if not isinstance(params.get(attribute), str):
                    continue
                component, reference = component_reference(POLICIES[name], attribute, params[attribute])
                version = version_of(reference)
                if version is not None:
                    params[attribute] = _pinned_component(tracking_uri(), component, version)
            return make_policy(name, **params)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"policy {self.spec!r}: {exc}") from exc

    def __str__(self) -> str:
        return self.spec


def pinned_aliases(
    name: str,
    references: dict[str, tuple[str, str]],
    registry: Registry,
    resolved: dict[tuple[str, str], int | None] | None = None,
) -> tuple[tuple[str, str], ...]:
    """`PolicySpec.pins` for policy `name` with these `component_references`: each component
    served from an alias (`champion` where the spec names none) as the version that alias points
    at now -- read once, so every cell of a replay runs one version even if the alias moves -- and
    none where no version carries the alias (the policy then runs without it, as a server would
    until one is promoted)."""
    resolved = {} if resolved is None else resolved  # shared: one read per alias for many specs
    own = POLICIES[name].components
    pins = []
    for attribute, (component, reference) in references.items():
        if version_of(reference) is not None:
            continue  # the spec pins it already
        if (component, reference) not in resolved:
            resolved[component, reference] = registry.resolve(component, reference, missing_ok=True)
        version = resolved[component, reference]
        if version is not None:  # in the form the spec takes: `vN`, or `NAME@vN` for an alternative
            pinned = f"v{version}" if own[attribute] == component else f"{component}@v{version}"
            pins.append((attribute, pinned))
    return tuple(pins)


def _policy_config_reference(spec: str) -> str | None:
    """The version or alias a `policy-config@REF` spec names (None for any other spec)."""
    name, *assignments = spec.strip().split(":")
    if not name.startswith(f"{POLICY_CONFIG}@"):
        return None
    if assignments:
        raise ValueError(
            f"policy {spec!r}: a registered {POLICY_CONFIG} takes no key=value (register another version)"
        )
    return name.partition("@")[2]


def registered_policy_config(reference: str) -> Any:
    """The `policy-config` a reference names (`v3`, or an alias such as `champion`), read once per
    process and store for each version (a version never changes; an alias is resolved each time)."""
    store = tracking_uri()
    try:
        version = version_of(reference)
        if version is None:
            if reference:
                version = Registry(store).resolve(POLICY_CONFIG, reference, missing_ok=True)
            if version is None:
                raise ValueError(
                    f"{POLICY_CONFIG}@{reference}: no such version or alias (expected vN or an alias"
                    f" such as champion; `adapt models show {POLICY_CONFIG}` lists them)"
                )
        return _pinned_component(store, POLICY_CONFIG, version)
    except (RegistryError, ComponentError) as exc:  # an unknown version, a config that fails its canary
        raise ValueError(str(exc)) from exc


def pin_policy_config(spec: str) -> tuple[str, str | None]:
    """(`spec` with a `policy-config` alias replaced by the version it points at now, what that
    version runs), so every cell of a replay -- in whichever process -- runs one version even if
    the alias moves meanwhile, and the results name it. Any other spec: (`spec`, None)."""
    reference = _policy_config_reference(spec)
    if reference is None:
        return spec, None
    config = registered_policy_config(reference)  # read once: an alias resolved twice could move
    params = "".join(  # as a spec takes them: strings bare, anything else as JSON
        f":{key}={value if isinstance(value, str) else json.dumps(value)}"
        for key, value in sorted((config.params or {}).items())
    )
    return f"{POLICY_CONFIG}@v{config.metadata['registry_version']}", f"{config.policy}{params}"


@functools.lru_cache(maxsize=8)
def _pinned_component(store: str, component: str, version: int) -> Any:
    return Registry(store).load(component, version=version)
