"""Prompts embedded in the API server (`adapt serve --embed-prompts`): the text taken from a request
body, the vector's wire format in `vllm_xargs`, the embedder's batching and fall-backs, and the
middleware that holds a request for its vector (a fake model: the real one is served in
`tests/integration/test_serve.py`)."""

import asyncio
import base64
import json
import threading
from argparse import Namespace

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from predictors.embedding import DIMENSION
from serving_hooks import http, prompt_embedder
from serving_hooks.prompt_embedder import PromptEmbedder, prompt_text
from serving_hooks.xargs import EMBEDDING_FIELD, embedding_from_extra_args, encode_embedding, validate_xargs


def unit(index: int) -> np.ndarray:
    vector = np.zeros(DIMENSION, np.float32)
    vector[index] = 1.0
    return vector


def by_length(texts):
    """A stand-in model: each text embeds as the basis vector of its length."""
    return np.stack([unit(len(t) % DIMENSION) for t in texts])


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"prompt": "hello"}, "hello"),
        ({"prompt": ["hello"]}, "hello"),
        ({"prompt": ["a", "b"]}, None),  # several prompts: one vector cannot stand for them
        ({"prompt": [1, 2, 3]}, None),  # token ids: no text
        ({"prompt": ""}, None),
        (
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
            "be brief\nhi",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]}
                ]
            },
            "look",
        ),
        ({"messages": "not a list"}, None),
        ({}, None),
    ],
)
def test_the_text_embedded_from_a_request_body(body, text):
    assert prompt_text(body) == text


def test_an_embedding_goes_through_vllm_xargs_unchanged():
    vector = by_length(["abc"])[0]
    extra = {EMBEDDING_FIELD: encode_embedding(vector)}
    np.testing.assert_array_equal(embedding_from_extra_args(extra), vector)
    assert embedding_from_extra_args({"slo_kind": "best_effort"}) is None


def test_a_client_may_not_send_a_vector_of_its_own():
    message = validate_xargs({EMBEDDING_FIELD: encode_embedding(unit(3))})
    assert message.startswith(f"vllm_xargs.{EMBEDDING_FIELD}: set by the server")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (3, "expected a base64 string"),
        ("not base64!", "expected 2048 base64 characters"),
        ("A" * 10_000_000, "expected 2048 base64 characters"),  # refused before decoding
        ("é" * 2048, "not valid base64"),
        ("!" * 2048, "not valid base64"),
        (base64.b64encode(b"\0" * 1534).decode(), "float32 values, got 1534 bytes"),
        (encode_embedding(np.full(DIMENSION, np.nan, np.float32)), "finite"),
        (encode_embedding(2 * unit(0)), "unit vector"),
    ],
)
def test_a_bad_embedding_is_a_value_error_naming_the_field(value, says):
    with pytest.raises(ValueError, match=f"^vllm_xargs.{EMBEDDING_FIELD}: .*{says}"):
        embedding_from_extra_args({EMBEDDING_FIELD: value})


def embedder_ready(**kwargs) -> PromptEmbedder:
    embedder = PromptEmbedder(load=lambda: None, **kwargs)
    embedder.start()
    embedder._loaded.result(timeout=10)
    return embedder


def test_prompts_waiting_together_are_embedded_in_one_batch():
    batches = []
    release = threading.Event()

    def slow(texts):
        release.wait(10)
        batches.append(list(texts))
        return by_length(texts)

    embedder = embedder_ready(embed=slow)

    async def main():
        first = asyncio.ensure_future(embedder.vector("a"))
        await asyncio.sleep(0.05)  # "a" is being embedded; these three wait for the next batch
        rest = [asyncio.ensure_future(embedder.vector(t)) for t in ("bb", "ccc", "dddd")]
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(first, *rest)

    vectors = asyncio.run(main())
    assert batches == [["a"], ["bb", "ccc", "dddd"]]
    for text, vector in zip(["a", "bb", "ccc", "dddd"], vectors, strict=True):
        np.testing.assert_array_equal(vector, unit(len(text)))
    summary = embedder.summary()
    # "a" waited ~0.1 s, the other three ~0.05 s: what a replay charges as its intake delay.
    assert 0.05 <= summary.pop("mean_wait_s") < 5
    assert summary == {
        "ready": True,
        "load_error": None,
        "embedded": 4,
        "passed_through": 0,
        "timed_out": 0,
        "failed": 0,
        "waiting": 0,
    }


