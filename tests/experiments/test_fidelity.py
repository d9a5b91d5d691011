"""`adapt fidelity`'s analysis of kept runs: the live engine's noise floor and `--reuse`.

The live runs themselves are in `tests/integration/test_conformance.py`; here a run directory is
written by hand (the client's times and the engine's request log), so every figure is known.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import fidelity


def write_run(out: Path, requests: dict[str, tuple[float, float | None, float | None]]) -> None:
    """A kept run: `requests` maps client id -> (arrival, first token, finish); None = dropped."""
    out.mkdir(parents=True)
    (out / "client.json").write_text(json.dumps({k: list(v) for k, v in requests.items()}))
    lines = [
        json.dumps({"request_id": f"{k}-abc", "outcome": "dropped" if v[2] is None else "finished"})
        for k, v in requests.items()
    ]
    (out / "requests-000001.jsonl").write_text("\n".join(lines) + "\n")


def test_live_repeat_compares_each_request_with_itself(tmp_path: Path) -> None:
    # E2E 1.0 -> 1.1 (+10%), 2.0 -> 1.0 (-50%), 4.0 -> 4.0 (0%); TTFT 0.5 -> 0.5, 1.0 -> 0.5, 2.0 -> 3.0
    write_run(tmp_path / "B", {"r0": (0.0, 0.5, 1.0), "r1": (1.0, 2.0, 3.0), "r2": (2.0, 4.0, 6.0)})
    write_run(tmp_path / "B2", {"r0": (0.0, 0.5, 1.1), "r1": (1.0, 1.5, 2.0), "r2": (2.0, 5.0, 6.0)})
    floor = fidelity.live_repeat(tmp_path / "B", tmp_path / "B2")
    assert floor["e2e_median_abs_pct_error"] == pytest.approx(10.0)
    assert floor["e2e_bias_pct"] == pytest.approx(0.0)
    assert floor["ttft_median_abs_pct_error"] == pytest.approx(50.0)
    assert floor["e2e_mean"] == pytest.approx((1.1 + 1.0 + 4.0) / 3)
    assert floor["ttft_p50"] == pytest.approx(0.5)


def test_live_repeat_leaves_out_requests_dropped_in_either_run(tmp_path: Path) -> None:
    write_run(tmp_path / "B", {"r0": (0.0, 0.5, 1.0), "r1": (1.0, None, None)})
    write_run(tmp_path / "B2", {"r0": (0.0, 0.5, 2.0), "r1": (1.0, 1.5, 2.0)})
    floor = fidelity.live_repeat(tmp_path / "B", tmp_path / "B2")
    assert floor["e2e_median_abs_pct_error"] == pytest.approx(100.0)  # r0 only


def test_reuse_keeps_a_finished_run_and_refuses_one_of_other_requests(tmp_path: Path) -> None:
    rows, settings = [{"arrival_s": 0.0, "prompt": 8, "output": 4, "slo": {}}], {"kv_blocks": 64}
    out = tmp_path / "B-fcfs"
    out.mkdir()
    (out / "workload.json").write_text(json.dumps({"rows": rows, "settings": settings}))
    (out / "engine.json").write_text("{}")
    fidelity.serve("no-model", "fcfs", rows, out, settings, reuse=True)  # kept: no engine started
    with pytest.raises(ValueError, match="other requests or engine settings"):
        fidelity.serve("no-model", "fcfs", rows, out, {"kv_blocks": 128}, reuse=True)


def test_reuse_without_keep_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from adapt.cli import main

    assert main(["fidelity", "--policy", "fcfs", "--reuse"]) == 2
    assert "--keep" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--model", "/nonexistent"], "no model directory"),
        (["--policies", "fcfs,nosuch"], "nosuch"),
        (["--policies", "fcfs,sjf-oracle"], "true output lengths"),
        (["--policy", "spf:victim=sideways"], "victim"),
    ],
)
def test_bad_input_is_refused_before_any_engine_starts(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from adapt.cli import main

    monkeypatch.setattr(fidelity, "serve", lambda *a, **k: pytest.fail("an engine was started"))
    argv = argv if "--policy" in argv or "--policies" in argv else ["--policy", "fcfs", *argv]
    assert main(["fidelity", *argv]) == 2
    assert says in capsys.readouterr().err


def test_rank_orders_policies_lowest_first_and_compares_each_order_with_lives() -> None:
    def result(policy: str, live: float, replay: float, at_speed: float, again: float) -> dict:
        return {
            "policy": policy,
            "live": {"e2e_mean": live},
            "replay": {"e2e_mean": replay},
            "at_measured_speed": {"replay": {"e2e_mean": at_speed}},
            "live_repeat": {"e2e_mean": again},
        }

    # live a < b < c; replay swaps b and c (tau 1/3); at speed the same order (tau 1); live again reversed
    results = [
        result("a", 1.0, 1.0, 1.1, 3.0),
        result("b", 2.0, 3.0, 2.1, 2.0),
        result("c", 3.0, 2.0, 3.1, 1.0),
    ]
    ranking = fidelity.rank(results, "e2e_mean", repeat=True)
    assert ranking["live"] == ["a", "b", "c"] and ranking["replay"] == ["a", "c", "b"]
    assert ranking["kendall_tau"] == pytest.approx(1 / 3)
    assert ranking["replay_at_measured_speed"] == ["a", "b", "c"]
    assert ranking["at_measured_speed_kendall_tau"] == pytest.approx(1.0)
    assert ranking["live_repeat"] == ["c", "b", "a"] and ranking["live_repeat_kendall_tau"] == pytest.approx(
        -1.0
    )
    assert "live_repeat" not in fidelity.rank(results, "e2e_mean", repeat=False)
