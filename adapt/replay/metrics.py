"""Per-request accounting during a replay, and the aggregate metrics of DESIGN.md section 7.

SLO accounting (DESIGN.md section 4):
- latency: output token i (from 0) is on time if it arrives by arrival + ttft + i * tbt; with only a
  TBT target, by first_token + i * tbt. Goodput counts the on-time output tokens; the request
  attains its SLO if every token was on time.
- deadline: prompt + output tokens count if the request finished by arrival + deadline.
- compound: all tokens of a program count if its last request finished by the program's first
  arrival + deadline.
- best_effort: a finished request counts all its tokens and attains its SLO.
A dropped request counts nothing and never attains its SLO; `dropped_by_reason` counts drops by
cause (the engine could not hold it: longer than max_model_len or the whole KV cache; the policy's
admission control; a parent dropped), so a drop is never only a number.

TBT samples are kept per class as (values, weight) chunks: a run of identical decode steps adds
one array of step times with the number of requests that decoded in it as the weight.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adapt.policy import RequestState
from adapt.requests import CompletedRequest
from adapt.steplog import STEP_FIELDS, StepBatch


def _on_time_limit(state: RequestState, index: int) -> float:
    slo = state.slo
    if slo.ttft_s is not None:
        if index == 0 or slo.tbt_s is not None:
            return state.arrival_s + slo.ttft_s + index * (slo.tbt_s or 0.0)
        return math.inf
    if index == 0 or state.first_token_s is None:
        return math.inf
    return state.first_token_s + index * slo.tbt_s  # type: ignore[operator]


@dataclass
class RequestRecord:
    request_id: str
    label: str | None
    slo_kind: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    ontime_tokens: int = 0
    preemptions: int = 0
    dropped: str | None = None
    program_id: str | None = None
    deadline_s: float | None = None


@dataclass
class ReplayResult:
    """Everything a replay produced: per-request records, TBT samples, the step log."""

    records: list[RequestRecord]
    tbt: dict[str | None, list[tuple[np.ndarray, float]]]
    steps: int
    sim_wall_s: float
    kv_timeline: tuple[np.ndarray, np.ndarray]
    preemptions: int
    # What the engine ran under (token budget, max running): a comparison is fair only when these
    # match across policies, or differ where a policy declares its own (sarathi's 512).
    engine_settings: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        """DESIGN.md section 7 METRICS, plus `by_class` when requests carry labels."""
        result = _aggregate(self.records, self._tbt_for(None), self.makespan_s())
        result["preemptions"] = self.preemptions
        result["sim_wall_s"] = self.sim_wall_s
        result["steps"] = self.steps
        result.update(self.engine_settings)
        labels = sorted({r.label for r in self.records if r.label is not None})
        if labels:
            result["by_class"] = {
                label: _aggregate(
                    [r for r in self.records if r.label == label], self._tbt_for(label), self.makespan_s()
                )
                for label in labels
            }
        return result

    @classmethod
    def merge(cls, results: Sequence[ReplayResult], sim_wall_s: float) -> ReplayResult:
        """One result for several replicas (the KV timeline is replica 0's)."""
        tbt: dict[str | None, list[tuple[np.ndarray, float]]] = defaultdict(list)
        for result in results:
            for label, chunks in result.tbt.items():
                tbt[label].extend(chunks)
        return cls(
            records=[r for result in results for r in result.records],
            tbt=dict(tbt),
            steps=sum(r.steps for r in results),
            sim_wall_s=sim_wall_s,
            kv_timeline=results[0].kv_timeline,
            preemptions=sum(r.preemptions for r in results),
            engine_settings=results[0].engine_settings,
        )

    def write_request_log(self, path: str | Path) -> Path:
        """The run as a request log (JSONL of `CompletedRequest`), the format the pipelines read."""
        path = Path(path)
        with open(path, "w") as handle:
            for r in self.records:
                record = CompletedRequest(
                    request_id=r.request_id,
                    arrival_s=r.arrival_s,
                    prompt_tokens=r.prompt_tokens,
                    output_tokens=r.output_tokens if r.dropped is None else 0,
                    first_token_s=r.first_token_s,
                    finish_s=r.finish_s,
                    outcome="dropped" if r.dropped is not None else "finished",
                    label=r.label,
                    preemptions=r.preemptions,
                )
                handle.write(json.dumps(record.to_dict()) + "\n")
        return path

    def makespan_s(self) -> float:
        if not self.records:
            return 0.0
        start = min(r.arrival_s for r in self.records)
        ends = [r.finish_s for r in self.records if r.finish_s is not None]
        return (max(ends) - start) if ends else 0.0

    def _tbt_for(self, label: str | None) -> list[tuple[np.ndarray, float]]:
        if label is None:
            return [chunk for chunks in self.tbt.values() for chunk in chunks]
        return self.tbt.get(label, [])


def weighted_percentile(chunks: Sequence[tuple[np.ndarray, float]], q: float) -> float | None:
    """Percentile q (0-100) over values with weights, by the inverted CDF (no interpolation)."""
    if not chunks:
        return None
    values = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v, _ in chunks])
    weights = np.concatenate([np.full(np.size(v), w, dtype=np.float64) for v, w in chunks])
    if len(values) == 0:
        return None
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    index = int(np.searchsorted(cumulative, q / 100.0 * cumulative[-1], side="left"))
    return float(values[order][min(index, len(values) - 1)])


