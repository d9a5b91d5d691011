"""The serving monitor's JSONL logs: bounded buffering, rotation, names `adapt retrain` reads."""

import json

import pytest

from adapt.requests import CompletedRequest
from serving_hooks.monitor import JsonlLog, Monitor


def test_buffer_is_bounded_and_flushes_in_batches(tmp_path):
    log = JsonlLog(tmp_path, "requests", flush_every=3, flush_interval_s=3600)
    for i in range(5):
        log.write({"i": i})
    assert [json.loads(line)["i"] for line in log.path.read_text().splitlines()] == [0, 1, 2]  # 2 buffered
    log.flush()
    assert len(log.path.read_text().splitlines()) == 5


def test_rotation_keeps_retrain_names_and_continues_numbering(tmp_path):
    log = JsonlLog(tmp_path, "steps", flush_every=1, max_bytes=40)
    for i in range(4):
        log.write({"tokens": i, "duration_s": 0.01})
    names = sorted(p.name for p in tmp_path.glob("steps-*.jsonl"))
    assert len(names) >= 2 and names[0] == "steps-000001.jsonl"
    assert JsonlLog(tmp_path, "steps").path.name > names[-1]  # a restart never appends to old files


def test_prompts_are_left_out_unless_asked(tmp_path):
    record = CompletedRequest("r", 0.0, 5, 2, 0.1, 0.2, prompt_text="secret")
    for log_prompts, expected in ((False, None), (True, "secret")):
        monitor = Monitor(tmp_path / str(log_prompts), log_prompts=log_prompts)
        monitor.request(record)
        monitor.flush()
        line = next((tmp_path / str(log_prompts)).glob("requests-*.jsonl")).read_text()
        assert json.loads(line)["prompt_text"] == expected


def test_the_decision_log_is_asked_for_with_the_log_dir_and_kept_beside_it(tmp_path):
    from serving_hooks.server import server_command

    _, env = server_command("model-dir", "spf", log_dir=tmp_path, log_decisions=True)
    assert env["ADAPT_LOG_DECISIONS"] == "1" and env["ADAPT_LOG_DIR"] == str(tmp_path.resolve())
    with pytest.raises(ValueError, match="--log-decisions: give --log-dir"):
        server_command("model-dir", "spf", log_decisions=True)
    monitor = Monitor(tmp_path, log_decisions=True)
    monitor.decision({"index": 0, "scheduled": {"r1": 8}})
    monitor.flush()
    assert [p.name for p in tmp_path.glob("decisions-*.jsonl")] == ["decisions-000001.jsonl"]
    assert Monitor(tmp_path / "plain").decisions is None
