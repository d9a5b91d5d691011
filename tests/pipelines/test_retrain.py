"""`adapt retrain`: idempotent, locked, gated -- against a temp sqlite store and real replay logs."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from adapt.cli import main
from adapt.registry import Registry
from adapt.replay.cost import roofline
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.workloads import WORKLOADS
from pipelines.retrain import retrain_ewsjf_layout
from serving_hooks.policies import make_policy

pytestmark = pytest.mark.slow


def write_logs(data_dir, seed: int, n: int = 600, tag: str = "a") -> None:
    spec = WORKLOADS["ewsjf-mixed"]
    engine = ReplayEngine(
        make_policy("fcfs"), roofline(spec.model, spec.gpu, tp=spec.tp), EngineConfig(record_steps=True)
    )
    result = engine.run(spec.build(20.0, n, seed))
    pd.DataFrame(engine.recorder.step_log()).to_csv(data_dir / f"steps-{tag}.csv", index=False)
    result.write_request_log(data_dir / f"requests-{tag}.jsonl")


def test_retrain_once_is_idempotent_and_follows_new_data(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    uri = f"sqlite:///{tmp_path / 'r.db'}"
    base = ["--tracking-uri", uri, "retrain", "--once", "--data-dir", str(data)]
    assert main(base) == 0
    assert capsys.readouterr().out.count("no data") == 6
    write_logs(data, seed=0)
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "cost-model           registered v1 (promoted)" in out
    assert "ewsjf-meta-policy    registered v1 (promoted)" in out
    assert main(base) == 0  # unchanged data: nothing new
    statuses = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert statuses == ["unchanged", "unchanged", "no", "no", "no", "no"]
    reg = Registry(uri, cache_dir=tmp_path / "c")
    assert [len(reg.versions(n)) for n in ("cost-model", "ewsjf-meta-policy")] == [1, 1]
    write_logs(data, seed=1, tag="b")  # new traffic arrived
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "cost-model           registered v2" in out and "ewsjf-meta-policy    registered v2" in out
    assert main(["--tracking-uri", uri, "retrain", "--once", "--data-dir", str(tmp_path / "missing")]) == 2


def test_retrain_picks_up_prompt_and_program_files(tmp_path, capsys):
    """Prompt/response files retrain semantic-history, qrf-length and neural-length, program graphs
    retrain pattern-graph; a second pass on the same files registers nothing. 150 instructions: on
    60, neural-length's bound covers ~63% of held-out requests at q = 0.95 and the gate refuses it."""
    import gzip
    import json

    from adapt.programs import write_graphs
    from adapt.workloads import bundled
    from adapt.workloads.compound import generate_graphs

    data = tmp_path / "data"
    data.mkdir()
    with gzip.open(bundled("alpaca_eval_lengths.jsonl.gz"), "rt") as handle:
        rows = [json.loads(line) for line in handle]
    keep = set(sorted({r["instruction"] for r in rows})[:150])
    (data / "prompts-a.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["instruction"] in keep)
    )
    write_graphs(data / "programs-a.jsonl", generate_graphs(200, seed=5))
    uri = f"sqlite:///{tmp_path / 'p.db'}"
    base = ["--tracking-uri", uri, "retrain", "--once", "--data-dir", str(data)]
    assert main(base) == 0
    out = capsys.readouterr().out
    for name in ("semantic-history", "qrf-length", "neural-length", "pattern-graph"):
        assert f"{name:<20} registered v1 (promoted)" in out
    assert main(base) == 0
    statuses = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert statuses == ["no", "no", "unchanged", "unchanged", "unchanged", "unchanged"]