def _stat(values: list[float], q: float | None = None) -> float | None:
    if not values:
        return None
    return float(np.mean(values)) if q is None else float(np.percentile(values, q))


def _attained(record: RequestRecord, program_ok: dict[str, bool]) -> bool:
    if record.dropped is not None or record.finish_s is None:
        return False
    if record.slo_kind == "latency":
        return record.ontime_tokens == record.output_tokens
    if record.slo_kind == "deadline":
        return record.finish_s <= record.arrival_s + (record.deadline_s or math.inf)
    if record.slo_kind == "compound":
        return program_ok.get(record.program_id or "", False)
    return True


def _good_tokens(record: RequestRecord, attained: bool) -> int:
    if record.slo_kind == "latency":
        return record.ontime_tokens if record.dropped is None else 0
    return record.prompt_tokens + record.output_tokens if attained else 0


def _program_outcomes(records: Sequence[RequestRecord]) -> dict[str, bool]:
    """A program attains its SLO when all its requests finished by first arrival + deadline."""
    start: dict[str, float] = {}
    deadline: dict[str, float] = {}
    ok: dict[str, bool] = defaultdict(lambda: True)
    last: dict[str, float] = {}
    for r in records:
        if r.slo_kind != "compound" or r.program_id is None:
            continue
        start[r.program_id] = min(start.get(r.program_id, math.inf), r.arrival_s)
        deadline[r.program_id] = r.deadline_s or math.inf
        if r.finish_s is None:
            ok[r.program_id] = False
        else:
            last[r.program_id] = max(last.get(r.program_id, -math.inf), r.finish_s)
    return {pid: ok[pid] and last.get(pid, math.inf) <= start[pid] + deadline[pid] for pid in start}


