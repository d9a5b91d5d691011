"""`adapt serve`'s command: what it refuses before vLLM starts, and how it stops the server it runs
(no vLLM server is started here: a stand-in child takes its place)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
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


# A stand-in for the vLLM server: it writes its pid (and, with an argument, starts a grandchild as
# vLLM starts its engine core, and ignores SIGTERM); on SIGTERM it writes the marker and exits 0.
STAND_IN = """
import os, pathlib, signal, subprocess, sys, time
here = pathlib.Path(sys.argv[1])
pids = [os.getpid()]
if len(sys.argv) > 2:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid)
else:
    signal.signal(signal.SIGTERM, lambda *_: (here / "stopped").write_text("SIGTERM") and sys.exit(0))
(here / "pids.tmp").write_text(" ".join(map(str, pids)))
(here / "pids.tmp").rename(here / "pids")
time.sleep(60)
"""

# `serve` with the stand-in for vLLM and a metrics directory of its own, as `server_command` makes one.
SERVE = """
import os, sys
import serving_hooks.server as server
here = sys.argv[1]

def command(model, policy, **kwargs):
    env = {**os.environ, "ADAPT_STATUS_FILE": os.path.join(here, "status.json")}
    env["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(here, "metrics")
    return [sys.executable, "-c", sys.argv[2], here], env

server.server_command = command
sys.exit(server.serve("model-dir", "fcfs"))
"""

# `run_server` with a short grace and a stand-in that ignores SIGTERM and has a child of its own.
RUN_STUBBORN = """
import sys
from serving_hooks.server import run_server
sys.exit(run_server([sys.executable, "-c", sys.argv[2], sys.argv[1], "stubborn"], {}, grace_s=0.5))
"""


def _start(script: str, here: Path) -> tuple[subprocess.Popen, list[int]]:
    """`script` in a process of its own (signals to it cannot reach pytest), once its stand-in
    server runs: the process and the stand-in's pids."""
    env = {key: value for key, value in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}
    repo = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", script, str(here), STAND_IN], env=env, cwd=repo)
    deadline = time.monotonic() + 30
    while not (here / "pids").exists():
        assert parent.poll() is None and time.monotonic() < deadline, "the stand-in never started"
        time.sleep(0.02)
    return parent, [int(pid) for pid in (here / "pids").read_text().split()]


def _gone(pid: int) -> bool:
    """No such process, or one that exited and waits to be reaped (by init, for an orphan)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stop(parent: subprocess.Popen, pids: list[int]) -> int:
    """SIGTERM `parent` and its exit status; the stand-in's processes are killed if they outlived it."""
    try:
        parent.send_signal(signal.SIGTERM)
        return parent.wait(timeout=30)
    finally:
        time.sleep(0.2)  # an orphan is reaped by init, not at once
        alive = [pid for pid in pids if not _gone(pid)]
        for pid in alive:  # only the processes this test started
            os.kill(pid, signal.SIGKILL)
        assert not alive, f"left running: {alive}"


def test_sigterm_stops_the_server_and_serve_removes_its_metrics_directory(tmp_path):
    """`subprocess.call` passed no signal on: `kill` ended `adapt serve` at once, its metrics
    directory stayed, and vLLM went on serving, holding the port."""
    (tmp_path / "metrics").mkdir()
    parent, pids = _start(SERVE, tmp_path)
    assert _stop(parent, pids) == 0  # the server's own exit status
    assert (tmp_path / "stopped").read_text() == "SIGTERM"
    assert not (tmp_path / "metrics").exists()


def test_a_server_that_does_not_stop_in_time_is_killed_with_its_children(tmp_path):
    """A killed API server would leave its engine core running: its descendants go first."""
    parent, pids = _start(RUN_STUBBORN, tmp_path)
    assert len(pids) == 2
    assert _stop(parent, pids) == 128 + signal.SIGKILL
