import pytest

from serving_hooks.policies import POLICIES, make_policy, make_policy_from_spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # a budget of 0 used to become the engine's 2048 (`x or default`), 1.5 reached the engine as is
        ("sarathi:token_budget=0", "token_budget: expected an integer in [1, inf), got 0"),
        ("sarathi:token_budget=1.5", "token_budget: expected an integer in [1, inf), got 1.5"),
        ("slai-fixed:offset=NaN", "offset: expected a finite number in [0, inf), got nan"),
        ("slai-fixed:offset=Infinity", "offset: expected a finite number"),
        ("slai:offset=-1", "offset: expected a finite number in [0, inf)"),
        ("slai-fixed:max_active=0", "max_active: expected an integer in [1, inf)"),  # through **kwargs
        ("jitserve:quantile=1", "quantile: expected a finite number in (0, 1)"),
        ("jitserve:fairness=2", "fairness: expected a finite number in [0, 1]"),
        ("sagesched:learn_online=1", "learn_online: expected true or false"),
        ("fastserve:levels=true", "levels: expected an integer"),
        ("sarathi:order=3", "order: expected a string"),
        ("ltr:sigma=-0.5", "sigma: expected a finite number in [0, inf)"),
        ("sarathi:budget=5", "budget: not a parameter of this policy; it takes token_budget, order"),
        ("slai-fixed:budget=5", "it takes offset, prefill_order,"),  # slai's, passed on through **kwargs
        ("spf:victim=oldest", "victim: expected one of priority, newest, got 'oldest'"),
        ("sagesched:victim=3", "victim: expected a string"),
        # a component given as a number or list reached the policy and failed mid-replay (exit 70)
        ("jitserve:qrf=5", "qrf: expected a registered qrf-length or neural-length"),
        ("jitserve:qrf=[1]", "qrf: expected a registered qrf-length"),
        ("jitserve-oracle:qrf=true", "qrf: expected a registered qrf-length"),
        ("jitserve:patterns=5", "patterns: expected a registered pattern-graph"),
        ("slai:offset=[1]", "offset: expected a number of batch times, a slai-offset or its parameters"),
        ("slai:offset=true", "offset: expected a number of batch times"),
        ("ewsjf:meta=5", "meta: expected a registered ewsjf-meta-policy"),
        ("ewsjf-online:meta=[1]", "meta: expected a registered ewsjf-meta-policy"),
        ("ltr:predict=nope", "predict: expected a length predictor"),
        ("trail:predict=5", "a spec cannot give one"),
        # the last of two values used to run silently
        ("spf:victim=priority:victim=newest", "victim given twice"),
    ],
)
def test_bad_spec_values_are_one_line_naming_the_parameter(spec, message):
    with pytest.raises(ValueError) as err:
        make_policy_from_spec(spec)
    assert message in str(err.value) and spec in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "spec",
    [
        "sarathi:token_budget=8",
        "sarathi:order=spf",
        "slai-fixed:offset=5",
        "slai-fixed:offset=0",
        "jitserve:waiting_time_s=null",
        "jitserve:batch_size=null",
        "jitserve:fairness=0.5",
        "sagesched:preempt_on_flip=true",
        "spf:victim=newest",
        "sagesched:victim=newest",
        "jitserve:qrf=null:patterns=null",
        "ewsjf:meta=null",
        "ewsjf:meta={}",
        "ltr:predict=null",
    ],
)
def test_valid_specs_still_build(spec):
    assert make_policy_from_spec(spec) is not None


def test_every_policy_builds_with_its_defaults():
    for name in POLICIES:
        make_policy(name)


def test_a_component_reference_may_name_an_alternative_the_policy_lists():
    from serving_hooks.policies import component_reference
    from serving_hooks.policies.jitserve import JITServe

    assert component_reference(JITServe, "qrf", "v3") == ("qrf-length", "v3")
    assert component_reference(JITServe, "qrf", "neural-length@v2") == ("neural-length", "v2")
    assert component_reference(JITServe, "qrf", "qrf-length@champion") == ("qrf-length", "champion")
    with pytest.raises(ValueError, match="'semantic-history' cannot serve there; expected one of qrf-length"):
        component_reference(JITServe, "qrf", "semantic-history@v1")
    with pytest.raises(ValueError, match=r"policy 'jitserve:patterns=neural-length@v1'.*cannot serve there"):
        make_policy_from_spec("jitserve:patterns=neural-length@v1")  # no alternative listed there


def test_a_policy_built_with_an_alternative_follows_and_reports_that_name():
    from predictors.neural_length import NeuralLength
    from serving_hooks.policies.jitserve import JITServe

    policy = JITServe(qrf=NeuralLength())
    assert policy.components == {"qrf": "neural-length", "patterns": "pattern-graph"}
    assert JITServe.components["qrf"] == "qrf-length"  # the class default is untouched
    assert JITServe().components["qrf"] == "qrf-length"


def test_component_instances_and_code_given_predictors_pass_the_type_check():
    """What the checks let through: the components `make_policy` loads (unfitted ones here) and
    a predictor handed over in code."""
    from predictors.ewsjf_meta import EwsjfMetaPolicy, QueueSpec
    from predictors.pattern_graph import PatternGraph
    from predictors.qrf_length import QrfLength

    meta = EwsjfMetaPolicy()
    meta.queues_ = [QueueSpec(low=0, high=10_000, mean=100, share=1.0)]
    jitserve = make_policy("jitserve", qrf=QrfLength(generated_features=0), patterns=PatternGraph())
    assert jitserve.qrf is not None and jitserve.patterns is not None
    assert len(make_policy("ewsjf", meta=meta).queues) == 1
    assert make_policy("ltr", predict=lambda request: 10.0).needs_oracle is False
    assert make_policy("trail", predict=lambda request: 10.0).needs_oracle is False
