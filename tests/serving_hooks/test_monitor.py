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


# A disk that fills part way through a flush, as a process's file size limit makes it: run in a
# child process, which writes 2 records, flushes 3 with room for about 1.5, then gets room again.
FULL_DISK_CHILD = """
import json, resource, sys
from serving_hooks.monitor import JsonlLog

log = JsonlLog(sys.argv[1], "steps", flush_every=100, flush_interval_s=3600)
record = lambda i: {"start_s": float(i), "tokens": 1.0, "duration_s": 0.01, "pad": "x" * 100}
for i in range(2):
    log.write(record(i))
log.flush()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
room = log.path.stat().st_size + 3 * len(json.dumps(record(2))) // 2
resource.setrlimit(resource.RLIMIT_FSIZE, (room, hard))
for i in range(2, 5):
    log.write(record(i))
try:
    log.flush()
except OSError as exc:
    print("raised:", exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
log.flush()
"""


def test_a_flush_cut_short_by_a_full_disk_is_undone_and_written_whole_once_there_is_room(tmp_path):
    # It left a torn line and, retried, wrote the records that had reached the disk a second time.
    import subprocess
    import sys

    from adapt.steplog import load_step_log

    child = subprocess.run(
        [sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    assert "raised" not in child.stdout
    (path,) = tmp_path.glob("steps-*.jsonl")
    lines = path.read_text().splitlines()
    assert [json.loads(line)["start_s"] for line in lines] == [0.0, 1.0, 2.0, 3.0, 4.0]  # each once, whole
    assert load_step_log(path)["start_s"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def full_disk(log: JsonlLog) -> None:
    """Make every write to `log`'s file fail, as a full disk does: its path is a directory, what
    was written kept aside."""
    if log.path.exists():
        log.path.rename(log.path.with_suffix(".aside"))
    log.path.mkdir()


def room_again(log: JsonlLog) -> None:
    log.path.rmdir()
    if log.path.with_suffix(".aside").exists():
        log.path.with_suffix(".aside").rename(log.path)


def test_a_log_that_cannot_be_written_keeps_its_records_and_never_raises(tmp_path, caplog):
    log = JsonlLog(tmp_path, "decisions", flush_every=1, flush_interval_s=3600)
    full_disk(log)
    for i in range(3):
        log.write({"index": i})  # raised OSError into the engine
    log.flush()
    assert "could not write" in caplog.text
    room_again(log)
    log.flush()
    assert [json.loads(line)["index"] for line in log.path.read_text().splitlines()] == [0, 1, 2]


def test_after_a_failed_flush_writes_retry_once_per_interval_and_the_buffer_is_bounded(tmp_path, monkeypatch):
    # Each write retried the whole growing buffer on the engine's thread, 2 ms a write at 5,000.
    import types

    from serving_hooks import monitor

    now = [0.0]
    monkeypatch.setattr(monitor, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    log = JsonlLog(tmp_path, "steps", flush_every=1, flush_interval_s=1.0, max_buffer_bytes=1000)
    tries = []
    append = log._append
    monkeypatch.setattr(log, "_append", lambda *args: tries.append(now[0]) or append(*args))
    full_disk(log)
    for i in range(40):
        log.write({"step": f"{i:03d}", "pad": "x" * 80})
        now[0] += 0.25
    assert tries == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    kept = 1000 // (len(json.dumps({"step": "000", "pad": "x" * 80})) + 1)
    assert len(log._buffer) == kept and log.dropped == 40 - kept  # the oldest dropped, and counted
    room_again(log)
    log.flush()
    steps = [json.loads(line)["step"] for line in log.path.read_text().splitlines()]
    assert steps == [f"{i:03d}" for i in range(40 - kept, 40)]


def test_a_step_log_that_cannot_be_written_loses_no_step_and_repeats_none(tmp_path):
    # A failed write left the adapter's previous step in place: it was logged again at every
    # step, with a growing duration, until the disk had room.
    pytest.importorskip("vllm")
    import types

    from adapt.steplog import load_step_log
    from serving_hooks.vllm_adapter import PolicyScheduler

    monitor = Monitor(tmp_path, flush_every=1)
    request = types.SimpleNamespace(num_computed_tokens=101, num_prompt_tokens=100, num_tokens=102)
    scheduler = types.SimpleNamespace(
        monitor=monitor, _last_step=None, _arrivals=0, requests={"a": request}, _policy_s=0.0
    )
    output = types.SimpleNamespace(num_scheduled_tokens={"a": 1})
    for step in range(10):
        if step == 3:
            full_disk(monitor.steps)
        if step == 8:
            room_again(monitor.steps)
        PolicyScheduler._log_step(scheduler, 1000.0 + step, output)
    monitor.flush()
    steps = load_step_log(monitor.steps.path)
    assert steps["start_s"].tolist() == [1000.0 + step for step in range(9)]
    assert steps["duration_s"].tolist() == [1.0] * 9


def test_a_decision_log_that_cannot_be_written_does_not_stop_the_engine(tmp_path):
    pytest.importorskip("vllm")
    import types
    from collections import deque

    from serving_hooks.vllm_adapter import PolicyScheduler

    monitor = Monitor(tmp_path, log_decisions=True)
    scheduler = types.SimpleNamespace(
        monitor=monitor, _undelivered=deque(), _output_at=5.0, _idle=lambda: True, requests={}, _states={}
    )
    full_disk(monitor.decisions)
    for index in range(3):
        scheduler._undelivered.append({"index": index})
        PolicyScheduler._deliver(scheduler, types.SimpleNamespace(num_scheduled_tokens={}))  # raised
    room_again(monitor.decisions)
    monitor.flush()
    lines = monitor.decisions.path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"index": i, "delivered_t": 5.0} for i in range(3)]


def test_other_files_in_the_log_directory_do_not_stop_the_numbering(tmp_path):
    # `requests-replica2-backup.jsonl` beside the logs made the engine fail to start.
    for name in ("requests-backup.jsonl", "requests-replica2-backup.jsonl", "steps-000009.jsonl"):
        (tmp_path / name).touch()
    assert JsonlLog(tmp_path, "requests").path.name == "requests-000001.jsonl"
    (tmp_path / "requests-999999.jsonl").touch()
    (tmp_path / "requests-1000000.jsonl").touch()  # past six digits: numbers, not names, order them
    assert JsonlLog(tmp_path, "requests").path.name == "requests-1000001.jsonl"


def test_a_status_file_a_previous_run_left_is_gone_before_the_server_starts(tmp_path, monkeypatch):
    # Served as it was, it answered for the new server (HTTP 200, another run's versions) until
    # the new engine wrote its own; gone, the route answers 503 until then.
    import serving_hooks.server as server

    status = tmp_path / "status.json"
    status.write_text('{"policy": "spf", "components": {"qrf-length": 3}}')
    started = []
    monkeypatch.setattr(server, "run_server", lambda argv, env: started.append(status.exists()) or 0)
    assert server.serve("model-dir", "fcfs", status_file=status, metrics=False) == 0
    assert started == [False]
