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
    # what each ran, beside what it scored: sarathi's own 512-token budget, fcfs the engine's
    assert data["policy_params"] == {
        "fcfs": {"policy": "fcfs"},
        "sarathi": {"policy": "sarathi", "token_budget": 512, "order": "fcfs"},
    }


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
        (["--policies", "sarathi:colour=red"], "colour: not a parameter of this policy"),
        (["--rate", "-1"], "--rate: must be > 0"),
        (["--num-requests", "0"], "--num-requests: must be > 0"),
        (["--replicas", "0"], "--replicas"),
        (["--policies", "fcfs,spf,fcfs"], "fcfs given twice"),
        (["--policies", "fcfs,,sjf-oracle"], "--policies: expected comma-separated items, none empty"),
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
                "fcfs,spf,ewsjf",
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
    runs = {r.data.params["policy"]: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["ewsjf", "fcfs", "spf"]
    assert all("short.ttft_mean" in r.data.metrics for r in runs.values())
    # the policy's parameters, so that two runs of one name can be told apart: EWSJF's layout
    ewsjf = runs["ewsjf"].data.params
    assert ewsjf["policy.queues"] == "4" and ewsjf["policy.meta_version"] == "in-memory"
    assert "policy.policy" not in ewsjf


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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "0"], "argument --tp: must be > 0 (an integer), got '0'"),  # was taken as tp 1
        (["--tp", "3"], "--tp: mistral-7b has 32 attention heads and 8 KV heads"),
        (["--rate", "inf"], "argument --rate: must be > 0, at least 1e-06 and below 1e+09 (a finite number)"),
        (["--rate", "1e-300"], "argument --rate: must be > 0, at least 1e-06"),
        (["--rate", "nan"], "argument --rate: must be > 0"),
        (["--duration", "1e300"], "argument --duration: must be > 0 and below 1e+10"),
        (["--duration", "1e9"], "would generate 9.6e+08 requests; at most 10,000,000"),
        (["--token-budget", "0"], "argument --token-budget: must be > 0"),
        (["--seed", "-1"], "argument --seed: must be >= 0"),
        (["--intake-delay", "-0.1"], "argument --intake-delay: must be >= 0"),
        (["--policies", "sarathi:token_budget=0"], "token_budget: expected an integer in [1, inf), got 0"),
        (
            ["--policies", "sarathi:token_budget=1.5"],
            "token_budget: expected an integer in [1, inf), got 1.5",
        ),
        (["--policies", "slai-fixed:offset=NaN"], "offset: expected a finite number in [0, inf), got nan"),
        (["--cost-model", "../../x"], "Invalid alias name"),  # an MlflowException, was a traceback
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_out_of_range_flags_are_one_line_naming_the_flag(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'r.db'}")
    assert main(["replay", "--workload", "slai-tiers", "--no-mlflow", "--quiet", *args]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("replaying")]
    err = [line for line in err if " INFO " not in line]  # MLflow creating its tables
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize(
    "args",
    [
        ["train", "qrf-length", "--test-share", "0"],
        ["tune", "ewsjf", "--trials", "0"],
        ["tune", "slai", "--rate", "0"],  # was taken as the default rate, 2.8
        ["models", "promote", "qrf-length", "0"],
        ["serve", "--model", "m", "--policy", "fcfs", "--port", "70000"],
        ["retrain", "--once", "--margin", "nan"],
    ],
)
def test_every_command_checks_its_flags_before_running(capsys, args):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("adapt: error: argument ")


def test_a_bug_is_one_line_exit_70_and_debug_shows_the_traceback(monkeypatch, capsys):
    import adapt.cli

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(adapt.cli, "load_trace", broken)
    assert main(["trace", "stats", "x.csv"]) == 70
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "internal error (KeyError" in err[0]
    with pytest.raises(KeyError):
        main(["--debug", "trace", "stats", "x.csv"])


