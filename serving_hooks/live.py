"""Live hot swap inside a serving engine: registry slots for the policy's components, applied
between scheduling steps, and a status file the HTTP side serves as `GET /v1/adapt/status`.

`adapt serve` runs the scheduler in vLLM's engine-core process and the OpenAI API in another, so
the two share the status through a small JSON file (`ADAPT_STATUS_FILE`), replaced atomically
(write + rename) whenever a version, a swap count, a refusal or (with metrics on) the online
prediction quality, its drift alarms or the policy's own state (`policy_state`) change. Slots poll
the registry in their own threads (`adapt.hotswap.Slot`); the scheduler thread only compares
versions and hands a new component to the policy (`Policy.use_component`), so a step never waits
for the registry (at most for a slot's status write). A version is applied at the engine's next
step, and an idle engine takes none: the status says which versions the slots have loaded
(`loaded`, the `policy-config` slot's too) beside those in use (`components`, `policy_config`),
and a slot rewrites it when it loads one, so a promotion shows at once, idle or not.

With `ADAPT_FOLLOW_POLICY_CONFIG=1` (`adapt serve --follow-policy-config`) one more slot follows
the `policy-config` champion: the whole policy is what that version names (the `--policy` given to
the server serves only while none is registered). A new version is built into a fresh policy and
slots for its components are made and loaded -- in that slot's thread, as it loads the version,
so a swap never waits for the registry inside a step either -- then, at the engine's next step,
the scheduler hands the policy every request in flight (`PolicyScheduler._switch_policy`) and its
slots replace the old policy's.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from adapt.files import write_text_atomic
from adapt.hotswap import Slot
from adapt.policy import Policy
from adapt.registry import CHAMPION
from serving_hooks.policies import component_references, spec_references

log = logging.getLogger("adapt.live")

STATUS_ENV = "ADAPT_STATUS_FILE"
WATCH_ENV = "ADAPT_WATCH_INTERVAL"
FOLLOW_CONFIG_ENV = "ADAPT_FOLLOW_POLICY_CONFIG"


class LiveComponents:
    """One slot per component the policy holds; `apply()` once per step."""

    def __init__(
        self,
        policy: Policy,
        interval_s: float,
        status_file: str | Path | None = None,
        follow_config: bool = False,
        references: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        """`references`: per component attribute, the (registered component, version or alias)
        its slot follows (`serving_hooks.policies.component_references` of the served spec: a
        version the spec names stays pinned, an alias is followed); default, every component's
        `champion`."""
        from adapt.registry import Registry

        self.registry = Registry()
        # A slot's first load publishes the status, which reads these: set before any slot starts.
        self.policy, self.slots, self.applied = policy, {}, {}
        self.interval_s = interval_s
        self.status_file = Path(status_file) if status_file else None
        # The scheduler thread and the slots' threads (on a load) both publish; one at a time.
        self._publishing = threading.Lock()
        self._last_status: dict[str, Any] | None = None
        self._publish_failed = False
        self.config_version: int | None = None  # the policy-config version serving
        self._config_tried: int | None = None  # the newest one built (one that fails is not retried)
        self.policy_swaps = 0
        self.quality: dict[str, dict[str, Any]] = {}
        self.predictions: dict[str, Any] | None = None
        self.policy_state: dict[str, Any] = {}
        # A policy-config version's policy and its loaded slots, made in the config slot's thread
        # (`_prepare`), waiting for the engine's next step to take them (`next_policy`, `adopt`).
        self._preparing = threading.Lock()
        self._prepared: tuple[int, Policy, dict[str, Slot]] | None = None
        self._handing: tuple[int, Policy, dict[str, Slot]] | None = None
        self.config_slot = (
            Slot(self.registry, "policy-config", interval_s=interval_s, on_swap=self._prepare)
            if follow_config
            else None
        )
        self._follow(policy, self._slots_for(policy, references))
        if self.config_slot is not None:
            self.config_slot.start()
        self.apply()

    def _follow(self, policy: Policy, slots: dict[str, Slot]) -> None:
        """Serve `policy` with `slots` for its components, stopping the previous policy's slots."""
        for slot in self.slots.values():
            slot.stop(wait=False)  # in the engine's step: a load in progress must not hold it
        with self._publishing:
            self.policy, self.slots, self.applied = policy, slots, dict.fromkeys(slots)
            self._unusable: dict[str, int | None] = {}  # per attribute, a version the policy refused

    def _slots_for(
        self, policy: Policy, references: dict[str, tuple[str, str]] | None = None
    ) -> dict[str, Slot]:
        """One started slot per component of `policy` that `references` names (each loads its
        version as it starts): pinned to a version the spec named, else following an alias."""
        if references is None:
            references = {attribute: (name, CHAMPION) for attribute, name in policy.components.items()}
        slots = {
            attribute: Slot(self.registry, name, reference, self.interval_s, on_swap=self._publish)
            for attribute, (name, reference) in references.items()
        }
        for slot in slots.values():
            slot.start()
        return slots

    def _prepare(self) -> None:
        """The config slot loaded a new version (in its thread): build its policy and load that
        policy's component slots here, for the engine's next step to swap in without waiting for
        the registry. A version that fails to build is logged and never served."""
        self._publish()
        config, version = self.config_slot.snapshot()  # type: ignore[union-attr]
        if config is None:
            return
        try:
            policy = config.build()
            references = component_references(config.policy, dict(config.params or {}))
        except Exception:
            log.exception("policy-config v%s: its policy cannot be built; the serving one stays", version)
            return
        prepared = (version, policy, self._slots_for(policy, references))
        with self._preparing:
            stale, self._prepared = self._prepared, prepared
        _stop_slots(stale)  # a newer version came before the engine took the last one

    @classmethod
    def from_environment(cls, policy: Policy, spec: str) -> LiveComponents | None:
        """Enabled by `adapt serve` through the environment of the engine process; `policy` was
        built from `spec`, whose component references its slots follow."""
        interval = os.environ.get(WATCH_ENV)
        if not interval:
            return None
        follow = os.environ.get(FOLLOW_CONFIG_ENV) == "1"
        references = spec_references(spec)
        return cls(policy, float(interval), os.environ.get(STATUS_ENV), follow, references)

    def next_policy(self) -> Policy | None:
        """The policy of a `policy-config` version that went live since the last call, built and
        with its components loaded (`_prepare`); None when not following or nothing changed. The
        caller moves the requests in flight to it and then calls `adopt`. No registry call."""
        _stop_slots(self._handing)  # the last hand-over failed: its slots are not needed
        self._handing = None
        with self._preparing:
            prepared, self._prepared = self._prepared, None
        if prepared is None or prepared[0] in (self.config_version, self._config_tried):
            _stop_slots(prepared)
            return None
        self._config_tried, self._handing = prepared[0], prepared
        return prepared[1]

    @property
    def next_config_version(self) -> int | None:
        """The policy-config version `next_policy` last built: the one `adopt` makes serving."""
        return self._config_tried

    def adopt(self, policy: Policy) -> None:
        """`policy` serves from now on: follow its components instead of the old policy's. Only
        now does the status name its policy-config (a build or hand-over that failed left the old
        one serving, and the status says so)."""
        handing, self._handing = self._handing, None
        prepared = handing is not None and handing[1] is policy
        self._follow(policy, handing[2] if prepared else self._slots_for(policy))
        self.config_version = self._config_tried
        self.policy_swaps += 1
        log.info("now serving policy %s (policy-config v%s)", policy.name, self.config_version)
        self.apply()

    def apply(self) -> None:
        for attribute, slot in self.slots.items():
            component, version = slot.snapshot()
            if component is None or version in (self.applied[attribute], self._unusable.get(attribute)):
                continue
            try:
                self.policy.use_component(attribute, component)
            except Exception:  # the policy cannot use this version: the old one serves on
                self._unusable[attribute] = version  # not tried again on every step
                log.exception("policy %s refused %s v%s", self.policy.name, slot.name, version)
                continue
            with self._publishing:
                self.applied[attribute] = version
            log.info("policy %s now uses %s v%s", self.policy.name, slot.name, version)
        self._publish()

    def _every_slot(self) -> list[Slot]:
        return [*self.slots.values(), *([self.config_slot] if self.config_slot else [])]

    def status(self) -> dict[str, Any]:
        slots = self._every_slot()
        return {
            "policy": self.policy.name,
            "policy_config": self.config_version,
            "policy_swaps": self.policy_swaps,
            "components": {slot.name: self.applied[a] for a, slot in self.slots.items()},
            "loaded": {slot.name: slot.version for slot in slots},
            "swaps": sum(slot.swaps for slot in slots),
            "failed_swaps": sum(slot.failed_swaps for slot in slots),
            "reconnects": sum(slot.reconnects for slot in slots),
            "registry_errors": sum(slot.registry_errors for slot in slots),
            "quality": self.quality,
            "drift_alarms": sorted(name for name, q in self.quality.items() if q.get("drift_alarm")),
            "predictions": self.predictions,
            "policy_state": self.policy_state,
        }

    def report_quality(
        self,
        quality: dict[str, dict[str, Any]],
        predictions: dict[str, Any] | None = None,
        policy_state: dict[str, Any] | None = None,
    ) -> None:
        """The online prediction quality per component (`serving_hooks.metrics`), what the policy's
        off-step predictions did (`adapt.predictions.PredictionStats.summary`) and the policy's own
        state (`Policy.describe()`: e.g. `ewsjf-online`'s adoptions, SageSched's history size),
        published with the status; the file is rewritten only when a figure changed, at most once a
        publish. Called from the scheduler thread, so the policy is read between its steps."""
        self.quality = quality
        self.predictions = predictions
        self.policy_state = policy_state or {}
        self._publish()

    def _publish(self) -> None:
        """Write the status where the API server reads it. A write that fails (a full disk, the
        directory gone) is logged once and tried again with the next change, never raised into
        the engine's step."""
        with self._publishing:
            status = self.status()
            if status == self._last_status or self.status_file is None:
                return
            try:
                write_text_atomic(self.status_file, json.dumps(status, default=str))
            except OSError as exc:
                if not self._publish_failed:
                    log.warning(
                        "cannot write the status file %s: %s (the status shown is stale)",
                        self.status_file,
                        exc,
                    )
                self._publish_failed = True
            else:
                self._publish_failed = False
            self._last_status = status

    def stop(self) -> None:
        for slot in self._every_slot():
            slot.stop()
        _stop_slots(self._prepared)
        _stop_slots(self._handing)


def _stop_slots(prepared: tuple[int, Policy, dict[str, Slot]] | None) -> None:
    """Stop the slots of a prepared policy-config version that will not serve (None: none)."""
    for slot in (prepared[2] if prepared is not None else {}).values():
        slot.stop(wait=False)  # often in the engine's step, which must not wait for a load
