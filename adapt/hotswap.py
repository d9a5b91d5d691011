"""Hot swap: a Slot serves one component version and follows a registry alias.

A background thread polls `get_model_version_by_alias` every `interval_s` (MLflow webhooks fire
only from `mlflow server`, so polling is the mechanism that works everywhere). When the alias
points at a new version the slot downloads it, verifies checksums, loads and validates it (the
component's canaries), then swaps one reference -- an atomic store in CPython -- so readers never
block and, after the first successful load, never see None. A version that fails any of those
steps is refused: the old one keeps serving, the refusal is logged and counted, and the slot does
not retry that version until the alias moves again. While the registry is unreachable the slot
backs off exponentially (up to `max_backoff_s`) and keeps serving. Before each poll it asks the
registry whether its sqlite file was replaced underneath it (a restore from backup), which would
otherwise keep it reading the old file forever; if so the registry reconnects and the slot counts
it (`reconnects`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlflow.exceptions import MlflowException

from adapt.component import LearnedComponent
from adapt.registry import CHAMPION, BrokenVersion, Registry, RegistryError, version_of

log = logging.getLogger("adapt.hotswap")

# What an unreachable or damaged store raises (its server, database or files: `requests`' errors are
# OSErrors): tried again with back-off. Any other error loading a version is that version's own --
# a canary that fails, an `ImportError` on a server without the library the component needs -- and
# refuses it until the alias moves (retrying it would fail the same way forever).
STORE_ERRORS: tuple[type[Exception], ...] = (MlflowException, RegistryError, OSError)


@dataclass
class SwapEvent:
    at_s: float
    version: int
    ok: bool
    detail: str = ""


@dataclass
class _Serving:
    """What readers see, replaced as a whole so (component, version) always match."""

    component: LearnedComponent | None = None
    version: int | None = None
    held_out: dict[str, float] = field(default_factory=dict)  # the version's registered metrics


class Slot:
    """`Slot(reg, name, alias="champion", interval_s=5.0)`; `start()`, `get()`, `version`, `stop()`.
    `alias` is an alias the slot follows, or a version `vN` it holds.
    `on_swap`, if given, is called (in the swapping thread, after the swap) each time a new
    version goes live in the slot: an engine that applies versions only between its steps uses it
    to say a version is loaded while it idles."""

    def __init__(
        self,
        registry: Registry,
        name: str,
        alias: str = CHAMPION,
        interval_s: float = 5.0,
        max_backoff_s: float = 60.0,
        on_swap: Callable[[], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        self.registry = registry
        self.name = name
        self.alias = alias
        # `alias` may name a version (`v3`): the slot then loads that one and never moves (a
        # server told to serve `jitserve:qrf=v3` keeps v3 whatever is promoted).
        self._pinned = version_of(alias)
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self.on_swap = on_swap
        self._serving = _Serving()
        self._previous: _Serving | None = None
        self._refused: set[int] = set()
        self._last_target: int | None = None
        self._lock = threading.Lock()  # serialises swap attempts, never taken by readers
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.swaps = 0
        self.failed_swaps = 0
        self.registry_errors = 0
        self.reconnects = 0
        self.events: list[SwapEvent] = []

    # ----------------------------------------------------------------- readers
    def get(self) -> LearnedComponent | None:
        """The component serving now (None only before the first successful load). Lock-free."""
        return self._serving.component

    @property
    def version(self) -> int | None:
        return self._serving.version

    def snapshot(self) -> tuple[LearnedComponent | None, int | None]:
        """(component, version) read together, consistent with each other."""
        serving = self._serving
        return serving.component, serving.version

    @property
    def held_out(self) -> dict[str, float]:
        """The metrics the registry holds for the serving version (empty if it could not say)."""
        return self._serving.held_out

    @property
    def last_swap_s(self) -> float | None:
        """Wall-clock time the serving version went live (None before the first)."""
        return next((event.at_s for event in reversed(self.events) if event.ok), None)

    @property
    def previous(self) -> tuple[LearnedComponent | None, int | None]:
        prev = self._previous
        return (prev.component, prev.version) if prev else (None, None)

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "swaps": self.swaps,
            "failed_swaps": self.failed_swaps,
            "registry_errors": self.registry_errors,
            "reconnects": self.reconnects,
        }

    # ------------------------------------------------------------------ control
    def start(self) -> Slot:
        """Try a first load now, then keep following the alias in a daemon thread."""
        if self._thread is not None:
            return self
        try:
            self.swap_now()
        except Exception as exc:  # registry down at start: keep trying in the background
            self.registry_errors += 1
            log.warning("slot %s@%s: first load failed: %s", self.name, self.alias, exc)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"slot-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """Stop following the alias. `wait=False` returns at once, for a caller that must not block
        (an engine's scheduling step): a load in progress finishes in its own thread, which then
        ends, and its version is never handed to anyone."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            if wait:
                self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> Slot:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def swap_now(self) -> bool:
        """Check the alias once and swap if it moved. Returns True when a new version went live.
        Raises only when the registry itself cannot be reached."""
        swapped = self._swap_once()
        if swapped and self.on_swap is not None:
            try:
                self.on_swap()
            except Exception:  # the listener's trouble is not the registry's: the swap stands
                log.exception("slot %s@%s: on_swap failed", self.name, self.alias)
        return swapped

    def _swap_once(self) -> bool:
        with self._lock:
            if self.registry.reconnect_if_replaced():
                self.reconnects += 1
            target = self._pinned or self.registry.resolve(self.name, self.alias, missing_ok=True)
            if target != self._last_target:
                self._refused.clear()  # the alias moved: a refused version may be retried later
                self._last_target = target
            if target is None or target == self._serving.version or target in self._refused:
                return False
            try:
                component = self.registry.load(self.name, version=target)
            except BrokenVersion as exc:
                self._refuse(target, exc)
                return False
            except STORE_ERRORS:
                raise  # the store's trouble, not the version's: `_run` backs off and tries again
            except Exception as exc:  # the version's own: a canary, its code, a library it needs
                self._refuse(target, exc)
                return False
            self._previous = self._serving if self._serving.component is not None else self._previous
            self._serving = _Serving(component, target, self._held_out(target))
            self.swaps += 1
            self.events.append(SwapEvent(time.time(), target, True))
            log.info("slot %s@%s: now serving version %s", self.name, self.alias, target)
            return True

    def _held_out(self, version: int) -> dict[str, float]:
        """The version's registered metrics; a store that cannot say does not stop the swap."""
        try:
            return self.registry.version_metrics(self.name, version)
        except Exception as exc:
            log.warning("slot %s: no registered metrics for version %s: %s", self.name, version, exc)
            return {}

    def _refuse(self, version: int, exc: Exception) -> None:
        self._refused.add(version)
        self.failed_swaps += 1
        self.events.append(SwapEvent(time.time(), version, False, str(exc)))
        log.error(
            "slot %s@%s: refused version %s, still serving %s: %s",
            self.name,
            self.alias,
            version,
            self._serving.version,
            exc,
        )

    def _run(self) -> None:
        delay = self.interval_s
        while not self._stop.is_set():
            self._wake.wait(delay)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.swap_now()
                delay = self.interval_s
            except Exception as exc:  # registry unreachable: back off, keep serving
                self.registry_errors += 1
                delay = min(self.max_backoff_s, delay * 2)
                log.warning(
                    "slot %s@%s: registry unreachable (%s); serving %s, retry in %.1fs",
                    self.name,
                    self.alias,
                    exc,
                    self._serving.version,
                    delay,
                )


class PolicySlots:
    """One slot per learned component a policy declares (`Policy.components`), applied to it by
    `apply()` between engine steps -- never during one: what `serving_hooks.live` does inside vLLM,
    for an engine that is not vLLM (the replay engine's retraining loop). The slots are polled by
    `apply()` itself (`Slot.swap_now`), not by threads, so swaps happen at the engine's (simulated)
    time, not the wall clock's."""

    def __init__(self, registry: Registry, policy: Any, alias: str = CHAMPION) -> None:
        self.policy = policy
        self.slots = {attribute: Slot(registry, name, alias) for attribute, name in policy.components.items()}
        self.applied: dict[str, int | None] = dict.fromkeys(self.slots)

    def apply(self, use: Callable[[str, Any], None] | None = None) -> dict[str, int]:
        """Follow each alias once; hand every component whose version moved to the policy (or to
        `use`: the replay engine's `use_component` hands it over at its next step, where a live
        engine applies its swaps). Returns {component name: version} of what went live now."""
        use = use or self.policy.use_component
        swapped = {}
        for attribute, slot in self.slots.items():
            slot.swap_now()
            component, version = slot.snapshot()
            if component is not None and version != self.applied[attribute]:
                use(attribute, component)
                self.applied[attribute] = version
                swapped[slot.name] = version
        return swapped

    def status(self) -> dict[str, Any]:
        return {
            "components": {slot.name: self.applied[a] for a, slot in self.slots.items()},
            "swaps": sum(slot.swaps for slot in self.slots.values()),
            "failed_swaps": sum(slot.failed_swaps for slot in self.slots.values()),
        }
