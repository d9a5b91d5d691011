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

Memory is bounded by what is in flight: a request's record lives as an object only while it is
in the engine, then moves into a columnar `RecordTable` (~80 bytes per request), and TBT samples go
into a mergeable per-class `QuantileSketch` (percentiles within 1e-4 relative). With
`keep_token_times` the raw samples are kept too -- (values, weight) chunks, a run of identical
decode steps adding one array of step times weighted by the number of requests that decoded in it
-- and TBT percentiles are then exact; so is the KV-usage timeline.
"""

from __future__ import annotations

import json
import math
import operator
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adapt.policy import RequestState
from adapt.replay.sketch import QuantileSketch
from adapt.requests import CompletedRequest
from adapt.steplog import STEP_FIELDS, StepBatch

_GAP_BATCH = 65_536  # TBT gaps buffered per class before they are bucketed in one numpy call
_CLOSE_BATCH = 1_024  # records of departed requests moved into the table at once


def _on_time_limits(state: RequestState, first: int, count: int, intake_delay_s: float) -> np.ndarray:
    """`RequestState.token_due_s` of tokens first .. first + count - 1, as one array (same arithmetic)."""
    slo = state.slo
    index = first + np.arange(count, dtype=np.float64)
    if slo.ttft_s is not None:
        if slo.tbt_s is not None:
            return state.arrival_s - intake_delay_s + slo.ttft_s + index * slo.tbt_s
        return np.where(index == 0, state.arrival_s - intake_delay_s + slo.ttft_s + 0.0, math.inf)
    if state.first_token_s is None:
        return np.full(count, math.inf)
    return np.where(index == 0, math.inf, state.first_token_s + index * slo.tbt_s)  # type: ignore[operator]


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


class RecordTable:
    """Requests that left the engine, as columns: a constant ~80 bytes per request instead of an
    object each, so a million-request replay holds its per-request results in tens of MB. Text
    columns (label, SLO kind, drop reason, program) are stored as codes into a small vocabulary."""

    _FLOATS = ("arrival_s", "first_token_s", "finish_s", "deadline_s")
    _INTS = ("prompt_tokens", "output_tokens", "ontime_tokens", "preemptions")
    _CODED = ("label", "slo_kind", "dropped", "program_id")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self._floats = {name: array("d") for name in self._FLOATS}
        self._ints = {name: array("q") for name in self._INTS}
        self._codes = {name: array("q") for name in self._CODED}
        self._vocab: dict[str, dict[Any, int]] = {name: {} for name in self._CODED}

    @classmethod
    def from_records(cls, records: Iterable[RequestRecord]) -> RecordTable:
        table = cls()
        table.extend(list(records))
        return table

    def extend(self, records: Sequence[RequestRecord]) -> None:
        """Append `records` as rows, column by column: one pass per column over the batch costs
        a fifth of reading each record's thirteen fields in turn (the recorder closes a
        request's record at every finish). Every column is converted before any grows, so a
        record that does not fit (a float count) leaves the table as it was."""
        floats = {
            name: array(
                "d",
                [math.nan if value is None else value for value in map(operator.attrgetter(name), records)],
            )
            for name in self._floats
        }
        ints = {name: array("q", map(operator.attrgetter(name), records)) for name in self._ints}
        vocabularies = {name: dict(vocab) for name, vocab in self._vocab.items()}
        codes = {
            name: array(
                "q",
                [
                    -1 if value is None else vocabularies[name].setdefault(value, len(vocabularies[name]))
                    for value in map(operator.attrgetter(name), records)
                ],
            )
            for name in self._codes
        }
        self.request_ids.extend([record.request_id for record in records])
        for name, values in floats.items():
            self._floats[name].extend(values)
        for name, values in ints.items():
            self._ints[name].extend(values)
        for name, values in codes.items():
            self._codes[name].extend(values)
        self._vocab = vocabularies

    def __len__(self) -> int:
        return len(self.request_ids)

    def column(self, name: str) -> np.ndarray:
        """A numeric column (NaN where the record has None), or a coded column's codes (-1: None)."""
        if name in self._floats:
            return np.frombuffer(self._floats[name], dtype=np.float64)
        source = self._ints[name] if name in self._ints else self._codes[name]
        return np.frombuffer(source, dtype=np.int64)

    def vocabulary(self, name: str) -> list[Any]:
        """The values of a coded column, indexed by code."""
        return list(self._vocab[name])

    def select(self, order: np.ndarray) -> RecordTable:
        """A new table of the rows at `order` (indices), in that order."""
        table = RecordTable()
        table.request_ids = [self.request_ids[i] for i in order.tolist()]
        for name in self._FLOATS:
            table._floats[name] = array("d", self.column(name)[order].tobytes())
        for name in self._INTS:
            table._ints[name] = array("q", self.column(name)[order].tobytes())
        for name in self._CODED:
            table._codes[name] = array("q", self.column(name)[order].tobytes())
            table._vocab[name] = dict(self._vocab[name])
        return table

    def records(self) -> list[RequestRecord]:
        """The rows as `RequestRecord`s (for a look at a few requests; costs an object per row)."""
        columns: dict[str, list[Any]] = {"request_id": self.request_ids}
        for name in self._FLOATS:
            columns[name] = [None if math.isnan(v) else v for v in self._floats[name]]
        for name in self._INTS:
            columns[name] = list(self._ints[name])
        for name in self._CODED:
            vocab = self.vocabulary(name)
            columns[name] = [None if c < 0 else vocab[c] for c in self._codes[name]]
        names = list(columns)
        return [
            RequestRecord(**dict(zip(names, row, strict=True))) for row in zip(*columns.values(), strict=True)
        ]

    @classmethod
    def concat(cls, tables: Sequence[RecordTable]) -> RecordTable:
        table = cls()
        for part in tables:
            table.request_ids.extend(part.request_ids)
            for name in cls._FLOATS:
                table._floats[name].extend(part._floats[name])
            for name in cls._INTS:
                table._ints[name].extend(part._ints[name])
            for name in cls._CODED:
                vocab = part.vocabulary(name)
                ours = table._vocab[name]
                remap = [ours.setdefault(value, len(ours)) for value in vocab]
                table._codes[name].extend(-1 if c < 0 else remap[c] for c in part._codes[name])
        return table