def test_concurrent_retrains_do_not_corrupt_the_store(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_logs(data, seed=0)
    uri = f"sqlite:///{tmp_path / 'r.db'}"
    cmd = [
        sys.executable,
        "-m",
        "adapt.cli",
        "--tracking-uri",
        uri,
        "retrain",
        "--once",
        "--data-dir",
        str(data),
    ]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes in ([0, 0], [0, 75]), [o[1].decode()[-1500:] for o in outputs]
    reg = Registry(uri, cache_dir=tmp_path / "c")
    for name in ("cost-model", "ewsjf-meta-policy"):
        assert len(reg.versions(name)) == 1  # locked or idempotent: never registered twice
        reg.load(name)  # and the champion loads, verified


def test_schedule_rejects_a_bad_cron(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    assert (
        main(
            [
                "--tracking-uri",
                f"sqlite:///{tmp_path / 'r.db'}",
                "retrain",
                "--schedule",
                "not cron",
                "--data-dir",
                str(data),
            ]
        )
        == 2
    )
    assert "invalid cron expression" in capsys.readouterr().err


def test_the_retrain_lock_is_per_store_not_per_data_directory(tmp_path, capsys):
    """Two retrains of one store from two data directories used to hold two different locks (one
    beside each directory) and registered the same data twice."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    uri = f"sqlite:///{tmp_path / 'r.db'}"
    with Registry(uri, cache_dir=tmp_path / "c").store_lock("retrain"):  # a retrain reading `first`
        assert main(["--tracking-uri", uri, "retrain", "--once", "--data-dir", str(second)]) == 75
        assert "r.db.retrain.lock: another retrain holds this store" in capsys.readouterr().err
        other = f"sqlite:///{tmp_path / 'other.db'}"
        assert main(["--tracking-uri", other, "retrain", "--once", "--data-dir", str(second)]) == 0
    assert main(["--tracking-uri", uri, "retrain", "--once", "--data-dir", str(second)]) == 0


def test_retrain_reads_every_replicas_logs_once(tmp_path, capsys):
    """A fleet's replicas log to subdirectories of one shared directory; a log copied again (a
    re-sync, a backup) is the same data, so retrain finds nothing new in it."""
    import shutil

    shared = tmp_path / "shared"
    for replica in (0, 1):
        (shared / f"replica-{replica}").mkdir(parents=True)
        write_logs(shared / f"replica-{replica}", seed=replica, n=300, tag=str(replica))
    uri = f"sqlite:///{tmp_path / 'r.db'}"
    base = ["--tracking-uri", uri, "retrain", "--once", "--data-dir", str(shared)]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "cost-model           registered v1" in out and "ewsjf-meta-policy    registered v1" in out
    shutil.copytree(shared / "replica-0", shared / "backup" / "replica-0")
    assert main(base) == 0
    statuses = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert statuses[:2] == ["unchanged", "unchanged"]
    (shared / "replica-2").mkdir()
    write_logs(shared / "replica-2", seed=2, n=300, tag="2")
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "cost-model           registered v2" in out and "ewsjf-meta-policy    registered v2" in out


def test_the_layout_gate_replays_the_logs_on_the_engine_that_served_them(tmp_path):
    """With the server's `engine.json` beside its logs and a cost-model champion, the gate replays
    the logged requests on that engine (a small engine: 4 running, so the load queues) -- and
    scores the layouts as a replay on it does; without either it says it used its default."""
    from adapt.replay.engine import ENGINE_FILE
    from adapt.traces import load_trace
    from pipelines.ewsjf import ServedShare, replay_ttft, train_ewsjf_meta
    from pipelines.retrain import logged_requests, retrain_cost_model, served_engine

    data = tmp_path / "data"
    data.mkdir()
    write_logs(data, seed=0, n=300)
    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    assert served_engine(registry, data) == (None, f"(no {ENGINE_FILE}: on the default engine)")
    small = EngineConfig(token_budget=512, max_running=4, kv_capacity_tokens=20_000)
    (data / ENGINE_FILE).write_text(small.to_json())
    assert served_engine(registry, data) == (None, "(no cost-model champion: on the default engine)")
    retrain_cost_model(registry, data, margin=0.0)
    (cost, config), said = served_engine(registry, data)
    assert config == small and said == "on the server's engine (cost-model v1)"

    train_ewsjf_meta(registry, lengths=np.full(100, 64.0), promote_if_better=True)
    result = retrain_ewsjf_layout(registry, data, margin=0.0)
    assert result.detail.endswith("on the server's engine (cost-model v1)")
    requests = logged_requests([load_trace(data / "requests-a.jsonl", "requestlog")])
    champion = registry.load("ewsjf-meta-policy", version=1)
    served = [ServedShare(requests, (cost, config))]
    assert registry.version_metrics("ewsjf-meta-policy", 2)["replay_ttft_mean"] == pytest.approx(
        replay_ttft(registry.load("ewsjf-meta-policy", version=2), served)
    )
    assert replay_ttft(champion, served) != replay_ttft(champion, [ServedShare(requests)])


def test_a_fleets_logs_are_replayed_each_replica_on_its_own_engine_and_clock(tmp_path):
    """Replicas on other machines log arrivals on unrelated clocks and each served its router's
    share on its own engine: the gate replays each replica's requests apart, on the `engine.json`
    beside its logs, the newest split evenly, and pools their TTFTs. Replayed as one stream on
    one engine (as before), the fleet's load would fall on one replica, its clocks interleaved."""
    import json

    from adapt.replay.engine import ENGINE_FILE
    from adapt.traces import load_trace
    from pipelines.ewsjf import ServedShare, replay_ttft, train_ewsjf_meta
    from pipelines.retrain import logged_requests, request_logs, retrain_cost_model, served_shares

    shared = tmp_path / "shared"
    engines = {0: EngineConfig(max_running=4, kv_capacity_tokens=20_000), 1: EngineConfig(max_running=64)}
    for replica, engine in engines.items():
        (shared / f"replica-{replica}").mkdir(parents=True)
        write_logs(shared / f"replica-{replica}", seed=replica, n=300, tag=str(replica))
        (shared / f"replica-{replica}" / ENGINE_FILE).write_text(engine.to_json())
    log = shared / "replica-1" / "requests-1.jsonl"  # this machine's clock is 5 days ahead
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for record in records:
        for name in ("arrival_s", "first_token_s", "finish_s"):
            record[name] = None if record[name] is None else record[name] + 432_000.0
    log.write_text("".join(json.dumps(record) + "\n" for record in records))
    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    retrain_cost_model(registry, shared, margin=0.0)
    cost = registry.champion("cost-model")

    shares, said = served_shares(registry, shared, request_logs(shared), most=100)
    assert said == "on the server's engine (cost-model v1), 2 replicas each on its own"
    assert [share.engine[1] for share in shares] == [engines[0], engines[1]]
    assert {share.engine[0].metadata["registry_version"] for share in shares} == {1}
    for replica, share in enumerate(shares):
        own = logged_requests([load_trace(shared / f"replica-{replica}" / f"requests-{replica}.jsonl")], 50)
        assert [r.request_id for r in share.requests] == [f"r{replica}-log{i}" for i in range(50)]
        assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in share.requests] == [
            (r.arrival_s, r.prompt_tokens, r.output_tokens) for r in own
        ]

    train_ewsjf_meta(registry, lengths=np.full(100, 64.0), promote_if_better=True)
    result = retrain_ewsjf_layout(registry, shared, margin=0.0)
    assert result.detail.endswith("2 replicas each on its own")
    shares, _ = served_shares(registry, shared, request_logs(shared))
    layout = registry.load("ewsjf-meta-policy", version=2)
    gated = registry.version_metrics("ewsjf-meta-policy", 2)["replay_ttft_mean"]
    assert gated == pytest.approx(replay_ttft(layout, shares))
    one_stream = logged_requests(request_logs(shared))
    assert gated != pytest.approx(replay_ttft(layout, [ServedShare(one_stream, (cost, engines[0]))]))


