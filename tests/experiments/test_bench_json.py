"""The per-policy and JITServe benchmarks write what they print as JSON (`--json OUT`), as every
benchmark does, so a figure in a closing note can be read back rather than copied by hand."""

from __future__ import annotations

import json

import pytest

from experiments import bench_jitserve, bench_policies


def test_bench_policies_writes_one_figure_per_policy_asked(tmp_path, capsys):
    out = tmp_path / "policies.json"
    bench_policies.main(["--steps", "3", "--policies", "fcfs,slai", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["settings"] == {"steps": 3, "running": 256, "waiting": 1000}
    assert set(report["policies"]) == {"fcfs", "slai"}
    assert all(figure["on_step_us"] > 0 for figure in report["policies"].values())
    printed = capsys.readouterr().out
    assert f"{report['policies']['slai']['on_step_us']:10.1f}" in printed


def test_bench_policies_refuses_an_unknown_policy(capsys):
    with pytest.raises(SystemExit):
        bench_policies.main(["--policies", "fcfs,nope"])
    assert "argument --policies: each item must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_jitserve_writes_each_figure_it_prints(tmp_path, capsys):
    out = tmp_path / "jitserve.json"
    bench_jitserve.main(["--waiting", "200", "--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["settings"] == {"waiting": 200, "running": 256, "repeats": 1}
    assert set(report["ms"]) == {
        "qrf_single",
        "qrf_single_library",
        "qrf_per_request_of_500",
        "qrf_per_request_of_500_library",
        "gmax_frame",
        "pattern_match",
    }
    assert all(ms > 0 for ms in report["ms"].values())
    assert f"{report['ms']['gmax_frame']:8.2f} ms" in capsys.readouterr().out
