"""`LiveComponents`, the registry slots inside the engine: a promoted version is loaded by its slot
at once and published as `loaded`; the policy uses it (`components`) from the next `apply()`, the
engine's next step -- which an idle engine does not take."""

from __future__ import annotations

import json

import numpy as np

from adapt.registry import Registry
from predictors.ewsjf_meta import EwsjfMetaPolicy
from serving_hooks.live import LiveComponents
from serving_hooks.policies.ewsjf import EWSJF


def test_a_loaded_version_is_published_before_the_next_step_applies_it(tmp_path):
    registry = Registry(cache_dir=tmp_path / "cache")  # the test's own sqlite store (conftest)
    first = registry.log(EwsjfMetaPolicy().fit(np.arange(1, 2000, 7)))
    second = registry.log(EwsjfMetaPolicy(alpha=2.0).fit(np.arange(1, 4000, 5)))
    registry.promote("ewsjf-meta-policy", first)
    status_file = tmp_path / "status.json"
    policy = EWSJF()
    live = LiveComponents(policy, interval_s=3600, status_file=status_file)  # the test polls itself
    try:

        def published() -> dict:
            return json.loads(status_file.read_text())

        assert published()["components"] == published()["loaded"] == {"ewsjf-meta-policy": first}
        layout = [(q.low, q.high) for q in policy.queues]
        registry.promote("ewsjf-meta-policy", second)
        assert live.slots["meta"].swap_now()  # what the slot's thread does on its next poll
        assert published()["loaded"] == {"ewsjf-meta-policy": second}
        assert published()["components"] == {"ewsjf-meta-policy": first}  # no step yet
        assert [(q.low, q.high) for q in policy.queues] == layout  # the policy untouched meanwhile
        live.apply()  # the engine's next step
        assert published()["components"] == {"ewsjf-meta-policy": second}
        assert policy.meta.alpha == 2.0
    finally:
        live.stop()
