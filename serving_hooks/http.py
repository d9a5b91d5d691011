"""The HTTP side of `adapt serve`: a vLLM `--middleware` that validates our `vllm_xargs`, answers
`GET /v1/adapt/status`, and with `--embed-prompts` embeds each prompt before it goes on to the
engine (`serving_hooks.prompt_embedder`).

vLLM's `--middleware` runs outside its own API-key check, so where the server has keys
(`--api-key`, or `VLLM_API_KEY`) this layer checks them itself for what it answers or does: the
status (policy, component versions, SLO figures) is refused with vLLM's own 401, as every other
`/v1` route is, and a POST to a `/v1` route without a valid key goes straight on to vLLM's 401:
a client without the key gets that 401 whatever its `vllm_xargs`, and costs no read, parse or
embedding of its body on the event loop.

vLLM passes `vllm_xargs` through to the engine untouched, where a bad value could only be logged
and ignored; checking them here gives the client an HTTP 400 whose message names the field, e.g.
`vllm_xargs.deadline_s: must be > 0, got -3`. Absent fields mean best effort. The status is the
JSON file the scheduler's live slots keep current (`serving_hooks.live`); `read_status` is the one
client of that route (the CLI's `adapt status`, the retrain watcher, the quickstart), so every
reader tells "not written yet" from "not answering" the same way, and sends the key it is given.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import secrets
import urllib.error
import urllib.request
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving_hooks.prompt_embedder import PromptEmbedder, configured_embedder, prompt_text
from serving_hooks.xargs import EMBEDDING_FIELD, encode_embedding, validate_xargs

STATUS_PATH = "/v1/adapt/status"
# Routes behind vLLM's key check in every vLLM: some guard more prefixes, whose requests this layer
# checks whatever their key, as it does `/invocations`, which vLLM lets through without one.
KEYED_PREFIX = "/v1"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
STATUS_TIMEOUT_S = 5.0


class StatusNotReady(ConnectionError):
    """The server answered 503: it runs, but its engine has not written a first status yet
    (a caller waiting for a starting server retries; one showing the status shows none)."""


class NoStatusRoute(ConnectionError):
    """The server answered 404: it does not serve the route (not `adapt serve`), though it may
    still answer `/metrics`."""


class Unreachable(ConnectionError):
    """Nothing answered: refused, timed out, or not speaking HTTP."""


class ApiKeyRequired(ConnectionError):
    """The server answered 401: it checks API keys (`--api-key`) and the request carried none, or
    not one of its keys. The caller has to be given the key; retrying as it is cannot help."""


def read_status(url: str, timeout_s: float = STATUS_TIMEOUT_S, api_key: str | None = None) -> dict[str, Any]:
    """The status JSON of the server at base URL `url`, asked with `Authorization: Bearer
    api_key` where a key is given (a server started with `--api-key` answers no one else). Every
    failure is a ConnectionError whose message names the address and the cause, so a caller that
    polls servers catches one type: `StatusNotReady` (503), `NoStatusRoute` (404), `ApiKeyRequired`
    (401), `Unreachable` (nothing answered), or plain for another HTTP error or a body that is not a
    JSON object."""
    address = url.rstrip("/") + STATUS_PATH
    body = get_body(address, timeout_s, api_key)
    try:
        status = json.loads(body)
    except ValueError as exc:
        raise ConnectionError(f"{address}: not a status JSON ({exc})") from None
    if not isinstance(status, dict):
        raise ConnectionError(f"{address}: not a status JSON (a {type(status).__name__}, not an object)")
    return status


def get_body(address: str, timeout_s: float, api_key: str | None = None) -> bytes:
    """The body `address` answers with (asked with `api_key` as a bearer token where given); every
    failure a ConnectionError naming the address: `StatusNotReady` for HTTP 503, `NoStatusRoute`
    for 404 (read as "nothing here yet" / "not served here" for any route of the server,
    `/metrics` too), `ApiKeyRequired` for 401, `Unreachable` when nothing answered, plain for
    another HTTP error. No message holds the key."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(address, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as exc:  # before URLError, its base class: the server did answer
        if exc.code == 503:
            raise StatusNotReady(f"{address}: HTTP 503, nothing written there yet") from None
        if exc.code == 404:
            raise NoStatusRoute(f"{address}: HTTP 404, not served here") from None
        if exc.code == 401:
            given = "refuses the API key given" if api_key else "wants an API key"
            raise ApiKeyRequired(
                f"{address}: HTTP 401, the server {given}: give one of its --api-key values"
                " (adapt status --api-key KEY, adapt retrain --watch-api-key KEY, or the"
                " VLLM_API_KEY environment variable for either)"
            ) from None
        raise ConnectionError(f"{address}: HTTP {exc.code}") from None
    except (OSError, http.client.HTTPException) as exc:  # refused, timed out, not speaking HTTP
        raise Unreachable(f"cannot reach {address} ({getattr(exc, 'reason', exc)})") from None