def test_a_request_goes_on_without_a_vector_while_loading_when_full_and_when_the_model_fails():
    loading = threading.Event()
    embedder = PromptEmbedder(embed=by_length, load=lambda: loading.wait(10))
    assert asyncio.run(embedder.vector("early")) is None  # the model is still loading
    loading.set()
    embedder._loaded.result(timeout=10)
    assert asyncio.run(embedder.vector("")) is None  # nothing to embed

    def failing(texts):
        raise RuntimeError("model gone")

    broken = embedder_ready(embed=failing)
    assert asyncio.run(broken.vector("x")) is None
    assert (broken.failed, broken.embedded) == (1, 0)

    release = threading.Event()
    full = embedder_ready(embed=lambda texts: release.wait(10) and by_length(texts), max_waiting=1)

    async def two():
        first = asyncio.ensure_future(full.vector("a"))
        await asyncio.sleep(0.05)
        second = await full.vector("b")  # one already waits: this one goes on at once
        release.set()
        return await first, second

    first, second = asyncio.run(two())
    assert first is not None and second is None
    assert embedder.passed_through == 2 and full.passed_through == 1


def test_a_request_waits_at_most_the_timeout_for_its_vector():
    stuck = threading.Event()
    embedder = embedder_ready(embed=lambda texts: stuck.wait(10) and by_length(texts), timeout_s=0.1)
    assert asyncio.run(embedder.vector("slow")) is None
    stuck.set()
    assert (embedder.timed_out, embedder.summary()["waiting"]) == (1, 0)


def test_a_prompt_whose_request_gave_up_waiting_is_not_embedded():
    # Once a batch took longer than the timeout, every prompt that timed out was still embedded
    # in the next batch: the queue grew past max_waiting and "embedded" counted vectors no one got.
    batches = []
    release = threading.Event()

    def slow(texts):
        batches.append(list(texts))
        release.wait(10)
        return by_length(texts)

    embedder = embedder_ready(embed=slow, timeout_s=0.1)

    async def main():
        first = asyncio.ensure_future(embedder.vector("a"))
        await asyncio.sleep(0.02)  # "a" is being embedded
        late = await asyncio.gather(*(embedder.vector(t) for t in ("bb", "ccc")))  # they time out
        release.set()
        await embedder._batcher  # the batcher's work done, whatever it found to do
        return await first, late

    first, late = asyncio.run(main())
    assert first is None and late == [None, None] and embedder.timed_out == 3  # "a" too: 0.1 s
    assert batches == [["a"]]  # was [["a"], ["bb", "ccc"]]


def test_a_model_that_returns_too_few_vectors_fails_the_batch_and_frees_every_wait():
    embedder = embedder_ready(embed=lambda texts: by_length(texts[:1]))

    async def two():
        return await asyncio.gather(embedder.vector("a"), embedder.vector("bb"))

    assert asyncio.run(two()) == [None, None]
    assert (embedder.failed, embedder.embedded) == (2, 0)


def test_a_model_that_fails_to_load_says_so_in_the_summary():
    def no_model():
        raise OSError("no MiniLM here")

    embedder = PromptEmbedder(embed=by_length, load=no_model)
    embedder.start()
    with pytest.raises(OSError):
        embedder._loaded.result(timeout=10)
    assert asyncio.run(embedder.vector("x")) is None
    assert embedder.summary()["load_error"] == "OSError: no MiniLM here"


@pytest.fixture
def client(monkeypatch, tmp_path):
    """vLLM's app stands in as a route that echoes the body it was given, behind our middleware;
    its parsed arguments (`app.state.args`) give no `--api-key`."""

    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        assert int(request.headers["content-length"]) == len(body)  # the rewritten body's length
        return JSONResponse(json.loads(body))

    status = tmp_path / "status.json"
    status.write_text(json.dumps({"policy": "sagesched"}))
    monkeypatch.setenv("ADAPT_STATUS_FILE", str(status))
    monkeypatch.setenv(prompt_embedder.ENABLED_ENV, "1")
    monkeypatch.setattr(prompt_embedder, "_embedder", embedder_ready(embed=by_length))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    routes = [Route(path, echo, methods=["POST"]) for path in ("/v1/completions", "/v1/responses")]
    app = Starlette(routes=routes)
    app.state.args = Namespace(api_key=None)
    app.add_middleware(BaseHTTPMiddleware, dispatch=http.adapt_middleware)
    return TestClient(app)