@dataclass
class ReplayResult:
    """Everything a replay produced: per-request records (columns), TBT sketches per class, and --
    only when asked for (`EngineConfig.keep_token_times`) -- the raw TBT samples and KV timeline."""

    table: RecordTable
    tbt: dict[str | None, QuantileSketch]
    steps: int
    sim_wall_s: float
    preemptions: int
    kv_timeline: tuple[np.ndarray, np.ndarray] | None = None
    tbt_samples: dict[str | None, list[tuple[np.ndarray, float]]] | None = None
    # What the engine ran under (token budget, max running): a comparison is fair only when these
    # match across policies, or differ where a policy declares its own (sarathi's 512).
    engine_settings: dict[str, Any] = field(default_factory=dict)
    # The policy's own parameters as the run ended (`Policy.describe()`): which component versions
    # and settings it ran, logged with the run so that two replays of one policy name can be told
    # apart in MLflow. Kept out of `metrics()`: they describe the run, they are not its outcome.
    policy_params: dict[str, Any] = field(default_factory=dict)

    @property
    def records(self) -> list[RequestRecord]:
        return self.table.records()

    def metrics(self) -> dict[str, Any]:
        """DESIGN.md section 7 METRICS, plus `by_class` when requests carry labels."""
        makespan = self.makespan_s()
        result = _aggregate(self.table, self._tbt_percentile(None), makespan)
        result["preemptions"] = self.preemptions
        result["sim_wall_s"] = self.sim_wall_s
        result["steps"] = self.steps
        result.update(self.engine_settings)
        labels = self.table.vocabulary("label")
        if labels:
            codes = self.table.column("label")
            result["by_class"] = {
                label: _aggregate(
                    self.table, self._tbt_percentile(label), makespan, codes == labels.index(label)
                )
                for label in sorted(labels)
            }
        return result

    @classmethod
    def merge(cls, results: Sequence[ReplayResult], sim_wall_s: float) -> ReplayResult:
        """One result for several replicas (the KV timeline, if kept, is replica 0's)."""
        tbt: dict[str | None, QuantileSketch] = {}
        samples: dict[str | None, list[tuple[np.ndarray, float]]] | None = (
            defaultdict(list) if all(r.tbt_samples is not None for r in results) else None
        )
        for result in results:
            for label, sketch in result.tbt.items():
                tbt.setdefault(label, QuantileSketch(sketch.relative_accuracy)).merge(sketch)
            if samples is not None:
                for label, chunks in (result.tbt_samples or {}).items():
                    samples[label].extend(chunks)
        return cls(
            table=RecordTable.concat([r.table for r in results]),
            tbt=tbt,
            steps=sum(r.steps for r in results),
            sim_wall_s=sim_wall_s,
            preemptions=sum(r.preemptions for r in results),
            kv_timeline=results[0].kv_timeline,
            tbt_samples=None if samples is None else dict(samples),
            engine_settings=results[0].engine_settings,
            policy_params=results[0].policy_params,
        )

    def write_request_log(self, path: str | Path) -> Path:
        """The run as a request log (JSONL of `CompletedRequest`), the format the pipelines read."""
        return write_request_log(self.records, path)

    def makespan_s(self) -> float:
        if not len(self.table):
            return 0.0
        finish = self.table.column("finish_s")
        if np.all(np.isnan(finish)):
            return 0.0
        return float(np.nanmax(finish) - self.table.column("arrival_s").min())

    def _tbt_percentile(self, label: str | None):
        """q -> TBT percentile of one class (None: all): exact from kept samples, else the sketch."""
        if self.tbt_samples is not None:
            chunks = (
                [c for cs in self.tbt_samples.values() for c in cs]
                if label is None
                else self.tbt_samples.get(label, [])
            )
            return lambda q: weighted_percentile(chunks, q)
        if label is not None:
            sketch = self.tbt.get(label)
            return lambda q: sketch.quantile(q) if sketch is not None else None
        merged = QuantileSketch()
        for sketch in self.tbt.values():
            merged.merge(sketch)
        return merged.quantile


