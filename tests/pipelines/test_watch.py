"""Detection (`pipelines.watch`): the early-retrain and rollback decisions on hand-written status
dicts, the watch reading real HTTP servers (one of them silent), a rollback in a real sqlite MLflow
registry, the in-process retrain loop, and `adapt retrain --every/--watch` on the command line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from adapt.cli import build_parser, main
from adapt.registry import Registry
from pipelines.retrain import RetrainResult, every, retrain_loop
from pipelines.watch import ROLLED_BACK_TAG, Aliases, QualityWatch, Rollback, early_retrain, rollbacks
from tests.serving_helpers import StatusServer, fake_slot, silent_url

URL = "http://replica-a:8000"


def _entry(
    version: int | None,
    coverage: float | None = None,
    requests: int = 300,
    *,
    alarm: bool = False,
    predecessor: dict[str, Any] | None = None,
    rank_correlation: float | None = None,
) -> dict[str, Any]:
    """One component's quality entry, shaped as `SchedulerMetrics.publish` writes it."""
    entry: dict[str, Any] = {"requests": requests, "version": version, "predecessor": predecessor}
    if coverage is not None:
        entry.update(coverage=coverage, overestimate=1.5, held_out_coverage=0.95, drift_alarm=alarm)
    if rank_correlation is not None:
        entry["rank_correlation"] = rank_correlation
    return entry


def _before(version: int, coverage: float | None = None, requests: int = 500, rank: float | None = None):
    return {
        "version": version,
        "coverage": coverage,
        "overestimate": None if coverage is None else 1.4,
        "rank_correlation": rank,
        "requests": requests,
    }


def _status(**quality: dict[str, Any]) -> dict[str, Any]:
    return {
        "components": {name: entry["version"] for name, entry in quality.items()},
        "quality": quality,
        "drift_alarms": sorted(name for name, entry in quality.items() if entry.get("drift_alarm")),
    }


# ------------------------------------------------------------- early retrain
def test_a_drift_alarm_retrains_now_naming_what_it_saw():
    statuses = {URL: _status(**{"qrf-length": _entry(4, 0.81, 300, alarm=True)})}
    reason = early_retrain(statuses, now=1000.0, last_retrain_s=None)
    assert reason == (
        f"drift alarm: qrf-length v4 on {URL}: coverage 0.81 vs held-out 0.95 over 300 requests"
    )


def test_no_alarm_no_retrain():
    statuses = {URL: _status(**{"qrf-length": _entry(4, 0.94, 300)})}
    assert early_retrain(statuses, now=1000.0, last_retrain_s=None) is None


def test_an_alarm_that_stays_on_waits_for_the_cooldown():
    statuses = {URL: _status(**{"qrf-length": _entry(4, 0.81, 300, alarm=True)})}
    assert early_retrain(statuses, now=1000.0, last_retrain_s=800.0, cooldown_s=300.0) is None
    assert early_retrain(statuses, now=1100.0, last_retrain_s=800.0, cooldown_s=300.0) is not None


def test_an_alarm_on_a_version_with_too_few_requests_waits():
    statuses = {URL: _status(**{"qrf-length": _entry(5, 0.5, 150, alarm=True)})}
    assert early_retrain(statuses, now=1000.0, last_retrain_s=None, least_requests=200) is None
    assert early_retrain(statuses, now=1000.0, last_retrain_s=None, least_requests=150) is not None


# ------------------------------------------------------------------ rollback
def test_a_version_worse_than_its_predecessor_is_rolled_back():
    # coverage 0.80 over 300 requests against v3's 0.92 over 500: 0.80 < 0.92 - 0.05
    statuses = {URL: _status(**{"qrf-length": _entry(4, 0.80, 300, predecessor=_before(3, 0.92))})}
    decided = rollbacks(statuses, {"qrf-length": Aliases(4, 3)}, least_requests=200, margin=0.05)
    assert decided == [
        Rollback(
            "qrf-length",
            4,
            3,
            "online coverage 0.800 over 300 requests, below v3's 0.920 over 500 by more than 0.05",
        )
    ]


def test_a_version_as_good_or_better_stays():
    aliases = {"qrf-length": Aliases(4, 3)}
    within = {URL: _status(**{"qrf-length": _entry(4, 0.88, 300, predecessor=_before(3, 0.92))})}
    better = {URL: _status(**{"qrf-length": _entry(4, 0.97, 300, predecessor=_before(3, 0.92))})}
    assert rollbacks(within, aliases, margin=0.05) == []  # 0.04 lower: within the margin
    assert rollbacks(better, aliases, margin=0.05) == []


