"""Live hot swap inside a serving engine: registry slots for the policy's components, applied
between scheduling steps, and a status file the HTTP side serves as `GET /v1/adapt/status`.

`adapt serve` runs the scheduler in vLLM's engine-core process and the OpenAI API in another, so
the two share the status through a small JSON file (`ADAPT_STATUS_FILE`), replaced atomically
(write + rename) whenever a version, a swap count or a refusal changes. Slots poll the registry in
their own threads (`adapt.hotswap.Slot`); the scheduler thread only compares versions and hands a
new component to the policy (`Policy.use_component`), so a swap never blocks a step.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from adapt.hotswap import Slot
from adapt.policy import Policy

log = logging.getLogger("adapt.live")

STATUS_ENV = "ADAPT_STATUS_FILE"
WATCH_ENV = "ADAPT_WATCH_INTERVAL"


class LiveComponents:
    """One slot per component the policy holds; `apply()` once per step."""

    def __init__(self, policy: Policy, interval_s: float, status_file: str | Path | None = None) -> None:
        from adapt.registry import Registry

        self.policy = policy
        self.status_file = Path(status_file) if status_file else None
        registry = Registry()
        self.slots = {
            attribute: Slot(registry, name, interval_s=interval_s).start()
            for attribute, name in policy.components.items()
        }
        self.applied: dict[str, int | None] = dict.fromkeys(self.slots)
        self._last_status: dict[str, Any] | None = None
        self.apply()

    @classmethod
    def from_environment(cls, policy: Policy) -> LiveComponents | None:
        """Enabled by `adapt serve` through the environment of the engine process."""
        interval = os.environ.get(WATCH_ENV)
        if not interval:
            return None
        return cls(policy, float(interval), os.environ.get(STATUS_ENV))

    def apply(self) -> None:
        for attribute, slot in self.slots.items():
            component, version = slot.snapshot()
            if component is not None and version != self.applied[attribute]:
                self.policy.use_component(attribute, component)
                self.applied[attribute] = version
                log.info("policy %s now uses %s v%s", self.policy.name, slot.name, version)
        self._publish()

    def status(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "components": {slot.name: self.applied[a] for a, slot in self.slots.items()},
            "swaps": sum(slot.swaps for slot in self.slots.values()),
            "failed_swaps": sum(slot.failed_swaps for slot in self.slots.values()),
        }

    def _publish(self) -> None:
        status = self.status()
        if status == self._last_status or self.status_file is None:
            return
        tmp = self.status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(status))
        tmp.replace(self.status_file)
        self._last_status = status

    def stop(self) -> None:
        for slot in self.slots.values():
            slot.stop()
