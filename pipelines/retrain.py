"""`adapt retrain`: refit every component whose training data moved, gate, promote.

Made for cron, systemd timers and Kubernetes CronJobs:
- one run at a time per store, whatever data directory each reads: an exclusive, non-blocking
  lock on the store (`Registry.store_lock`: a lock file beside a sqlite database, a lock entry in a
  server-backed registry); a second concurrent run exits at once with EXIT_LOCKED;
- idempotent: a candidate whose training-data hash equals the latest registered version's is not
  registered again, so re-running on unchanged data changes nothing (but finishes that version's
  promotion if a failed pass left it undone: `pipelines.outcome.unchanged`);
- a failure in one component is reported and leaves its champion untouched; the others still run.

Data comes from a directory the serving side fills (the vLLM monitor's logs, or files you drop in;
subdirectories included, e.g. one per replica of a fleet on shared storage; a file whose content
was read already, a step or a request logged twice, counts once):
`steps*.csv|jsonl|parquet` step logs for `cost-model`, `requests*.jsonl` request logs for
`ewsjf-meta-policy` (its queue layout is refit on the logged prompt lengths, keeping Theta, and
gated on a replay of the logged requests, each replica's on its own engine),
`prompts*.jsonl[.gz]` prompt/response files for `semantic-history`, `qrf-length` and
`neural-length` -- and, for these three, the request logs themselves when the server logged prompt
texts (`adapt serve --log-dir DIR --log-prompts`): each finished request is a prompt with the
length it really had, in the served model's tokens, which is what the live policy counts -- and
`programs*.jsonl` compound-program graphs for `pattern-graph`.
Components tuned on replay (`slai-offset`, EWSJF's Theta) are retrained by `adapt tune`.

One pass reads each directory's logs once: the layout and the three prompt components share the
parsed request logs (`_once_per_pass`), and nothing read is kept after the pass.

In-process (`retrain_loop`): a pass at every fire time of a cron expression or every N seconds,
and with `--watch` one early when a server's drift alarm goes off (`pipelines.watch`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from adapt.registry import Registry, StoreLocked
from adapt.replay.engine import ENGINE_FILE, EngineConfig
from adapt.requests import Request
from adapt.steplog import CostModel, load_step_log
from adapt.traces import NoUsableRows, Trace, load_trace
from pipelines.cost_model import train_cost_model
from pipelines.ewsjf import ServedShare, train_ewsjf_meta
from pipelines.jitserve import train_pattern_graph
from pipelines.outcome import TrainOutcome, usable_champion

if TYPE_CHECKING:
    import pandas as pd

EXIT_OK, EXIT_FAILED, EXIT_LOCKED = 0, 1, 75  # 75 = EX_TEMPFAIL: try again later
REPLAY_MOST = 2000  # logged requests a layout's gate replays (the most recent), to keep it to seconds
log = logging.getLogger("adapt.retrain")


RetrainLocked = StoreLocked  # another retrain run holds the store's lock


@dataclass
class RetrainResult:
    component: str
    status: str  # registered | unchanged | no data | failed
    version: int | None = None
    promoted: bool = False
    detail: str = ""


Retrainer = Callable[[Registry, Path, float], RetrainResult]
"""Refits one component from a log directory (with its `margin`) and says what happened."""


_PASS_READS: ContextVar[dict[tuple[str, Path], Any] | None] = ContextVar("retrain_pass_reads", default=None)


@contextlib.contextmanager
def _one_read_per_pass() -> Iterator[None]:
    """Within a `retrain_once` pass, what `_once_per_pass` reads is read once and shared by every
    retrainer (a 64 MB request log was parsed four times a pass); dropped when the pass ends, so
    the next pass sees what the server wrote since."""
    token = _PASS_READS.set({})
    try:
        yield
    finally:
        _PASS_READS.reset(token)


def _once_per_pass(what: str, data_dir: Path, read: Callable[[Path], Any]) -> Any:
    """`read(data_dir)`, or what it returned earlier in this pass (read afresh outside one)."""
    reads = _PASS_READS.get()
    if reads is None:
        return read(data_dir)
    key = (what, data_dir.resolve())
    if key not in reads:
        reads[key] = read(data_dir)
    return reads[key]


def request_logs(data_dir: Path) -> list[Trace]:
    """Every `requests*.jsonl` log under `data_dir`, each logged request once (`_unique_requests`)."""

    def read(directory: Path) -> list[Trace]:
        logs = []
        for path in _files(directory, ("requests*.jsonl",)):
            try:
                logs.append(load_trace(path, "requestlog"))
            except NoUsableRows as exc:  # every request in it dropped, or none flushed: it adds none
                log.warning("skipped: %s", exc)
        return _unique_requests(logs)

    return _once_per_pass("request logs", data_dir, read)


def _files(data_dir: Path, patterns: tuple[str, ...]) -> list[Path]:
    """The files matching `patterns` in `data_dir` and below (a fleet's replicas each write to a
    subdirectory of one shared directory), each content once: a log copied twice -- a re-sync,
    a backup beside it -- is read once."""
    found = sorted({p for pattern in patterns for p in data_dir.rglob(pattern) if p.is_file()})
    by_content: dict[str, Path] = {}
    for path in found:
        with open(path, "rb") as handle:
            by_content.setdefault(hashlib.file_digest(handle, "sha256").hexdigest(), path)
    return sorted(by_content.values())


def _result(name: str, outcome: TrainOutcome, detail: str) -> RetrainResult:
    if outcome.version is None:
        return RetrainResult(name, "unchanged", detail="training data unchanged since the last version")
    detail = f"{detail}; {outcome.note}" if outcome.note else detail
    return RetrainResult(name, "registered", outcome.version, outcome.promoted, detail)


def retrain_cost_model(registry: Registry, data_dir: Path, margin: float) -> RetrainResult:
    files = _files(data_dir, ("steps*.csv", "steps*.jsonl", "steps*.parquet"))
    if not files:
        return RetrainResult("cost-model", "no data", detail=f"no steps*.csv|jsonl|parquet in {data_dir}")
    import pandas as pd

    frames = [frame for frame in map(_step_log, files) if frame is not None]
    if not frames:
        return RetrainResult("cost-model", "no data", detail=f"no steps in the step logs in {data_dir}")
    # A step logged twice (a file appended to and copied again) is one step.
    frame = pd.concat(frames, ignore_index=True).drop_duplicates(ignore_index=True)
    # A log from before a feature column existed lacks it: 0 there, as the cost model reads a
    # missing column (each file's values were checked finite as it was read).
    frame = frame.fillna({column: 0.0 for column in frame.columns if column != "start_s"})
    if "start_s" in frame.columns:  # each file is sorted; together they need sorting again
        frame = frame.sort_values("start_s", kind="stable").reset_index(drop=True)
    outcome = train_cost_model(registry, frame, promote_if_better=True, margin=margin, skip_unchanged=True)
    return _result("cost-model", outcome, f"held-out MAPE {outcome.metrics.get('mape', float('nan')):.4f}")


def _step_log(path: Path) -> pd.DataFrame | None:
    """A step log, or None (with a warning) for one without steps: a server's log before its first
    flush (stopped, or its disk full) is empty or torn, and failing on it failed every pass."""
    try:
        return load_step_log(path)
    except NoUsableRows as exc:
        log.warning("skipped: %s", exc)
        return None


# The fewest logged requests a layout is refitted from: a fresh log directory's first handful (8
# requests of one burst once replaced a 31-queue champion with 3 queues, gated on those same 8).
MIN_LAYOUT_REQUESTS = 200


def retrain_ewsjf_layout(registry: Registry, data_dir: Path, margin: float) -> RetrainResult:
    logs = request_logs(data_dir)
    if not logs:
        return RetrainResult("ewsjf-meta-policy", "no data", detail=f"no requests*.jsonl in {data_dir}")
    logged = sum(len(log) for log in logs)
    if logged < MIN_LAYOUT_REQUESTS:
        return RetrainResult(
            "ewsjf-meta-policy",
            "no data",
            detail=f"{logged} finished requests logged in {data_dir}; a layout needs {MIN_LAYOUT_REQUESTS}",
        )
    lengths = np.concatenate([log.prompt_tokens for log in logs]).astype(np.float64)
    shares, on = served_shares(registry, data_dir, logs)
    outcome = train_ewsjf_meta(
        registry,
        lengths=lengths,
        promote_if_better=True,
        margin=margin,
        skip_unchanged=True,
        replay=shares,
    )
    queues = outcome.metrics.get("queues", float("nan"))
    ttft = outcome.metrics.get("replay_ttft_mean", float("nan"))
    return _result("ewsjf-meta-policy", outcome, f"{queues:.0f} queues, replayed mean TTFT {ttft:.3f} s {on}")


def served_engine(registry: Registry, data_dir: Path) -> tuple[tuple[CostModel, EngineConfig] | None, str]:
    """The engine that served the logs, for a gate that replays them: its limits as the server
    wrote them (`ENGINE_FILE`; the newest when a fleet's replicas each wrote one) timed by the
    `cost-model` champion, which `retrain_cost_model` refits from the same server's step log just
    before. Judged on a default engine instead, a load that queues on the server may not queue at
    all, and then every layout looks alike. None (and the gate's default) without the file or a
    usable cost model (one that cannot be loaded must not block the layout's retrain); the string
    says which was used."""
    files = sorted(data_dir.rglob(ENGINE_FILE), key=lambda p: p.stat().st_mtime)
    if not files:
        return None, f"(no {ENGINE_FILE}: on the default engine)"
    cost, unusable = usable_champion(registry, "cost-model")
    if cost is None:
        return None, f"({unusable or 'no cost-model champion'}: on the default engine)"
    config = EngineConfig.from_json(files[-1].read_text(), source=str(files[-1]))
    return (cost, config), f"on the server's engine (cost-model v{cost.metadata.get('registry_version')})"


def served_shares(
    registry: Registry, data_dir: Path, logs: list[Trace], most: int = REPLAY_MOST
) -> tuple[list[ServedShare], str]:
    """The logged traffic as a gate replays it: one share per replica -- the request logs of one
    directory, as `adapt serve --log-dir DIR` writes them -- each on its own timeline and its own
    engine (the `ENGINE_FILE` beside its logs, else `served_engine`'s), the newest `most` requests
    split evenly between replicas (`_even_split`). Each replica of a fleet saw only its router's
    share of the load, and its arrivals are on its own clock (`time.monotonic()`, unrelated
    between machines): replayed as one stream on one engine, a gate would judge the whole fleet's
    load on one replica, with arrivals from unrelated clocks interleaved. The string says which
    engine was used."""
    fallback, said = served_engine(registry, data_dir)
    by_directory: dict[Path, list[Trace]] = {}
    for log in logs:
        if len(log):  # a copy whose every request another log already holds adds nothing
            by_directory.setdefault(Path(log.report.path).parent, []).append(log)  # type: ignore[union-attr]
    replicas = sorted(by_directory.items())
    quotas = _even_split(most, [sum(len(log) for log in replica_logs) for _, replica_logs in replicas])
    shares = []
    for replica, ((directory, replica_logs), quota) in enumerate(zip(replicas, quotas, strict=True)):
        engine, own = fallback, directory / ENGINE_FILE
        if fallback is not None and own.is_file():
            engine = (fallback[0], EngineConfig.from_json(own.read_text(), source=str(own)))
        prefix = f"r{replica}-log" if len(replicas) > 1 else "log"
        block_size = engine[1].block_size if engine else None
        shares.append(ServedShare(logged_requests(replica_logs, quota, block_size, prefix), engine))
    if len(shares) > 1:
        said += f", {len(shares)} replicas each on its own"
    return shares, said


def _even_split(most: int, available: list[int]) -> list[int]:
    """How many of its newest requests each replica gives, `most` in all: an even share each, and
    what a replica that logged fewer leaves over goes to the others, evenly again."""
    quotas = [0] * len(available)
    left = most
    for rank, replica in enumerate(sorted(range(len(available)), key=available.__getitem__)):
        quotas[replica] = min(available[replica], left // (len(available) - rank))
        left -= quotas[replica]
    return quotas


def _unique_requests(logs: list[Trace]) -> list[Trace]:
    """Each logged request once, however many logs hold it. Ids are unique per engine only, so a
    request is known by its id, arrival (as logged) and output length together."""
    seen: set[tuple] = set()
    unique = []
    for log in logs:
        arrivals = log.columns["logged_arrival_s"]
        keys = zip(log.columns["request_id"], arrivals, log.output_tokens.tolist(), strict=True)
        fresh = []
        for row, key in enumerate(keys):
            if key not in seen:
                seen.add(key)
                fresh.append(row)
        unique.append(log.take(fresh))
    return unique


def logged_requests(
    logs: list[Trace], most: int = REPLAY_MOST, block_size: int | None = None, prefix: str = "log"
) -> list[Request]:
    """The most recent `most` finished requests of one server's request logs, as requests to
    replay (ids `prefix` + a number): their logged arrivals (shifted to start at 0) and true
    lengths -- the traffic a gate should judge a scheduling component on. Arrivals are taken as
    logged, on the server's clock: each log's own (which start at 0) would lay the logs of
    consecutive windows on top of each other, and the gate would judge at their summed rate. (A
    fleet's replicas are on different clocks: `served_shares` takes each one's logs apart.) With
    the served engine's `block_size`, each request keeps the content keys its record carries
    where they fit that block size exactly (a server restarted with another block size wrote
    others), so a replay with prefix caching finds the server's hits."""
    arrivals = _arrivals(logs)
    prompts = np.concatenate([log.prompt_tokens for log in logs])
    outputs = np.concatenate([log.output_tokens for log in logs])
    keep = np.argsort(arrivals, kind="stable")[-most:]
    start = float(arrivals[keep[0]]) if len(keep) else 0.0
    prompt_keys, answer_keys = _column(logs, "prompt_blocks", ()), _column(logs, "answer_blocks", ())
    skips = _column(logs, "skip_reading_prefix_cache", False)
    requests = []
    for i, row in enumerate(keep.tolist()):
        prompt, output = int(prompts[row]), int(outputs[row])
        if output > 0:
            content = _content(prompt, output, prompt_keys[row], answer_keys[row], skips[row], block_size)
            requests.append(Request(f"{prefix}{i}", float(arrivals[row]) - start, prompt, output, **content))
    return requests


def _arrivals(logs: list[Trace]) -> np.ndarray:
    """One server's logged arrivals, end to end: on the wall clock where every record has it (a
    server's monotonic clock restarts when its host reboots, so arrivals logged before and after
    a reboot would interleave, and the newest requests would look like the oldest), else all on
    its monotonic clock, as servers before the wall clock logged only that (never a mix: the
    two clocks' zeros are decades apart)."""
    wall = _column(logs, "logged_wall_arrival_s", None)
    arrivals = wall if all(value is not None for value in wall) else _column(logs, "logged_arrival_s", None)
    return np.asarray(arrivals, dtype=np.float64)


def _column(logs: list[Trace], name: str, default: Any) -> list[Any]:
    """One column of the logs, end to end; `default` in each row of a log without it."""
    return [value for log in logs for value in log.columns.get(name, [default] * len(log))]


def _content(
    prompt: int, output: int, prompt_keys: tuple, answer_keys: tuple, skip: bool, block_size: int | None
) -> dict[str, Any]:
    """A logged request's prefix-cache content (`Request.prompt_blocks`, `answer_blocks`,
    `skip_reading_prefix_cache`) where its keys fit `block_size`: a key per full prompt block and
    per full block its answer filled; none without a block size."""
    if block_size is None:
        return {}
    fits = len(prompt_keys) == prompt // block_size
    fits = fits and len(prompt_keys) + len(answer_keys) == (prompt + output) // block_size
    keys = (
        {"prompt_blocks": prompt_keys, "answer_blocks": answer_keys}
        if fits and prompt_keys + answer_keys
        else {}
    )
    return {**keys, **({"skip_reading_prefix_cache": True} if skip else {})}


@dataclass
class PromptData:
    """What a prompt component is refitted on, and where it came from (for the result's detail)."""

    trace: Trace | None
    prompt_files: int
    request_logs: int  # request logs with prompt texts, each logged request counted once
    logs_without_text: int  # request logs of a server run without --log-prompts (not usable)

    def describe(self) -> str:
        parts = [f"{self.prompt_files} prompt file(s)", f"{self.request_logs} request log(s) with prompts"]
        if self.logs_without_text:
            parts.append(f"{self.logs_without_text} without prompts skipped (serve with --log-prompts)")
        return ", ".join(parts)


def _answered_prompts(log: Trace) -> Trace:
    """The finished requests of a request log whose prompt text was logged, as prompt/answer pairs.
    A server run with `--log-prompts` logs every prompt; a log can also hold requests without one
    (a replay's compound calls, which have no text), and those are no pairs to learn from."""
    texts = log.columns["logged_prompt_text"]
    rows = [row for row, text in enumerate(texts) if text is not None]
    return replace(log.take(rows), prompt_text=[texts[row] for row in rows])


def prompt_responses(data_dir: Path) -> PromptData:
    """Every `prompts*.jsonl[.gz]` (alpaca format: instruction, output) and every request log's
    finished requests that carry their prompt text, as one trace (None when there are none).

    Aborted and dropped requests are not read (their lengths are not the answers' lengths). Only
    columns every source has are kept. Read once per `retrain_once` pass, for all three prompt
    components."""
    return _once_per_pass("prompt responses", data_dir, _read_prompt_responses)


def _read_prompt_responses(data_dir: Path) -> PromptData:
    prompt_files = _files(data_dir, ("prompts*.jsonl", "prompts*.jsonl.gz"))
    logs = request_logs(data_dir)
    answered = [_answered_prompts(log) for log in logs]
    with_text = [pairs for pairs in answered if len(pairs)]
    without_text = sum(1 for log, pairs in zip(logs, answered, strict=True) if len(log) and not len(pairs))
    prompt_traces = [load_trace(f) for f in prompt_files]
    for path, trace in zip(prompt_files, prompt_traces, strict=True):
        if trace.prompt_text is None:
            raise ValueError(f"{path}: a prompts file needs prompt texts (alpaca: instruction, output)")
    traces = prompt_traces + with_text
    if not traces:
        return PromptData(None, 0, 0, without_text)
    shared = set.intersection(*(set(t.columns) for t in traces))
    trace = Trace(
        f"{len(prompt_files)} prompt file(s) and {len(with_text)} request log(s) in {data_dir}",
        np.concatenate([t.prompt_tokens for t in traces]),
        np.concatenate([t.output_tokens for t in traces]),
        prompt_text=[text for t in traces for text in t.prompt_text],  # type: ignore[union-attr]
        columns={key: [v for t in traces for v in t.columns[key]] for key in sorted(shared)},
    )
    return PromptData(trace, len(prompt_files), len(with_text), without_text)


def prompt_retrainer(name: str, train: Callable[..., TrainOutcome], metric: str) -> Retrainer:
    """Refit a component trained on prompts and their answers' lengths: from `prompts*.jsonl[.gz]`
    and from request logs written with prompt texts (see `prompt_responses`)."""

    def retrain(registry: Registry, data_dir: Path, margin: float) -> RetrainResult:
        data = prompt_responses(data_dir)
        if data.trace is None:
            detail = f"no prompts*.jsonl[.gz] and no request log with prompt texts in {data_dir}"
            if data.logs_without_text:
                detail += f" ({data.logs_without_text} request log(s) without them: serve with --log-prompts)"
            return RetrainResult(name, "no data", detail=detail)
        outcome = train(
            registry, data.trace, promote_if_better=True, margin=margin, skip_unchanged=True, replay=True
        )
        score = outcome.metrics.get(metric, float("nan"))
        return _result(name, outcome, f"held-out {metric} {score:.4g}; from {data.describe()}")

    return retrain


def retrain_pattern_graph(registry: Registry, data_dir: Path, margin: float) -> RetrainResult:
    files = _files(data_dir, ("programs*.jsonl",))
    if not files:
        return RetrainResult("pattern-graph", "no data", detail=f"no programs*.jsonl in {data_dir}")
    with tempfile.TemporaryDirectory(prefix="adapt-programs-") as scratch:  # the data may be read-only
        merged = Path(scratch) / "programs-merged.jsonl"
        # A file whose last line has no newline must not run into the next file's first line.
        merged.write_text(
            "".join(text if text.endswith("\n") else text + "\n" for text in map(Path.read_text, files))
        )
        outcome = train_pattern_graph(
            registry, merged, promote_if_better=True, margin=margin, skip_unchanged=True, replay=True
        )
    return _result(
        "pattern-graph",
        outcome,
        f"held-out share error {outcome.metrics.get('share_error', float('nan')):.4f}",
    )


def retrain_once(
    registry: Registry,
    data_dir: str | Path,
    retrainers: dict[str, Retrainer],
    *,
    margin: float = 0.0,
) -> list[RetrainResult]:
    """One pass over `retrainers` (the catalogue's: `pipelines.catalogue.retrainers()`), under the
    store's exclusive retrain lock (RetrainLocked when another run holds it)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir}: no such data directory")
    with registry.store_lock("retrain"), _one_read_per_pass():
        results = []
        for name, retrain in retrainers.items():
            print(f"retrain: {name} ...", file=sys.stderr)
            try:
                results.append(retrain(registry, data_dir, margin))
            except Exception as exc:  # one component's failure must not stop the others
                results.append(RetrainResult(name, "failed", detail=f"{type(exc).__name__}: {exc}"))
        return results


class Watch(Protocol):
    """What `retrain_loop` asks between passes (`pipelines.watch.QualityWatch`)."""

    def poll(self, now: float) -> bool:
        """Look at the servers (and act on what needs no retrain); True: run a pass now."""
        ...

    def retrained(self, now: float) -> None:
        """A pass ended at `now`."""
        ...


def cron_times(cron: str) -> Iterator[float]:
    """The fire times of a 5-field cron expression in the host's local time, from now on. The start
    is an aware datetime: croniter reads a naive one as UTC, which on a host west of UTC put every
    fire time hours in the past (`*/5` ran some 60 passes back to back at start-up)."""
    from datetime import datetime

    from croniter import croniter

    if not croniter.is_valid(cron):
        raise ValueError(f"--schedule: invalid cron expression {cron!r}")
    schedule = croniter(cron, datetime.now().astimezone())
    return iter(lambda: schedule.get_next(float), None)


def every(seconds: float, clock: Callable[[], float] = time.time) -> Iterator[float]:
    """Fire times `seconds` apart, each counted from the end of the pass before (cron has no step
    below a minute, and a pass longer than the interval must not queue up passes behind it)."""
    if not seconds > 0:
        raise ValueError(f"--every: must be > 0 seconds, got {seconds}")
    return iter(lambda: clock() + seconds, None)


def retrain_loop(
    registry: Registry,
    data_dir: str | Path,
    retrainers: dict[str, Retrainer],
    fire_times: Iterable[float],
    *,
    margin: float = 0.0,
    watch: Watch | None = None,
    watch_interval_s: float = 10.0,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """A `retrain_once` pass at every fire time, in this process, until `fire_times` ends. With a
    `watch`, poll it every `watch_interval_s` while waiting and run a pass at once when it asks
    (a drift alarm: `pipelines.watch`). A pass or a poll that fails is reported and the loop goes
    on: a daemon must outlive a data directory not written yet or a store that does not answer."""
    for fire in fire_times:
        while (now := clock()) < fire:
            if watch is None:
                sleep(fire - now)
                continue
            sleep(min(watch_interval_s, fire - now))
            if (now := clock()) < fire and _poll(watch, now):  # at the fire time, the pass is due anyway
                retrain_pass(registry, data_dir, retrainers, margin=margin)
                watch.retrained(clock())
        retrain_pass(registry, data_dir, retrainers, margin=margin)
        if watch is not None:
            watch.retrained(clock())


def _poll(watch: Watch, now: float) -> bool:
    """`watch.poll(now)`; False, reported, when it fails: the scheduled passes must go on (the next
    poll may find the servers and the store answering)."""
    try:
        return watch.poll(now)
    except Exception as exc:
        print(f"retrain: watch poll failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return False


def retrain_pass(
    registry: Registry, data_dir: str | Path, retrainers: dict[str, Retrainer], *, margin: float
) -> None:
    """`retrain_once`, one printed line per component; a pass another run holds the lock for is
    reported and skipped, and so is a pass that fails as a whole (a data directory the servers have
    not created yet, a store that does not answer): the next one will try again. `--once` calls
    `retrain_once` itself, so its failures still end it with an error."""
    try:
        for result in retrain_once(registry, data_dir, retrainers, margin=margin):
            print(format_result(result), flush=True)
    except RetrainLocked as exc:
        print(f"retrain: skipped: {exc}", file=sys.stderr)
    except Exception as exc:
        print(f"retrain: pass failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def format_result(result: RetrainResult) -> str:
    version = f" v{result.version}" if result.version is not None else ""
    promoted = " (promoted)" if result.promoted else ""
    return f"{result.component:<20} {result.status}{version}{promoted}  {result.detail}"
