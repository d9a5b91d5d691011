"""The engine contract (`adapt.mechanics`): which mechanics a policy relies on, and what an engine
that refuses or differs on one does with it."""

import math

import pytest

from adapt.mechanics import ENGINES, MECHANICS, UnsupportedPolicy, check_policy, relied_on
from adapt.policy import Policy
from serving_hooks.policies import POLICIES, make_policy

UNIVERSAL = ["admission", "running_order", "preempt_and_drop", "async_output"]


def test_relied_on_by_hand():
    assert relied_on(make_policy("fcfs")) == UNIVERSAL
    assert relied_on(make_policy("vllm-v0")) == [*UNIVERSAL, "token_budget", "prefill_first"]
    assert relied_on(make_policy("sarathi")) == [*UNIVERSAL, "token_budget"]
    assert relied_on(make_policy("slai")) == UNIVERSAL  # the workload's budget, like every policy
    assert relied_on(make_policy("slai", token_budget=512)) == [*UNIVERSAL, "token_budget"]
    assert relied_on(make_policy("sjf-oracle")) == [*UNIVERSAL, "oracle"]


def test_replay_honours_every_mechanic_of_every_policy():
    for name in POLICIES:
        assert check_policy(make_policy(name), "replay") == []


def test_vllm_refuses_with_the_reason_and_honours_the_rest():
    with pytest.raises(UnsupportedPolicy, match="'sjf-oracle' cannot run in vllm: it needs true output"):
        check_policy(make_policy("sjf-oracle"), "vllm")
    with pytest.raises(UnsupportedPolicy, match="'vllm-v0' cannot run in vllm: vLLM V1 always mixes"):
        check_policy(make_policy("vllm-v0"), "vllm")
    assert check_policy(make_policy("slai"), "vllm", engine_token_budget=2048) == []
    assert check_policy(make_policy("sarathi"), "vllm", engine_token_budget=512) == []


def test_a_budget_above_the_engines_is_refused():
    with pytest.raises(UnsupportedPolicy, match=r"needs a token budget of 1024 .* started with 512"):
        check_policy(make_policy("sarathi", token_budget=1024), "vllm", engine_token_budget=512)
    assert (
        check_policy(make_policy("sarathi", token_budget=1024), "replay", engine_token_budget=math.inf) == []
    )


def test_every_engine_entry_names_a_known_mechanic():
    for table in ENGINES.values():
        assert set(table) <= set(MECHANICS)


def test_a_new_policy_relies_on_the_universal_mechanics_only():
    class Plain(Policy):
        name = "plain"

    assert relied_on(Plain()) == UNIVERSAL
