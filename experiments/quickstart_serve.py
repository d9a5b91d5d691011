"""`adapt quickstart --serve`: the live half of the main job.

Starts `adapt serve` with `jitserve` on a tiny random model (vllm-cpu), drives a short
`jitserve-mix` load at it through the OpenAI client, promotes a retrained `pattern-graph` while the
load runs, and shows `GET /v1/adapt/status` before and after: the engine swaps to the new version
without failing a request. Needs the registry the quickstart just filled (pattern-graph champion).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from serving_hooks.http import read_status

STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post_completion(port: int, body: dict[str, Any], timeout_s: float = 120) -> tuple[int, dict[str, Any]]:
    """POST `body` to the server's `/v1/completions`: (HTTP status, reply JSON). An HTTP error is a
    status with its error body, not an exception; a connection that fails raises OSError."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def stop(process: subprocess.Popen, timeout_s: float = 60) -> None:
    """Ask a server (or any child) to exit, and kill it if it has not within `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()


def adapt_status(port: int) -> dict[str, Any]:
    """The status of the local server on `port`; ConnectionError until it answers with one."""
    return read_status(f"http://127.0.0.1:{port}", timeout_s=10)


def wait_for_status(
    port: int, server: subprocess.Popen, log: Path, ready, timeout_s: float = STARTUP_TIMEOUT_S
) -> dict[str, Any]:
    """Poll `GET /v1/adapt/status` until `ready(status)`; fail if the server exits or stalls."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"adapt serve exited ({server.returncode}); see {log}")
        try:
            status = adapt_status(port)
            if ready(status):
                return status
        except ConnectionError:  # still starting: not listening yet, or no status written yet
            pass
        time.sleep(0.5)
    raise RuntimeError(f"adapt serve not ready after {timeout_s} s; see {log}")


def serve_demo(out: Path, fast: bool) -> dict[str, Any]:
    from adapt.registry import Registry
    from adapt.workloads import get_workload
    from adapt.workloads.compound import generate_graphs
    from experiments.bench_serve import run_load, summarise
    from predictors.pattern_graph import PatternGraph
    from serving_hooks.server import server_command
    from serving_hooks.tiny_model import VLLM_CPU_ARGS, make_tiny_model

    registry = Registry()
    model = make_tiny_model(out / "tiny-model")
    port = free_port()
    log = out / "serve.log"
    argv, env = server_command(
        str(model),
        "jitserve",
        port=port,
        watch_interval_s=1.0,
        status_file=out / "status.json",
        extra=VLLM_CPU_ARGS,
    )
    print(f"[serve] starting adapt serve (jitserve, tiny model, port {port}); log: {log}", file=sys.stderr)
    with open(log, "w") as handle:
        server = subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT)
    try:
        before = wait_for_status(
            port, server, log, lambda s: s["components"].get("pattern-graph") is not None
        )
        print(f"[serve] GET /v1/adapt/status -> {json.dumps(before)}", file=sys.stderr)
        requests = get_workload("jitserve-mix").build(2.0, 20 if fast else 40, 1)
        result: dict[str, Any] = {}
        # Trained and logged before the load starts, so the promotion lands while requests flow:
        # the engine applies it between scheduling steps, and an idle engine takes none.
        seed = int(time.time()) % 100_000
        retrained = PatternGraph().fit(generate_graphs(500 if fast else 2000, seed=seed))
        version = registry.log(retrained, metrics=retrained.evaluate(generate_graphs(100, seed=2000)))
        load = threading.Thread(
            target=lambda: result.update(
                records=asyncio.run(run_load(f"http://127.0.0.1:{port}", str(model), requests, 64, 32))
            )
        )
        print(
            f"[serve] driving {len(requests)} jitserve-mix requests through the OpenAI API", file=sys.stderr
        )
        load.start()
        registry.promote("pattern-graph", version)
        print(f"[serve] promoted a retrained pattern-graph v{version} while the load runs", file=sys.stderr)

        def swapped(status: dict[str, Any]) -> bool:
            if status["components"].get("pattern-graph") == version:
                return True
            if not load.is_alive():  # the load ended first: one short request, a step to apply it at
                # (a timeout or a refused connection: the next poll tries again)
                with contextlib.suppress(OSError):
                    post_completion(port, {"model": str(model), "prompt": "nudge", "max_tokens": 1})
            return False

        wait_for_status(port, server, log, swapped)
        load.join()
        after = adapt_status(port)
        print(f"[serve] GET /v1/adapt/status -> {json.dumps(after)}", file=sys.stderr)
        summary = summarise(result["records"])
        return {"before": before, "after": after, "promoted_version": version, "client": summary}
    finally:
        stop(server)