@pytest.mark.parametrize(
    ("most", "available", "quotas"),
    [
        (100, [300, 300], [50, 50]),
        (100, [10, 300], [10, 90]),
        (101, [300, 300, 300], [33, 34, 34]),
        (100, [10, 20, 300], [10, 20, 70]),
        (100, [5, 5], [5, 5]),
        (3, [300, 300], [1, 2]),
    ],
)
def test_the_gates_requests_are_split_evenly_and_what_a_quiet_replica_leaves_goes_to_the_others(
    most, available, quotas
):
    from pipelines.retrain import _even_split

    assert _even_split(most, available) == quotas


def test_a_bad_engine_file_fails_the_layout_retrain_with_its_path(tmp_path):
    from adapt.replay.engine import ENGINE_FILE
    from pipelines.retrain import retrain_cost_model

    data = tmp_path / "data"
    data.mkdir()
    write_logs(data, seed=0, n=200)
    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    retrain_cost_model(registry, data, margin=0.0)
    (data / ENGINE_FILE).write_text('{"token_budget": 512, "turbo": true}')
    with pytest.raises(ValueError, match=r"engine\.json: unknown fields \['turbo'\]"):
        retrain_ewsjf_layout(registry, data, margin=0.0)
    (data / ENGINE_FILE).write_text("{")
    with pytest.raises(ValueError, match=r"engine\.json: not JSON"):
        retrain_ewsjf_layout(registry, data, margin=0.0)