def test_too_few_requests_on_either_side_decide_nothing():
    aliases = {"qrf-length": Aliases(4, 3)}
    young = {URL: _status(**{"qrf-length": _entry(4, 0.5, 199, predecessor=_before(3, 0.92))})}
    thin = {URL: _status(**{"qrf-length": _entry(4, 0.5, 300, predecessor=_before(3, 0.92, requests=50))})}
    assert rollbacks(young, aliases, least_requests=200) == []
    assert rollbacks(thin, aliases, least_requests=200) == []


def test_a_champion_that_moved_on_is_not_fought():
    statuses = {URL: _status(**{"qrf-length": _entry(4, 0.5, 300, predecessor=_before(3, 0.92))})}
    assert rollbacks(statuses, {"qrf-length": Aliases(5, 4)}) == []  # v5 promoted since
    assert rollbacks(statuses, {"qrf-length": Aliases(3, 2)}) == []  # rolled back already
    assert rollbacks(statuses, {"qrf-length": Aliases(4, 2)}) == []  # the registry's previous is not v3
    assert rollbacks(statuses, {}) == []


def test_rank_correlation_decides_for_a_length_estimate():
    entry = _entry(7, None, 400, rank_correlation=0.41, predecessor=_before(6, rank=0.63, requests=400))
    statuses = {URL: _status(**{"semantic-history": entry})}
    (decided,) = rollbacks(statuses, {"semantic-history": Aliases(7, 6)})
    assert (decided.component, decided.version, decided.predecessor) == ("semantic-history", 7, 6)
    assert decided.reason.startswith("online rank_correlation 0.410 over 400 requests, below v6's 0.630")


def test_replicas_are_pooled_by_requests_and_a_stale_replica_does_not_count():
    # (0.80 * 300 + 0.95 * 100) / 400 = 0.8375 against (0.92 * 500 + 0.90 * 500) / 1000 = 0.91
    statuses = {
        "http://a": _status(**{"qrf-length": _entry(4, 0.80, 300, predecessor=_before(3, 0.92))}),
        "http://b": _status(**{"qrf-length": _entry(4, 0.95, 100, predecessor=_before(3, 0.90))}),
        "http://c": _status(**{"qrf-length": _entry(3, 0.20, 900)}),  # not swapped yet: ignored
    }
    (decided,) = rollbacks(statuses, {"qrf-length": Aliases(4, 3)}, least_requests=200, margin=0.05)
    assert "0.838 over 400 requests, below v3's 0.910 over 1000" in decided.reason
    # pooled, 0.8375 is within 0.1 of 0.91 although replica a alone (0.80 vs 0.92) is not
    assert rollbacks(statuses, {"qrf-length": Aliases(4, 3)}, margin=0.1) == []


@settings(max_examples=200, deadline=None)
@given(
    now=st.floats(0, 1),
    then=st.floats(0, 1),
    now_n=st.integers(0, 1000),
    then_n=st.integers(0, 1000),
    margin=st.floats(0, 0.5),
)
def test_one_server_rolls_back_exactly_when_worse_by_the_margin_over_enough_requests(
    now, then, now_n, then_n, margin
):
    assume(abs(now - (then - margin)) > 1e-9)  # not on the boundary, where pooling rounds either way
    statuses = {URL: _status(c=_entry(2, now, now_n, predecessor=_before(1, then, then_n)))}
    decided = rollbacks(statuses, {"c": Aliases(2, 1)}, least_requests=200, margin=margin)
    assert bool(decided) == (min(now_n, then_n) >= 200 and now < then - margin)


