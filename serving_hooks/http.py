"""The HTTP side of `adapt serve`: a vLLM `--middleware` that validates our `vllm_xargs` and
answers `GET /v1/adapt/status`.

vLLM passes `vllm_xargs` through to the engine untouched, where a bad value could only be logged
and ignored; checking them here gives the client an HTTP 400 whose message names the field, e.g.
`vllm_xargs.deadline_s: must be > 0, got -3`. Absent fields mean best effort. The status is the
JSON file the scheduler's live slots keep current (`serving_hooks.live`).
"""

from __future__ import annotations

import json
import os

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving_hooks.xargs import validate_xargs

STATUS_PATH = "/v1/adapt/status"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def _error(message: str) -> JSONResponse:
    field = message.split(":", 1)[0]
    return JSONResponse(
        {"error": {"message": message, "type": "BadRequestError", "param": field, "code": 400}},
        status_code=400,
    )


async def adapt_middleware(request: Request, call_next) -> Response:
    if request.url.path == STATUS_PATH and request.method == "GET":
        path = os.environ.get("ADAPT_STATUS_FILE")
        if not path or not os.path.exists(path):
            return JSONResponse({"error": {"message": "adapt status not available yet"}}, status_code=503)
        with open(path) as handle:
            return JSONResponse(json.load(handle))
    if request.method == "POST" and request.url.path in GENERATION_PATHS:
        try:
            body = json.loads(await request.body() or b"{}")
        except json.JSONDecodeError:
            return await call_next(request)  # vLLM reports malformed JSON itself
        message = validate_xargs(body.get("vllm_xargs")) if isinstance(body, dict) else None
        if message is not None:
            return _error(message)
    return await call_next(request)
