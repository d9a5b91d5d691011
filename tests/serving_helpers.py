"""Test doubles for the serving side: a real local HTTP server standing in for `adapt serve`'s
status and metrics routes, a URL nothing listens on, and a hot-swap slot as the metrics read it."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

from serving_hooks.http import STATUS_PATH


class StatusServer:
    """A real local HTTP server (a thread on a free port) answering `GET /v1/adapt/status` with
    `self.status` and `GET /metrics` with `self.metrics`; both can change while it runs.

    `status` is sent as JSON, unless it is bytes (sent as they are, e.g. a body that is not JSON)
    or an int (that HTTP error code, e.g. 503 before the engine wrote a status). `metrics` None
    answers 404, as a server started with `--no-metrics`; so does any other path. With `api_key`
    the status route answers 401 without `Authorization: Bearer <api_key>`, as a server started
    with vLLM's `--api-key` (which leaves `/metrics` open)."""

    def __init__(self, status: Any, metrics: bytes | None = None, api_key: str | None = None) -> None:
        self.status = status
        self.metrics = metrics
        self.api_key = api_key
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                keyed = owner.api_key is not None and self.path == STATUS_PATH
                if keyed and self.headers.get("Authorization") != f"Bearer {owner.api_key}":
                    self.send_error(401)
                    return
                answer = {STATUS_PATH: owner.status, "/metrics": owner.metrics}.get(self.path)
                if answer is None or isinstance(answer, int):
                    self.send_error(answer or 404)
                    return
                body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def silent_url() -> str:
    """The URL of a local port nothing listens on (bound, read, released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def fake_slot(
    name: str,
    version: int | None,
    swaps: int,
    failed: int = 0,
    held_out: dict[str, float] | None = None,
    last: float | None = None,
) -> SimpleNamespace:
    """What `SchedulerMetrics.publish` reads of a hot-swap slot (`adapt.hotswap.Slot`): its
    component, the version serving, swap counts, held-out figures and the last swap's time."""
    return SimpleNamespace(
        name=name,
        version=version,
        swaps=swaps,
        failed_swaps=failed,
        held_out=held_out or {},
        last_swap_s=last,
    )
