"""`adapt conformance`: did the replay decide as a running server did, step by step?

A server started with `adapt serve --log-dir DIR --log-decisions` writes every scheduling step's
decisions (`decisions-*.jsonl`) beside its limits (`engine.json`). This command replays each
engine run in that log under the policy the server served -- with the component versions the log
names -- with the live steps' times (`adapt.conformance.replay_decisions`), and prints the
share of identical steps and the first divergence with both engines' queues. It is the check of
`tests/integration/test_conformance.py`, on an operator's own traffic, engine and GPU: answers
that end on EOS, requests its clients abort (a disconnect, a stop string) or that end in an error,
async scheduling, the real model's step times, and what went live while it served -- component
versions and, with `--follow-policy-config`, whole policies -- each loaded from the registry and
handed over at the step the server did. The log names the policy it served; an engine restart
starts a new run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adapt.cli.usage import UsageError, write_json
from adapt.conformance import compare, read_decision_log, replay_decisions
from adapt.registry import load_reference, version_of
from adapt.replay.engine import ENGINE_FILE, EngineConfig


def load_component(reference: str) -> Any:
    """The registered version a log names (`NAME@vN`)."""
    name, _, version = reference.rpartition("@")
    if not name or version_of(version) is None:
        raise ValueError(f"decision log: {reference!r} is not a registered version (NAME@vN)")
    return load_reference(name, version)


def logged_policy(spec: str, components: dict[str, str]) -> Any:
    """The policy `spec` names (a `policy-config@vN` too), built with the component versions a log
    names (`attribute -> NAME@vN`) in place of any the spec gives."""
    from serving_hooks.policies import make_policy, parse_policy_spec

    name, params = parse_policy_spec(spec)
    return make_policy(name, **{**params, **components})


def run_conformance(log_dir: str, policy: str | None, json_path: str | None) -> int:
    """Replay every run of `log_dir`'s decision log under the policy it names (or `policy`, which
    overrides the one serving at each run's start); 0 if every step was identical."""
    from serving_hooks.policies import make_policy_from_spec

    engine_file = Path(log_dir) / ENGINE_FILE
    if not engine_file.is_file():
        raise UsageError(f"{log_dir}: no {ENGINE_FILE} (the server writes it at start with --log-dir)")
    config = EngineConfig.from_json(engine_file.read_text(), source=str(engine_file))
    try:
        runs = read_decision_log(log_dir)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    reports: list[dict[str, Any]] = []
    for number, run in enumerate(runs, 1):
        spec = policy or run.policy
        if spec is None:
            raise UsageError(f"{log_dir}: run {number}'s log does not name its policy; give --policy")
        swaps = {i: {a: load_component(ref) for a, ref in refs.items()} for i, refs in run.swaps.items()}
        switches = {i: make_policy_from_spec(name) for i, name in run.switches.items()}
        first = logged_policy(spec, run.components)
        agreement = compare(run.decisions, replay_decisions(run.decisions, first, config, swaps, switches))
        print(f"run {number} ({spec}, {run.components or 'no learned components'}): {agreement.describe()}")
        for i, name in run.switches.items():
            print(f"  policy {name} live at step {run.decisions[i]['index']}, and so in the replay")
        for i, refs in run.swaps.items():
            print(f"  {refs} live at step {run.decisions[i]['index']}, and so in the replay")
        aborted = sum(len(step.get("aborted", {})) for step in run.decisions)
        if aborted:
            why = "a client's abort, a stop string or an error"
            print(f"  {aborted} requests aborted live ({why}), and so in the replay")
        if run.stopped_by:
            print(f"  compared up to there: {run.stopped_by}")
        reports.append(
            {
                "policy": spec,
                "components": run.components,
                "steps": agreement.steps,
                "identical": agreement.identical,
                "agreement": agreement.agreement,
                "first_divergence": agreement.first_divergence,
                "switches": {run.decisions[i]["index"]: name for i, name in run.switches.items()},
                "swaps": {run.decisions[i]["index"]: refs for i, refs in run.swaps.items()},
                "aborted": aborted,
                "stopped_by": run.stopped_by,
            }
        )
    steps = sum(r["steps"] for r in reports)
    identical = sum(r["identical"] for r in reports)
    print(f"{identical:,} of {steps:,} steps identical over {len(reports)} run(s)")
    if json_path:
        report = {"policy": policy, "log_dir": str(log_dir), "steps": steps, "identical": identical}
        write_json(json_path, {**report, "runs": reports})
    return 0 if identical == steps else 1
