import json

import pytest

from adapt.cli import main

REQUIRED = {
    "num_requests",
    "completed",
    "ttft_mean",
    "ttft_p50",
    "ttft_p99",
    "tbt_p50",
    "tbt_p99",
    "ttlt_mean",
    "ttlt_p50",
    "ttlt_p99",
    "throughput_rps",
    "throughput_tps",
    "slo_attainment",
    "goodput_tokens",
    "goodput_requests",
    "preemptions",
    "makespan_s",
    "sim_wall_s",
}


def test_replay_workload_writes_the_documented_json(tmp_path):
    out = tmp_path / "r.json"
    code = main(
        [
            "replay",
            "--workload",
            "slai-tiers",
            "--policies",
            "fcfs,sarathi",
            "--num-requests",
            "60",
            "--json",
            str(out),
            "--no-mlflow",
            "--quiet",
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert data["workload"]["name"] == "slai-tiers"
    assert data["workload"]["model"] == "mistral-7b" and data["workload"]["num_requests"] == 60
    for metrics in data["policies"].values():
        assert set(metrics) >= REQUIRED
        assert set(metrics["by_class"]) <= {"paying", "free"}
        assert metrics["completed"] == 60


def test_replay_trace_without_timestamps_needs_rate(tmp_path, shared_traces, capsys):
    trace = shared_traces / "sharegpt_lengths.csv"
    assert main(["replay", "--trace", str(trace), "--num-requests", "20", "--no-mlflow", "--quiet"]) == 2
    assert "pass --rate" in capsys.readouterr().err
    out = tmp_path / "r.json"
    args = ["replay", "--trace", str(trace), "--num-requests", "20", "--rate", "2", "--json", str(out)]
    assert main([*args, "--no-mlflow", "--quiet", "--replicas", "2", "--router", "round-robin"]) == 0
    assert json.loads(out.read_text())["policies"]["fcfs"]["completed"] == 20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "fcfs,nope"], "unknown 'nope'"),
        (["--policies", "sarathi:order"], "expected key=value"),
        (["--policies", "sarathi:colour=red"], "unexpected keyword"),
        (["--rate", "-1"], "--rate: must be > 0"),
        (["--num-requests", "0"], "--num-requests: must be > 0"),
        (["--replicas", "0"], "--replicas"),
    ],
)
def test_replay_bad_arguments_exit_2_with_one_line(capsys, args, message):
    assert main(["replay", "--workload", "slai-tiers", "--no-mlflow", "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.slow
def test_replay_logs_one_mlflow_run_per_policy(tmp_path):
    from mlflow.tracking import MlflowClient

    assert (
        main(
            [
                "replay",
                "--workload",
                "ewsjf-mixed",
                "--policies",
                "fcfs,spf",
                "--num-requests",
                "50",
                "--quiet",
                "--experiment",
                "t",
            ]
        )
        == 0
    )
    from adapt import tracking

    client = MlflowClient(tracking.tracking_uri())
    experiment = client.get_experiment_by_name("t")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.params["policy"] for r in runs) == ["fcfs", "spf"]
    assert all("short.ttft_mean" in r.data.metrics for r in runs)


@pytest.mark.slow
def test_compare_lines_up_runs_and_plots_goodput_versus_load(tmp_path, capsys):
    for rate in ("1.0", "2.0"):
        args = [
            "replay",
            "--workload",
            "slai-tiers",
            "--policies",
            "fcfs,sarathi",
            "--num-requests",
            "40",
            "--rate",
            rate,
            "--quiet",
            "--experiment",
            "cmp",
        ]
        assert main(args) == 0
    capsys.readouterr()
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "compare",
                "--experiment",
                "cmp",
                "--metric",
                "ttft_mean",
                "--out",
                str(out),
                "--json",
                str(tmp_path / "c.json"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    header = text.splitlines()[1]
    assert "slai-tiers@1.0" in header and "slai-tiers@2.0" in header
    assert any(line.startswith("sarathi") for line in text.splitlines())
    assert (out / "slai-tiers_vs_load.png").is_file()
    rows = json.loads((tmp_path / "c.json").read_text())
    assert len(rows) == 4
    assert main(["compare", "--experiment", "nope"]) == 2
