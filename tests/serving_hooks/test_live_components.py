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


def test_a_status_file_that_cannot_be_written_never_fails_a_step(tmp_path, caplog):
    # A full disk or a removed directory: every step raised a policy error (and logged a
    # traceback) while the policy itself was fine. Now it warns once and keeps serving.
    import shutil

    registry = Registry(cache_dir=tmp_path / "cache")
    first = registry.log(EwsjfMetaPolicy().fit(np.arange(1, 2000, 7)))
    second = registry.log(EwsjfMetaPolicy(alpha=2.0).fit(np.arange(1, 4000, 5)))
    registry.promote("ewsjf-meta-policy", first)
    directory = tmp_path / "status"
    directory.mkdir()
    live = LiveComponents(EWSJF(), interval_s=3600, status_file=directory / "status.json")
    try:
        shutil.rmtree(directory)
        registry.promote("ewsjf-meta-policy", second)
        assert live.slots["meta"].swap_now()
        for _ in range(3):
            live.apply()  # raised OSError on every step
        assert live.policy.meta.alpha == 2.0
        assert caplog.text.count("cannot write the status file") == 1
    finally:
        live.stop()


def test_the_status_names_a_policy_config_only_once_its_policy_serves(tmp_path):
    # It named the new version as soon as it was built, though a hand-over that failed after
    # left the old policy serving.
    from serving_hooks.policies import make_policy
    from serving_hooks.policies.config import PolicyConfig

    registry = Registry(cache_dir=tmp_path / "cache")
    registry.promote("policy-config", registry.log(PolicyConfig("spf")))
    status_file = tmp_path / "status.json"
    live = LiveComponents(make_policy("fcfs"), interval_s=3600, status_file=status_file, follow_config=True)
    try:
        replacement = live.next_policy()
        assert replacement.name == "spf" and live.next_config_version == 1
        live.apply()
        assert json.loads(status_file.read_text())["policy_config"] is None  # fcfs still serves
        assert live.next_policy() is None  # not built again
        live.adopt(replacement)
        assert json.loads(status_file.read_text())["policy_config"] == 1
    finally:
        live.stop()


def test_a_new_policy_config_is_built_and_loaded_outside_the_engines_step(tmp_path, monkeypatch):
    # The engine's step took the new version's policy from the slot and built it there (registry
    # loads for its components included): a 3 s load stalled a step 3 s. Now the slot's thread
    # builds it and loads its components' slots; the step only swaps them in.
    import threading

    from serving_hooks.policies import make_policy
    from serving_hooks.policies.config import PolicyConfig

    registry = Registry(cache_dir=tmp_path / "cache")
    registry.promote("policy-config", registry.log(PolicyConfig("spf")))
    registry.promote("ewsjf-meta-policy", registry.log(EwsjfMetaPolicy().fit(np.arange(1, 2000, 7))))
    live = LiveComponents(
        make_policy("fcfs"), interval_s=3600, status_file=tmp_path / "s.json", follow_config=True
    )
    try:
        live.adopt(live.next_policy())  # spf, prepared as the engine started
        engine = threading.current_thread()
        build = PolicyConfig.build

        def built_off_the_step(config):
            assert threading.current_thread() is not engine, "built inside the engine's step"
            return build(config)

        monkeypatch.setattr(PolicyConfig, "build", built_off_the_step)
        registry.promote("policy-config", registry.log(PolicyConfig("ewsjf")))
        poll = threading.Thread(target=live.config_slot.swap_now)  # what the slot's thread does
        poll.start()
        poll.join(60)
        policy = live.next_policy()  # the engine's next step: no build, no registry call
        assert policy.name == "ewsjf" and live.next_config_version == 2
        live.adopt(policy)
        assert live.slots["meta"].version == 1  # loaded by the slot's thread, before the step
        assert json.loads((tmp_path / "s.json").read_text())["policy_config"] == 2
    finally:
        live.stop()


def test_a_version_the_spec_names_stays_pinned_live_and_the_rest_follow_the_champion(tmp_path, caplog):
    """`adapt serve --policy ewsjf:meta=v1` serves v1 whatever is promoted (its slot used to follow
    the champion and swap v2 in at the first step); a spec that names no version follows the
    champion. The first status is published without a traceback (the slots' first loads once
    published before the slots were kept)."""
    from serving_hooks.policies import PolicySpec, spec_references

    registry = Registry(cache_dir=tmp_path / "cache")
    first = registry.log(EwsjfMetaPolicy().fit(np.arange(1, 2000, 7)))
    second = registry.log(EwsjfMetaPolicy(alpha=2.0).fit(np.arange(1, 4000, 5)))
    registry.promote("ewsjf-meta-policy", second)
    for spec, serving in ((f"ewsjf:meta=v{first}", first), ("ewsjf", second)):
        policy = PolicySpec(spec)()
        status_file = tmp_path / f"{spec}.json"
        live = LiveComponents(policy, 3600, status_file, references=spec_references(spec))
        try:
            live.apply()  # the engine's first step
            assert json.loads(status_file.read_text())["components"] == {"ewsjf-meta-policy": serving}
            assert policy.meta.alpha == (3.0 if serving == first else 2.0)  # v1 has the default
            registry.promote("ewsjf-meta-policy", first if serving == second else second)
            live.slots["meta"].swap_now()
            live.apply()
            moved = first if spec == "ewsjf" else serving  # the champion follower moves, the pin not
            assert json.loads(status_file.read_text())["components"] == {"ewsjf-meta-policy": moved}
        finally:
            live.stop()
            registry.promote("ewsjf-meta-policy", second)
    assert "on_swap failed" not in caplog.text


def test_a_version_the_policy_cannot_use_for_any_reason_is_refused_once_and_the_step_goes_on(
    tmp_path, monkeypatch, caplog
):
    # Only a ValueError was caught: any other error from `use_component` escaped every step's
    # apply (a policy error and a traceback per step), the version never marked unusable.
    registry = Registry(cache_dir=tmp_path / "cache")
    first = registry.log(EwsjfMetaPolicy().fit(np.arange(1, 2000, 7)))
    second = registry.log(EwsjfMetaPolicy(alpha=2.0).fit(np.arange(1, 4000, 5)))
    registry.promote("ewsjf-meta-policy", first)
    policy = EWSJF()
    live = LiveComponents(policy, interval_s=3600, status_file=tmp_path / "status.json")
    try:
        calls = []

        def broken(attribute, component):
            calls.append(component.metadata["registry_version"])
            raise RuntimeError("the layout needs a library this server lacks")

        monkeypatch.setattr(policy, "use_component", broken)
        registry.promote("ewsjf-meta-policy", second)
        assert live.slots["meta"].swap_now()
        for _ in range(3):
            live.apply()  # the engine's steps
        assert calls == [second]  # tried once, not on every step
        published = json.loads((tmp_path / "status.json").read_text())
        assert published["components"] == {"ewsjf-meta-policy": first}
        assert caplog.text.count(f"refused ewsjf-meta-policy v{second}") == 1
    finally:
        live.stop()
