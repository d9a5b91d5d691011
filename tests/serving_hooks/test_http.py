"""`read_status`, the one client of `GET /v1/adapt/status`, against a real local HTTP server: a
status JSON comes back as a dict, and every other answer (or none) is a ConnectionError that says
which, a 503 (no status written yet), a 404 (no such route) and a 401 (no valid API key) as their
own subclasses. And the route itself, behind vLLM's API keys where the server has them: our
middleware answers it outside vLLM's own key check."""

from __future__ import annotations

import json
from argparse import Namespace
from collections.abc import Callable, Iterator

import pytest
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from serving_hooks import http, prompt_embedder
from serving_hooks.http import ApiKeyRequired, NoStatusRoute, StatusNotReady, read_status
from tests.serving_helpers import StatusServer, silent_url


@pytest.fixture
def server() -> Iterator[StatusServer]:
    stand_in = StatusServer({"policy": "jitserve", "components": {"qrf-length": 4}})
    yield stand_in
    stand_in.close()


def test_a_status_json_is_read_whatever_the_trailing_slash(server):
    assert read_status(server.url) == {"policy": "jitserve", "components": {"qrf-length": 4}}
    assert read_status(server.url + "/", timeout_s=2) == read_status(server.url)


def test_a_503_is_not_ready_yet(server):
    server.status = 503
    with pytest.raises(StatusNotReady, match="HTTP 503"):
        read_status(server.url)


def test_a_404_is_no_status_route(server):
    server.status = None  # the route answers 404, as a server that is not adapt serve
    with pytest.raises(NoStatusRoute, match="HTTP 404"):
        read_status(server.url)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (500, "HTTP 500"),
        (b"<html>busy</html>", "not a status JSON"),
        ([1, 2], "not a status JSON (a list, not an object)"),
    ],
)
def test_any_other_answer_is_a_connection_error_naming_it(server, answer, says):
    server.status = answer
    with pytest.raises(ConnectionError, match=r"/v1/adapt/status: ") as raised:
        read_status(server.url)
    assert says in str(raised.value)
    assert not isinstance(raised.value, StatusNotReady | NoStatusRoute | ApiKeyRequired)


def test_a_server_that_does_not_listen_cannot_be_reached():
    url = silent_url()
    with pytest.raises(ConnectionError, match=f"cannot reach {url}/v1/adapt/status") as raised:
        read_status(url, timeout_s=2)
    assert not isinstance(raised.value, StatusNotReady | NoStatusRoute | ApiKeyRequired)


def test_a_keyed_servers_status_is_read_with_its_key():
    keyed = StatusServer({"policy": "jitserve"}, api_key="k")
    try:
        assert read_status(keyed.url, api_key="k") == {"policy": "jitserve"}
    finally:
        keyed.close()


@pytest.mark.parametrize(
    ("api_key", "says"), [(None, "wants an API key"), ("nope", "refuses the API key given")]
)
def test_a_401_says_the_server_wants_its_api_key_and_how_to_give_it(api_key, says):
    keyed = StatusServer({"policy": "jitserve"}, api_key="k")
    try:
        with pytest.raises(ApiKeyRequired, match="/v1/adapt/status: HTTP 401") as raised:
            read_status(keyed.url, api_key=api_key)
    finally:
        keyed.close()
    message = str(raised.value)
    assert says in message and "--api-key KEY" in message and "VLLM_API_KEY" in message
    assert "nope" not in message  # a key is never printed


@pytest.fixture
def status_route(monkeypatch, tmp_path) -> Callable[[list[str] | None], TestClient]:
    """Our middleware before an app with no routes of its own, as vLLM's would be given
    `--api-key KEYS` (None: no `--api-key`); vLLM keeps its parsed arguments in `app.state.args`."""
    status = tmp_path / "status.json"
    status.write_text(json.dumps({"policy": "sagesched"}))
    monkeypatch.setenv("ADAPT_STATUS_FILE", str(status))
    monkeypatch.setenv(prompt_embedder.ENABLED_ENV, "0")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)

    def client(api_keys: list[str] | None) -> TestClient:
        app = Starlette()
        app.state.args = Namespace(api_key=api_keys)
        app.add_middleware(BaseHTTPMiddleware, dispatch=http.adapt_middleware)
        return TestClient(app)

    return client


