"""Importers for real request traces and prompt/response datasets.

Every importer returns a `Trace`: column arrays (arrival times when the source has them, prompt and
output token counts, optional text) plus an `ImportReport` that counts everything read, so nothing
is dropped silently. Malformed input raises `TraceError`, whose message names the file, the line and
the field -- the CLI prints that one line and exits non-zero. Values are range-checked here, where
the file and line are known: token counts are whole, non-negative and at most `MAX_TOKENS`,
timestamps finite, non-negative and at most `MAX_TIMESTAMP_S`. A UTF-8 byte-order mark and CRLF line
ends are accepted (spreadsheet exports have both), and a file none of whose rows load is an error,
not an empty trace.

Supported formats (auto-detected from the extension and the header/first record):
- `azure`: Azure LLM inference trace CSV (`arrived_at`|`TIMESTAMP`, `num_prefill_tokens`|`ContextTokens`,
  `num_decode_tokens`|`GeneratedTokens`); `TIMESTAMP` may be a date-time string.
- `lengths`: length-statistics CSV without timestamps (`num_prefill_tokens`, `num_decode_tokens`).
- `burstgpt`: BurstGPT CSV (`Timestamp`, `Request tokens`, `Response tokens`, ...); rows with zero
  response tokens are failed requests in that dataset and are counted under `skipped`.
- `mooncake`: Mooncake JSONL (`timestamp` in ms, `input_length`, `output_length`, `hash_ids`).
- `alpaca`: AlpacaEval-style prompt/response JSON or JSONL (`instruction`, `output` or a counted
  `output_tokens`, optional `generator`, `category`); token counts come from a named tokenizer (see
  `adapt.tokenizer`).
- `requestlog`: this project's own request logs (JSONL of `CompletedRequest` records). Like every
  trace its arrivals start at 0; column `logged_arrival_s` keeps them as logged, on the server's
  clock, so logs of one server read together keep their requests apart in time.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import math
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from adapt.requests import CompletedRequest, ValidationError
from adapt.tokenizer import MINILM, count_tokens, well_formed

FORMATS: tuple[str, ...] = ("azure", "lengths", "burstgpt", "mooncake", "alpaca", "requestlog")
# No model's context comes near a billion tokens; a larger count is a corrupt cell (and past 2**63
# it would not even fit the int64 columns).
MAX_TOKENS = 1_000_000_000
# Year 2286 in Unix seconds (today's are ~1.7e9): larger is a unit mix-up or corruption, and 1e300
# would turn every arrival gap into rounding noise.
MAX_TIMESTAMP_S = 1e10
# What reading a damaged file raises (a corrupt gzip stream is a zlib.error, a truncated one EOFError).
_READ_ERRORS = (OSError, UnicodeDecodeError, EOFError, zlib.error, csv.Error)


class TraceError(ValueError):
    """Malformed trace input. `str(err)` is one line: file, line, field and what was wrong."""

    def __init__(self, path: Path | str, message: str, line: int | None = None, field: str | None = None):
        where = f"{path}" + (f":{line}" if line is not None else "")
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{message}")
        self.path, self.line, self.field = str(path), line, field


class NoUsableRows(TraceError):
    """Every row was read and skipped (e.g. a request log whose requests were all dropped): a
    trace of its own is useless, but beside others such a file adds nothing, not an error."""


# A request log's line that is not JSON: a write the server's process did not finish (a full disk,
# a kill mid-flush). Skipped and counted under this reason; every other defect stays an error.
TORN_LINE = "torn line (unfinished write)"


@dataclass
class ImportReport:
    """What an importer read: every row is either loaded or counted under a skip reason."""

    path: str
    format: str
    rows_read: int = 0
    loaded: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    reordered: int = 0
    tokenizer: str | None = None

    def summary(self) -> str:
        parts = [f"{self.path} [{self.format}]: read {self.rows_read} rows, loaded {self.loaded}"]
        parts += [f"skipped {count} ({reason})" for reason, count in sorted(self.skipped.items())]
        if self.reordered:
            parts.append(f"{self.reordered} out-of-order timestamps sorted")
        if self.tokenizer:
            parts.append(f"tokens counted with {self.tokenizer}")
        return ", ".join(parts)


@dataclass
class Trace:
    """A trace as column arrays. `arrival_s` is None for sources without timestamps."""

    name: str
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    arrival_s: np.ndarray | None = None
    prompt_text: list[str] | None = None
    columns: dict[str, list[Any]] = field(default_factory=dict)
    report: ImportReport | None = None

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def take(self, indices: np.ndarray | list[int]) -> Trace:
        """A new trace with the given rows, in the given order."""
        idx = np.asarray(indices, dtype=np.int64)
        return Trace(
            name=self.name,
            prompt_tokens=self.prompt_tokens[idx],
            output_tokens=self.output_tokens[idx],
            arrival_s=None if self.arrival_s is None else self.arrival_s[idx],
            prompt_text=None if self.prompt_text is None else [self.prompt_text[i] for i in idx],
            columns={k: [v[i] for i in idx] for k, v in self.columns.items()},
            report=self.report,
        )

    def head(self, n: int) -> Trace:
        return self.take(np.arange(min(n, len(self))))


def _open_text(path: Path) -> io.TextIOBase:
    """UTF-8 text with a leading byte-order mark removed (else it glues onto the first column's
    name and a timestamp column goes unrecognised); line ends are left to the csv/json readers."""
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _base_suffix(path: Path) -> str:
    suffixes = [s for s in path.suffixes if s != ".gz"]
    return suffixes[-1].lower() if suffixes else ""


def detect_format(path: Path) -> str:
    """Guess the format from the extension and the header (CSV) or the first record (JSON)."""
    suffix = _base_suffix(path)
    try:
        with _open_text(path) as handle:
            if suffix == ".csv":
                header = next(csv.reader(handle), None)
                if header is None:
                    raise TraceError(path, "empty file", line=1)
                return _csv_format(path, [h.strip() for h in header])
            if suffix in (".jsonl", ".json"):
                first = _first_json_record(path, handle, suffix)
                return _json_format(path, first)
    except _READ_ERRORS as exc:
        raise TraceError(path, f"cannot read: {exc}") from exc
    raise TraceError(path, f"unknown extension {suffix or '(none)'}; expected .csv, .jsonl or .json (.gz ok)")


def _csv_format(path: Path, header: list[str]) -> str:
    cols = set(header)
    if "Request tokens" in cols and "Response tokens" in cols:
        return "burstgpt"
    if cols & {"arrived_at", "TIMESTAMP"}:
        return "azure"
    if {"num_prefill_tokens", "num_decode_tokens"} <= cols:
        return "lengths"
    raise TraceError(
        path, f"unrecognised CSV header {header}; expected an Azure, BurstGPT or lengths CSV", line=1
    )


def _first_json_record(path: Path, handle: io.TextIOBase, suffix: str) -> dict[str, Any]:
    if suffix == ".json":
        text = handle.read(1 << 16)
        start = text.find("{")
        if start < 0:
            raise TraceError(path, "no JSON object found", line=1)
        decoder = json.JSONDecoder()
        try:
            record, _ = decoder.raw_decode(text[start:])
        except (ValueError, RecursionError) as exc:
            raise _json_error(path, exc, None) from exc
        return record
    for lineno, line in enumerate(handle, start=1):
        if line.strip():
            return _parse_json_line(path, line, lineno)
    raise TraceError(path, "empty file", line=1)


def _json_format(path: Path, record: dict[str, Any]) -> str:
    if {"timestamp", "input_length", "output_length"} <= set(record):
        return "mooncake"
    if "instruction" in record and ({"output", "output_tokens"} & set(record)):
        return "alpaca"
    if {"request_id", "outcome", "arrival_s"} <= set(record):
        return "requestlog"
    raise TraceError(path, f"unrecognised JSON record with keys {sorted(record)}", line=1)


def _json_error(path: Path, exc: ValueError | RecursionError, lineno: int | None) -> TraceError:
    """Besides syntax errors, `json` refuses integers of over 4,300 digits (ValueError) and nesting
    deeper than the interpreter's stack (RecursionError); all are one unparsable-JSON line."""
    if isinstance(exc, json.JSONDecodeError):
        return TraceError(path, f"unparsable JSON: {exc.msg}", line=exc.lineno if lineno is None else lineno)
    if isinstance(exc, RecursionError):
        return TraceError(path, "unparsable JSON: nested too deeply", line=lineno)
    return TraceError(path, f"unparsable JSON: {exc}", line=lineno)