def test_the_recorders_status_entries_are_what_the_decisions_read():
    """The contract with `serving_hooks.metrics`: its per-version entries, as the status file
    holds them, decide a rollback and an early retrain."""
    from types import SimpleNamespace

    from adapt.policy import RequestState
    from adapt.requests import SLO
    from serving_hooks.metrics import SchedulerMetrics

    class Bounded(SimpleNamespace):
        name, components = "bounded", {"qrf": "qrf-length"}

        def length_bound(self, request):
            return ("qrf-length", request.cache["bound"])

    metrics, policy = SchedulerMetrics(window=500, drift_least=100), Bounded()
    slot = fake_slot("qrf-length", 3, swaps=1, held_out={"coverage_at_0": 0.95})
    live = SimpleNamespace(slots={"qrf": slot}, config_slot=None)

    def serve(count: int, covered_every: int) -> dict[str, Any]:
        metrics.publish(0.0, policy=policy, waiting=[], running=0, kv_usage=0.0, live=live)  # sees a swap
        for i in range(count):  # every `covered_every`-th request runs past its bound of 10 tokens
            state = RequestState(f"r{i}", 0.0, 10, 64, SLO())
            state.finish_s, state.tokens_generated = 1.0, 11 if i % covered_every == 0 else 9
            state.cache["bound"] = 10.0
            metrics.finished(state, "finished", policy)
        quality = metrics.publish(0.0, policy=policy, waiting=[], running=0, kv_usage=0.0, live=live)
        alarms = sorted(name for name, q in quality.items() if q.get("drift_alarm"))
        return json.loads(json.dumps({"quality": quality, "drift_alarms": alarms}))  # as the file holds it

    serve(300, covered_every=20)  # v3 covers 0.95
    slot.version = 4
    status = serve(300, covered_every=4)  # v4 covers 0.75
    assert status["quality"]["qrf-length"]["predecessor"]["coverage"] == 0.95
    (decided,) = rollbacks({URL: status}, {"qrf-length": Aliases(4, 3)})
    assert (decided.version, decided.predecessor) == (4, 3)
    assert early_retrain({URL: status}, now=0.0, last_retrain_s=None) is not None


# ---------------------------------------------------------- the watch, on HTTP
@pytest.fixture
def status_server() -> Iterator[StatusServer]:
    server = StatusServer(_status(**{"qrf-length": _entry(4, 0.95, 300)}))
    yield server
    server.close()