def _drop_causes(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Drops counted by cause. A dependant's reason names its parent (`parent p.s0 dropped`); those
    are counted together as `parent dropped`."""
    causes = Counter(
        "parent dropped" if r.dropped.startswith("parent ") else r.dropped
        for r in records
        if r.dropped is not None
    )
    return dict(sorted(causes.items()))


def _aggregate(
    records: Sequence[RequestRecord], tbt: list[tuple[np.ndarray, float]], makespan: float
) -> dict[str, Any]:
    done = [r for r in records if r.finish_s is not None]
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    ttlt = [r.finish_s - r.arrival_s for r in done]  # type: ignore[operator]
    program_ok = _program_outcomes(records)
    attained = [_attained(r, program_ok) for r in records]
    good_tokens = sum(_good_tokens(r, a) for r, a in zip(records, attained, strict=True))
    output = sum(r.output_tokens for r in done)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "dropped": sum(1 for r in records if r.dropped is not None),
        "dropped_by_reason": _drop_causes(records),
        "ttft_mean": _stat(ttft),
        "ttft_p50": _stat(ttft, 50),
        "ttft_p99": _stat(ttft, 99),
        "tbt_p50": weighted_percentile(tbt, 50),
        "tbt_p99": weighted_percentile(tbt, 99),
        "ttlt_mean": _stat(ttlt),
        "ttlt_p50": _stat(ttlt, 50),
        "ttlt_p99": _stat(ttlt, 99),
        "throughput_rps": len(done) / makespan if makespan > 0 else None,
        "throughput_tps": output / makespan if makespan > 0 else None,
        "slo_attainment": sum(attained) / len(records) if records else None,
        "goodput_tokens": good_tokens,
        "goodput_requests": sum(attained),
        "preemptions": sum(r.preemptions for r in records),
        "makespan_s": makespan,
    }


class Recorder:
    """Collects per-request records and samples as the engine reports events."""

    def __init__(self, record_steps: bool = False) -> None:
        self._records: dict[str, RequestRecord] = {}
        self._step_log: dict[str, list[np.ndarray]] | None = defaultdict(list) if record_steps else None
        self._tbt_single: dict[str | None, list[float]] = defaultdict(list)
        self._tbt_runs: dict[str | None, list[tuple[np.ndarray, float]]] = defaultdict(list)
        self._kv_t: list[float] = []
        self._kv_u: list[float] = []
        self._steps = 0
        self.preemptions = 0
        self.done_count = 0

    def arrived(self, state: RequestState, output_tokens: int) -> None:
        self._records[state.id] = RequestRecord(
            request_id=state.id,
            label=state.label,
            slo_kind=state.slo.kind,
            arrival_s=state.arrival_s,
            prompt_tokens=state.prompt_tokens,
            output_tokens=output_tokens,
            program_id=state.program.program_id if state.program else None,
            deadline_s=state.slo.deadline_s,
        )

    def dropped(self, state: RequestState, now: float, reason: str) -> None:
        self._records[state.id].dropped = reason
        self.done_count += 1

    def preempted(self, state: RequestState) -> None:
        self._records[state.id].preemptions += 1
        self.preemptions += 1

    def token(self, state: RequestState, now: float) -> None:
        """One token emitted by a normal step (before the engine bumps tokens_generated)."""
        record = self._records[state.id]
        index = state.tokens_generated
        if state.last_token_s is not None and index > 0:
            self._tbt_single[state.label].append(now - state.last_token_s)
        if state.slo.kind == "latency" and now <= _on_time_limit(state, index):
            record.ontime_tokens += 1

    def decode_run(
        self,
        running: Sequence[RequestState],
        times: np.ndarray,
        ends: np.ndarray,
        kv_usage: float,
        context_sum: int,
        context_max: int,
    ) -> None:
        """A run of k identical decode steps: every running request got one token per step.
        `context_sum`/`context_max` are the decodes' cached contexts at the run's first step."""
        counts: dict[str | None, int] = defaultdict(int)
        k = len(times)
        for state in running:
            counts[state.label] += 1
            if state.slo.kind == "latency":
                first = state.tokens_generated
                limits = np.array([_on_time_limit(state, first + j) for j in range(k)])
                self._records[state.id].ontime_tokens += int(np.count_nonzero(ends <= limits))
        for label, count in counts.items():
            self._tbt_runs[label].append((times, float(count)))
        self._steps += k
        self._kv_t.append(float(ends[-1]))
        self._kv_u.append(kv_usage)
        if self._step_log is not None:
            n, i = len(running), np.arange(k, dtype=np.float64)
            row = {
                "start_s": ends - times,
                "tokens": np.full(k, float(n)),
                "sampled": np.full(k, float(n)),
                "prefill_attn_units": np.zeros(k),
                "prefill_kv_read": np.zeros(k),
                "num_decodes": np.full(k, float(n)),
                "decode_ctx_sum": context_sum + n * i,
                "decode_ctx_max": context_max + i,
                "duration_s": times,
            }
            for name, values in row.items():
                self._step_log[name].append(values)

    def step(self, start: float, duration: float, batch: StepBatch, kv_usage: float) -> None:
        self._steps += 1
        self._kv_t.append(start + duration)
        self._kv_u.append(kv_usage)
        if self._step_log is not None:
            row = {"start_s": start, **{f: getattr(batch, f) for f in STEP_FIELDS}, "duration_s": duration}
            for name, value in row.items():
                self._step_log[name].append(np.atleast_1d(np.asarray(value, dtype=np.float64)))

    def step_log(self) -> dict[str, np.ndarray]:
        """Every step's features and duration, in the format `cost-model` trains on."""
        if self._step_log is None:
            raise RuntimeError("step log not recorded: EngineConfig(record_steps=True)")
        return {name: np.concatenate(chunks) for name, chunks in self._step_log.items()}

    def finished(self, state: RequestState) -> None:
        record = self._records[state.id]
        record.first_token_s = state.first_token_s
        record.finish_s = state.finish_s
        self.done_count += 1

    def result(self, sim_wall_s: float) -> ReplayResult:
        tbt: dict[str | None, list[tuple[np.ndarray, float]]] = defaultdict(list)
        for label, values in self._tbt_single.items():
            tbt[label].append((np.asarray(values), 1.0))
        for label, chunks in self._tbt_runs.items():
            tbt[label].extend(chunks)
        return ReplayResult(
            records=list(self._records.values()),
            tbt=dict(tbt),
            steps=self._steps,
            sim_wall_s=sim_wall_s,
            kv_timeline=(np.asarray(self._kv_t), np.asarray(self._kv_u)),
            preemptions=self.preemptions,
        )
