"""Request metadata in the OpenAI API's `vllm_xargs` (DESIGN.md section 7): the SLO (`slo_kind`,
`ttft_s`, `tbt_s`, `deadline_s`, `tier`), for compound requests `program_id` and `stage`, and
`adapt_embedding`, the prompt's MiniLM vector (384 little-endian float32, base64), which `adapt serve
--embed-prompts` computes in the API server (`serving_hooks.prompt_embedder`). A client may not
send that one: a vector that says "short answer" would move its request ahead of others, and the
engine keeps it for the prompt's text (`EmbeddingCache.remember`), where later requests would find
it. In-process callers of the engine (`adapt fidelity`) are trusted and may set it.

`validate_xargs` runs in the HTTP server (a bad value is an HTTP 400 naming the field); the
`*_from_extra_args` readers run in the scheduler, where the same values arrive as
`sampling_params.extra_args`. Absent fields mean best effort.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from adapt.requests import SLO, ProgramRef, ValidationError
from predictors.embedding import DIMENSION

MAX_PROGRAMS = 10_000  # program start times remembered for compound deadlines
EMBEDDING_FIELD = "adapt_embedding"
ENCODED_LENGTH = 4 * ((DIMENSION * 4 + 2) // 3)  # base64 of DIMENSION float32
UNIT_NORM_TOLERANCE = 1e-3  # SageSched thresholds cosine similarity as an inner product of unit vectors

SLO_FIELDS = {
    "slo_kind": "kind",
    "ttft_s": "ttft_s",
    "tbt_s": "tbt_s",
    "deadline_s": "deadline_s",
    "tier": "tier",
}


def slo_from_extra_args(extra: dict[str, Any] | None) -> SLO:
    """The request's SLO from OpenAI `vllm_xargs`; absent fields mean best effort."""
    if not extra:
        return SLO()
    fields = {ours: extra[theirs] for theirs, ours in SLO_FIELDS.items() if theirs in extra}
    if not fields:
        return SLO()
    fields.setdefault("kind", "latency" if ("ttft_s" in fields or "tbt_s" in fields) else "best_effort")
    return SLO(**fields)


def program_from_extra_args(
    extra: dict[str, Any] | None, starts: dict[str, float], now: float
) -> ProgramRef | None:
    """A compound request's place in its program from `vllm_xargs` (`program_id`, `stage`); the
    program's start is the first time this engine saw any of its calls (`starts`, updated here)."""
    if not extra or "program_id" not in extra:
        return None
    program_id = str(extra["program_id"])
    # Kept in order of last sight, so the one forgotten first is the program seen least recently
    # (by first sight, a burst of one-call programs pushed out a long-running program's start).
    start = starts.pop(program_id, now)
    starts[program_id] = start
    if len(starts) > MAX_PROGRAMS:
        del starts[next(iter(starts))]
    return ProgramRef(program_id, int(extra.get("stage", 0)), start_s=start)


def encode_embedding(vector: np.ndarray) -> str:
    """The `adapt_embedding` value for a prompt's vector."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def embedding_from_extra_args(extra: dict[str, Any] | None) -> np.ndarray | None:
    """The prompt's vector from `adapt_embedding`, None where absent; ValueError naming the field
    for anything but a base64 unit vector of DIMENSION float32 values."""
    if not extra or EMBEDDING_FIELD not in extra:
        return None
    value = extra[EMBEDDING_FIELD]
    field = f"vllm_xargs.{EMBEDDING_FIELD}"
    if not isinstance(value, str):
        raise ValueError(f"{field}: expected a base64 string, got {type(value).__name__}")
    if len(value) != ENCODED_LENGTH:  # before decoding: a huge string costs nothing here
        raise ValueError(
            f"{field}: expected {ENCODED_LENGTH} base64 characters ({DIMENSION} float32), got {len(value)}"
        )
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        raise ValueError(f"{field}: not valid base64") from None
    if len(raw) != DIMENSION * 4:  # padding: 2048 characters may hold 1534 to 1536 bytes
        raise ValueError(f"{field}: expected {DIMENSION} float32 values, got {len(raw)} bytes")
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(vector).all():
        raise ValueError(f"{field}: values must be finite")
    norm = float(np.linalg.norm(vector))
    if abs(norm - 1.0) > UNIT_NORM_TOLERANCE:
        raise ValueError(f"{field}: expected a unit vector (L2-normalised), got norm {norm:.4f}")
    return vector


def validate_xargs(xargs: Any) -> str | None:
    """None when `vllm_xargs` carries a valid SLO/program (or none), else the error message."""
    if xargs is None:
        return None
    if not isinstance(xargs, dict):
        return f"vllm_xargs: expected an object, got {type(xargs).__name__}"
    try:
        slo_from_extra_args(xargs)  # the SLO's own checks; only the names change to the API's
    except OverflowError as exc:  # an integer too large for a float (10**400): a 400, not a 500
        return f"vllm_xargs: a number out of range ({exc})"
    except ValidationError as exc:
        message = str(exc).replace("slo.kind", "vllm_xargs.slo_kind").replace("slo.", "vllm_xargs.")
        return message if message.startswith("vllm_xargs") else f"vllm_xargs: {message}"
    if "stage" in xargs and "program_id" not in xargs:
        return "vllm_xargs.stage: needs program_id"
    if "program_id" in xargs and (not isinstance(xargs["program_id"], str) or not xargs["program_id"]):
        return f"vllm_xargs.program_id: expected a non-empty string, got {xargs['program_id']!r}"
    stage = xargs.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        return f"vllm_xargs.stage: expected an integer >= 0, got {stage!r}"
    if EMBEDDING_FIELD in xargs:
        return (
            f"vllm_xargs.{EMBEDDING_FIELD}: set by the server (adapt serve --embed-prompts), not by clients"
        )
    return None