def completed_request(r: RequestRecord, prompt_text: str | None = None) -> CompletedRequest:
    """A replayed request as the record a serving engine's request log holds for it (with its
    prompt's text, as `adapt serve --log-prompts` logs it, when given)."""
    return CompletedRequest(
        request_id=r.request_id,
        arrival_s=r.arrival_s,
        prompt_tokens=r.prompt_tokens,
        output_tokens=r.output_tokens if r.dropped is None else 0,
        first_token_s=r.first_token_s,
        finish_s=r.finish_s,
        outcome="dropped" if r.dropped is not None else "finished",
        label=r.label,
        preemptions=r.preemptions,
        prompt_text=prompt_text,
    )


def write_request_log(
    records: Iterable[RequestRecord], path: str | Path, prompt_texts: Mapping[str, str] | None = None
) -> Path:
    """`records` as a request log (JSONL of `CompletedRequest`), as `adapt serve --log-dir` writes;
    with `prompt_texts` (request id -> text; the replay's records keep no texts), as `--log-prompts`
    writes it."""
    path = Path(path)
    texts = prompt_texts or {}
    with open(path, "w") as handle:
        for r in records:
            handle.write(json.dumps(completed_request(r, texts.get(r.request_id)).to_dict()) + "\n")
    return path


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


def _stat(values: np.ndarray, q: float | None = None) -> float | None:
    if not len(values):
        return None
    return float(np.mean(values)) if q is None else float(np.percentile(values, q))