def test_drops_are_a_table_column_and_counted_by_reason(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,100,10\n0.5,10000000,10\n1,50,5\n")
    out = tmp_path / "r.json"
    args = [
        "replay",
        "--trace",
        str(trace),
        "--policies",
        "fcfs",
        "--json",
        str(out),
        "--no-mlflow",
        "--quiet",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    header, _, row = captured.out.strip().splitlines()
    assert header.split()[1:3] == ["done", "dropped"] and row.split()[1:3] == ["2", "1"]
    assert "fcfs: 1 dropped (1 longer than max_model_len)" in captured.err
    metrics = json.loads(out.read_text())["policies"]["fcfs"]
    assert metrics["dropped"] == 1 and metrics["dropped_by_reason"] == {"longer than max_model_len": 1}


def test_a_registered_policy_config_replays_as_the_policy_it_names(tmp_path, capsys):
    """`policy-config@champion` is pinned to the version it points at when the replay starts (the
    table and JSON name the version) and replays exactly as its policy with its parameters."""
    from adapt.registry import Registry
    from serving_hooks.policies.config import PolicyConfig

    registry = Registry(cache_dir=tmp_path / "cache")
    registry.log(PolicyConfig("fcfs"))
    registry.promote(
        "policy-config", registry.log(PolicyConfig("sarathi", {"order": "spf", "token_budget": 256}))
    )
    out = tmp_path / "r.json"
    args = ["replay", "--workload", "slai-tiers", "--num-requests", "80", "--no-mlflow", "--quiet"]
    policies = "policy-config@champion,sarathi:order=spf:token_budget=256,policy-config@v1"
    assert main([*args, "--policies", policies, "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "policy-config@champion is policy-config@v2, which runs sarathi:order=spf:token_budget=256" in err
    assert "policy-config@v1 runs fcfs" in err
    results = json.loads(out.read_text())["policies"]
    assert results["policy-config@v1"]["policy_config"] == "fcfs"
    assert set(results) == {"policy-config@v2", "sarathi:order=spf:token_budget=256", "policy-config@v1"}
    for key in ("ttft_mean", "ttlt_mean", "preemptions", "completed"):
        assert results["policy-config@v2"][key] == results["sarathi:order=spf:token_budget=256"][key]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("policy-config@v7", "no version 7"),
        ("policy-config@canary", "policy-config@canary: no such version or alias"),
        ("policy-config@", "no such version or alias"),
        ("policy-config@v1:order=spf", "takes no key=value"),
        ("policy-config@v1,policy-config@v1", "policy-config@v1 given twice"),
    ],
)
def test_a_bad_policy_config_reference_exits_2_with_one_line(tmp_path, capsys, spec, message):
    from adapt.registry import Registry
    from serving_hooks.policies.config import PolicyConfig

    Registry(cache_dir=tmp_path / "cache").log(PolicyConfig("spf"))
    capsys.readouterr()  # MLflow's own notes while logging
    assert main(["replay", "--workload", "slai-tiers", "--no-mlflow", "--quiet", "--policies", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_pinned_policy_config_says_what_it_runs_as_a_spec_that_builds(tmp_path):
    from adapt.registry import Registry
    from serving_hooks.policies import make_policy_from_spec, pin_policy_config
    from serving_hooks.policies.config import PolicyConfig

    registry = Registry(cache_dir=tmp_path / "cache")
    version = registry.log(PolicyConfig("sagesched", {"preempt_on_flip": True, "victim": "priority"}))
    pinned, runs = pin_policy_config(f"policy-config@v{version}")
    assert (pinned, runs) == (f"policy-config@v{version}", "sagesched:preempt_on_flip=true:victim=priority")
    policy = make_policy_from_spec(runs)
    assert policy.preempt_on_flip is True and policy.victim == "priority"
    assert pin_policy_config("spf:victim=newest") == ("spf:victim=newest", None)


def test_an_intake_delay_is_recorded_and_charged_to_every_latency(tmp_path):
    """`--intake-delay S` (the API server's hold under `adapt serve --embed-prompts`): the same
    replay, every TTFT and TTLT S longer, and the setting in the JSON beside the workload."""
    results = {}
    for delay in ("0", "0.5"):
        out = tmp_path / f"r{delay}.json"
        args = ["replay", "--workload", "slai-tiers", "--policies", "fcfs", "--num-requests", "40"]
        assert main([*args, "--intake-delay", delay, "--json", str(out), "--no-mlflow", "--quiet"]) == 0
        results[delay] = json.loads(out.read_text())
    plain, delayed = results["0"], results["0.5"]
    assert "intake_delay_s" not in plain["workload"] and delayed["workload"]["intake_delay_s"] == 0.5
    for metric in ("ttft_mean", "ttlt_mean"):
        shift = delayed["policies"]["fcfs"][metric] - plain["policies"]["fcfs"][metric]
        assert shift == pytest.approx(0.5, abs=1e-6), metric


def test_a_learned_policy_replays_with_the_champion_it_would_serve_pinned_at_the_start(tmp_path, capsys):
    """`adapt serve --policy ewsjf` serves the champion layout; `adapt replay --policies ewsjf` ran
    the default layout instead. Now a component the spec leaves out is the champion's version,
    read once at the start and said; one the spec names is kept; a policy-config's policy too."""
    import numpy as np

    from adapt.registry import Registry
    from predictors.ewsjf_meta import EwsjfMetaPolicy
    from serving_hooks.policies.config import PolicyConfig

    registry = Registry(cache_dir=tmp_path / "cache")
    first = registry.log(EwsjfMetaPolicy().fit(np.arange(1, 2000, 7)))
    second = registry.log(EwsjfMetaPolicy(alpha=2.0).fit(np.arange(1, 4000, 5)))
    registry.promote("ewsjf-meta-policy", second)
    config = registry.log(PolicyConfig("ewsjf"))
    capsys.readouterr()
    out = tmp_path / "r.json"
    policies = f"ewsjf,ewsjf:meta=v{first},policy-config@v{config}"
    args = ["replay", "--workload", "ewsjf-mixed", "--num-requests", "60", "--policies", policies]
    assert main([*args, "--json", str(out), "--no-mlflow", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"ewsjf runs with meta=v{second} (ewsjf-meta-policy@champion)" in err
    params = json.loads(out.read_text())["policy_params"]
    assert params["ewsjf"]["meta_version"] == params[f"policy-config@v{config}"]["meta_version"] == second
    assert params[f"ewsjf:meta=v{first}"]["meta_version"] == first


def test_a_duration_is_filled_to_its_end_and_recorded(tmp_path, monkeypatch):
    """slai-tiers seed 8 at 0.8 req/s: the 58 requests first generated for 60 s all arrive by 57.1 s,
    where a Poisson process has more up to 60 s; the workload is generated again, larger, until an
    arrival reaches 60 s, and the JSON says the window and what was generated."""
    import dataclasses

    from adapt.workloads import WORKLOADS

    spec = WORKLOADS["slai-tiers"]
    last_arrivals = []

    def build(rate, num, seed):
        requests = spec.build(rate, num, seed)
        last_arrivals.append(max(r.arrival_s for r in requests))
        return requests

    monkeypatch.setitem(WORKLOADS, "slai-tiers", dataclasses.replace(spec, build=build))
    out = tmp_path / "d.json"
    args = ["replay", "--workload", "slai-tiers", "--duration", "60", "--seed", "8", "--policies", "fcfs"]
    assert main([*args, "--json", str(out), "--no-mlflow", "--quiet", "--jobs", "1"]) == 0
    assert last_arrivals[0] < 60 <= last_arrivals[-1]
    workload = json.loads(out.read_text())["workload"]
    assert workload["duration_s"] == 60
    kept = [r for r in spec.build(0.8, workload["generated_requests"], 8) if r.arrival_s < 60]
    assert workload["num_requests"] == len(kept)


@pytest.mark.parametrize("where", ["empty", "directory", "under a file"])
def test_a_json_path_it_cannot_write_fails_before_the_replay(tmp_path, monkeypatch, capsys, where):
    """Checked as the flag is read: not after the replays ran and their MLflow runs were logged."""
    from adapt.cli import replay as cli_replay

    def replayed(*args, **kwargs):
        raise AssertionError("the replay ran")

    monkeypatch.setattr(cli_replay, "replay_cells", replayed)
    (tmp_path / "afile").write_text("x")
    path, message = {
        "empty": ("", "empty output path"),
        "directory": (str(tmp_path), "is a directory"),
        "under a file": (str(tmp_path / "afile" / "r.json"), "a part of that path is a file"),
    }[where]
    args = ["replay", "--workload", "slai-tiers", "--num-requests", "5", "--policies", "fcfs", "--quiet"]
    assert main([*args, "--json", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("adapt: error: argument --json: ") and message in err[0]


def test_a_trace_that_is_a_directory_is_named_as_one(tmp_path, capsys):
    assert main(["replay", "--trace", str(tmp_path), "--rate", "1", "--no-mlflow", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is a directory; expected a trace file" in err and "no such file" not in err


def test_every_command_checks_its_output_paths_before_the_work(tmp_path, monkeypatch, capsys):
    import experiments.fidelity
    import pipelines.catalogue

    def ran(*args, **kwargs):
        raise AssertionError("the work ran")

    monkeypatch.setattr(pipelines.catalogue, "entry", ran)
    monkeypatch.setattr(experiments.fidelity, "run", ran)
    (tmp_path / "afile").write_text("x")
    bad = str(tmp_path / "afile" / "out.json")
    for command in (
        ["evaluate", "qrf-length", "--data", str(tmp_path / "d.jsonl"), "--json", bad],
        ["compare", "--out", str(tmp_path / "plots"), "--json", bad, "--no-mlflow"],
        ["compare", "--out", str(tmp_path / "afile" / "plots"), "--no-mlflow"],
        ["fidelity", "--policy", "fcfs", "--json", ""],
        ["trace", "stats", str(tmp_path / "afile"), "--json", bad],
        ["conformance", "--log-dir", str(tmp_path), "--json", bad],
        ["quickstart", "--out", str(tmp_path / "afile" / "report")],
    ):
        assert main(command) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("a part of that path is a file" in err[0] or "empty output path" in err[0])
