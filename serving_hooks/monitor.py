"""What a serving engine leaves behind for the pipelines: a request log and a step log, and on
request a decision log.

All are JSONL files in one directory (`ADAPT_LOG_DIR`, set by `adapt serve --log-dir`), named so
`adapt retrain --data-dir` picks them up: `requests-<n>.jsonl` (one `CompletedRequest` per finished,
aborted or dropped request; prompt text only with `ADAPT_LOG_PROMPTS=1`, which lets the prompt
components be refitted from the log alone) and `steps-<n>.jsonl`
(the `adapt.steplog` columns of every scheduling step plus its start and measured duration). With
`ADAPT_LOG_DECISIONS=1` (`adapt serve --log-decisions`), `decisions-<n>.jsonl` holds every step's
decisions in `adapt.conformance`'s format, for `adapt conformance` to replay: a diagnostic, larger
than the other two (each step lists the queues).

Durability: records are buffered and handed to the OS every `flush_every` records or
`flush_interval_s` seconds, whichever comes first, so a crash of the engine process loses at most
that much (64 records or one second by default) -- and the scheduler flushes whenever the engine
goes idle; the OS writes flushed records out even if the process dies (an OS crash may lose what
it had not synced). Files rotate at `max_bytes` to the next number. A write that fails (a full
disk) is logged and retried, never raised into the engine (`JsonlLog`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import deque
from pathlib import Path
from typing import Any

from adapt.conformance import DECISION_LOG
from adapt.files import write_text_atomic
from adapt.replay.engine import ENGINE_FILE, EngineConfig
from adapt.requests import CompletedRequest

log = logging.getLogger("adapt.monitor")
REPORT_EVERY_S = 60.0  # a flush that keeps failing is logged this seldom


class JsonlLog:
    """Append-only JSONL with bounded buffering and size-based rotation.

    Writing never raises into the serving engine that calls it: a flush that fails (a full disk)
    is logged, at most once a minute while it lasts, and cuts the file back to where that flush
    began, so a retry writes each record once and no torn line is left. The buffer is kept, and
    `write` retries it at most once per `flush_interval_s` (not on every write, which made each
    engine step pay for re-joining it); an explicit `flush` (the engine idle or stopping) always
    tries. Past `max_buffer_bytes` the oldest records are dropped and counted (`dropped`), so a
    disk that stays full costs bounded memory."""

    def __init__(
        self,
        directory: str | Path,
        prefix: str,
        *,
        max_bytes: int = 64 << 20,
        flush_every: int = 64,
        flush_interval_s: float = 1.0,
        max_buffer_bytes: int = 16 << 20,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.max_buffer_bytes = max_buffer_bytes
        self._number = _last_number(self.directory, prefix) + 1
        self._buffer: deque[str] = deque()
        self._buffer_bytes = 0
        self._torn = False  # a failed flush could not be cut back: begin the next on a fresh line
        self._last_flush = time.monotonic()
        self._retry_at = 0.0  # after a failed flush, `write` tries no other before this moment
        self._failed = 0  # flushes failed since the last one that succeeded
        self._next_report = 0.0
        self.records = 0
        self.dropped = 0  # records dropped from a full buffer, never written

    @property
    def path(self) -> Path:
        return self.directory / f"{self.prefix}-{self._number:06d}.jsonl"

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record)
        self._buffer.append(line)
        self._buffer_bytes += len(line) + 1  # ASCII: `json.dumps` escapes the rest
        self.records += 1
        self._bound_buffer()
        now = time.monotonic()
        if now >= self._retry_at and (
            len(self._buffer) >= self.flush_every or now - self._last_flush >= self.flush_interval_s
        ):
            self.flush()

    def flush(self) -> None:
        """Append the buffer; a failure is logged and the buffer kept for the next try."""
        now = time.monotonic()
        self._last_flush = now
        if not self._buffer:
            return
        path = self.path
        try:
            size = self._append(path, ("\n" if self._torn else "") + "\n".join(self._buffer) + "\n")
        except OSError as exc:
            self._retry_at = now + self.flush_interval_s
            self._failed += 1
            self._report(path, exc, now)
            return
        if self._failed:
            log.warning("%s: written again after %d failed flush(es)", path, self._failed)
        self._buffer.clear()
        self._buffer_bytes = 0
        self._torn = False
        self._failed = 0
        self._retry_at = self._next_report = 0.0
        if size >= self.max_bytes:
            self._number += 1

    def _append(self, path: Path, text: str) -> int:
        """Write `text` at the end of `path` and return the file's size; on failure the file is
        cut back to its size before, so nothing of this write stays half written."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(fd).st_size
            encoded = text.encode()
            data = memoryview(encoded)
            try:
                while data:  # a write(2) may take part of it (a file size limit) and fail on the rest
                    data = data[os.write(fd, data) :]
            except OSError:
                self._cut_back(fd, path, start)
                raise
            return start + len(encoded)
        finally:
            os.close(fd)

    def _cut_back(self, fd: int, path: Path, size: int) -> None:
        """Truncate to `size` (shrinking a file needs no space); where even that fails, what was
        written stays and the next flush begins on a fresh line, leaving one torn line that
        readers skip (`adapt.traces.TORN_LINE`) and records they read once however often logged."""
        try:
            os.ftruncate(fd, size)
        except OSError:
            log.exception("%s: could not remove a partly written flush", path)
            self._torn = True

    def _bound_buffer(self) -> None:
        """Drop the oldest records past `max_buffer_bytes` (always keeping the newest)."""
        if self._buffer_bytes <= self.max_buffer_bytes or len(self._buffer) == 1:
            return
        if not self.dropped:
            log.warning(
                "%s: %d bytes of records wait for a flush: dropping the oldest (counted in `dropped`)",
                self.path,
                self._buffer_bytes,
            )
        while self._buffer_bytes > self.max_buffer_bytes and len(self._buffer) > 1:
            self._buffer_bytes -= len(self._buffer.popleft()) + 1
            self.dropped += 1

    def _report(self, path: Path, exc: OSError, now: float) -> None:
        """Log a failed flush at most once a minute: a full disk fails every retry."""
        if now < self._next_report:
            return
        self._next_report = now + REPORT_EVERY_S
        log.error(
            "%s: could not write %d record(s), kept to retry (%d flush(es) failed, %d record(s) dropped): %s",
            path,
            len(self._buffer),
            self._failed,
            self.dropped,
            exc,
        )