def _alpaca_rows(generator: str, instructions: int) -> list[dict]:
    import gzip
    import json

    from adapt.workloads import bundled

    with gzip.open(bundled("alpaca_eval_lengths.jsonl.gz"), "rt") as handle:
        rows = [json.loads(line) for line in handle]
    keep = set(sorted({r["instruction"] for r in rows})[:instructions])
    return [r for r in rows if r["instruction"] in keep and r["generator"] == generator]


def _served(rows: list[dict], with_prompts: bool, start_s: float) -> list[dict]:
    """The request log a server writes for these prompts, answered at their logged lengths
    (`adapt serve --log-dir [--log-prompts]`) from `start_s` on, one aborted request among them."""
    from adapt.requests import CompletedRequest

    records = [
        CompletedRequest(
            f"req-{start_s:.0f}-{i}",  # a server's ids are unique across its runs
            arrival_s=start_s + i,
            prompt_tokens=max(1, len(r["instruction"].split())),
            output_tokens=r["output_tokens"],
            first_token_s=start_s + i + 0.5,
            finish_s=start_s + i + 9.0,
            prompt_text=r["instruction"] if with_prompts else None,
        )
        for i, r in enumerate(rows)
    ]
    aborted = CompletedRequest(
        "req-aborted",
        0.0,
        5,
        3,
        0.2,
        None,
        outcome="aborted",
        prompt_text="cut short" if with_prompts else None,
    )
    return [r.to_dict() for r in [*records, aborted]]


def test_prompt_components_retrain_from_the_servers_own_request_logs(tmp_path):
    """A server that logs prompt texts (`--log-prompts`) feeds `qrf-length` (and semantic-history,
    neural-length) without any prompts file: each finished request is a prompt and the length its
    answer really had. The champion was fitted on a terse model's answers (phi-2, median 67
    tokens); the server now answers as a verbose one does (Yi-34B-Chat, median 490), so the refit
    covers the new answers far better than the champion on the same requests. A log written without prompt
    texts is skipped and said so; aborted requests are not answers and are not read."""
    import json

    from adapt.traces import load_trace
    from pipelines.catalogue import entry
    from pipelines.jitserve import train_qrf_length

    def write(path, records):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    terse = tmp_path / "terse.jsonl"
    write(terse, _alpaca_rows("phi-2", 200))
    train_qrf_length(registry, load_trace(terse), promote_if_better=True)
    data = tmp_path / "logs"
    data.mkdir()
    write(data / "requests-000001.jsonl", _served(_alpaca_rows("Yi-34B-Chat", 200), False, 0.0))
    retrain = entry("qrf-length").retrain
    result = retrain(registry, data, 0.0)
    assert (
        result.status == "no data"
        and "1 request log(s) without them: serve with --log-prompts" in result.detail
    )

    verbose = _alpaca_rows("Yi-34B-Chat", 200)
    write(data / "requests-000002.jsonl", _served(verbose, True, 1000.0))
    result = retrain(registry, data, 0.0)
    assert result.status == "registered" and result.version == 2, result
    assert "from 0 prompt file(s), 1 request log(s) with prompts, 1 without prompts skipped" in result.detail
    window = registry.load("qrf-length", version=2).metadata["data_window"]
    assert window["train_rows"] + window["test_rows"] == len(verbose)  # the aborted one left out
    candidate = registry.version_metrics("qrf-length", 2)
    champion_on_same_rows = registry.load("qrf-length", version=1).evaluate(
        load_trace(data / "requests-000002.jsonl", "requestlog")
    )
    assert candidate["coverage_at_0"] > champion_on_same_rows["coverage_at_0"] + 0.2
    assert retrain(registry, data, 0.0).status == "unchanged"  # the same logs again: nothing new


