"""Every experiment script checks its flags as argparse reads them: a bad list item, count or rate, an
unknown name, or an output path it cannot write exits 2 with argparse's message before any work --
not a traceback, and not after the minutes of work whose result the path was to hold. The work is
stubbed with one that fails the test if it starts."""

from __future__ import annotations

import importlib
import json

import pytest

BAD = "{bad}"  # an output path under a file, filled in per test
EMPTY_ITEM = "expected comma-separated items, none empty"
CASES = [
    # (module, argv, the work that must not start, what the message says)
    ("bound_staleness", ["--seeds", "1,,2"], "run", f"argument --seeds: {EMPTY_ITEM}"),
    ("bound_staleness", ["--json", BAD], "run", "argument --json:"),
    ("drift_study", ["--seeds", "1,,2"], "run_cell", f"argument --seeds: {EMPTY_ITEM}"),
    ("drift_study", ["--scenarios", "drift-chat-to-summaries,nope"], "run_cell", "got 'nope'"),
    ("drift_study", ["--json", BAD], "run_cell", "argument --json:"),
    ("drift_study", ["--plot-dir", BAD], "run_cell", "argument --plot-dir:"),
    ("engine_settings", ["--budgets", "512,,2048"], "measure", f"argument --budgets: {EMPTY_ITEM}"),
    ("engine_settings", ["--json", BAD], "measure", "argument --json:"),
    ("ewsjf_online_study", ["--seeds", ""], "steady_cell", f"argument --seeds: {EMPTY_ITEM}"),
    ("ewsjf_online_study", ["--json", BAD], "steady_cell", "argument --json:"),
    ("history_staleness", ["--rates", "nan,x"], "run", "argument --rates: each item must be > 0"),
    ("history_staleness", ["--requests", "0"], "run", "argument --requests: must be > 0"),
    ("history_staleness", ["--json", BAD], "run", "argument --json:"),
    ("generalisation", ["--seeds", ","], "champion_specs", f"argument --seeds: {EMPTY_ITEM}"),
    ("generalisation", ["--json", BAD], "champion_specs", "argument --json:"),
    ("length_bounds", ["--seeds", "0,x"], "load_trace", "argument --seeds: each item must be >= 0"),
    ("length_bounds", ["--json", BAD], "load_trace", "argument --json:"),
    ("live_loop", ["--arms", "stale,,loop"], "scaled_requests", f"argument --arms: {EMPTY_ITEM}"),
    ("live_loop", ["--json", BAD], "scaled_requests", "argument --json:"),
    ("own_workload", ["--workloads", "nope,ewsjf-mixed"], "Registry", "argument --workloads:"),
    ("own_workload", ["--workloads", ""], "Registry", f"argument --workloads: {EMPTY_ITEM}"),
    ("own_workload", ["--scales", "1,0"], "Registry", "argument --scales: each item must be > 0"),
    ("own_workload", ["--json", BAD], "Registry", "argument --json:"),
    ("jitserve_study", ["--seeds", "0,,1"], "load_components", f"argument --seeds: {EMPTY_ITEM}"),
    ("jitserve_study", ["--out", BAD], "load_components", "argument --out:"),
    ("sagesched_study", ["--rates", "3,,4.5"], "load_history", f"argument --rates: {EMPTY_ITEM}"),
    ("sagesched_study", ["--out", BAD], "load_history", "argument --out:"),
    ("slai_study", ["--rates", "1,,2"], "ReplayObjective", f"argument --rates: {EMPTY_ITEM}"),
    ("slai_study", ["--out", BAD], "ReplayObjective", "argument --out:"),
    ("ewsjf_study", ["--trials", "0"], "history_lengths", "argument --trials: must be > 0"),
    ("ewsjf_study", ["--out", BAD], "history_lengths", "argument --out:"),
    ("bench_policies", ["--steps", "0"], "bench", "argument --steps: must be > 0"),
    ("bench_policies", ["--json", BAD], "bench", "argument --json:"),
    ("bench_jitserve", ["--repeats", "0"], "bench_qrf", "argument --repeats: must be > 0"),
    ("bench_jitserve", ["--json", BAD], "bench_qrf", "argument --json:"),
    ("bench_memory", ["--requests", "0"], "write_trace", "argument --requests: must be > 0"),
    ("bench_memory", ["--json", BAD], "write_trace", "argument --json:"),
    ("bench_replay", ["--policies", "fcfs,,slai"], "load_trace", f"argument --policies: {EMPTY_ITEM}"),
    ("bench_replay", ["--json", BAD], "load_trace", "argument --json:"),
    ("bench_embed_placement", ["--model", "m", "--max-tokens", "0"], "one_run", "argument --max-tokens:"),
    ("bench_embed_placement", ["--model", "m", "--json", BAD], "one_run", "argument --json:"),
    ("bench_serve", ["--model", "m", "--rate", "inf"], "load_requests", "argument --rate:"),
    ("bench_serve", ["--model", "m", "--json", BAD], "load_requests", "argument --json:"),
    ("bench_registry", ["--promotions", "0"], "Registry", "argument --promotions: must be > 0"),
    ("bench_sagesched", ["--repeats", "0"], "load_trace", "argument --repeats: must be > 0"),
    ("gpu_steps", ["measure", "--out", BAD], "measure", "argument --out:"),
    ("gpu_steps", ["measure", "--out", "x.csv", "--repeats", "0"], "measure", "argument --repeats:"),
    ("gpu_steps", ["compare", "--json", BAD], "measure", "argument --json:"),
]
# Scripts whose work starts by making a tiny model (vLLM's), stubbed there.
TINY_MODEL_CASES = [
    ("bench_scheduler", ["--steps", "0"], "argument --steps: must be > 0"),
    ("bench_scheduler", ["--json", BAD], "argument --json:"),
    ("bench_throughput", ["--policies", "fcfs,,sarathi"], f"argument --policies: {EMPTY_ITEM}"),
    ("bench_throughput", ["--json", BAD], "argument --json:"),
    ("bench_metrics", ["--pairs", "0"], "argument --pairs: must be > 0"),
    ("bench_metrics", ["--json", BAD], "argument --json:"),
]


