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


def test_a_flush_cut_short_by_a_full_disk_leaves_one_torn_line_and_loses_no_record(tmp_path, monkeypatch):
    import builtins
    import errno

    import serving_hooks.monitor as monitor
    from adapt.requests import CompletedRequest
    from adapt.traces import TORN_LINE, load_trace

    log = JsonlLog(tmp_path, "requests", flush_every=3, flush_interval_s=3600)
    records = [CompletedRequest(f"r{i}", float(i), 10 + i, 5, i + 0.1, i + 0.5).to_dict() for i in range(6)]
    for record in records[:3]:
        log.write(record)  # flushed whole
    real_open = builtins.open

    class FullDisk:
        def __init__(self, *args):
            self.handle = real_open(*args)

        def write(self, text):
            self.handle.write(text[: len(text) // 2])  # half of it reaches the disk
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr(monitor, "open", FullDisk, raising=False)
    with pytest.raises(OSError):
        log.write(records[3])
        log.write(records[4])
        log.write(records[5])
    monkeypatch.undo()
    log.flush()  # the disk has room again: the kept buffer is written whole, on a fresh line
    trace = load_trace(log.path, "requestlog")
    # r3 reached the disk whole before the failure and again after it: `adapt retrain` reads a
    # request logged twice once (`pipelines.retrain._unique_requests`).
    assert trace.columns["request_id"] == ["r0", "r1", "r2", "r3", "r3", "r4", "r5"]
    assert trace.report.skipped == {TORN_LINE: 1}


def test_a_status_file_a_previous_run_left_is_gone_before_the_server_starts(tmp_path, monkeypatch):
    # Served as it was, it answered for the new server (HTTP 200, another run's versions) until
    # the new engine wrote its own; gone, the route answers 503 until then.
    import serving_hooks.server as server

    status = tmp_path / "status.json"
    status.write_text('{"policy": "spf", "components": {"qrf-length": 3}}')
    started = []
    monkeypatch.setattr(server.subprocess, "call", lambda argv, env: started.append(status.exists()) or 0)
    assert server.serve("model-dir", "fcfs", status_file=status, metrics=False) == 0
    assert started == [False]