def _error(message: str) -> JSONResponse:
    field = message.split(":", 1)[0]
    return JSONResponse(
        {"error": {"message": message, "type": "BadRequestError", "param": field, "code": 400}},
        status_code=400,
    )


def authorized(request: Request) -> bool:
    """Whether vLLM's API-key middleware lets `request` through, which it decides only after this
    layer: every request where the server has no keys, else one with `Authorization: Bearer KEY`
    for one of them (the scheme in any case; compared in constant time, as vLLM does).

    The keys are those vLLM's own check holds (`vllm.entrypoints.serve.middleware.register`): its
    `--api-key` values, else `VLLM_API_KEY`. They come from the arguments vLLM parsed, which its
    app keeps in `app.state.args`, not from a parse of our own: `--api_key=K` or a `--config` file
    reach vLLM's check too. An app without those arguments is an error, not a server without
    keys, so that a vLLM that stops keeping them cannot open the status silently."""
    args = request.app.state.args
    keys = [key for key in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if key]
    if not keys:
        return True
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode()).digest()
    # Every key compared, none skipped on a match: the time taken says nothing about which matched.
    matches = [secrets.compare_digest(digest, hashlib.sha256(key.encode()).digest()) for key in keys]
    return any(matches)


def _refused_by_vllm(request: Request) -> bool:
    """Whether vLLM's key check, inside this middleware, answers `request` 401 whatever its body:
    a `KEYED_PREFIX` route without one of the server's keys (the path as vLLM reads it, without
    the server's root path)."""
    path = request.scope["path"].removeprefix(request.scope.get("root_path", ""))
    return path.startswith(KEYED_PREFIX) and not authorized(request)


async def adapt_middleware(request: Request, call_next) -> Response:
    embedder = configured_embedder()
    if embedder is not None:
        embedder.start()  # the server's first request of any kind: vLLM's engine process is up
    if request.url.path == STATUS_PATH and request.method == "GET":
        if not authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)  # vLLM's own answer
        path = os.environ.get("ADAPT_STATUS_FILE")
        if not path or not os.path.exists(path):
            return JSONResponse({"error": {"message": "adapt status not available yet"}}, status_code=503)
        with open(path) as handle:
            status = json.load(handle)
        if embedder is not None:
            status["prompt_embedder"] = embedder.summary()
        return JSONResponse(status)
    # Every JSON POST, not only the two generation routes the embedder reads prompts from: vLLM
    # passes `vllm_xargs` to the engine from its other routes too (/v1/responses, /v1/messages,
    # /invocations), where an unchecked value once reached the scheduler.
    if request.method == "POST" and "json" in request.headers.get("content-type", "json"):
        if _refused_by_vllm(request):
            return await call_next(request)
        try:
            body = json.loads(await request.body() or b"{}")
        except (ValueError, RecursionError):
            return await call_next(request)  # vLLM reports malformed JSON itself
        if not isinstance(body, dict):
            return await call_next(request)
        message = validate_xargs(body.get("vllm_xargs"))
        if message is not None:
            return _error(message)
        if embedder is not None and request.url.path in GENERATION_PATHS:
            await _attach_embedding(request, body, embedder)
    return await call_next(request)


async def _attach_embedding(request: Request, body: dict[str, Any], embedder: PromptEmbedder) -> None:
    """Hold the request until its prompt is embedded and send the vector on in `vllm_xargs`.
    Starlette's middleware hands the next layer the body it read, so the rewritten body (and its
    length) replaces it there. Only for a request vLLM lets through (`_refused_by_vllm`)."""
    vector = await embedder.vector(prompt_text(body))
    if vector is None:
        return
    body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), EMBEDDING_FIELD: encode_embedding(vector)}
    encoded = json.dumps(body).encode()
    request._body = encoded
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"content-length"]
    request.scope["headers"] = [*headers, (b"content-length", str(len(encoded)).encode())]
