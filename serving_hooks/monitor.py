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
it had not synced). Files rotate at `max_bytes` to the next number.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from adapt.conformance import DECISION_LOG
from adapt.files import write_text_atomic
from adapt.replay.engine import ENGINE_FILE, EngineConfig
from adapt.requests import CompletedRequest


class JsonlLog:
    """Append-only JSONL with bounded buffering and size-based rotation."""

    def __init__(
        self,
        directory: str | Path,
        prefix: str,
        *,
        max_bytes: int = 64 << 20,
        flush_every: int = 64,
        flush_interval_s: float = 1.0,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        existing = sorted(self.directory.glob(f"{prefix}-*.jsonl"))
        self._number = int(existing[-1].stem.rsplit("-", 1)[1]) + 1 if existing else 1
        self._buffer: list[str] = []
        self._torn = False  # the last write failed part way: begin the next on a fresh line
        self._last_flush = time.monotonic()
        self.records = 0

    @property
    def path(self) -> Path:
        return self.directory / f"{self.prefix}-{self._number:06d}.jsonl"

    def write(self, record: dict[str, Any]) -> None:
        self._buffer.append(json.dumps(record))
        self.records += 1
        if (
            len(self._buffer) >= self.flush_every
            or time.monotonic() - self._last_flush >= self.flush_interval_s
        ):
            self.flush()

    def flush(self) -> None:
        """Append the buffer. A write that fails part way (a full disk) leaves a torn line and
        keeps the buffer: the next flush starts on a fresh line, so the torn line stays one line
        that readers skip (`adapt.traces.TORN_LINE`), and the records are written whole after it."""
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        text = "\n".join(self._buffer) + "\n"
        with open(self.path, "a") as handle:
            if self._torn:
                text = "\n" + text
            self._torn = True
            handle.write(text)
            handle.flush()
        self._torn = False
        self._buffer.clear()
        if self.path.stat().st_size >= self.max_bytes:
            self._number += 1


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
