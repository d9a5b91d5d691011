"""Decision conformance: does the replay engine take the decisions the live engine took?

A live engine (vLLM under `serving_hooks.vllm_adapter.PolicyScheduler` with decision recording
on) logs, per scheduling step: when it started, which requests had arrived since the last step,
what it scheduled (request -> tokens), what it preempted, which requests left, and when the step's
output reached the scheduler. `replay_decisions` replays the same requests through `ReplayEngine`
with *trace-driven time*: each replay step starts when the live step did, with the live step's
number, lasts until the next live step, and sees arrivals at the same step boundaries. A policy
whose every input is the same in both engines must then decide the same; `compare` counts the
steps where it did and shows the first where it did not, with both engines' queues.

Conformance needs the live run to be one the replay can describe: no KV watermark. A request
that a sampled token ended -- `max_tokens`, a stop or EOS token, vLLM's repetition detection --
gets the output length the log keeps (`finished`); one that did not finish -- its client aborted
it (a disconnect, or a stop *string*, which vLLM's API server applies by aborting), or it ended
in an error -- is aborted where the log says it left (`aborted`: id -> moment,
`ReplayEngine.abort`), in order with a prefix cache reset logged in the same interval. Where a
policy that reads prompts went live with requests in flight, the live engine gave them their text
then; the log keeps it (`prompt_texts`) and the replay gives it at the same step. With prefix
caching on, each arrival carries its prompt blocks' keys and each request that left its answer
blocks' keys, and the replay's prefix cache finds the hits vLLM found: on shared system prompts,
on a conversation's earlier turns (answers included), on a preempted request's own blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adapt.policy import Policy
from adapt.predictions import Scripted
from adapt.replay.engine import EngineConfig, ReplayEngine, TraceStep
from adapt.requests import SLO, ProgramRef, Request
from adapt.traces import iter_log_records

COMPARED = ("scheduled", "preempted", "freed")
LOGGED = frozenset({"index", "t", "arrived", "delivered_t", *COMPARED})  # what a replay reads of a step
DECISION_LOG = "decisions"  # a server's decision log: `decisions-<n>.jsonl` (`adapt serve --log-decisions`)
log = logging.getLogger("adapt.conformance")


@dataclass(frozen=True)
class LoggedRun:
    """One engine lifetime's stretch of a decision log that a replay can follow. `policy` is the
    spec serving at its start (None where the log does not say); `switches` the specs of whole
    policies swapped in live and `swaps` the component versions (`attribute -> NAME@vN`) that went
    live, each by the position of the first step it served; `components` the versions serving at
    the start. It ends (`stopped_by`) at a swap to a policy the log cannot name, or at a
    streaming-input session, which the replay does not model."""

    decisions: list[dict[str, Any]]
    policy: str | None
    components: dict[str, str]
    switches: dict[int, str] = dataclasses.field(default_factory=dict)
    swaps: dict[int, dict[str, str]] = dataclasses.field(default_factory=dict)
    stopped_by: str | None = None


def read_decision_log(directory: str | Path) -> list[LoggedRun]:
    """The runs in a directory's decision log, in file order; a new run starts where the step
    index does not grow (the engine restarted). Torn lines and repeated records are left out
    (`_file_decisions`)."""
    paths = sorted(Path(directory).glob(f"{DECISION_LOG}-*.jsonl"))
    if not paths:
        raise FileNotFoundError(
            f"{directory}: no {DECISION_LOG}-*.jsonl (serve with `adapt serve --log-dir DIR --log-decisions`)"
        )
    runs: list[list[dict[str, Any]]] = []
    for path in paths:
        for record in _file_decisions(path):
            if not runs or record["index"] <= runs[-1][-1]["index"]:
                runs.append([])
            runs[-1].append(record)
    return [_followable(run) for run in runs]


def _file_decisions(path: Path) -> list[dict[str, Any]]:
    """One decision-log file's records. A torn line (a write cut short: `adapt.traces.TORN_LINE`)
    is skipped, and a record the same as one before it in the file dropped (a flush retried after a
    partial write wrote its first records twice): both counted in a warning, so that one full disk
    does not make the whole log unreadable or split a run where the index repeats."""
    records: list[dict[str, Any]] = []
    seen: dict[Any, dict[str, Any]] = {}  # index -> the record read with it
    torn = repeated = 0
    for number, record in iter_log_records(path):
        if record is None:
            torn += 1
            continue
        missing = LOGGED - record.keys()
        if missing:
            raise ValueError(f"{path}:{number}: not a decision record (no {', '.join(sorted(missing))})")
        if seen.get(record["index"]) == record:
            repeated += 1
            continue
        seen[record["index"]] = record
        records.append(record)
    if torn or repeated:
        log.warning("%s: %d torn line(s) skipped, %d repeated record(s) dropped", path, torn, repeated)
    return records


def _followable(run: list[dict[str, Any]]) -> LoggedRun:
    policy = run[0].get("policy")
    components = serving = run[0].get("components") or {}
    switches: dict[int, str] = {}
    swaps: dict[int, dict[str, str]] = {}
    if run[0].get("streaming_sessions"):  # the first request was one
        stopped_by = (
            f"a streaming-input session ({run[0]['streaming_sessions'][0]}) at step {run[0]['index']}"
        )
        return LoggedRun([], policy, components, switches, swaps, stopped_by + ": not modelled")
    for i, record in enumerate(run[1:], 1):
        if record.get("prefix_cache_reset") == "preempting" and "prefix_cache_reset_t" not in record:
            # an adapter before 2026-11-29 never told its policy of these preemptions
            stopped_by = f"the prefix cache was reset with requests running at step {record['index']}"
            return LoggedRun(run[:i], policy, components, switches, swaps, stopped_by)
        if record.get("streaming_sessions"):
            session = record["streaming_sessions"][0]
            stopped_by = f"a streaming-input session ({session}) at step {record['index']}: not modelled"
            return LoggedRun(run[:i], policy, components, switches, swaps, stopped_by)
        if "policy" in record:
            if record["policy"] is None:
                stopped_by = f"a policy the log does not name went live at step {record['index']}"
                return LoggedRun(run[:i], policy, components, switches, swaps, stopped_by)
            switches[i] = record["policy"]
        if "components" in record:
            swaps[i] = {a: ref for a, ref in record["components"].items() if serving.get(a) != ref}
            serving = record["components"]
    return LoggedRun(run, policy, components, switches, swaps)


def requests_from_log(decisions: Sequence[dict[str, Any]]) -> list[Request]:
    """The requests a live decision log saw arrive, each as long as the log says it finished (a
    stop token or repetition detection ends it early) or, if it never finished there (it ran
    past the log's end, or was aborted), its client's `max_tokens`."""
    lengths = {key: n for step in decisions for key, n in step.get("finished", {}).items()}
    answers = {key: keys for step in decisions for key, keys in step.get("answer_blocks", {}).items()}
    requests = []
    for step in decisions:
        for arrival in step["arrived"]:
            request_id, arrival_s, prompt_tokens, max_tokens = arrival[:4]
            extra = arrival[4] if len(arrival) > 4 else {}
            requests.append(
                Request(
                    request_id,
                    float(arrival_s),
                    int(prompt_tokens),
                    int(lengths.get(request_id, max_tokens)),
                    slo=SLO(**extra["slo"]) if extra.get("slo") else SLO(),
                    program=logged_program(extra.get("program")),
                    prompt_text=extra.get("prompt_text"),
                    max_tokens=int(max_tokens),
                    prompt_embedding=logged_embedding(extra.get("prompt_embedding")),
                    prompt_blocks=tuple(extra.get("prompt_blocks", ())),
                    answer_blocks=tuple(answers.get(request_id, ())),
                    skip_reading_prefix_cache=bool(extra.get("skip_reading_prefix_cache", False)),
                )
            )
    return requests


def logged_program(fields: dict[str, Any] | None) -> ProgramRef | None:
    """A compound request's place in its program, as its decision log lists it."""
    if fields is None:
        return None
    return ProgramRef(**{**fields, "parent_ids": tuple(fields.get("parent_ids", ()))})


def logged_embedding(values: list[float] | None) -> np.ndarray | None:
    """A vector the live request arrived with, as its decision log lists it (float32 values, so
    the list gives back the same vector bit for bit)."""
    return None if values is None else np.asarray(values, dtype=np.float32)


class _TraceTime:
    """The cost model of a trace-driven replay: every step's time comes from the live log."""

    arrival_overhead_s = 0.0  # the live steps' durations include every arrival's intake

    def time(self, batch: Any) -> float:
        raise RuntimeError("a trace-driven replay takes its step times from the live decision log")

    def kv_capacity_tokens(self) -> int:
        raise RuntimeError("a trace-driven replay takes its KV capacity from the live engine")


def replay_decisions(
    decisions: Sequence[dict[str, Any]],
    policy: Policy,
    config: EngineConfig,
    swaps: Mapping[int, Mapping[str, Any]] | None = None,
    switches: Mapping[int, Policy] | None = None,
) -> list[dict[str, Any]]:
    """Replay the requests of a live decision log under `policy` with the live engine's limits
    (`config`, which must give the KV capacity) in lockstep with the live steps; returns the
    replay's own decision log, one record per live step. `switches` (whole policies) and `swaps`
    (attribute -> component) went live at the step at that position: they are handed over as
    the live engine applied them (`ReplayEngine.switch_policy`, then `use_component`); a prefix
    cache reset before the step it was logged with."""
    if config.kv_capacity_tokens is None:
        raise ValueError("config.kv_capacity_tokens: give the live engine's KV capacity")
    config = dataclasses.replace(config, skip_decode_runs=False, record_decisions=True)
    # Each prediction is handed to the policy at the step the live engine handed it over: a key
    # handed over more than once (to a policy, then to the one swapped in) keeps every time.
    deliveries: dict[str, list[float]] = {}
    for live in decisions:
        for key in live.get("predicted", ()):
            deliveries.setdefault(key, []).append(live["t"])
    scripted = functools.partial(Scripted, deliveries=deliveries)
    engine = ReplayEngine(policy, _TraceTime(), config, predictions=scripted)  # type: ignore[arg-type]
    arrivals = iter(requests_from_log(decisions))
    pending = next(arrivals, None)
    for i, live in enumerate(decisions):
        arrived = {a[0] for a in live["arrived"]}
        texts = live.get("prompt_texts", {})
        while pending is not None and pending.request_id in arrived:
            engine.add(_with_text(pending, texts))
            pending = next(arrivals, None)
        _between_steps(engine, live)
        if switches and i in switches:
            engine.switch_policy(switches[i])
        for attribute, component in (swaps or {}).get(i, {}).items():
            engine.use_component(attribute, component)
        _give_texts(engine, texts)
        duration = decisions[i + 1]["t"] - live["t"] if i + 1 < len(decisions) else 0.0
        engine.step(TraceStep(live["t"], live["index"], duration, live["delivered_t"]))
    return engine.decisions  # type: ignore[return-value]


def _between_steps(engine: ReplayEngine, live: dict[str, Any]) -> None:
    """What the live engine did between the last step and this one, in its order: requests that
    did not finish (`aborted`: a client's abort or an error, each at its moment) and a prefix
    cache reset -- one that preempted running requests at its moment (`prefix_cache_reset_t`),
    an idle one after the aborts (it could not have reset while one held a block)."""
    reset = live.get("prefix_cache_reset")
    reset_t = live.get("prefix_cache_reset_t") if reset == "preempting" else None
    aborted = live.get("aborted", {}).items()
    for request_id, at in aborted:
        if reset_t is None or at < reset_t:
            engine.abort(request_id, at)
    if reset == "preempting":  # running requests preempted to free their blocks, then the reset
        engine.reset_prefix_cache(preempt_running=True, at=reset_t)
    elif reset:  # the live engine was idle; a replay that is not keeps its cache, as vLLM
        engine.reset_prefix_cache()  # would, and shows where it diverged
    for request_id, at in aborted:
        if reset_t is not None and at >= reset_t:
            engine.abort(request_id, at)


def _with_text(request: Request, texts: Mapping[str, str]) -> Request:
    """A request that came since the last step, with the text the live engine gave it at this
    step (`_give_texts`): from its arrival, the only point before the step the replay has."""
    text = texts.get(request.request_id)
    return request if text is None else dataclasses.replace(request, prompt_text=text)


def _give_texts(engine: ReplayEngine, texts: Mapping[str, str]) -> None:
    """The prompt texts the live engine gave its requests in flight when a policy that reads
    them went live (`PolicyScheduler._give_prompt_texts`), given to the replay's before the step
    that policy plans."""
    if texts:
        for state in [*engine.waiting.values(), *engine.running]:
            state.prompt_text = texts.get(state.id, state.prompt_text)


@dataclass(frozen=True)
class Conformance:
    """Step-by-step agreement of two decision logs."""

    steps: int
    identical: int
    first_divergence: dict[str, Any] | None

    @property
    def agreement(self) -> float:
        return self.identical / self.steps if self.steps else 1.0

    def describe(self) -> str:
        head = f"{self.identical}/{self.steps} steps identical ({self.agreement:.3f})"
        if self.first_divergence is None:
            return head
        d = self.first_divergence
        lines = [head, f"first divergence at step {d['index']} (t={d['t']:.6f}):"]
        for field in COMPARED:
            if d["live"][field] != d["replay"][field]:
                lines.append(f"  {field}: live {d['live'][field]} / replay {d['replay'][field]}")
        for engine in ("live", "replay"):
            state = d[engine]
            lines.append(
                f"  {engine}: running {state.get('running')} in the plan's order {state.get('order')};"
                f" waiting {state.get('waiting')}"
            )
        return "\n".join(lines)


def compare(live: Sequence[dict[str, Any]], replay: Sequence[dict[str, Any]]) -> Conformance:
    """Count the steps on which both logs scheduled, preempted and freed the same requests."""
    if len(live) != len(replay):
        raise ValueError(f"logs of different lengths: live {len(live)} steps, replay {len(replay)}")
    identical, first = 0, None
    for a, b in zip(live, replay, strict=True):
        if all(_normal(a[f]) == _normal(b[f]) for f in COMPARED):
            identical += 1
        elif first is None:
            first = {"index": a["index"], "t": a["t"], "live": a, "replay": b}
    return Conformance(len(live), identical, first)


def _normal(value: Any) -> Any:
    return {k: int(v) for k, v in value.items()} if isinstance(value, dict) else sorted(value)
