"""Reading a server's decision log (`adapt.conformance.read_decision_log`) and building its policy
with the logged component versions (`adapt conformance`)."""

import json

import pytest

from adapt.cli.conformance import logged_policy
from adapt.conformance import read_decision_log


def step(index, **extra):
    record = {"index": index, "t": float(index), "arrived": [], "delivered_t": None}
    return {**record, "scheduled": {}, "preempted": [], "freed": [], **extra}


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_runs_split_where_the_engine_restarted_and_name_their_policies(tmp_path):
    versions = {"qrf": "qrf-length@v3"}
    write(
        tmp_path / "decisions-000001.jsonl",
        [step(0, policy="jitserve", components=versions), step(1), step(2)],
    )
    write(
        tmp_path / "decisions-000002.jsonl",
        [
            step(3),
            step(0, policy="policy-config@v1", components={}),
            step(1),
            step(2, policy="policy-config@v2"),
        ],
    )
    first, second = read_decision_log(tmp_path)
    assert [r["index"] for r in first.decisions] == [0, 1, 2, 3]  # one run across two files
    assert (first.policy, first.components, first.switches) == ("jitserve", versions, {})
    assert [r["index"] for r in second.decisions] == [0, 1, 2] and second.stopped_by is None
    assert (second.policy, second.switches) == ("policy-config@v1", {2: "policy-config@v2"})


def test_a_policy_swapped_in_that_the_log_cannot_name_ends_the_run(tmp_path):
    write(
        tmp_path / "decisions-000001.jsonl", [step(0, policy="fcfs"), step(1), step(2, policy=None), step(3)]
    )
    (run,) = read_decision_log(tmp_path)
    assert len(run.decisions) == 2 and run.stopped_by == "a policy the log does not name went live at step 2"


def test_prefix_cache_resets_idle_or_preempting_stay_in_the_run(tmp_path):
    """Both kinds of reset are replayed (`ReplayEngine.reset_prefix_cache`, the preempting one
    preempting the running requests first), so neither ends the run a replay can follow."""
    records = [
        step(0, policy="fcfs"),
        step(1, prefix_cache_reset="idle"),
        step(2),
        step(3, prefix_cache_reset="preempting", prefix_cache_reset_t=2.5),
        step(4),
    ]
    write(tmp_path / "decisions-000001.jsonl", records)
    (run,) = read_decision_log(tmp_path)
    assert run.decisions == records and run.stopped_by is None


def test_a_preempting_reset_logged_before_it_was_replayable_ends_the_run(tmp_path):
    """A log without the reset's time was written by an adapter that never told its policy of
    these preemptions: no replay can follow it past there."""
    records = [step(0, policy="fcfs"), step(1, prefix_cache_reset="idle"), step(2)]
    write(tmp_path / "decisions-000001.jsonl", [*records, step(3, prefix_cache_reset="preempting"), step(4)])
    (run,) = read_decision_log(tmp_path)
    assert run.decisions == records
    assert run.stopped_by == "the prefix cache was reset with requests running at step 3"


def test_a_component_swap_is_replayed_at_the_step_it_went_live(tmp_path):
    serving = {"qrf": "qrf-length@v3", "patterns": "pattern-graph@v1"}
    write(
        tmp_path / "decisions-000001.jsonl",
        [step(0, components=serving), step(1), step(2, components={**serving, "qrf": "qrf-length@v4"})],
    )
    (run,) = read_decision_log(tmp_path)
    assert len(run.decisions) == 3 and run.stopped_by is None and run.policy is None
    assert run.components == serving and run.swaps == {2: {"qrf": "qrf-length@v4"}}


def test_a_missing_or_broken_log_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="--log-decisions"):
        read_decision_log(tmp_path)
    (tmp_path / "decisions-000001.jsonl").write_text(json.dumps(step(0)) + "\n[1]\n")
    with pytest.raises(ValueError, match=r"decisions-000001\.jsonl:2: expected a JSON object, got list"):
        read_decision_log(tmp_path)
    (tmp_path / "decisions-000001.jsonl").write_text(json.dumps({"index": 0, "t": 0.0}) + "\n[1]\n")
    with pytest.raises(ValueError, match=r":1: not a decision record \(no arrived, delivered_t, freed"):
        read_decision_log(tmp_path)


def test_a_torn_line_and_the_records_a_retried_flush_wrote_twice_leave_one_run(tmp_path, caplog):
    """What a full disk left with the earlier log writer: a flush cut short (steps 2 and 3 whole,
    step 4 torn) and, retried, the same records again on a fresh line. The torn line rejected the
    whole directory, and the repeated indices split the run as if the engine had restarted."""
    lines = [json.dumps(step(i)) for i in range(5)]
    torn = lines[4][:20]
    text = "\n".join([*lines[:4], torn, *lines[2:5], json.dumps(step(5))]) + "\n"
    (tmp_path / "decisions-000001.jsonl").write_text(text)
    (run,) = read_decision_log(tmp_path)
    assert [r["index"] for r in run.decisions] == [0, 1, 2, 3, 4, 5]
    assert "1 torn line(s) skipped, 2 repeated record(s) dropped" in caplog.text


def test_logged_versions_replace_what_the_spec_said(tmp_path):
    from adapt.registry import Registry
    from adapt.workloads.compound import generate_graphs
    from predictors.pattern_graph import PatternGraph
    from serving_hooks.policies.config import PolicyConfig

    registry = Registry(cache_dir=tmp_path / "cache")  # the test's own sqlite store (conftest)
    for seed in (1, 2):
        registry.log(PatternGraph().fit(generate_graphs(40, seed=seed)))
    registry.log(PolicyConfig("jitserve", {"waiting_time_s": 7.0}))

    def version(component):
        return component.metadata["registry_version"]

    policy = logged_policy("jitserve:patterns=v1:waiting_time_s=5", {})
    assert (version(policy.patterns), policy.waiting_time_s) == (1, 5)
    policy = logged_policy("jitserve:patterns=v1:waiting_time_s=5", {"patterns": "pattern-graph@v2"})
    assert (version(policy.patterns), policy.waiting_time_s) == (2, 5)
    policy = logged_policy("policy-config@v1", {"patterns": "pattern-graph@v2"})
    assert (policy.name, version(policy.patterns), policy.waiting_time_s) == ("jitserve", 2, 7.0)


def test_a_streaming_input_session_ends_the_run_where_it_arrived_even_at_the_first_step(tmp_path):
    """The replay does not model streaming-input sessions: the run a replay can follow ends at
    the record that notes one, the first record included."""
    write(tmp_path / "decisions-000001.jsonl", [step(0, policy="fcfs"), step(1, streaming_sessions=["s"])])
    write(tmp_path / "decisions-000002.jsonl", [step(0, policy="fcfs", streaming_sessions=["t"]), step(1)])
    first, second = read_decision_log(tmp_path)
    assert (
        len(first.decisions) == 1
        and first.stopped_by == "a streaming-input session (s) at step 1: not modelled"
    )
    assert (
        second.decisions == []
        and second.stopped_by == "a streaming-input session (t) at step 0: not modelled"
    )


@pytest.mark.parametrize("reference", ["qrf-length@champion", "qrf-length@x3", "qrf-length@v", "v3"])
def test_a_logged_component_must_name_a_version(reference):
    from adapt.cli.conformance import load_component

    with pytest.raises(ValueError, match="not a registered version"):
        load_component(reference)