def _program_outcomes(table: RecordTable) -> np.ndarray:
    """Per program code: True when all its requests finished by first arrival + deadline."""
    programs = table.column("program_id")
    compound = (table.column("slo_kind") == _code(table, "slo_kind", "compound")) & (programs >= 0)
    count = len(table.vocabulary("program_id"))
    start = np.full(count, math.inf)
    last = np.full(count, -math.inf)
    unfinished = np.zeros(count, dtype=bool)
    deadline = np.full(count, math.inf)
    ids = programs[compound]
    finish = table.column("finish_s")[compound]
    np.minimum.at(start, ids, table.column("arrival_s")[compound])
    np.maximum.at(last, ids, np.nan_to_num(finish, nan=-math.inf))
    np.logical_or.at(unfinished, ids, np.isnan(finish))
    deadline[ids] = np.nan_to_num(table.column("deadline_s")[compound], nan=math.inf)
    return ~unfinished & (last <= start + deadline)


def _code(table: RecordTable, column: str, value: str) -> int:
    vocabulary = table.vocabulary(column)
    return vocabulary.index(value) if value in vocabulary else -2


def _attainment(table: RecordTable) -> np.ndarray:
    """Per request: did it attain its SLO (see the module doc)?"""
    kind = table.column("slo_kind")
    finish = table.column("finish_s")
    served = (table.column("dropped") < 0) & ~np.isnan(finish)
    latency = table.column("ontime_tokens") == table.column("output_tokens")
    deadline = finish <= table.column("arrival_s") + np.nan_to_num(table.column("deadline_s"), nan=math.inf)
    programs = table.column("program_id")
    program_ok = _program_outcomes(table)
    compound = np.zeros(len(table), dtype=bool)
    has_program = programs >= 0
    compound[has_program] = program_ok[programs[has_program]]
    attained = np.where(
        kind == _code(table, "slo_kind", "latency"),
        latency,
        np.where(
            kind == _code(table, "slo_kind", "deadline"),
            deadline,
            np.where(kind == _code(table, "slo_kind", "compound"), compound, True),
        ),
    )
    return served & attained


def goodput_tokens(table: RecordTable) -> np.ndarray:
    """Per request, the tokens it counts toward token goodput: a latency-SLO request's on-time
    tokens (if served), any other request's prompt and output tokens if it attained its SLO."""
    return _goodput(table, _attainment(table))


def _goodput(table: RecordTable, attained: np.ndarray) -> np.ndarray:
    is_latency = table.column("slo_kind") == _code(table, "slo_kind", "latency")
    served = table.column("dropped") < 0
    return np.where(
        is_latency,
        np.where(served, table.column("ontime_tokens"), 0),
        np.where(attained, table.column("prompt_tokens") + table.column("output_tokens"), 0),
    )


def _drop_causes(table: RecordTable, mask: np.ndarray) -> dict[str, int]:
    """Drops counted by cause. A dependant's reason names its parent (`parent p.s0 dropped`); those
    are counted together as `parent dropped`."""
    reasons = table.vocabulary("dropped")
    codes = table.column("dropped")[mask]
    causes = Counter(
        "parent dropped" if reasons[c].startswith("parent ") else reasons[c]
        for c in codes[codes >= 0].tolist()
    )
    return dict(sorted(causes.items()))