def _work_must_not_start(*args, **kwargs):
    raise AssertionError("the work started before the flags were checked")


def _refused(module, argv, tmp_path, capsys) -> str:
    (tmp_path / "afile").write_text("x")
    bad = str(tmp_path / "afile" / "out.json")
    with pytest.raises(SystemExit) as stopped:
        module.main([bad if arg == BAD else arg for arg in argv])
    assert stopped.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("name", "argv", "work", "message"), CASES, ids=lambda v: str(v))
def test_a_bad_flag_exits_2_before_the_work(name, argv, work, message, tmp_path, monkeypatch, capsys):
    module = importlib.import_module(f"experiments.{name}")
    monkeypatch.setattr(module, work, _work_must_not_start)
    if name == "gpu_steps":  # `compare` reads the logs through cost_forms
        monkeypatch.setattr("experiments.cost_forms.compare_forms", _work_must_not_start)
    monkeypatch.chdir(tmp_path)  # a default output folder (reports/...) is made here, not in the checkout
    err = _refused(module, argv, tmp_path, capsys)
    assert message in err and ("a part of that path is a file" in err or BAD not in argv)


@pytest.mark.parametrize(("name", "argv", "message"), TINY_MODEL_CASES, ids=lambda v: str(v))
def test_a_bad_flag_exits_2_before_a_model_is_made(name, argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # bench_metrics sets it as it starts
    monkeypatch.setattr("serving_hooks.tiny_model.make_tiny_model", _work_must_not_start)
    err = _refused(importlib.import_module(f"experiments.{name}"), argv, tmp_path, capsys)
    assert message in err


def test_metrics_snapshot_checks_its_flags_before_starting_a_server(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("adapt.registry.Registry", _work_must_not_start)
    from experiments import metrics_snapshot

    assert "argument --seconds:" in _refused(metrics_snapshot, ["--seconds", "0"], tmp_path, capsys)
    assert "argument --out:" in _refused(metrics_snapshot, ["--out", BAD], tmp_path, capsys)


def test_a_json_path_in_a_folder_not_made_yet_is_written(tmp_path):
    from experiments import bench_policies

    out = tmp_path / "new" / "sub" / "policies.json"
    bench_policies.main(["--steps", "1", "--policies", "fcfs", "--json", str(out)])
    assert set(json.loads(out.read_text())["policies"]) == {"fcfs"}