def _last_number(directory: Path, prefix: str) -> int:
    """The highest n of the `<prefix>-<n>.jsonl` files in `directory` (0 if none), as a number:
    other files there (`requests-backup.jsonl`) are not this log's, and names sort wrongly past
    six digits."""
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.jsonl")
    numbers = [int(m[1]) for p in directory.iterdir() if (m := pattern.fullmatch(p.name))]
    return max(numbers, default=0)


class Monitor:
    """The logs of one engine."""

    def __init__(
        self, directory: str | Path, log_prompts: bool = False, log_decisions: bool = False, **options: Any
    ) -> None:
        self.requests = JsonlLog(directory, "requests", **options)
        self.steps = JsonlLog(directory, "steps", **options)
        self.decisions = JsonlLog(directory, DECISION_LOG, **options) if log_decisions else None
        self.log_prompts = log_prompts

    def request(self, record: CompletedRequest) -> None:
        data = record.to_dict()
        if not self.log_prompts:
            data["prompt_text"] = None
        self.requests.write(data)

    def step(self, start_s: float, duration_s: float, features: dict[str, float]) -> None:
        self.steps.write({"start_s": start_s, **features, "duration_s": duration_s})

    def decision(self, record: dict[str, Any]) -> None:
        """One step's decisions, once its output came (`delivered_t` filled in)."""
        self.decisions.write(record)  # type: ignore[union-attr]

    def engine(self, config: EngineConfig) -> None:
        """Record the serving engine's limits beside the logs (`ENGINE_FILE`), replaced atomically:
        what a retrain's gate replays the logged requests on."""
        write_text_atomic(self.requests.directory / ENGINE_FILE, config.to_json())

    def flush(self) -> None:
        self.requests.flush()
        self.steps.flush()
        if self.decisions is not None:
            self.decisions.flush()
