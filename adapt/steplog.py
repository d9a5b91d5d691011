"""What a scheduling step is, and the cost-model contract over it.

Every engine describes a step by the same features (`StepBatch`, built by `step_batch` from the
(tokens, cached) pairs it scheduled): the replay engine to time the step with a cost model, the vLLM
adapter's monitor to log it, the `cost-model` component to learn from those logs. Computing them
in one place is what makes a cost model fitted to live step logs mean the same thing in replay.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

STEP_FIELDS: tuple[str, ...] = (
    "tokens",  # tokens computed this step (prefill chunks + decodes)
    "sampled",  # requests that produced a token
    "prefill_attn_units",  # sum of c * p + c * (c + 1) / 2 over prefill chunks of c after p cached
    "prefill_kv_read",  # sum of p over prefill chunks
    "num_decodes",
    "decode_ctx_sum",  # cached context summed over decodes
    "decode_ctx_max",
)
STEP_LOG_COLUMNS: tuple[str, ...] = (*STEP_FIELDS, "duration_s")


@dataclass(frozen=True)
class StepBatch:
    """The features of one step that its cost depends on (arrays for many steps at once).

    Prefill chunks: `prefill_attn_units` = sum of c * p + c * (c + 1) / 2 for a chunk of c tokens
    after p cached ones, `prefill_kv_read` = sum of p. Decodes: their number and the sum and max of
    their cached contexts (a decode attends over its context plus itself).
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
