"""Request metadata in the OpenAI API's `vllm_xargs` (DESIGN.md section 7): the SLO (`slo_kind`,
`ttft_s`, `tbt_s`, `deadline_s`, `tier`) and, for compound requests, `program_id` and `stage`.

`validate_xargs` runs in the HTTP server (a bad value is an HTTP 400 naming the field); the
`*_from_extra_args` readers run in the scheduler, where the same values arrive as
`sampling_params.extra_args`. Absent fields mean best effort.
"""

from __future__ import annotations

from typing import Any

from adapt.requests import SLO, ProgramRef, ValidationError

MAX_PROGRAMS = 10_000  # program start times remembered for compound deadlines

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
    start = starts.setdefault(program_id, now)
    if len(starts) > MAX_PROGRAMS:
        del starts[next(iter(starts))]
    return ProgramRef(program_id, int(extra.get("stage", 0)), start_s=start)


def validate_xargs(xargs: Any) -> str | None:
    """None when `vllm_xargs` carries a valid SLO/program (or none), else the error message."""
    if xargs is None:
        return None
    if not isinstance(xargs, dict):
        return f"vllm_xargs: expected an object, got {type(xargs).__name__}"
    try:
        slo_from_extra_args(xargs)  # the SLO's own checks; only the names change to the API's
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
    return None
