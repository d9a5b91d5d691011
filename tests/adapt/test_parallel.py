"""Cells on every core: order kept, errors named, and parallel replays identical to serial ones."""

from __future__ import annotations

import json
import pickle

import pytest

from adapt.parallel import run_cells
from adapt.registry import Registry
from adapt.replay.cells import ReplayCell, compare_serial_parallel
from adapt.replay.runner import ReplaySetup
from adapt.workloads import WORKLOADS
from predictors.slai_offset import SlaiOffset
from serving_hooks.policies import PolicySpec


def square(x: int) -> int:
    return x * x


def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three is not allowed")
    return x


def test_results_come_back_in_item_order_whatever_finishes_first():
    items = list(range(7))
    assert run_cells(square, items, jobs=2, cost=lambda x: x, progress=False) == [x * x for x in items]
    assert run_cells(square, items, jobs=1, progress=False) == [x * x for x in items]
    assert run_cells(square, [], jobs=2, progress=False) == []


def test_a_failing_cell_is_named():
    for jobs in (1, 2):
        with pytest.raises(ValueError, match="three is not allowed") as raised:
            run_cells(
                fail_on_three, [1, 2, 3, 4], jobs=jobs, describe=lambda x: f"number {x}", progress=False
            )
        assert "in cell number 3" in raised.value.__notes__


def test_jobs_must_be_positive():
    with pytest.raises(ValueError, match="jobs"):
        run_cells(square, [1, 2], jobs=0)


def test_on_result_sees_every_cell():
    seen: list[tuple[int, int]] = []
    run_cells(square, [1, 2, 3], jobs=2, progress=False, on_result=lambda i, r: seen.append((i, r)))
    assert sorted(seen) == [(1, 1), (2, 4), (3, 9)]


def _cells(policies: list[str], workload: str = "slai-tiers", num: int = 150) -> list[ReplayCell]:
    spec = WORKLOADS[workload]
    setup = ReplaySetup(
        spec.build(spec.rate, num, 3), spec.info(spec.rate, num, 3), spec.model, spec.gpu, spec.tp
    )
    config = spec.engine_config()
    return [ReplayCell(p, p, setup, PolicySpec(p), config) for p in policies]


@pytest.mark.slow
def test_parallel_replays_equal_serial_replays():
    """Every metric of every cell, as JSON, for baselines and learned policies with their default
    components -- the property `adapt replay --jobs N` and the quickstart rely on."""
    cells = _cells(["fcfs", "sarathi", "spf", "ewsjf", "slai", "jitserve", "fastserve"])
    outcome = compare_serial_parallel(cells, jobs=2)
    assert outcome["identical"], outcome
    assert outcome["cells"] == 7


def test_policy_spec_pickles_and_builds_what_the_spec_names():
    spec = PolicySpec("sarathi:order=spf")
    copy = pickle.loads(pickle.dumps(spec))
    assert copy == spec and str(copy) == "sarathi:order=spf"
    assert copy().describe() == spec().describe()
    with pytest.raises(ValueError, match="unknown"):
        PolicySpec("no-such-policy")()


def test_policy_spec_loads_a_pinned_version_once_per_process(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    version = Registry(uri).log(SlaiOffset([0.5, 0.9], [2, 6, 12]))
    first, second = PolicySpec(f"slai:offset=v{version}")(), PolicySpec(f"slai:offset=v{version}")()
    assert first is not second
    assert first.offset is second.offset  # the same loaded version, not a second load
    assert json.dumps(first.describe(), default=str) == json.dumps(second.describe(), default=str)


def bowl(params: dict[str, float]) -> tuple[float, dict[str, float]]:
    value = (params["x"] - 0.3) ** 2 + (params["y"] + 1.0) ** 2
    return value, {"value": value}


def test_tuning_gives_the_same_trials_on_any_number_of_processes():
    """Trials are asked in fixed batches, so a study does not depend on the machine's cores."""
    from adapt.online import TRIAL_BATCH, tune

    space = {"x": (-1.0, 1.0), "y": (-2.0, 2.0)}
    runs = [tune(bowl, space, n_trials=2 * TRIAL_BATCH + 1, seed=4, progress=False, jobs=j) for j in (1, 2)]
    assert runs[0].history == runs[1].history
    assert runs[0].params == runs[1].params and len(runs[0].history) == 2 * TRIAL_BATCH + 1


@pytest.mark.slow
def test_slai_offset_tunes_to_the_same_rule_on_two_processes():
    from pipelines.slai import ReplayObjective

    objective = ReplayObjective(2.0, 200)
    rules = [SlaiOffset().fit(objective, n_trials=5, seed=1, jobs=j).rule() for j in (1, 2)]
    assert rules[0] == rules[1]


@pytest.fixture
def local_ray():
    """A local Ray runtime for one test, shut down after it (it holds memory and processes)."""
    ray = pytest.importorskip("ray")
    yield "local"
    ray.shutdown()


@pytest.mark.slow
def test_cells_on_a_local_ray_runtime_match_the_serial_run(local_ray):
    items = list(range(6))
    assert run_cells(square, items, jobs=2, ray=local_ray, progress=False) == [x * x for x in items]
    with pytest.raises(ValueError, match="three is not allowed") as raised:
        run_cells(
            fail_on_three, [1, 3], jobs=2, ray=local_ray, describe=lambda x: f"number {x}", progress=False
        )
    assert "in cell number 3" in raised.value.__notes__
    outcome = compare_serial_parallel(_cells(["fcfs", "sarathi", "slai", "jitserve"]), jobs=2, ray=local_ray)
    assert outcome["ray_identical"] and outcome["identical"], outcome
