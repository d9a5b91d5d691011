"""`adapt serve`'s command: what it refuses before vLLM starts (no server is started here)."""

import pytest

from serving_hooks.server import server_command


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # each passed the name check and failed inside the engine process, after the model loaded
        ("spf:victim=bogus", "--policy: policy 'spf:victim=bogus': victim: expected one of priority, newest"),
        ("sjf-oracle", "--policy: policy 'sjf-oracle' cannot run in vllm: it needs true output lengths"),
        ("jitserve:qrf=v999", "--policy: qrf-length: no version 999"),
        ("jitserve:qrf=5", "qrf: expected a registered qrf-length"),
        ("nope", "--policy: policy: unknown 'nope'"),
    ],
)
def test_a_policy_that_cannot_be_built_or_served_is_refused_before_vllm_starts(tmp_path, spec, message):
    with pytest.raises(ValueError) as err:
        server_command("model-dir", spec, status_file=tmp_path / "status.json", metrics=False)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_servable_spec_goes_to_the_engine_as_given(tmp_path):
    spec = "jitserve:batch_size=1"
    _, env = server_command("model-dir", spec, status_file=tmp_path / "status.json", metrics=False)
    assert env["ADAPT_POLICY"] == spec


def test_log_prompts_needs_the_log_dir_it_writes_to(tmp_path):
    """It was silently ignored without one, while --log-decisions was refused."""
    with pytest.raises(ValueError, match="--log-prompts: give --log-dir"):
        server_command("model-dir", "fcfs", log_prompts=True, metrics=False)
    status = tmp_path / "status.json"
    _, env = server_command(
        "model-dir", "fcfs", log_dir=tmp_path, log_prompts=True, status_file=status, metrics=False
    )
    assert env["ADAPT_LOG_PROMPTS"] == "1"