def _aggregate(
    table: RecordTable, tbt_percentile, makespan: float, mask: np.ndarray | None = None
) -> dict[str, Any]:
    """The metrics of the rows in `mask` (all rows if None); `tbt_percentile(q)` gives their TBT."""
    rows = np.ones(len(table), dtype=bool) if mask is None else mask
    finish = table.column("finish_s")
    done = rows & ~np.isnan(finish)
    arrival = table.column("arrival_s")
    first = table.column("first_token_s")
    ttft = (first - arrival)[done & ~np.isnan(first)]
    ttlt = (finish - arrival)[done]
    every_attained = _attainment(table)
    attained = every_attained & rows
    output = table.column("output_tokens")
    served = table.column("dropped") < 0
    good = _goodput(table, every_attained)
    num = int(rows.sum())
    completed = int(done.sum())
    return {
        "num_requests": num,
        "completed": completed,
        "dropped": int((rows & ~served).sum()),
        "dropped_by_reason": _drop_causes(table, rows),
        "ttft_mean": _stat(ttft),
        "ttft_p50": _stat(ttft, 50),
        "ttft_p99": _stat(ttft, 99),
        "tbt_p50": tbt_percentile(50),
        "tbt_p99": tbt_percentile(99),
        "ttlt_mean": _stat(ttlt),
        "ttlt_p50": _stat(ttlt, 50),
        "ttlt_p99": _stat(ttlt, 99),
        "throughput_rps": completed / makespan if makespan > 0 else None,
        "throughput_tps": int(output[done].sum()) / makespan if makespan > 0 else None,
        "slo_attainment": int(attained.sum()) / num if num else None,
        # Requests with an SLO (not best effort): a scope without any attains trivially, and a
        # guard must not read its attainment (the served share again) as an SLO kept.
        "slo_requests": int(
            (rows & (table.column("slo_kind") != _code(table, "slo_kind", "best_effort"))).sum()
        ),
        "goodput_tokens": int(good[rows].sum()),
        "goodput_requests": int(attained.sum()),
        "preemptions": int(table.column("preemptions")[rows].sum()),
        "makespan_s": makespan,
    }


