"""`read_status`, the one client of `GET /v1/adapt/status`, against a real local HTTP server: a
status JSON comes back as a dict, and every other answer (or none) is a ConnectionError that says
which, a 503 (no status written yet) and a 404 (no such route) as their own subclasses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from serving_hooks.http import NoStatusRoute, StatusNotReady, read_status
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
    assert not isinstance(raised.value, StatusNotReady | NoStatusRoute)


def test_a_server_that_does_not_listen_cannot_be_reached():
    url = silent_url()
    with pytest.raises(ConnectionError, match=f"cannot reach {url}/v1/adapt/status") as raised:
        read_status(url, timeout_s=2)
    assert not isinstance(raised.value, StatusNotReady | NoStatusRoute)