class _NoRegistry:
    """Stands in for the registry where no rollback can be decided (nothing has a predecessor)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the registry was asked: {name}")


def test_the_watch_reads_servers_skips_a_silent_one_and_asks_for_a_retrain(status_server):
    silent = silent_url()
    said: list[str] = []
    watch = QualityWatch([status_server.url + "/", silent], _NoRegistry(), say=said.append, timeout_s=2)
    assert watch.poll(now=0.0) is False
    assert len(said) == 1 and said[0].startswith(f"watch: {silent} does not answer (")
    assert "refused" in said[0] and said[0].endswith("; skipped until it does")
    status_server.status = _status(**{"qrf-length": _entry(4, 0.70, 300, alarm=True)})
    assert watch.poll(now=10.0) is True
    assert said[1:] == [
        f"watch: early retrain: drift alarm: qrf-length v4 on {status_server.url}: coverage 0.7"
        " vs held-out 0.95 over 300 requests"
    ]  # the silent server is not reported again
    watch.retrained(now=20.0)
    assert watch.poll(now=30.0) is False  # cooling down
    assert watch.poll(now=20.0 + watch.cooldown_s) is True


def test_the_watch_reads_a_keyed_server_with_its_key_and_says_it_wants_one_without(status_server):
    status_server.api_key = "k"
    said: list[str] = []
    assert QualityWatch([status_server.url], _NoRegistry(), api_key="k", say=said.append).statuses()
    assert QualityWatch([status_server.url], _NoRegistry(), say=said.append).statuses() == {}
    (line,) = said
    assert "HTTP 401, the server wants an API key" in line and "VLLM_API_KEY" in line


def test_the_watch_refuses_what_is_not_a_server_url():
    for bad in ("localhost:8000", "ftp://host", "http://", ""):
        with pytest.raises(ValueError, match="--watch"):
            QualityWatch([bad], _NoRegistry())
    with pytest.raises(ValueError, match="--watch"):
        QualityWatch([], _NoRegistry())


# ------------------------------------------------------- rollback in MLflow
@pytest.mark.slow
def test_a_rollback_moves_the_champion_back_and_tags_the_bad_version(tmp_path, status_server):
    from serving_hooks.policies.config import PolicyConfig

    reg = Registry(f"sqlite:///{tmp_path / 'mlflow.db'}", cache_dir=tmp_path / "cache")
    v1 = reg.log(PolicyConfig("fcfs"))
    v2 = reg.log(PolicyConfig("sarathi"))
    v3 = reg.log(PolicyConfig("sarathi", {"token_budget": 256}))
    reg.promote("policy-config", v1)
    reg.promote("policy-config", v2)
    status_server.status = _status(**{"policy-config": _entry(v2, 0.70, 300, predecessor=_before(v1, 0.93))})
    said: list[str] = []
    watch = QualityWatch([status_server.url], reg, say=said.append)
    assert watch.poll(now=0.0) is False  # a rollback needs no retrain
    assert reg.resolve("policy-config") == v1
    reason = "online coverage 0.700 over 300 requests, below v1's 0.930 over 500 by more than 0.05"
    assert said == [f"watch: rolled back policy-config v{v2} -> v{v1}: {reason}"]
    assert {v.version: v.tags.get(ROLLED_BACK_TAG) for v in reg.versions("policy-config")} == {
        v1: None,
        v2: reason,
        v3: None,
    }
    watch.poll(now=10.0)  # the servers still measure v2 until they swap: nothing more to do
    assert reg.resolve("policy-config") == v1 and len(said) == 1

    reg.promote("policy-config", v3)  # a newer promotion, while the servers' figures are still v2's:
    watch.poll(now=20.0)  # v3 is left alone
    assert reg.resolve("policy-config") == v3 and len(said) == 1


@pytest.mark.slow
def test_a_rollback_decided_before_the_registry_moved_is_not_made(tmp_path):
    """Deciding (`rollbacks`, from the aliases read) and rolling back are two steps; in between,
    another watch on the store rolled back already, or a retrain promoted. Acting anyway used to
    roll back twice (v3 -> v2 -> v1), or undo that promotion (v4 -> v3, just tagged rolled back)."""
    from serving_hooks.policies.config import PolicyConfig

    reg = Registry(f"sqlite:///{tmp_path / 'mlflow.db'}", cache_dir=tmp_path / "cache")
    v1, v2, v3, v4 = (reg.log(PolicyConfig(policy)) for policy in ("fcfs", "sarathi", "spf", "edf"))
    for version in (v1, v2, v3):
        reg.promote("policy-config", version)
    statuses = {URL: _status(**{"policy-config": _entry(v3, 0.70, 300, predecessor=_before(v2, 0.93))})}
    said: list[str] = []
    first, second = QualityWatch([URL], reg, say=said.append), QualityWatch([URL], reg, say=said.append)
    decided = [rollbacks(statuses, watch._aliases(statuses)) for watch in (first, second)]
    assert decided[0] == decided[1] != []
    first.roll_back(decided[0][0])
    second.roll_back(decided[1][0])
    assert reg.resolve("policy-config") == v2
    assert said[1:] == [f"watch: policy-config: the champion is v{v2} now, not v{v3}; not rolled back"]

    reg.promote("policy-config", v3)  # v3 again: the same decision as before
    (again,) = rollbacks(statuses, first._aliases(statuses))
    reg.promote("policy-config", v4)  # a retrain promotes in between
    first.roll_back(again)
    assert reg.resolve("policy-config") == v4 and reg.resolve("policy-config", "previous") == v3
    assert said[2:] == [f"watch: policy-config: the champion is v{v4} now, not v{v3}; not rolled back"]


# ---------------------------------------------------------- the retrain loop
class ManualClock:
    """A clock the retrain loop reads and sleeps on, moved only by its sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _ScriptedWatch:
    """Asks for a retrain at the polls whose times are in `alarms`."""

    def __init__(self, clock: ManualClock, alarms: set[float]) -> None:
        self.clock, self.alarms = clock, alarms
        self.polls: list[float] = []
        self.passes_ended: list[float] = []

    def poll(self, now: float) -> bool:
        self.polls.append(now)
        return now in self.alarms

    def retrained(self, now: float) -> None:
        self.passes_ended.append(now)


