"""What a scheduling step is, and the cost-model contract over it.

Every engine describes a step by the same features (`StepBatch`, built by `step_batch` from the
(tokens, cached) pairs it scheduled): the replay engine to time the step with a cost model, the vLLM
adapter's monitor to log it, the `cost-model` component to learn from those logs. Computing them
in one place is what makes a cost model fitted to live step logs mean the same thing in replay.
`load_step_log` reads such a log and checks it where the file and line are still known.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from adapt.traces import NoUsableRows, TraceError, iter_log_records

if TYPE_CHECKING:  # pandas loads when a step log is read, not when the CLI builds its parser
    import pandas as pd

STEP_FIELDS: tuple[str, ...] = (
    "tokens",  # tokens computed this step (prefill chunks + decodes)
    "sampled",  # requests that produced a token
    "prefill_attn_units",  # sum of c * p + c * (c + 1) / 2 over prefill chunks of c after p cached
    "prefill_kv_read",  # sum of p over prefill chunks
    "num_decodes",
    "decode_ctx_sum",  # cached context summed over decodes
    "decode_ctx_max",
)
# Requests that reached the engine while the step ran. Their intake (vLLM's request processing, the
# policy's `on_arrival`) runs before the next step is scheduled, so it is part of the logged step's
# duration but not of its batch: a cost model charges it per arrival (`CostModel.arrival_overhead_s`).
ARRIVALS = "arrivals"
# Seconds the live step spent in the policy (building its view, `on_step`, applying the plan): part
# of the step's duration that no batch feature explains. Logged to show what a policy costs live;
# the replay engine does not charge it (its steps would then depend on the replaying machine).
POLICY_S = "policy_s"
STEP_LOG_COLUMNS: tuple[str, ...] = (*STEP_FIELDS, ARRIVALS, POLICY_S, "duration_s")


class StepBatch(NamedTuple):
    """The features of one step that its cost depends on (arrays for many steps at once).

    Prefill chunks: `prefill_attn_units` = sum of c * p + c * (c + 1) / 2 for a chunk of c tokens
    after p cached ones, `prefill_kv_read` = sum of p. Decodes: their number and the sum and max of
    their cached contexts (a decode attends over its context plus itself). A named tuple, not a
    frozen dataclass: the replay engine builds one or two per step, at a third of the cost.
    """

    tokens: np.ndarray | float
    sampled: np.ndarray | float
    prefill_attn_units: np.ndarray | float = 0.0
    prefill_kv_read: np.ndarray | float = 0.0
    num_decodes: np.ndarray | float = 0.0
    decode_ctx_sum: np.ndarray | float = 0.0
    decode_ctx_max: np.ndarray | float = 0.0

    def as_row(self) -> dict[str, float]:
        """The step-log columns of one step."""
        return {name: float(getattr(self, name)) for name in STEP_FIELDS}


def step_batch(work: Iterable[tuple[int, int, bool, bool]]) -> StepBatch:
    """Features of one step from what it scheduled: per request (tokens n, tokens already cached p,
    is this a decode, does it sample a token). Both engines call this, so a step means the same."""
    tokens = sampled = decodes = 0
    attn = kv_read = ctx_sum = 0.0
    ctx_max = 0
    for n, p, is_decode, samples in work:
        tokens += n
        sampled += samples
        if is_decode:
            decodes += 1
            ctx_sum += p
            ctx_max = max(ctx_max, p)
        else:
            attn += n * p + n * (n + 1) / 2
            kv_read += p
    return StepBatch(tokens, sampled, attn, kv_read, decodes, ctx_sum, ctx_max)


def attention_work(batch: StepBatch, decode_attention: str = "sum") -> tuple[object, object]:
    """(attention units, KV tokens read) of a step. Decodes read their own context ("sum", what
    paged-attention kernels do) or, with "max", each as much as the longest one in the batch."""
    if decode_attention == "max":
        decode_read = batch.num_decodes * batch.decode_ctx_max
    else:
        decode_read = batch.decode_ctx_sum
    return batch.prefill_attn_units + decode_read + batch.num_decodes, batch.prefill_kv_read + decode_read


class CostModel(Protocol):
    """What the replay engine needs from a cost model: the roofline (`adapt.replay.cost`) and the
    `cost-model` fitted to step logs (`predictors.cost_model`) both provide it."""

    def time(self, batch: StepBatch) -> np.ndarray | float:
        """Seconds for one step, or for each of many steps when the fields are arrays."""

    def decode_run_times(
        self, num_decodes: int, context_sum: int, context_max: int, steps: int
    ) -> np.ndarray:
        """Times of `steps` consecutive decode-only steps of the same requests, every context growing
        by one token per step (the replay engine's fast path)."""

    def kv_capacity_tokens(self) -> int:
        """KV-cache tokens the modelled engine holds."""

    @property
    def arrival_overhead_s(self) -> float:
        """Engine time per arriving request, spent between steps before the request can be
        scheduled (its intake; see `ARRIVALS`)."""


def load_step_log(path: str | Path) -> pd.DataFrame:
    """A step log (CSV, JSONL or parquet; .gz ok) as a frame sorted by `start_s` when it has one.

    Every failure is one `TraceError` naming the file and, where it can, the line and field: an
    empty or unreadable file, a ragged row, a missing column, or a step-log value that is missing,
    not a number, not finite or negative (pandas would otherwise carry them into a fit as NaN or
    fail later with its own traceback). Valid logs come back exactly as pandas reads them. A log
    with no steps -- empty, a header or torn lines only: a server stopped, or its disk full, before
    its first whole flush -- raises `NoUsableRows`, which a reader of many logs skips."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise TraceError(path, "no such file")
    suffixes = "".join(path.suffixes)
    first_line = None if ".parquet" in suffixes else 1 if ".jsonl" in suffixes else 2  # of row 0
    try:
        if first_line is None:
            frame = pd.read_parquet(path)
        elif first_line == 1:
            frame = _read_jsonl_steps(path)
        else:
            frame = pd.read_csv(path, encoding="utf-8-sig")
    except pd.errors.EmptyDataError:
        raise NoUsableRows(path, "empty file", line=1) from None
    except (ValueError, OSError, EOFError, zlib.error) as exc:  # pandas' parser errors are ValueErrors
        raise TraceError(path, f"cannot read: {' '.join(str(exc).split())}") from None
    required = {"tokens", "duration_s"}
    missing = required - set(frame.columns)
    if missing:
        raise TraceError(path, f"missing column(s) {', '.join(sorted(missing))}", line=1)
    if frame.empty:
        raise NoUsableRows(path, "no steps")
    for column in frame.columns:
        if column in STEP_LOG_COLUMNS or column == "start_s":
            frame[column] = _checked_column(path, frame[column], str(column), first_line)
    if "start_s" in frame.columns:
        frame = frame.sort_values("start_s", kind="stable")
    return frame.reset_index(drop=True)


def _read_jsonl_steps(path: Path) -> pd.DataFrame:
    """A server's JSONL step log; a torn line (a write cut short: `adapt.traces.TORN_LINE`) is
    skipped with a warning, so one unfinished flush does not stop every later cost-model refit."""
    import pandas as pd

    records, torn = [], 0
    for _, record in iter_log_records(path):
        if record is None:
            torn += 1
        else:
            records.append(record)
    if torn:
        logging.getLogger("adapt.steplog").warning("%s: %d torn line(s) skipped", path, torn)
    if not records and not torn:
        raise pd.errors.EmptyDataError
    if not records:  # torn lines only: a log with no steps, which its reader says as much of
        return pd.DataFrame(columns=["tokens", "duration_s"])
    return pd.DataFrame.from_records(records)


def _checked_column(path: Path, column: pd.Series, name: str, first_line: int | None) -> pd.Series:
    """The column as numbers; the first missing, non-numeric (booleans included), non-finite or
    (a step feature) negative value is an error at its line (parquet: its row)."""
    import pandas as pd

    values = pd.to_numeric(column, errors="coerce")
    floats = values.to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(floats) | (column.map(lambda v: isinstance(v, bool)).to_numpy(dtype=bool))
    if name != "start_s":
        bad |= floats < 0
    rows = np.flatnonzero(bad)
    if len(rows) == 0:
        return values
    row = int(rows[0])
    expected = "a finite number" if name == "start_s" else "a finite number >= 0"
    what = f"expected {expected}, got {column.iloc[row]!r}"
    if first_line is None:
        raise TraceError(path, f"row {row + 1}: {what}", field=name)
    raise TraceError(path, what, line=first_line + row, field=name)