@pytest.mark.parametrize(
    ("xargs", "says"),
    [
        ('{"program_id": "p", "stage": Infinity}', "vllm_xargs.stage: expected an integer >= 0"),
        ('{"ttft_s": 1' + "0" * 400 + "}", "vllm_xargs: a number out of range"),  # was a 500
        ('{"adapt_embedding": "AAAA"}', "set by the server"),
    ],
)
def test_every_route_that_carries_vllm_xargs_has_them_checked(client, xargs, says):
    # vLLM hands `vllm_xargs` to the engine from /v1/responses (and /v1/messages, /invocations)
    # too; checked on the two completion routes only, `stage: Infinity` there stopped the engine.
    for path in ("/v1/completions", "/v1/responses"):
        body = '{"model": "m", "input": "four", "vllm_xargs": ' + xargs + "}"
        answer = client.post(path, content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 400 and says in answer.json()["error"]["message"], path


def test_the_middleware_sends_the_prompts_vector_on_to_the_engine(client):
    body = {"model": "m", "prompt": "four", "vllm_xargs": {"slo_kind": "best_effort"}}
    seen = client.post("/v1/completions", json=body).json()
    assert seen["vllm_xargs"]["slo_kind"] == "best_effort"
    np.testing.assert_array_equal(embedding_from_extra_args(seen["vllm_xargs"]), unit(4))
    # A client's own vector is a 400, before anything is embedded.
    own = encode_embedding(unit(7))
    refused = client.post("/v1/completions", json={"prompt": "four", "vllm_xargs": {EMBEDDING_FIELD: own}})
    assert refused.status_code == 400 and EMBEDDING_FIELD in refused.json()["error"]["message"]
    status = client.get("/v1/adapt/status").json()
    assert status["policy"] == "sagesched"
    assert (status["prompt_embedder"]["embedded"], status["prompt_embedder"]["ready"]) == (1, True)


def test_without_the_option_the_body_goes_on_untouched(client, monkeypatch):
    monkeypatch.setenv(prompt_embedder.ENABLED_ENV, "0")
    body = {"prompt": "four"}
    assert client.post("/v1/completions", json=body).json() == body
    assert "prompt_embedder" not in client.get("/v1/adapt/status").json()


@pytest.mark.parametrize(("threads", "says"), [("two", "expected an integer"), ("0", "must be >= 1")])
def test_a_bad_thread_count_is_a_load_error_naming_the_setting(monkeypatch, threads, says):
    monkeypatch.setenv(prompt_embedder.THREADS_ENV, threads)
    embedder = PromptEmbedder(embed=by_length)  # the real loader, which checks before loading
    embedder.start()
    with pytest.raises(ValueError):
        embedder._loaded.result(timeout=60)
    error = embedder.summary()["load_error"]
    assert error.startswith(f"ValueError: {prompt_embedder.THREADS_ENV}") and says in error


def test_a_request_without_the_servers_key_goes_on_unembedded(client):
    """vLLM checks keys after this middleware: an unauthenticated request costs no embedding."""
    client.app.state.args.api_key = ["k"]
    plain = client.post("/v1/completions", json={"prompt": "four"}).json()
    assert EMBEDDING_FIELD not in (plain.get("vllm_xargs") or {})
    keyed = client.post(
        "/v1/completions", json={"prompt": "four"}, headers={"authorization": "Bearer k"}
    ).json()
    np.testing.assert_array_equal(embedding_from_extra_args(keyed["vllm_xargs"]), unit(4))


def test_serve_with_embedded_prompts_keeps_minilm_out_of_the_engines_process(monkeypatch):
    from serving_hooks.server import server_command

    monkeypatch.delenv("ADAPT_EMBEDDING_PROCESS", raising=False)
    _, env = server_command("model-dir", "sagesched", embed_prompts=True)
    assert (env[prompt_embedder.ENABLED_ENV], env["ADAPT_EMBEDDING_PROCESS"]) == ("1", "1")
    _, env = server_command("model-dir", "sagesched")
    assert env[prompt_embedder.ENABLED_ENV] == "0" and "ADAPT_EMBEDDING_PROCESS" not in env
    monkeypatch.setenv("ADAPT_EMBEDDING_PROCESS", "0")  # an operator's choice stands
    _, env = server_command("model-dir", "sagesched", embed_prompts=True)
    assert env["ADAPT_EMBEDDING_PROCESS"] == "0"


def test_a_programs_start_is_forgotten_least_recently_seen_first(monkeypatch):
    """A compound program's deadline counts from its first call; the engine remembers at most
    `MAX_PROGRAMS` starts. By first sight, one-call programs arriving meanwhile pushed out the
    start of a program still running, whose next call then counted from itself."""
    from serving_hooks import xargs

    monkeypatch.setattr(xargs, "MAX_PROGRAMS", 3)
    starts: dict[str, float] = {}
    for now, program in enumerate(["long", "a", "b", "long", "c"]):
        xargs.program_from_extra_args({"program_id": program}, starts, float(now))
    assert list(starts) == ["b", "long", "c"]  # "a" went, not "long" (seen again at t=3)
    assert xargs.program_from_extra_args({"program_id": "long", "stage": 2}, starts, 9.0).start_s == 0.0