class Recorder:
    """Collects per-request records and samples as the engine reports events. A record stays an
    object while its request is in the engine and moves into the table when it leaves."""

    def __init__(
        self, record_steps: bool = False, keep_token_times: bool = False, intake_delay_s: float = 0.0
    ) -> None:
        # Engines see a request this long after it arrived (`EngineConfig.intake_delay_s`): its
        # record and its SLO count from the arrival.
        self._intake_delay_s = intake_delay_s
        self._open: dict[str, RequestRecord] = {}
        self._order: dict[str, int] = {}
        self._arrivals = 0
        self._table = RecordTable()
        self._sequence = array("q")  # arrival order of the table's rows
        # Records of requests that left, not yet in the table: moved a batch at a time
        # (`RecordTable.extend`), and before anything reads the table.
        self._closed: list[RequestRecord] = []
        self._step_log: dict[str, list[np.ndarray]] | None = defaultdict(list) if record_steps else None
        self._tbt: dict[str | None, QuantileSketch] = defaultdict(QuantileSketch)
        self._samples: dict[str | None, list[tuple[np.ndarray, float]]] | None = (
            defaultdict(list) if keep_token_times else None
        )
        self._single: dict[str | None, array] = defaultdict(lambda: array("d"))
        # TBT gaps of single tokens, per class, not yet in the sketch: bucketed one batch at a time
        # (a sketch's counts are exact integer sums, so batching does not change the result).
        self._gaps: dict[str | None, array] = defaultdict(lambda: array("d"))
        # Decode runs' step times, per class and weight (requests that decoded in them), likewise.
        self._run_times: dict[tuple[str | None, float], array] = defaultdict(lambda: array("d"))
        self._kv: tuple[array, array] | None = (array("d"), array("d")) if keep_token_times else None
        self._steps = 0
        self.preemptions = 0
        self.done_count = 0

    def arrived(self, state: RequestState, output_tokens: int) -> None:
        self._open[state.id] = RequestRecord(
            request_id=state.id,
            label=state.label,
            slo_kind=state.slo.kind,
            arrival_s=state.arrival_s - self._intake_delay_s,
            prompt_tokens=state.prompt_tokens,
            output_tokens=output_tokens,
            program_id=state.program.program_id if state.program else None,
            deadline_s=state.slo.deadline_s,
        )
        self._order[state.id] = self._arrivals
        self._arrivals += 1

    def dropped(self, state: RequestState, now: float, reason: str) -> None:
        self._open[state.id].dropped = reason
        self._close(state.id)

    def preempted(self, state: RequestState) -> None:
        self._open[state.id].preemptions += 1
        self.preemptions += 1

    def tokens(self, states: Iterable[RequestState], now: float) -> None:
        """One token emitted at `now` by each of `states` in a normal step (before the engine bumps
        their tokens_generated)."""
        gaps = self._gaps
        for state in states:
            index = state.tokens_generated
            last = state.last_token_s
            if last is not None and index > 0:
                gaps[state.label].append(now - last)
            if state.slo.kind == "latency":
                self._count_on_time(state, index, now)
        for label, pending in gaps.items():
            if len(pending) >= _GAP_BATCH:
                self._flush_gaps(label)

    def _count_on_time(self, state: RequestState, index: int, at: float) -> None:
        """Token `index` of `state` (latency SLO) came at `at`: count it toward the metrics'
        on-time tokens if due by then from the request's arrival at the server, and toward the
        state's own count (`tokens_on_time`, which a policy reads) if due from the arrival the
        engine saw, as the live adapter judges it -- the same test unless an intake delay is set."""
        seen_on_time = at <= state.token_due_s(index)
        state.tokens_on_time += seen_on_time
        delay = self._intake_delay_s
        if (at <= state.token_due_s(index, delay)) if delay else seen_on_time:
            self._open[state.id].ontime_tokens += 1

    def _flush_run_times(self, label: str | None, weight: float) -> None:
        pending = self._run_times.pop((label, weight))
        self._tbt[label].add_many(np.frombuffer(pending, dtype=np.float64), weight)

    def _flush_gaps(self, label: str | None) -> None:
        pending = self._gaps[label]
        if not pending:
            return
        self._gaps[label] = array("d")
        self._tbt[label].add_many(np.frombuffer(pending, dtype=np.float64))
        if self._samples is not None:
            self._single[label].extend(pending)

    def run_tokens(
        self,
        counts: Mapping[str | None, int],
        latency: Iterable[RequestState],
        times: Sequence[float],
        ends: Sequence[float],
    ) -> None:
        """The tokens of k decode steps in a row, `times` long, ending at `ends`, in each of which
        the same requests got a token: `counts` of them per class (their gaps are counted in
        bulk, by weight), `latency` those with a latency SLO (their on-time tokens, read before
        the engine bumps their tokens_generated). The steps themselves are recorded apart
        (`decode_run`, or `step` for a step that also ran prefills)."""
        delay = self._intake_delay_s
        if len(times) == 1:  # one step (a bulk step): scalar arithmetic, as `tokens` does
            for state in latency:
                self._count_on_time(state, state.tokens_generated, ends[0])
        else:
            ends_array = np.asarray(ends)
            for state in latency:
                limits = _on_time_limits(state, state.tokens_generated, len(times), delay)
                on_time = int(np.count_nonzero(ends_array <= limits))
                self._open[state.id].ontime_tokens += on_time
                if delay:  # the state's count is from the arrival the engine saw
                    limits = _on_time_limits(state, state.tokens_generated, len(times), 0.0)
                    on_time = int(np.count_nonzero(ends_array <= limits))
                state.tokens_on_time += on_time
        for label, count in counts.items():
            if not count:
                continue
            pending = self._run_times[label, float(count)]
            pending.extend(times)
            if len(pending) >= _GAP_BATCH:
                self._flush_run_times(label, float(count))
            if self._samples is not None:
                self._samples[label].append((np.array(times, dtype=np.float64), float(count)))

    def decode_run(
        self,
        counts: Mapping[str | None, int],
        latency: Iterable[RequestState],
        times: Sequence[float],
        ends: Sequence[float],
        kv_usage: float,
        context_sum: int,
        context_max: int,
    ) -> None:
        """A run of k identical decode steps: every running request -- `counts` of them per class,
        `latency` those with a latency SLO -- got one token per step. `context_sum`/`context_max`
        are the decodes' cached contexts at the run's first step."""
        self.run_tokens(counts, latency, times, ends)
        k = len(times)
        self._steps += k
        self._note_kv(float(ends[-1]), kv_usage)
        if self._step_log is not None:
            times, ends = np.asarray(times, dtype=np.float64), np.asarray(ends, dtype=np.float64)
            n, i = sum(counts.values()), np.arange(k, dtype=np.float64)
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
        self._note_kv(start + duration, kv_usage)
        if self._step_log is not None:
            row = {"start_s": start, **{f: getattr(batch, f) for f in STEP_FIELDS}, "duration_s": duration}
            for name, value in row.items():
                self._step_log[name].append(np.atleast_1d(np.asarray(value, dtype=np.float64)))

    def _note_kv(self, at: float, usage: float) -> None:
        if self._kv is not None:
            self._kv[0].append(at)
            self._kv[1].append(usage)

    def step_log(self, since: int = 0) -> dict[str, np.ndarray]:
        """The features and duration of every step from the `since`-th on, in the format
        `cost-model` trains on. Only the chunks that hold those steps are joined, so a writer that
        checkpoints the log (the replay loop) pays for its new steps, not the whole run's."""
        if self._step_log is None:
            raise RuntimeError("step log not recorded: EngineConfig(record_steps=True)")
        chunks = self._step_log.get("duration_s", [])  # every column is chunked alike
        wanted, first, held = max(0, self._steps - since), len(chunks), 0
        while held < wanted:
            first -= 1
            held += len(chunks[first])
        return {
            name: np.concatenate(columns[first:])[held - wanted :] if wanted else np.empty(0)
            for name, columns in self._step_log.items()
        }

    def finished(self, state: RequestState) -> None:
        record = self._open[state.id]
        record.first_token_s = state.first_token_s
        record.finish_s = state.finish_s
        self._close(state.id)

    def _close(self, request_id: str) -> None:
        self._closed.append(self._open.pop(request_id))
        self._sequence.append(self._order.pop(request_id))
        self.done_count += 1
        if len(self._closed) >= _CLOSE_BATCH:
            self._flush_closed()

    def _flush_closed(self) -> None:
        closed, self._closed = self._closed, []
        self._table.extend(closed)

    def closed_since(self, start: int) -> list[RequestRecord]:
        """Records of the requests that left the engine (finished or dropped) after the first
        `start` of them, in the order they left -- what a serving engine's request log gained
        meanwhile. Read-only, so it may be called while the replay runs (unlike `result`)."""
        self._flush_closed()
        rows = np.arange(start, len(self._table), dtype=np.int64)
        return self._table.select(rows).records()

    def result(self, sim_wall_s: float) -> ReplayResult:
        """The run so far, rows in arrival order (requests still in the engine included as they are)."""
        for label in list(self._gaps):
            self._flush_gaps(label)
        for label, weight in list(self._run_times):
            self._flush_run_times(label, weight)
        for request_id in list(self._open):
            self._closed.append(self._open.pop(request_id))
            self._sequence.append(self._order.pop(request_id))
        self._flush_closed()
        order = np.argsort(np.frombuffer(self._sequence, dtype=np.int64), kind="stable")
        samples = None
        if self._samples is not None:
            samples = defaultdict(list)
            for label, values in self._single.items():
                samples[label].append((np.asarray(values), 1.0))
            for label, chunks in self._samples.items():
                samples[label].extend(chunks)
            samples = dict(samples)
        return ReplayResult(
            table=self._table.select(order),
            tbt=dict(self._tbt),
            steps=self._steps,
            sim_wall_s=sim_wall_s,
            preemptions=self.preemptions,
            kv_timeline=None
            if self._kv is None
            else tuple(np.frombuffer(a, dtype=np.float64) for a in self._kv),
            tbt_samples=samples,
        )
