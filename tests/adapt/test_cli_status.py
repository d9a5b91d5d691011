"""`adapt status` against a stand-in server: the summary a real recorder's metrics and a status
file produce, and one clear line (exit 2) when nothing answers."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from adapt.cli import main
from adapt.policy import RequestState
from adapt.requests import SLO
from serving_hooks.metrics import SchedulerMetrics
from tests.serving_helpers import StatusServer, fake_slot


def _recorded() -> SchedulerMetrics:
    from types import SimpleNamespace

    from serving_hooks.policies import make_policy_from_spec

    metrics = SchedulerMetrics(window=10, drift_least=5)
    policy = make_policy_from_spec("jitserve")
    for i in range(6):
        state = RequestState(f"r{i}", 0.0, 10, 64, SLO("deadline", deadline_s=1.0))
        state.first_token_s, state.finish_s, state.tokens_generated = 0.1, 0.5 + 0.2 * i, 20 + 10 * i
        state.cache["jit_bound"] = (40.0, 0)  # outputs 20..70 under a bound of 40: 3 of 6 covered
        metrics.finished(state, "finished", policy)
    metrics.finished(RequestState("d", 0.0, 10, 64, SLO()), "dropped", policy)
    metrics.step(0.002, 0.03, fallback=False)
    slot = fake_slot("qrf-length", 4, swaps=2, failed=1, held_out={"coverage_at_0": 0.95})
    quality = metrics.publish(
        0.0,
        policy=policy,
        waiting=[],
        running=3,
        kv_usage=0.4,
        live=SimpleNamespace(slots={"q": slot}, config_slot=None),
    )
    assert quality["online-quantile"]["coverage"] == 0.5  # jitserve without a qrf champion
    return metrics


@pytest.fixture
def server():
    metrics_text = generate_latest(_recorded().registry)
    status = {
        "policy": "jitserve",
        "components": {"qrf-length": 4},
        "swaps": 2,
        "failed_swaps": 1,
        "policy_swaps": 0,
        "quality": {},
        "drift_alarms": ["online-quantile"],
        "predictions": {
            "submitted": 8, "refused": 2, "delivered": 8, "on_prior": 3, "waited_s": 0.2,
            "share_on_prior": 0.5, "mean_wait_s": 0.025, "supplied": 5,
        },
        "prompt_embedder": {
            "ready": True, "load_error": None, "embedded": 5, "passed_through": 1, "failed": 0, "waiting": 0,
        },
    }  # fmt: skip

    stand_in = StatusServer(status, metrics_text)
    yield stand_in.url
    stand_in.close()


def test_status_summarises_a_running_server(server, capsys):
    assert main(["status", server]) == 0
    out = capsys.readouterr().out
    assert "policy      jitserve" in out
    assert "qrf-length" in out and "v4" in out and "swaps 2, failed 1" in out
    deadline_row = next(line for line in out.splitlines() if line.strip().startswith("deadline"))
    # r0..r5 finish at 0.5 .. 1.5 against a 1.0 s deadline: 0.5, 0.7, 0.9 met; 1.1, 1.3, 1.5 not
    assert deadline_row.split()[1:5] == ["6", "3", "3", "0"] and "0.500" in deadline_row
    quality_row = next(line for line in out.splitlines() if line.strip().startswith("online-quantile"))
    assert quality_row.split()[1:3] == ["6", "0.500"]
    assert "DRIFT" in out and "policy 2.00 ms" in out
    assert "first scheduled on a prior 0.500, mean wait 25.0 ms, refused 2, 5 came embedded" in out
    assert "embedding before the engine: ready, 5 embedded, 1 went on without, 0 failed" in out


def test_status_says_when_no_server_answers(capsys):
    assert main(["status", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:9" in err and "adapt serve" in err


def test_fleet_status_shows_each_replica_and_the_version_split(capsys):
    """Two replicas answer (one still on qrf-length v3 after v4 was promoted), one does not."""
    metrics_text = generate_latest(_recorded().registry)  # 7 requests left, 3 met the SLO
    base = {"policy": "jitserve", "swaps": 2, "failed_swaps": 0, "policy_swaps": 0, "quality": {}}
    lagging = {**base, "components": {"qrf-length": 3, "pattern-graph": 2}, "failed_swaps": 1}
    servers = [
        StatusServer({**base, "components": {"qrf-length": 4, "pattern-graph": 2}}, metrics_text),
        StatusServer(lagging, metrics_text),
    ]
    urls = [server.url for server in servers] + ["http://127.0.0.1:9"]
    try:
        assert main(["status", "--fleet", ",".join(urls)]) == 1  # a replica did not answer
    finally:
        for server in servers:
            server.close()
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("http")}
    assert "qrf-length v4" in rows[urls[0]] and "qrf-length v3" in rows[urls[1]]
    assert rows[urls[0]].split()[-2:] == ["7", "0.429"] and " 2/1 " in rows[urls[1]]
    assert "UNREACHABLE" in rows[urls[2]]
    split = next(line for line in out.splitlines() if line.startswith("SPLIT"))
    assert f"qrf-length: v3 on 1 ({urls[1]}); v4 on 1 ({urls[0]})" in split
    assert "pattern-graph" not in split  # every replica serves v2


def test_fleet_needs_urls(capsys):
    assert main(["status", "--fleet", " , "]) == 2
    assert "--fleet" in capsys.readouterr().err


def test_a_new_versions_empty_window_shows_no_coverage_rather_than_nan():
    from adapt.cli.status import render

    samples = {
        "adapt_length_bound_coverage": [({"component": "pattern-graph"}, float("nan"))],
        "adapt_length_bound_window_requests": [({"component": "pattern-graph"}, 0.0)],
    }
    line = next(line for line in render(None, samples, now=0.0).splitlines() if "pattern-graph" in line)
    assert "nan" not in line and line.split()[:3] == ["pattern-graph", "0", "-"]


def test_a_component_a_policy_swap_retired_is_not_shown_or_alarmed():
    """A whole-policy swap sets the old components' gauges to NaN in a multiprocess metrics
    directory (they cannot be removed there): `int(nan)` crashed the status, and a NaN drift gauge
    read as an alarm."""
    from adapt.cli.status import render

    nan = float("nan")
    samples = {
        "adapt_component_version": [({"component": "semantic-history"}, nan)],
        "adapt_length_bound_coverage": [({"component": "semantic-history"}, nan)],
        "adapt_length_bound_window_requests": [({"component": "semantic-history"}, nan)],
        "adapt_length_bound_drift_alarm": [({"component": "semantic-history"}, nan)],
    }
    text = render({"policy": "spf", "components": {}}, samples, now=0.0)
    assert "ALARM" not in text and "v" + "nan" not in text.lower()


def test_a_version_loaded_but_not_yet_applied_is_shown_beside_the_serving_one():
    """A promotion reaches an idle server's slot at once, but the engine applies it at its next
    step: the operator sees both."""
    from adapt.cli.status import render

    status = {"policy": "jitserve", "components": {"pattern-graph": 1, "qrf-length": 3}}
    status["loaded"] = {"pattern-graph": 2, "qrf-length": 3}
    lines = {line.split()[0]: line for line in render(status, {}, now=0.0).splitlines()[1:]}
    assert (
        lines["pattern-graph"].split()[1] == "v1"
        and "(v2 loaded: live at the next step)" in lines["pattern-graph"]
    )
    assert "loaded" not in lines["qrf-length"]


def test_the_policys_own_state_shows_its_plain_figures():
    """ewsjf-online adopts layouts inside the engine, with no registry version to show for it:
    the status's `policy_state` is where an operator sees it."""
    from adapt.cli.status import render

    state = {"policy": "ewsjf-online", "queues": 11, "adoptions": 2, "last_adoption": {"kind": "layout"}}
    lines = render({"policy": "ewsjf-online", "components": {}, "policy_state": state}, {}, now=0.0)
    assert "state       queues=11, adoptions=2" in lines.splitlines()
    assert "state" not in render({"policy": "fcfs", "components": {}}, {}, now=0.0)