def test_a_bound_gone_too_high_is_replaced_when_the_answers_get_shorter(tmp_path):
    """The served model changes to one whose answers are about half as long (AlpacaEval: GPT-4
    1106-preview, median 471 tokens -> GPT-4 0613, 252). The stale bound now covers every answer
    -- it misses its 0.95 quantile by 0.05, no more than a refit does, so a gate on coverage error
    kept it -- while it is far too high, which costs JITServe goodput. The gate ranks by pinball
    loss, and its replay check draws the mix's prompts and lengths from the held-out requests of
    the logs, not from the bundled data: the refit is promoted."""
    import json

    from adapt.traces import load_trace, split_by_instruction
    from pipelines.catalogue import entry
    from pipelines.jitserve import train_qrf_length

    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    verbose = tmp_path / "verbose.jsonl"
    verbose.write_text("".join(json.dumps(r) + "\n" for r in _alpaca_rows("gpt4_1106_preview", 200)))
    train_qrf_length(registry, load_trace(verbose), promote_if_better=True)
    data = tmp_path / "logs"
    data.mkdir()
    served = _served(_alpaca_rows("gpt4_0613", 200), True, 0.0)
    (data / "requests-000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in served))
    result = entry("qrf-length").retrain(registry, data, 0.0)
    assert result.status == "registered" and result.promoted, result
    _, held_out = split_by_instruction(load_trace(data / "requests-000001.jsonl", "requestlog"))
    stale, fresh = (registry.load("qrf-length", version=v).evaluate(held_out) for v in (1, 2))
    assert stale["coverage_at_0"] == 1.0 and stale["bound_mean_at_0"] > 1.5 * fresh["bound_mean_at_0"]
    assert stale["coverage_error"] <= fresh["coverage_error"]  # why the old gate kept the stale bound
    assert fresh["pinball_loss"] < 0.8 * stale["pinball_loss"]
    candidate = registry.version_metrics("qrf-length", 2)
    assert candidate["replay_goodput_tokens"] > 0


def test_replay_checks_serve_the_held_out_traffic_not_the_bundled_mix(tmp_path):
    """The replay checks of a length bound and of a semantic history draw their mix's text
    requests from the held-out data they are given: the same component, replayed on a terse and on
    a verbose model's answers, meets two different loads."""
    from adapt.traces import Trace
    from pipelines.replay_checks import jitserve_goodput, sagesched_ttlt
    from predictors.semantic_history import SemanticHistory

    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")

    def answers(generator: str) -> Trace:
        rows = _alpaca_rows(generator, 60)
        texts = [r["instruction"] for r in rows]
        lengths = [r["output_tokens"] for r in rows]
        return Trace(
            generator, np.array([len(t.split()) for t in texts]), np.array(lengths), prompt_text=texts
        )

    replay = jitserve_goodput("qrf")
    terse, verbose = (replay(registry, None, answers(g)) for g in ("phi-2", "Yi-34B-Chat"))
    assert terse > 0 and verbose > 0 and terse != verbose
    # a semantic history's check too: the mix's text requests are the held-out answers, so the
    # verbose model's traffic takes longer to serve
    history = SemanticHistory().fit(answers("phi-2"))
    terse, verbose = (sagesched_ttlt(registry, history, answers(g)) for g in ("phi-2", "Yi-34B-Chat"))
    assert 0 < terse < verbose


def test_a_request_log_is_read_for_the_prompts_whose_text_it_logged(tmp_path):
    """A replay logs a text only for requests that have one (a compound program's calls have
    none): those finished requests are prompt/answer pairs; the rest of the log is not read as such."""
    from adapt.replay.metrics import write_request_log
    from pipelines.retrain import prompt_responses

    spec = WORKLOADS["jitserve-mix"]
    requests = spec.build(2.0, 60, seed=3)
    engine = ReplayEngine(make_policy("fcfs"), roofline(spec.model, spec.gpu, tp=spec.tp), EngineConfig())
    records = engine.run(requests).records
    texts = {r.request_id: r.prompt_text for r in requests if r.prompt_text is not None}
    write_request_log(records, tmp_path / "requests-1.jsonl", texts)
    data = prompt_responses(tmp_path)
    pairs = [r for r in records if r.dropped is None and r.request_id in texts]
    assert any(r.request_id not in texts for r in records)  # compound calls, logged without text
    assert (data.request_logs, data.logs_without_text, len(data.trace)) == (1, 0, len(pairs))
    assert sorted(data.trace.prompt_text) == sorted(texts[r.request_id] for r in pairs)
    assert sorted(data.trace.output_tokens.tolist()) == sorted(r.output_tokens for r in pairs)


def test_the_gate_replays_consecutive_logs_one_after_the_other(tmp_path):
    """Every loaded trace starts at 0, but two logs of one server are two stretches of time: the
    gate's replay keeps them apart (laid on top of each other, it would judge a layout at twice
    the rate the server saw). The same request in two logs is one request."""
    from adapt.replay.metrics import write_request_log
    from adapt.traces import load_trace
    from pipelines.retrain import _unique_requests, logged_requests

    spec = WORKLOADS["ewsjf-mixed"]
    engine = ReplayEngine(make_policy("fcfs"), roofline(spec.model, spec.gpu, tp=spec.tp), EngineConfig())
    records = sorted(engine.run(spec.build(10.0, 400, seed=3)).records, key=lambda r: r.arrival_s)
    write_request_log(records[:200], tmp_path / "requests-1.jsonl")
    write_request_log(records[150:], tmp_path / "requests-2.jsonl")  # 50 requests in both
    logs = _unique_requests([load_trace(tmp_path / f"requests-{n}.jsonl", "requestlog") for n in (1, 2)])
    assert sum(len(log) for log in logs) == 400
    replayed = logged_requests(logs)
    expected = [r.arrival_s - records[0].arrival_s for r in records]
    assert [r.arrival_s for r in replayed] == pytest.approx(expected)
    assert [r.output_tokens for r in replayed] == [r.output_tokens for r in records]


def test_a_pass_parses_each_request_log_once_and_the_next_pass_reads_afresh(tmp_path, monkeypatch):
    """The layout and the three prompt components all read the request logs; within one
    `retrain_once` pass they share one parse, and the next pass sees a log written since."""
    import json

    import pipelines.retrain as retrain

    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    data = tmp_path / "logs"
    data.mkdir()

    def write_log(name: str, start_s: float) -> None:
        rows = _served(_alpaca_rows("phi-2", 10), True, start_s)
        (data / name).write_text("".join(json.dumps(row) + "\n" for row in rows))

    parsed: list[str] = []
    real_load_trace = retrain.load_trace

    def counting_load_trace(path, *args, **kwargs):
        parsed.append(Path(path).name)
        return real_load_trace(path, *args, **kwargs)

    monkeypatch.setattr(retrain, "load_trace", counting_load_trace)
    seen: list[int] = []

    def reader(registry, data_dir, margin):
        seen.append(len(retrain.prompt_responses(data_dir).trace))
        seen.append(sum(len(log) for log in retrain.request_logs(data_dir)))
        return retrain.RetrainResult("reader", "unchanged")

    write_log("requests-000001.jsonl", 0.0)
    retrain.retrain_once(registry, data, {f"reader {i}": reader for i in range(4)})
    assert parsed == ["requests-000001.jsonl"] and seen == [10, 10] * 4
    write_log("requests-000002.jsonl", 100.0)
    parsed.clear(), seen.clear()
    retrain.retrain_once(registry, data, {f"reader {i}": reader for i in range(2)})
    assert sorted(parsed) == ["requests-000001.jsonl", "requests-000002.jsonl"] and seen == [20, 20] * 2
    parsed.clear()
    retrain.prompt_responses(data), retrain.prompt_responses(data)  # outside a pass: read each time
    assert len(parsed) == 4


def test_a_servers_unusual_logs_do_not_stop_a_retrain(tmp_path):
    """What a real log directory holds besides clean logs: a replica's log of only dropped requests
    (its first flush during an overload burst), step logs from before and after a feature column,
    two program files, the first without a final newline, and a directory the retrain may not
    write into. Each once failed its component for every later pass."""
    import json

    from adapt.programs import write_graphs
    from adapt.requests import CompletedRequest
    from adapt.workloads.compound import generate_graphs
    from pipelines.retrain import request_logs, retrain_cost_model, retrain_pattern_graph

    data = tmp_path / "data"
    (data / "replica-1").mkdir(parents=True)
    write_logs(data, seed=0, n=300)
    dropped = [CompletedRequest(f"d{i}", float(i), 100, 0, None, None, outcome="dropped") for i in range(3)]
    (data / "replica-1" / "requests-000001.jsonl").write_text(
        "".join(json.dumps(r.to_dict()) + "\n" for r in dropped)
    )
    assert sum(len(log) for log in request_logs(data)) == 300  # it raised "no usable rows"

    steps = pd.read_csv(data / "steps-a.csv")
    steps.head(50).assign(arrivals=1).to_csv(data / "replica-1" / "steps-new.csv", index=False)
    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    assert retrain_cost_model(registry, data, margin=0.0).status == "registered"  # was NaN in the fit

    write_graphs(data / "programs-a.jsonl", generate_graphs(30, seed=5))
    text = (data / "programs-a.jsonl").read_text()
    (data / "programs-a.jsonl").write_text(text.rstrip("\n"))
    write_graphs(data / "programs-b.jsonl", generate_graphs(30, seed=6))
    data.chmod(0o555)
    try:
        assert retrain_pattern_graph(registry, data, margin=0.0).status == "registered"
    finally:
        data.chmod(0o755)


def test_a_servers_empty_or_torn_only_logs_are_skipped_with_a_warning(tmp_path, caplog):
    """What a server stopped, or its disk full, before its first whole flush leaves: an empty log,
    or one torn line. Each failed its component's retrain on every later pass."""
    from pipelines.retrain import request_logs, retrain_cost_model

    data = tmp_path / "data"
    replica = data / "replica-1"
    replica.mkdir(parents=True)
    write_logs(data, seed=0, n=300)
    (replica / "steps-000001.jsonl").touch()
    (replica / "steps-000002.jsonl").write_text('{"start_s": 1.0, "tok\n')
    (replica / "requests-000001.jsonl").touch()
    (replica / "requests-000002.jsonl").write_text('{"request_id": "r0", "arr\n')
    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    assert retrain_cost_model(registry, replica, margin=0.0).status == "no data"
    assert sum(len(log) for log in request_logs(data)) == 300
    assert retrain_cost_model(registry, data, margin=0.0).status == "registered"
    assert retrain_ewsjf_layout(registry, data, margin=0.0).status == "registered"
    skipped = " ".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped: "))
    for name in ("steps-000001", "steps-000002", "requests-000001", "requests-000002"):
        assert f"replica-1/{name}.jsonl" in skipped


def test_a_layout_is_not_refitted_from_a_handful_of_logged_requests(tmp_path):
    from pipelines.ewsjf import train_ewsjf_meta
    from pipelines.retrain import MIN_LAYOUT_REQUESTS

    data = tmp_path / "data"
    data.mkdir()
    write_logs(data, seed=0, n=8)  # a fresh log directory's first burst
    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    train_ewsjf_meta(registry, lengths=np.full(400, 64.0), promote_if_better=True)
    result = retrain_ewsjf_layout(registry, data, margin=0.0)
    assert result.status == "no data" and f"needs {MIN_LAYOUT_REQUESTS}" in result.detail
    assert registry.resolve("ewsjf-meta-policy") == 1  # it replaced the champion, gated on those 8


def test_a_gate_takes_the_newest_requests_across_a_reboot_by_their_wall_clock(tmp_path):
    """A server logs arrivals on `time.monotonic()`, which restarts when its host reboots; the log
    directory stays. Before the reboot: 200 requests at uptime 800,100-800,299 s; after it: 200 at
    uptime 100-299 s, a day later by the wall clock. The newest 200 are the second log's, 1 s apart:
    by the monotonic clock the gate took the first log's (and laid both logs on top of each other)."""
    import json

    from adapt.requests import CompletedRequest
    from pipelines.retrain import logged_requests, request_logs

    data = tmp_path / "data"
    data.mkdir()
    day = 1.8e9
    for number, (uptime, wall) in enumerate([(800_100.0, day), (100.0, day + 86_400.0)], start=1):
        records = []
        for i in range(200):
            record = CompletedRequest(f"r{i}", uptime + i, 10 + number, 5, uptime + i + 0.1, uptime + i + 0.5)
            record.extra["wall_arrival_s"] = wall + i
            records.append(json.dumps(record.to_dict()) + "\n")
        (data / f"requests-{number:06d}.jsonl").write_text("".join(records))
    newest = logged_requests(request_logs(data), most=200)
    assert {r.prompt_tokens for r in newest} == {12}  # the post-reboot log's
    assert [r.arrival_s for r in newest[:3]] == [0.0, 1.0, 2.0]
    # A log from before servers wrote the wall clock: every request on the monotonic clock.
    old = data / "requests-000001.jsonl"
    old.write_text(
        "".join(line.replace('"wall_arrival_s"', '"other"') for line in old.read_text().splitlines(True))
    )
    assert {r.prompt_tokens for r in logged_requests(request_logs(data), most=200)} == {11}


def test_champions_that_cannot_be_loaded_do_not_block_the_layouts_retrain(tmp_path, monkeypatch):
    """A cost-model champion without its checksum (which times the gate's replay) and a layout
    champion this code's schema no longer reads (a code upgrade) failed every layout retrain, so
    nothing could replace them: now the gate replays on the default engine, the candidate is
    compared with nothing, and the result's line says both."""
    from adapt.replay.engine import ENGINE_FILE
    from pipelines.ewsjf import train_ewsjf_meta
    from pipelines.retrain import retrain_cost_model
    from predictors.ewsjf_meta import EwsjfMetaPolicy

    data = tmp_path / "data"
    data.mkdir()
    write_logs(data, seed=0, n=300)
    (data / ENGINE_FILE).write_text(EngineConfig(max_running=4).to_json())
    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    retrain_cost_model(registry, data, margin=0.0)
    train_ewsjf_meta(registry, lengths=np.full(100, 64.0), promote_if_better=True)
    registry.client.delete_model_version_tag("cost-model", "1", "adapt.manifest_sha256")
    monkeypatch.setattr(EwsjfMetaPolicy, "schema_version", EwsjfMetaPolicy.schema_version + 1)
    result = retrain_ewsjf_layout(registry, data, margin=0.0)
    assert (result.status, result.version, result.promoted) == ("registered", 2, True)
    assert "(the cost-model champion cannot be loaded (BrokenVersion: " in result.detail
    assert "on the default engine); the ewsjf-meta-policy champion cannot be loaded (ComponentError: " in (
        result.detail
    )
    assert registry.resolve("ewsjf-meta-policy") == 2


def test_a_layout_whose_promotion_was_lost_is_promoted_by_the_next_pass(tmp_path, monkeypatch):
    """Registered, then the promotion failed (the aliases lock busy): a pass on the same lengths
    skipped it as unchanged, for ever."""
    from adapt.registry import StoreLocked
    from pipelines.ewsjf import train_ewsjf_meta

    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")
    lengths = np.full(100, 64.0)

    def busy(*args, **kwargs):
        raise StoreLocked("aliases lock busy: a rollback was running")

    with monkeypatch.context() as patch:
        patch.setattr(Registry, "promote", busy)
        with pytest.raises(StoreLocked):
            train_ewsjf_meta(registry, lengths=lengths, promote_if_better=True, skip_unchanged=True)
    outcome = train_ewsjf_meta(registry, lengths=lengths, promote_if_better=True, skip_unchanged=True)
    assert (outcome.version, outcome.promoted, registry.resolve("ewsjf-meta-policy", missing_ok=True)) == (
        1,
        True,
        1,
    )
    assert (
        train_ewsjf_meta(registry, lengths=lengths, promote_if_better=True, skip_unchanged=True).version
        is None
    )


def test_a_replay_check_runs_without_an_other_part_whose_champion_cannot_be_loaded(monkeypatch, capsys):
    """jitserve's replay takes its other part from the registry: a broken qrf-length champion failed
    every pattern-graph retrain's gate (and a broken pattern-graph one every bound's)."""
    import pipelines.replay_checks
    from adapt.registry import BrokenVersion
    from pipelines.replay_checks import jitserve_goodput

    class Broken:
        def champion(self, name):
            raise BrokenVersion(f"{name} v3: no manifest checksum recorded; not an adapt component")

    monkeypatch.setattr(pipelines.replay_checks, "_replay", lambda *args: {"goodput_tokens": 7.0})
    assert jitserve_goodput("patterns")(Broken(), None, None) == 7.0
    assert "the qrf-length champion cannot be loaded (BrokenVersion: qrf-length v3" in capsys.readouterr().err