def test_the_loop_runs_scheduled_passes_and_an_early_one_when_the_watch_asks(tmp_path, capsys):
    clock = ManualClock()
    passes: list[float] = []

    def retrainer(registry, data_dir, margin):
        passes.append(clock.now)
        clock.now += 1.0  # a pass takes a second
        return RetrainResult("cost-model", "unchanged", detail="training data unchanged")

    data = tmp_path / "data"
    data.mkdir()
    reg = Registry(f"sqlite:///{tmp_path / 'mlflow.db'}", cache_dir=tmp_path / "cache")
    watch = _ScriptedWatch(clock, alarms={30.0})
    fire_times = every(60.0, clock=clock)
    retrain_loop(
        reg,
        data,
        {"cost-model": retrainer},
        (next(fire_times) for _ in range(2)),  # two scheduled passes
        watch=watch,
        watch_interval_s=10.0,
        clock=clock,
        sleep=clock.sleep,
    )
    # polls every 10 s; the alarm at 30 runs a pass (30-31); scheduled at 60 and 121 (60 s after 61)
    assert passes == [30.0, 60.0, 121.0]
    assert watch.polls == [10.0, 20.0, 30.0, 41.0, 51.0, 71.0, 81.0, 91.0, 101.0, 111.0]
    assert watch.passes_ended == [31.0, 61.0, 122.0]
    assert capsys.readouterr().out.count("cost-model           unchanged") == 3


def test_the_loop_skips_a_pass_while_another_run_holds_the_lock(tmp_path, capsys):
    clock = ManualClock()
    data = tmp_path / "data"
    data.mkdir()
    reg = Registry(f"sqlite:///{tmp_path / 'mlflow.db'}", cache_dir=tmp_path / "cache")
    with reg.store_lock("retrain"):
        retrain_loop(reg, data, {}, [5.0], clock=clock, sleep=clock.sleep)
    assert clock.now == 5.0
    assert "retrain: skipped:" in capsys.readouterr().err


# ------------------------------------------------------------------------- CLI
def test_retrain_every_and_watch_parse():
    args = build_parser().parse_args(
        ["retrain", "--every", "30", "--watch", "http://a:8000,http://b:8000", "--watch-interval", "2.5"]
    )
    assert (args.every, args.watch, args.watch_interval, args.once, args.schedule) == (
        30.0,
        "http://a:8000,http://b:8000",
        2.5,
        False,
        None,
    )
    assert build_parser().parse_args(["retrain", "--schedule", "* * * * *"]).watch_interval == 10.0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--every", "-5"], "argument --every: must be > 0"),
        (["--every", "0"], "argument --every: must be > 0"),
        (["--every", "nan"], "argument --every: must be > 0"),
        (["--every", "5", "--schedule", "* * * * *"], "not allowed with argument --every"),
        (
            ["--every", "5", "--watch", "http://a:8000", "--watch-interval", "-1"],
            "--watch-interval: must be > 0",
        ),
    ],
)
def test_retrain_refuses_bad_intervals(argv, says, capsys):
    assert main(["retrain", *argv]) == 2
    assert says in capsys.readouterr().err


def test_retrain_watch_needs_a_schedule_and_server_urls(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    base = ["retrain", "--data-dir", str(data)]
    assert main([*base, "--once", "--watch", "http://a:8000"]) == 2
    assert "--watch: needs --every or --schedule" in capsys.readouterr().err
    assert main([*base, "--every", "5", "--watch", "a:8000"]) == 2
    assert "'a:8000' is not an http(s) URL with a host" in capsys.readouterr().err
    assert main([*base, "--every", "5", "--watch", " , "]) == 2
    assert "give the servers' URLs" in capsys.readouterr().err


def test_retrain_only_refits_the_components_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    data = tmp_path / "data"
    data.mkdir()
    base = ["retrain", "--once", "--data-dir", str(data)]
    assert main([*base, "--only", "ewsjf-meta-policy,nope"]) == 2
    assert "--only: unknown ['nope']; expected some of cost-model" in capsys.readouterr().err
    assert main([*base, "--only", " , "]) == 2
    assert main([*base, "--only", "ewsjf-meta-policy"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("ewsjf-meta-policy") and "no data" in out


def test_retrain_watch_asks_with_the_key_given_or_vllm_api_key(tmp_path, monkeypatch):
    import pipelines.retrain

    watches: list[QualityWatch] = []
    monkeypatch.setattr(
        pipelines.retrain, "retrain_loop", lambda *args, watch, **kwargs: watches.append(watch)
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("VLLM_API_KEY", "from-env")  # as vLLM's own server reads its key
    base = ["retrain", "--every", "5", "--data-dir", str(tmp_path), "--watch", "http://a:8000"]
    assert main(base) == 0
    assert main([*base, "--watch-api-key", "given"]) == 0
    assert [watch.api_key for watch in watches] == ["from-env", "given"]