@pytest.mark.parametrize("code", [503, 404])
def test_a_server_without_a_status_yet_still_shows_its_metrics(code, capsys):
    """503: the engine has not written its first status; 404: the server does not serve the route."""
    stand_in = StatusServer(code, generate_latest(_recorded().registry))
    try:
        assert main(["status", stand_in.url]) == 0
    finally:
        stand_in.close()
    out = capsys.readouterr().out
    assert "policy      jitserve" in out and "qrf-length" in out  # from the metrics alone
    assert not any(line.startswith("swaps ") for line in out.splitlines())  # the status-only line


def test_status_asks_a_keyed_server_with_the_key_given_or_vllm_api_key(monkeypatch, capsys):
    """A server started with `--api-key` refuses its status to anyone else (its /metrics stays open)."""
    keyed = StatusServer({"policy": "jitserve", "components": {"qrf-length": 4}}, b"", api_key="k")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    try:
        assert main(["status", keyed.url, "--api-key", "k"]) == 0
        assert "swaps       0 ok" in capsys.readouterr().out  # a line only the status gives
        assert main(["status", "--fleet", keyed.url, "--api-key", "k"]) == 0
        assert "jitserve" in capsys.readouterr().out
        monkeypatch.setenv("VLLM_API_KEY", "k")  # as vLLM's own server reads its key
        assert main(["status", keyed.url]) == 0
        assert main(["status", keyed.url, "--api-key", "nope"]) == 2
        assert "HTTP 401, the server refuses the API key given" in capsys.readouterr().err
        monkeypatch.delenv("VLLM_API_KEY")
        assert main(["status", keyed.url]) == 2
    finally:
        keyed.close()
    err = capsys.readouterr().err
    assert "HTTP 401, the server wants an API key" in err and "--api-key KEY" in err