def test_a_keyed_server_answers_its_status_only_with_one_of_its_keys(status_route):
    client = status_route(["k1", "k2"])
    for refused in (
        {},
        {"authorization": "Bearer nope"},
        {"authorization": "Basic k1"},
        {"authorization": "k1"},
    ):
        answer = client.get("/v1/adapt/status", headers=refused)
        assert (answer.status_code, answer.json()) == (401, {"error": "Unauthorized"}), refused  # vLLM's own
    for allowed in ("Bearer k1", "Bearer k2", "bearer k2"):  # vLLM reads the scheme in any case
        answer = client.get("/v1/adapt/status", headers={"authorization": allowed})
        assert (answer.status_code, answer.json()) == (200, {"policy": "sagesched"}), allowed


def test_a_server_without_keys_answers_its_status_to_anyone(status_route):
    answer = status_route(None).get("/v1/adapt/status")
    assert (answer.status_code, answer.json()) == (200, {"policy": "sagesched"})


def test_vllm_api_key_keys_the_status_unless_api_key_arguments_replace_it(status_route, monkeypatch):
    """As vLLM decides: its `--api-key` values where given, else the VLLM_API_KEY variable."""
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    client = status_route(None)
    assert client.get("/v1/adapt/status").status_code == 401
    assert client.get("/v1/adapt/status", headers={"authorization": "Bearer from-env"}).status_code == 200
    client = status_route(["from-args"])
    assert client.get("/v1/adapt/status", headers={"authorization": "Bearer from-env"}).status_code == 401
    assert client.get("/v1/adapt/status", headers={"authorization": "Bearer from-args"}).status_code == 200


@pytest.fixture
def behind_vllms_key_check(monkeypatch) -> TestClient:
    """Our middleware outside vLLM's own key check (`--api-key k`), as vLLM adds a `--middleware`
    after it, before routes that echo the body they get."""
    authenticate = pytest.importorskip("vllm.entrypoints.serve.middleware.authenticate")

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse(json.loads(await request.body()))

    monkeypatch.setenv(prompt_embedder.ENABLED_ENV, "0")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    app = Starlette(
        routes=[Route(path, echo, methods=["POST"]) for path in ("/v1/completions", "/invocations")]
    )
    app.state.args = Namespace(api_key=["k"])
    app.add_middleware(authenticate.AuthenticationMiddleware, tokens=["k"])
    app.add_middleware(BaseHTTPMiddleware, dispatch=http.adapt_middleware)
    return TestClient(app)


def test_a_request_without_the_key_gets_vllms_401_whatever_its_xargs(behind_vllms_key_check):
    """Its body was read and checked first: a 400 for its `vllm_xargs` where vLLM answers 401."""
    client, bad = behind_vllms_key_check, {"prompt": "four", "vllm_xargs": {"deadline_s": -3}}
    for headers in ({}, {"authorization": "Bearer nope"}):
        answer = client.post("/v1/completions", json=bad, headers=headers)
        assert (answer.status_code, answer.json()) == (401, {"error": "Unauthorized"}), headers
    keyed = client.post("/v1/completions", json=bad, headers={"authorization": "Bearer k"})
    assert keyed.status_code == 400 and keyed.json()["error"]["param"] == "vllm_xargs.deadline_s"
    # vLLM lets /invocations through without a key: its `vllm_xargs` are checked here all the same.
    assert client.post("/invocations", json=bad).status_code == 400
    good = {"prompt": "four", "vllm_xargs": {"deadline_s": 3}}
    assert client.post("/invocations", json=good).json() == good