def _parse_json_line(path: Path, line: str, lineno: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise _json_error(path, exc, lineno) from exc
    if not isinstance(record, dict):
        raise TraceError(path, f"expected a JSON object, got {type(record).__name__}", line=lineno)
    return record


def _number(path: Path, lineno: int | None, name: str, raw: Any, *, integer: bool, maximum: float) -> float:
    """Parse one numeric cell; non-numeric (booleans included), non-finite, negative and
    out-of-range values are errors."""
    try:
        if isinstance(raw, bool):
            raise TypeError
        value = float(raw)
    except (TypeError, ValueError, OverflowError):
        raise TraceError(path, f"expected a number, got {raw!r}", line=lineno, field=name) from None
    if not math.isfinite(value):
        raise TraceError(path, f"expected a finite number, got {raw!r}", line=lineno, field=name)
    if value < 0:
        raise TraceError(path, f"must not be negative, got {raw!r}", line=lineno, field=name)
    if value > maximum:
        raise TraceError(path, f"must be at most {maximum:.10g}, got {raw!r}", line=lineno, field=name)
    if integer and value != int(value):
        raise TraceError(path, f"expected a whole number of tokens, got {raw!r}", line=lineno, field=name)
    return value


def _count(path: Path, lineno: int | None, name: str, raw: Any) -> int:
    """A token count: a whole number in [0, MAX_TOKENS]."""
    return int(_number(path, lineno, name, raw, integer=True, maximum=MAX_TOKENS))


def _timestamp(path: Path, lineno: int, name: str, raw: str) -> float:
    """Seconds; Azure's raw `TIMESTAMP` column is a date-time string, the processed one a number."""
    try:
        float(raw)
    except ValueError:
        return _date_time(path, lineno, name, raw)
    return _number(path, lineno, name, raw, integer=False, maximum=MAX_TIMESTAMP_S)


def _date_time(path: Path, lineno: int, name: str, raw: str) -> float:
    """Seconds since 1970 of an ISO date-time, held to the range numeric timestamps are, its UTC
    offset kept (Azure's raw trace writes `2023-11-16 18:15:46.6805900+00:00`: seven fraction
    digits, which Python reads to the microsecond). One without an offset is read as UTC, not as
    this machine's local time, so a trace's gaps do not depend on where it is loaded (nor jump an
    hour at a DST change)."""
    try:
        moment = datetime.fromisoformat(raw.strip())
    except ValueError:
        raise TraceError(
            path, f"expected seconds or a date-time, got {raw!r}", line=lineno, field=name
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    seconds = moment.timestamp()
    if not 0 <= seconds <= MAX_TIMESTAMP_S:
        raise TraceError(path, f"date-time out of range (1970 to 2286), got {raw!r}", line=lineno, field=name)
    return seconds


def _pick(path: Path, header: list[str], *names: str) -> str:
    for name in names:
        if name in header:
            return name
    raise TraceError(path, f"missing column: expected one of {', '.join(names)}", line=1, field=names[0])


def _read_csv_rows(path: Path) -> Iterator[tuple[int, list[str], dict[str, str]]]:
    with _open_text(path) as handle:
        reader = csv.reader(handle)
        rows = _csv_lines(path, reader)
        header = next(rows, None)
        if header is None:
            raise TraceError(path, "empty file", line=1)
        header = [h.strip() for h in header]
        yield 1, header, {}
        for row in rows:
            lineno = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                raise TraceError(path, f"expected {len(header)} cells, got {len(row)}", line=lineno)
            yield lineno, header, dict(zip(header, row, strict=True))


def _csv_lines(path: Path, reader: Any) -> Iterator[list[str]]:
    """The reader's rows; a row the csv module refuses (a NUL byte, an unterminated quote at the end,
    an over-long field) is reported with its line."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise TraceError(path, f"cannot parse CSV: {exc}", line=reader.line_num) from None
        yield row


def _load_csv(path: Path, fmt: str) -> Trace:
    report = ImportReport(path=str(path), format=fmt)
    rows = _read_csv_rows(path)
    _, header, _ = next(rows)
    if fmt == "azure":
        time_col = _pick(path, header, "arrived_at", "TIMESTAMP")
        in_col = _pick(path, header, "num_prefill_tokens", "ContextTokens")
        out_col = _pick(path, header, "num_decode_tokens", "GeneratedTokens")
    elif fmt == "burstgpt":
        time_col = _pick(path, header, "Timestamp")
        in_col, out_col = _pick(path, header, "Request tokens"), _pick(path, header, "Response tokens")
    else:
        time_col = None
        in_col = _pick(path, header, "num_prefill_tokens")
        out_col = _pick(path, header, "num_decode_tokens")
    arrivals, prompts, outputs = [], [], []
    skipped: Counter[str] = Counter()
    for lineno, _, record in rows:
        report.rows_read += 1
        prompt = _count(path, lineno, in_col, record[in_col])
        output = _count(path, lineno, out_col, record[out_col])
        if prompt == 0:
            skipped["zero prompt tokens"] += 1
            continue
        if output == 0:
            skipped["zero output tokens (failed request)" if fmt == "burstgpt" else "zero output tokens"] += 1
            continue
        if time_col is not None:
            arrivals.append(_timestamp(path, lineno, time_col, record[time_col]))
        prompts.append(prompt)
        outputs.append(output)
    return _finish(path, report, skipped, arrivals if time_col else None, prompts, outputs)


def _finish(
    path: Path,
    report: ImportReport,
    skipped: Counter[str],
    arrivals: list[float] | None,
    prompts: list[int],
    outputs: list[int],
    prompt_text: list[str] | None = None,
    columns: dict[str, list[Any]] | None = None,
) -> Trace:
    if report.rows_read == 0:
        raise TraceError(path, "no data rows")
    if not prompts:
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
        raise NoUsableRows(path, f"no usable rows: all {report.rows_read} skipped ({reasons})")
    report.skipped = dict(skipped)
    report.loaded = len(prompts)
    trace = Trace(
        name=path.name.split(".")[0],
        prompt_tokens=np.asarray(prompts, dtype=np.int64),
        output_tokens=np.asarray(outputs, dtype=np.int64),
        arrival_s=None if arrivals is None else np.asarray(arrivals, dtype=np.float64),
        prompt_text=prompt_text,
        columns=columns or {},
        report=report,
    )
    if trace.arrival_s is not None and len(trace):
        report.reordered = int(np.count_nonzero(np.diff(trace.arrival_s) < 0))
        if report.reordered:
            trace = trace.take(np.argsort(trace.arrival_s, kind="stable"))
        trace.arrival_s = trace.arrival_s - trace.arrival_s[0]
    return trace


def _iter_json_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open_text(path) as handle:
        if _base_suffix(path) == ".json":
            try:
                data = json.load(handle)
            except (ValueError, RecursionError) as exc:
                raise _json_error(path, exc, None) from exc
            if not isinstance(data, list):
                raise TraceError(path, "expected a JSON array of objects", line=1)
            for index, record in enumerate(data, start=1):
                if not isinstance(record, dict):
                    raise TraceError(path, f"record {index}: expected a JSON object", line=None)
                yield index, record
            return
        for lineno, line in enumerate(handle, start=1):
            if line.strip():
                yield lineno, _parse_json_line(path, line, lineno)


def iter_log_records(path: Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """A server-written JSONL log's records, None for a torn line (`TORN_LINE`): a log written
    while a process died or a disk filled ends mid-record, and one bad line must not make every
    later retrain fail on the whole file."""
    with _open_text(path) as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = _parse_json_line(path, line, lineno)
            except TraceError as exc:
                # What a cut-short write leaves is a record's beginning, a syntax error; a
                # well-formed but hostile line (an integer of 5,000 digits, not an object) stays one.
                if not isinstance(exc.__cause__, json.JSONDecodeError):
                    raise
                record = None
            yield lineno, record


def _require(path: Path, lineno: int, record: dict[str, Any], name: str) -> Any:
    if name not in record:
        raise TraceError(path, "missing", line=lineno, field=name)
    return record[name]


def _load_mooncake(path: Path) -> Trace:
    report = ImportReport(path=str(path), format="mooncake")
    arrivals, prompts, outputs, hashes = [], [], [], []
    skipped: Counter[str] = Counter()
    for lineno, record in _iter_json_records(path):
        report.rows_read += 1
        stamp = _number(
            path,
            lineno,
            "timestamp",
            _require(path, lineno, record, "timestamp"),
            integer=False,
            maximum=MAX_TIMESTAMP_S * 1000.0,  # milliseconds
        )
        prompt = _count(path, lineno, "input_length", _require(path, lineno, record, "input_length"))
        output = _count(path, lineno, "output_length", _require(path, lineno, record, "output_length"))
        block_hashes = record.get("hash_ids", [])
        if not isinstance(block_hashes, list) or any(
            isinstance(h, bool) or not isinstance(h, int) for h in block_hashes
        ):
            raise TraceError(
                path, f"expected a list of integers, got {block_hashes!r}", line=lineno, field="hash_ids"
            )
        if prompt == 0 or output == 0:
            skipped["zero prompt or output tokens"] += 1
            continue
        arrivals.append(stamp / 1000.0)
        prompts.append(prompt)
        outputs.append(output)
        hashes.append(block_hashes)
    return _finish(path, report, skipped, arrivals, prompts, outputs, columns={"hash_ids": hashes})


def _load_alpaca(path: Path, tokenizer: str) -> Trace:
    """AlpacaEval rows. A row carries the response text (`output`) or, in the bundled slice, only
    its length (`output_tokens`, already counted with the MiniLM tokenizer)."""
    report = ImportReport(path=str(path), format="alpaca", tokenizer=tokenizer)
    instructions, outputs_text, generators, categories = [], [], [], []
    counted: list[int | None] = []
    for lineno, record in _iter_json_records(path):
        report.rows_read += 1
        instruction = _require(path, lineno, record, "instruction")
        if not isinstance(instruction, str):
            raise TraceError(
                path, f"expected a string, got {type(instruction).__name__}", line=lineno, field="instruction"
            )
        if "output" in record or "output_tokens" not in record:
            output = _require(path, lineno, record, "output")
            if not isinstance(output, str):
                raise TraceError(
                    path, f"expected a string, got {type(output).__name__}", line=lineno, field="output"
                )
            outputs_text.append(output)
            counted.append(None)
        else:
            tokens = record["output_tokens"]
            if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= MAX_TOKENS:
                raise TraceError(
                    path,
                    f"expected a count in [0, {MAX_TOKENS:,}], got {tokens!r}",
                    line=lineno,
                    field="output_tokens",
                )
            outputs_text.append("")
            counted.append(tokens)
        instructions.append(instruction)
        generators.append(str(record.get("generator", "")))
        categories.append(str(record.get("category", "")))
    prompt_counts = count_tokens(instructions, tokenizer)
    text_counts = count_tokens(outputs_text, tokenizer)
    output_counts = [
        text if given is None else given for text, given in zip(text_counts, counted, strict=True)
    ]
    keep = [i for i in range(len(instructions)) if prompt_counts[i] > 0 and output_counts[i] > 0]
    skipped = Counter({"empty instruction or output": len(instructions) - len(keep)})
    skipped = +skipped
    columns = {
        "generator": [generators[i] for i in keep],
        "category": [categories[i] for i in keep],
    }
    if any(c is None for c in counted):
        columns["output_text"] = [outputs_text[i] for i in keep]
    return _finish(
        path,
        report,
        skipped,
        None,
        [prompt_counts[i] for i in keep],
        [output_counts[i] for i in keep],
        prompt_text=[instructions[i] for i in keep],
        columns=columns,
    )


def _load_requestlog(path: Path) -> Trace:
    report = ImportReport(path=str(path), format="requestlog")
    records: list[CompletedRequest] = []
    skipped: Counter[str] = Counter()
    for lineno, raw in iter_log_records(path):
        report.rows_read += 1
        if raw is None:
            skipped[TORN_LINE] += 1
            continue
        try:
            record = CompletedRequest.from_dict(raw)
        except (ValidationError, TypeError, AttributeError) as exc:
            raise TraceError(path, str(exc), line=lineno) from exc
        _count(path, lineno, "prompt_tokens", record.prompt_tokens)
        _count(path, lineno, "output_tokens", record.output_tokens)
        for name in ("prompt_blocks", "answer_blocks"):  # prefix-cache content keys (`Request.prompt_blocks`)
            keys = record.extra.get(name, [])
            if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys):
                raise TraceError(path, f"extra.{name}: expected a list of block keys (strings)", line=lineno)
        for name in ("arrival_s", "first_token_s", "finish_s"):
            value = getattr(record, name)
            if value is not None:
                _number(path, lineno, name, value, integer=False, maximum=MAX_TIMESTAMP_S)
        if record.extra.get("wall_arrival_s") is not None:
            wall = record.extra["wall_arrival_s"]
            _number(path, lineno, "extra.wall_arrival_s", wall, integer=False, maximum=MAX_TIMESTAMP_S)
        if record.outcome != "finished":
            skipped[f"outcome {record.outcome}"] += 1
            continue
        records.append(record)
    texts = [r.prompt_text for r in records]
    return _finish(
        path,
        report,
        skipped,
        [r.arrival_s for r in records],
        [r.prompt_tokens for r in records],
        [r.output_tokens for r in records],
        prompt_text=texts if all(t is not None for t in texts) and texts else None,
        columns={
            "ttft_s": [r.ttft_s for r in records],
            "ttlt_s": [r.ttlt_s for r in records],
            "request_id": [r.request_id for r in records],
            "logged_arrival_s": [r.arrival_s for r in records],
            # The same on the wall clock, where the server logged it (None where not): a server's
            # arrivals restart with its host's monotonic clock at a reboot, the wall clock does not.
            "logged_wall_arrival_s": [r.extra.get("wall_arrival_s") for r in records],
            # `prompt_text` is set only when every row has one; this column keeps each row's (or None)
            "logged_prompt_text": texts,
            # Content keys, where the engine ran prefix caching (`Request.prompt_blocks`, ...)
            "prompt_blocks": [tuple(r.extra.get("prompt_blocks", ())) for r in records],
            "answer_blocks": [tuple(r.extra.get("answer_blocks", ())) for r in records],
            "skip_reading_prefix_cache": [bool(r.extra.get("skip_reading_prefix_cache")) for r in records],
        },
    )


def load_trace(path: str | Path, fmt: str | None = None, *, tokenizer: str = MINILM) -> Trace:
    """Load any supported trace or dataset; `fmt=None` auto-detects it."""
    path = Path(path)
    if path.is_dir():
        raise TraceError(path, "is a directory; expected a trace file")
    if not path.is_file():
        raise TraceError(path, "no such file")
    if path.stat().st_size == 0:
        # A server's request log before its first flush (stopped, or its disk full) holds no rows,
        # as one whose every request dropped: beside other logs it adds nothing.
        raise (NoUsableRows if fmt == "requestlog" else TraceError)(path, "empty file", line=1)
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise TraceError(path, f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    try:
        if fmt in ("azure", "lengths", "burstgpt"):
            return _load_csv(path, fmt)
        if fmt == "mooncake":
            return _load_mooncake(path)
        if fmt == "alpaca":
            return _load_alpaca(path, tokenizer)
        return _load_requestlog(path)
    except _READ_ERRORS as exc:
        raise TraceError(path, f"cannot read: {exc}") from exc


def _percentiles(values: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(np.mean(values)),
        "median": float(np.median(values)),
        "p90": float(np.percentile(values, 90)),
        "p99": float(np.percentile(values, 99)),
    }


def trace_stats(trace: Trace) -> dict[str, Any]:
    """The figures `adapt trace stats` prints: count, duration, rate and length percentiles."""
    stats: dict[str, Any] = {"count": len(trace)}
    if trace.arrival_s is not None and len(trace) > 1:
        duration = float(trace.arrival_s[-1] - trace.arrival_s[0])
        stats["duration_s"] = duration
        stats["rate_rps"] = (len(trace) - 1) / duration if duration > 0 else None
    else:
        stats["duration_s"] = None
        stats["rate_rps"] = None
    stats["input"] = _percentiles(trace.prompt_tokens)
    stats["output"] = _percentiles(trace.output_tokens)
    if trace.report is not None:
        stats["import"] = {
            "format": trace.report.format,
            "rows_read": trace.report.rows_read,
            "loaded": trace.report.loaded,
            "skipped": trace.report.skipped,
            "reordered": trace.report.reordered,
            "tokenizer": trace.report.tokenizer,
        }
    return stats


def prompt_hash(text: str | None) -> int:
    """A stable 63-bit fingerprint of a prompt (0 for no text), to recognise repeats cheaply; of the
    text as it is counted and embedded (`well_formed`: a lone surrogate cannot be UTF-8 encoded)."""
    if text is None:
        return 0
    digest = hashlib.blake2b(well_formed(text).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1 or 1


def instruction_split(texts: Sequence[str], test_share: float = 0.3) -> np.ndarray:
    """True for rows whose text falls in the held-out share, decided by a hash of the text, so that
    every copy of an instruction lands on the same side and the split never changes between runs."""
    if not 0.0 < test_share < 1.0:
        raise ValueError(f"test_share: expected a number in (0, 1), got {test_share!r}")
    cut = int(test_share * 1000)
    return np.array([prompt_hash(t) % 1000 < cut for t in texts], dtype=bool)


def split_by_instruction(trace: Trace, test_share: float = 0.3) -> tuple[Trace, Trace]:
    """(train, held-out) rows of a prompt/response trace, split by `instruction_split`."""
    held_out = instruction_split(trace.prompt_text, test_share)
    return trace.take(np.flatnonzero(~held_out)), trace.take(np.flatnonzero(held_out))
