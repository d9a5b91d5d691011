"""A fleet on one shared registry: two `adapt serve` replicas (each its own vLLM, tiny model) follow
the champions of a PostgreSQL-backed `mlflow server` -- a promotion reaches both within two poll
intervals, the registry going away for 20 s while requests flow fails none of them, and both pick
up a promotion made after it is back. `adapt status --fleet` shows the replicas and any split."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from adapt.cli import main
from adapt.registry import Registry
from adapt.workloads.compound import generate_graphs
from experiments.quickstart_serve import adapt_status, free_port, post_completion, wait_for_status
from predictors.pattern_graph import PatternGraph
from serving_hooks.server import server_command
from serving_hooks.tiny_model import VLLM_CPU_ARGS, make_tiny_model
from tests.shared_store import shared_store

pytestmark = pytest.mark.slow

POLL_S = 2.0  # each replica's registry poll interval (`adapt serve --watch-interval`)
REPLICAS = 2


def _complete(port: int, model: str, i: int) -> int:
    """One small compound-call request; its HTTP status (0 if the connection failed)."""
    xargs = {"slo_kind": "compound", "deadline_s": 60, "program_id": f"p{i // 3}", "stage": i % 3}
    body = {"model": model, "prompt": f"request {i}", "max_tokens": 4, "vllm_xargs": xargs}
    try:
        return post_completion(port, body, timeout_s=60)[0]
    except OSError:
        return 0


class Load:
    """Requests to every replica, one after another per replica, until stopped: the steps at which
    a replica applies a new version, and the requests that must not fail."""

    def __init__(self, ports: list[int], model: str) -> None:
        self.codes: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(port, model)) for port in ports]

    def _run(self, port: int, model: str) -> None:
        i = 0
        while not self._stop.is_set():
            self.codes.append(_complete(port, model, i))
            i += 1

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def _graphs(seed: int) -> PatternGraph:
    return PatternGraph().fit(generate_graphs(60 + 10 * seed, seed=seed))


def _until_all(ports, servers, logs, version, timeout_s) -> float:
    """Seconds until every replica serves pattern-graph `version`."""
    started = time.monotonic()

    def serves(status):
        return status["components"].get("pattern-graph") == version

    for port, server, log in zip(ports, servers, logs, strict=True):
        wait_for_status(port, server, log, serves, max(1.0, timeout_s - (time.monotonic() - started)))
    return time.monotonic() - started


def test_a_fleet_follows_one_registry_through_an_outage(tmp_path, monkeypatch, capsys):
    (tmp_path / "store").mkdir()
    with shared_store(tmp_path / "store") as store:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", store.tracking_uri)
        registry = Registry(store.tracking_uri, cache_dir=tmp_path / "cache")
        first = registry.log(_graphs(1))
        registry.promote("pattern-graph", first)
        model = str(make_tiny_model(tmp_path / "tiny"))
        ports, servers, logs = [], [], []
        try:
            for replica in range(REPLICAS):
                port = free_port()
                argv, env = server_command(
                    model,
                    "jitserve",
                    port=port,
                    watch_interval_s=POLL_S,
                    status_file=tmp_path / f"status-{replica}.json",
                    log_dir=tmp_path / "logs" / f"replica-{replica}",
                    extra=VLLM_CPU_ARGS,
                )
                logs.append(tmp_path / f"server-{replica}.log")
                with open(logs[-1], "w") as log:
                    servers.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
                ports.append(port)
            _until_all(ports, servers, logs, first, 300)

            with Load(ports, model) as load:
                second = registry.log(_graphs(2))
                registry.promote("pattern-graph", second)
                # Two polls, plus the step that applies it and the status write.
                assert _until_all(ports, servers, logs, second, 60) < 2 * POLL_S + 1.0

                store.server.stop()  # the registry is gone for 20 s while requests flow
                time.sleep(20)
                during = len(load.codes)
                assert all(adapt_status(port)["components"]["pattern-graph"] == second for port in ports)
                store.server.start()
                third = Registry(store.tracking_uri, cache_dir=tmp_path / "cache-2").log(_graphs(3))
                registry.promote("pattern-graph", third)
                _until_all(ports, servers, logs, third, 60)
            assert load.codes and set(load.codes) == {200}, f"failed requests: {load.codes.count(0)} refused"
            assert len(load.codes) > during > 0  # requests flowed through the outage and after it
            statuses = [adapt_status(port) for port in ports]
            assert all(s["failed_swaps"] == 0 and s["registry_errors"] >= 1 for s in statuses)

            urls = ",".join(f"http://127.0.0.1:{port}" for port in ports)
            assert main(["status", "--fleet", urls]) == 0
            out = capsys.readouterr().out
            assert out.count(f"pattern-graph v{third}") == REPLICAS and "SPLIT" not in out
        finally:
            for server in servers:
                server.terminate()
            for server in servers:
                server.wait(timeout=60)
