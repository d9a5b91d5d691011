"""Values the CLI used to take and then fail on late (exit 70 mid-replay, inside vLLM's engine
process) or act on wrongly (an alias that looks like the champion): each is now one line, exit 2,
before anything runs."""

import pytest

import serving_hooks.server
from adapt.cli import main
from adapt.registry import Registry
from serving_hooks.policies.config import PolicyConfig


def _one_error_line(capsys) -> str:
    """stderr's one line, beside replay's progress and MLflow creating its tables."""
    lines = capsys.readouterr().err.strip().splitlines()
    err = [line for line in lines if not line.startswith("replaying") and " INFO " not in line]
    assert len(err) == 1 and err[0].startswith("adapt: error: "), err
    return err[0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("jitserve:qrf=5", "qrf: expected a registered qrf-length or neural-length"),
        ("jitserve:patterns=5", "patterns: expected a registered pattern-graph"),
        ("ltr:predict=nope", "predict: expected a length predictor"),
        ("trail:predict=x", "predict: expected a length predictor"),
        ("ewsjf:meta=5", "meta: expected a registered ewsjf-meta-policy"),
        ("spf:victim=priority:victim=newest", "victim given twice"),
    ],
)
def test_a_spec_value_a_policy_cannot_use_is_refused_before_the_replay(capsys, spec, message):
    args = ["replay", "--workload", "ewsjf-mixed", "--num-requests", "20", "--policies", spec]
    assert main([*args, "--no-mlflow", "--quiet"]) == 2
    assert message in _one_error_line(capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "spf:victim=bogus"], "victim: expected one of priority, newest, got 'bogus'"),
        (["--policy", "sjf-oracle"], "policy 'sjf-oracle' cannot run in vllm"),
        (["--policy", "jitserve:qrf=v999"], "--policy: qrf-length: no version 999"),
        (["--policy", "fcfs", "--log-prompts"], "--log-prompts: give --log-dir"),
    ],
)
def test_serve_refuses_what_would_fail_after_the_model_loaded(monkeypatch, capsys, args, message):
    def no_server(argv, env):
        raise AssertionError("vLLM started")

    monkeypatch.setattr(serving_hooks.server, "run_server", no_server)
    assert main(["serve", "--model", "model-dir", "--no-metrics", *args]) == 2
    assert message in _one_error_line(capsys)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("alias", "message"),
    [
        ("previous", "'previous' is set by promote and rollback"),
        ("Previous", "'previous' is set by promote and rollback"),
        ("Champion", "alias 'Champion': aliases are case-sensitive; did you mean 'champion'?"),
        ("CHALLENGER", "did you mean 'challenger'?"),
    ],
)
def test_promote_refuses_the_managed_previous_and_look_alikes_of_the_named_aliases(
    tmp_path, capsys, alias, message
):
    uri = f"sqlite:///{tmp_path / 'r.db'}"
    registry = Registry(uri, cache_dir=tmp_path / "cache")
    version = registry.log(PolicyConfig("fcfs"))
    promote = ["--tracking-uri", uri, "models", "promote", "policy-config", str(version)]
    assert main([*promote, "--alias", alias]) == 2
    assert message in _one_error_line(capsys)
    aliases = registry.client.get_registered_model("policy-config").aliases
    assert not aliases  # neither the look-alike nor `previous` was set
    assert main([*promote, "--alias", "challenger"]) == 0
    assert registry.resolve("policy-config", "challenger") == version
