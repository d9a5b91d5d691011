"""GMAX's arithmetic over numpy columns, so that one planning frame over thousands of waiting
requests stays a handful of vectorised operations (JITServe paper section 4.2; DESIGN.md section 4).

`RequestTable` keeps, per tracked request, the numbers the estimates need in one row of a 2-D
array; the policy writes a row when something about the request changes (arrival, bound refresh,
admission, preemption, and for running requests once per frame) and reads whole columns at a frame.
"""

from __future__ import annotations

import numpy as np

KINDS: dict[str, int] = {"latency": 0, "deadline": 1, "compound": 2, "best_effort": 3}
FIELDS: tuple[str, ...] = (
    "arrival",  # s
    "prompt",  # prompt tokens
    "generated",  # output tokens so far
    "prefill",  # tokens still to prefill (prompt, or prompt + output after a preemption)
    "kind",  # KINDS
    "deadline",  # absolute; inf without one
    "stage_deadline",  # absolute sub-deadline of a compound call; inf otherwise
    "ttft",  # s; nan without a TTFT target
    "tbt",  # s; nan without a TBT target
    "first_token",  # absolute; nan before the first token
    "bound",  # upper bound on the remaining output, predicted when `generated` was `bound_at`
    "bound_at",
    "waiting",  # 1 while waiting or preempted
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}
_EPS = 1e-9  # token counts from float time ratios: 11.000000000000002 late tokens are 11


class RequestTable:
    """One row of `FIELDS` per tracked request; rows are reused after `release`."""

    def __init__(self, capacity: int = 1024) -> None:
        self.values = np.full((len(FIELDS), capacity), np.nan)
        self.rows: dict[str, int] = {}
        self._free: list[int] = []

    def set(self, request_id: str, **values: float) -> None:
        row = self.rows.get(request_id)
        if row is None:
            row = self._allocate(request_id)
        for name, value in values.items():
            self.values[_INDEX[name], row] = value

    def _allocate(self, request_id: str) -> int:
        if not self._free:
            old = self.values.shape[1]
            self.values = np.concatenate([self.values, np.full_like(self.values, np.nan)], axis=1)
            self._free.extend(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self.rows[request_id] = row
        return row

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def columns(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        block = self.values[:, rows]
        return {name: block[i] for i, name in enumerate(FIELDS)}


def bandwidth(t_gen: np.ndarray, t_rem: np.ndarray) -> np.ndarray:
    """bw = t_gen / t_rem: the share of the engine's per-request speed a request needs to finish
    in its remaining time; infinite when no time is left (it cannot make it)."""
    t_gen, t_rem = np.asarray(t_gen, dtype=np.float64), np.asarray(t_rem, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(t_rem > 0, t_gen / np.where(t_rem > 0, t_rem, 1.0), np.inf)


def remaining(c: dict[str, np.ndarray]) -> np.ndarray:
    """The bound counted down by the tokens generated since it was predicted (>= 1)."""
    return np.maximum(1.0, c["bound"] - (c["generated"] - c["bound_at"]))


def on_time_tokens(c: dict[str, np.ndarray], start: np.ndarray, rem: np.ndarray, step_s: float) -> np.ndarray:
    """How many of the next `rem` tokens meet their latency target if the first comes at
    start + step_s and then one per step. Token i is due by arrival + TTFT + i * TBT; with only a
    TBT, by first token + i * TBT (any time, for the first); with only a TTFT, the first by
    arrival + TTFT and the rest any time (the replay's accounting, `adapt.replay.metrics`)."""
    g, tbt = c["generated"], np.nan_to_num(c["tbt"], nan=0.0)
    has_ttft, has_tbt = ~np.isnan(c["ttft"]), ~np.isnan(c["tbt"])
    origin = np.where(has_ttft, c["arrival"] + np.nan_to_num(c["ttft"]), c["first_token"])
    slack0 = origin + g * tbt - (start + step_s)  # slack of token g; then it changes by tbt - step
    rate = tbt - step_s
    with np.errstate(divide="ignore", invalid="ignore"):
        late = np.where(rate > 0, np.ceil(-slack0 / np.where(rate > 0, rate, 1.0) - _EPS), rem)
        growing = np.where(slack0 >= 0, rem, np.maximum(0.0, rem - late))
        shrinking = np.where(
            slack0 < 0, 0.0, np.minimum(rem, np.floor(slack0 / np.where(rate < 0, -rate, 1.0) + _EPS) + 1)
        )
    count = np.where(rate >= 0, growing, shrinking)
    # TBT only, no token yet: the first is never late; the rest keep pace if a step fits the TBT.
    count = np.where(has_tbt & ~has_ttft & np.isnan(c["first_token"]), np.where(rate >= 0, rem, 1.0), count)
    # TTFT only: the first token (if still to come) must be in time, the rest always are.
    first_late = (g == 0) & (start + step_s > origin)
    return np.where(has_ttft & ~has_tbt, rem - first_late, count)


def estimates(
    c: dict[str, np.ndarray], now: float, step_s: float, prefill_tokens_per_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """(goodput, t_gen) per row: the goodput tokens earned if served from now at one token per
    step, and the generation time that takes (prefill plus the bounded remaining decode)."""
    rem = remaining(c)
    t_pre = np.maximum(c["prefill"], 0.0) / prefill_tokens_per_s
    t_gen = t_pre + rem * step_s
    tokens = c["prompt"] + c["generated"] + rem
    kind = c["kind"]
    # Each kind's rule, computed only where a row has that kind (a trace without SLOs, the common
    # case, is all best effort): per row, the same numbers as evaluating every rule for every row.
    goodput = np.array(tokens, dtype=np.float64)
    latency = kind == KINDS["latency"]
    if latency.any():
        goodput[latency] = on_time_tokens(c, now + t_pre, rem, step_s)[latency]
    deadline, compound = kind == KINDS["deadline"], kind == KINDS["compound"]
    if deadline.any() or compound.any():
        in_time = bandwidth(t_gen, c["deadline"] - now) <= 1
        goodput[deadline] = np.where(in_time, tokens, 0.0)[deadline]
        if compound.any():
            in_stage_time = bandwidth(t_gen, c["stage_deadline"] - now) <= 1
            goodput[compound] = np.where(in_stage_time, tokens, np.where(in_time, tokens / 2, 0.0))[compound]
    return goodput, t_gen


def select_batch(priority: np.ndarray, input_lengths: list[int], batch: int, cutoff: float) -> list[int]:
    """GMAX's grouped selection: keep candidates with priority >= cutoff * (B-th highest), sort
    them by input length, return the indices of the B consecutive ones with the largest priority
    sum (all candidates when there are no more than B)."""
    n = len(priority)
    if n <= batch:
        return list(range(n))
    kth = np.partition(priority, n - batch)[n - batch]
    keep = np.flatnonzero(priority >= cutoff * kth)
    if len(keep) <= batch:
        return keep.tolist()
    keep = keep[np.argsort(np.asarray(input_lengths)[keep], kind="stable")]
    sums = np.convolve(priority[keep], np.ones(batch), mode="valid")
    start = int(np.argmax(sums))
    return keep[start : start + batch].tolist()
