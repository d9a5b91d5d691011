"""`adapt retrain --every/--schedule`: the fire times of a cron expression are the host's local
ones, and the daemon outlives a pass or a watch poll that fails."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import datetime

import pytest

from adapt.cli import main
from adapt.registry import Registry
from pipelines.retrain import RetrainResult, cron_times, retrain_loop
from tests.pipelines.test_watch import ManualClock


@pytest.fixture(params=["America/New_York", "Asia/Kolkata"])
def local_zone(request) -> Iterator[str]:
    """The process's local time zone set to one west and one east of UTC (a half-hour one)."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = request.param
    time.tzset()
    yield request.param
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_cron_fire_times_are_the_hosts_local_times(local_zone):
    """croniter read a naive start as UTC: in New York the next `*/5` fire was some 5 hours past,
    and ~60 passes ran back to back at start-up; `0 3 * * *` fired at 22:00."""
    now = time.time()
    schedule = cron_times("*/5 * * * *")
    fires = [next(schedule) for _ in range(3)]
    assert now < fires[0] <= now + 300 and fires[1] - fires[0] == fires[2] - fires[1] == 300
    nightly = next(cron_times("0 3 * * *"))
    assert 0 < nightly - now <= 25 * 3600  # a day, and an hour more across a DST change
    assert datetime.fromtimestamp(nightly).strftime("%H:%M") == "03:00"


def _registry(tmp_path) -> Registry:
    return Registry(f"sqlite:///{tmp_path / 'r.db'}", cache_dir=tmp_path / "c")


def _counting(clock: ManualClock, passes: list[float]):
    def retrainer(registry, data_dir, margin):
        passes.append(clock.now)
        return RetrainResult("cost-model", "unchanged", detail="training data unchanged")

    return retrainer


def test_a_failed_pass_is_reported_and_the_next_one_runs(tmp_path, capsys):
    """The servers have not created the data directory yet: the first pass fails, the daemon
    stays, and the pass after the servers started runs."""
    clock, passes = ManualClock(), []
    data = tmp_path / "data"

    def fire_times() -> Iterator[float]:
        yield 5.0
        data.mkdir()  # the servers started
        yield 10.0

    retrain_loop(
        _registry(tmp_path),
        data,
        {"cost-model": _counting(clock, passes)},
        fire_times(),
        clock=clock,
        sleep=clock.sleep,
    )
    assert passes == [10.0]
    err = capsys.readouterr().err
    assert f"retrain: pass failed: FileNotFoundError: {data}: no such data directory" in err


def test_a_watch_poll_that_fails_does_not_end_the_loop(tmp_path, capsys):
    class Failing:
        def __init__(self) -> None:
            self.polls, self.ended = 0, []

        def poll(self, now: float) -> bool:
            self.polls += 1
            raise ConnectionError("status: connection refused")

        def retrained(self, now: float) -> None:
            self.ended.append(now)

    clock, passes, watch = ManualClock(), [], Failing()
    data = tmp_path / "data"
    data.mkdir()
    retrain_loop(
        _registry(tmp_path),
        data,
        {"cost-model": _counting(clock, passes)},
        [30.0],
        watch=watch,
        watch_interval_s=10.0,
        clock=clock,
        sleep=clock.sleep,
    )
    assert (watch.polls, passes, watch.ended) == (2, [30.0], [30.0])  # polled at 10 and 20
    assert (
        "retrain: watch poll failed: ConnectionError: status: connection refused" in capsys.readouterr().err
    )


def test_once_still_fails_on_a_missing_data_directory(tmp_path, capsys):
    missing = tmp_path / "missing"
    uri = f"sqlite:///{tmp_path / 'r.db'}"
    assert main(["--tracking-uri", uri, "retrain", "--once", "--data-dir", str(missing)]) == 2
    assert f"adapt: error: {missing}: no such data directory" in capsys.readouterr().err
