"""Engine-agnostic request data model shared by traces, the replay engine, vLLM hooks and pipelines.

Everything here validates on construction: a bad value is caught where it enters the system (an
importer, an HTTP request, a log line), not deep inside a scheduler step where the cause is lost.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

SLOKind = Literal["latency", "deadline", "compound", "best_effort"]
SLO_KINDS: tuple[str, ...] = ("latency", "deadline", "compound", "best_effort")
NODE_KINDS: tuple[str, ...] = ("llm", "tool")
OUTCOMES: tuple[str, ...] = ("finished", "dropped", "aborted")


class ValidationError(ValueError):
    """A value that violates the data model; the message names the field."""


def _check_positive(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValidationError(f"{name}: expected a finite number, got {value!r}")
    if value <= 0:
        raise ValidationError(f"{name}: must be > 0, got {value!r}")


def _check_count(name: str, value: int, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValidationError(f"{name}: must be >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SLO:
    """A request's service-level objective.

    `latency`: TTFT and/or TBT targets (token i is on time if it arrives by ttft + i * tbt);
    `deadline`: the whole response by `deadline_s` after arrival; `compound`: the last stage of the
    program by `deadline_s` after the program's first arrival; `best_effort`: no target.
    `tier` is a free label (e.g. paying/free) used for strict priority and per-tier reporting.
    """

    kind: SLOKind = "best_effort"
    ttft_s: float | None = None
    tbt_s: float | None = None
    deadline_s: float | None = None
    tier: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in SLO_KINDS:
            raise ValidationError(f"slo.kind: expected one of {', '.join(SLO_KINDS)}, got {self.kind!r}")
        _check_positive("slo.ttft_s", self.ttft_s)
        _check_positive("slo.tbt_s", self.tbt_s)
        _check_positive("slo.deadline_s", self.deadline_s)
        if self.kind == "latency" and self.ttft_s is None and self.tbt_s is None:
            raise ValidationError("slo: kind 'latency' needs ttft_s or tbt_s")
        if self.kind in ("deadline", "compound") and self.deadline_s is None:
            raise ValidationError(f"slo: kind {self.kind!r} needs deadline_s")
        if self.tier is not None and (not isinstance(self.tier, str) or not self.tier):
            raise ValidationError(f"slo.tier: expected a non-empty string, got {self.tier!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SLO:
        unknown = set(data) - {"kind", "ttft_s", "tbt_s", "deadline_s", "tier"}
        if unknown:
            raise ValidationError(f"slo: unknown field(s) {', '.join(sorted(unknown))}")
        return cls(**data)


BEST_EFFORT = SLO()


@dataclass(frozen=True, slots=True)
class ProgramRef:
    """Where a request sits inside a compound program (an agent, a RAG pipeline, a tool loop).

    `stage` counts LLM/tool nodes from 0 in program order; `parent_ids` are the request ids whose
    outputs this node consumes. `start_s` is the program's first arrival (a compound deadline runs
    from it); `after_parents_s` is the time between the last parent finishing and this request
    arriving (a tool call in between), which an engine that releases dependants itself uses.
    `num_stages` and `deadline_share` (the share of the program's execution time up to and
    including this stage, JITServe's phi(s)) are only known to oracles and the workload generator.
    """

    program_id: str
    stage: int
    node_kind: Literal["llm", "tool"] = "llm"
    parent_ids: tuple[str, ...] = ()
    num_stages: int | None = None
    start_s: float | None = None
    after_parents_s: float = 0.0
    deadline_share: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.program_id, str) or not self.program_id:
            raise ValidationError(f"program.program_id: expected a non-empty string, got {self.program_id!r}")
        _check_count("program.stage", self.stage)
        if self.node_kind not in NODE_KINDS:
            raise ValidationError(f"program.node_kind: expected llm or tool, got {self.node_kind!r}")
        if self.num_stages is not None:
            _check_count("program.num_stages", self.num_stages, minimum=1)
            if self.stage >= self.num_stages:
                raise ValidationError(
                    f"program.stage: {self.stage} is not below num_stages {self.num_stages}"
                )
        if self.start_s is not None and (not math.isfinite(self.start_s) or self.start_s < 0):
            raise ValidationError(f"program.start_s: must be a finite time >= 0, got {self.start_s!r}")
        if not (math.isfinite(self.after_parents_s) and self.after_parents_s >= 0):
            raise ValidationError(f"program.after_parents_s: must be >= 0, got {self.after_parents_s!r}")
        if self.deadline_share is not None and not 0 < self.deadline_share <= 1:
            raise ValidationError(f"program.deadline_share: must be in (0, 1], got {self.deadline_share!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProgramRef:
        return cls(**{**data, "parent_ids": tuple(data.get("parent_ids", ()))})


@dataclass(frozen=True, slots=True)
class Request:
    """One request as a trace or workload describes it, before any engine touches it.

    `output_tokens` is the true length the response will have (what the trace recorded); only
    oracle policies may read it. `label` is the class used in `by_class` reports. `max_tokens` is
    the client's cap, which policies do see (unset: whatever the context leaves; a live engine's
    decision log sets it to what the client asked for). `prompt_embedding` is the prompt's vector
    where the request arrives with it (as `adapt serve --embed-prompts` sends it to the engine), a
    float32 array of `predictors.embedding.DIMENSION`; left out of comparisons. `prompt_blocks`
    names the content of the prompt's full KV blocks, one key per block, each standing for the
    whole prefix up to its block's end (vLLM's block hashes): requests whose keys agree share those
    blocks under prefix caching (`EngineConfig.prefix_caching`); empty, nothing is shared.
    `answer_blocks` goes on where it stops, naming the full blocks the answer fills (those past
    the prompt's full blocks, as a live engine hashed them by the request's end): a later prompt
    that contains this answer, a conversation's next turn, shares them; empty, the answer's
    blocks are its own. It needs the key of every full prompt block before it.
    `skip_reading_prefix_cache` is vLLM's flag of that name: such a request (one that asked for
    its prompt's logprobs) computes its whole prompt, cached or not, and still caches it.
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    slo: SLO = BEST_EFFORT
    prompt_text: str | None = None
    program: ProgramRef | None = None
    label: str | None = None
    max_tokens: int | None = None
    prompt_embedding: Any = field(default=None, compare=False, repr=False)
    prompt_blocks: tuple[Hashable, ...] = field(default=(), compare=False, repr=False)
    answer_blocks: tuple[Hashable, ...] = field(default=(), compare=False, repr=False)
    skip_reading_prefix_cache: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValidationError(f"request_id: expected a non-empty string, got {self.request_id!r}")
        if not isinstance(self.arrival_s, int | float) or not math.isfinite(self.arrival_s):
            raise ValidationError(f"arrival_s: expected a finite number, got {self.arrival_s!r}")
        if self.arrival_s < 0:
            raise ValidationError(f"arrival_s: must be >= 0, got {self.arrival_s!r}")
        _check_count("prompt_tokens", self.prompt_tokens, minimum=1)
        _check_count("output_tokens", self.output_tokens, minimum=1)
        if self.max_tokens is not None:
            _check_count("max_tokens", self.max_tokens, minimum=self.output_tokens)
        if not isinstance(self.slo, SLO):
            raise ValidationError(f"slo: expected an SLO, got {type(self.slo).__name__}")
        if self.slo.kind == "compound" and self.program is None:
            raise ValidationError("program: a compound-SLO request needs a program reference")
        for name in ("prompt_blocks", "answer_blocks"):
            if not isinstance(keys := getattr(self, name), tuple):
                raise ValidationError(f"{name}: expected a tuple, got {type(keys).__name__}")


@dataclass(frozen=True, slots=True)
class CompletedRequest:
    """The record a request leaves behind: one line of a request log, one row of a pipeline's data.

    Times are absolute seconds on the engine's clock. `first_token_s` and `finish_s` are None for a
    request dropped before it produced anything. `outcome` is finished, dropped (admission control)
    or aborted (client or engine).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float | None
    finish_s: float | None
    outcome: Literal["finished", "dropped", "aborted"] = "finished"
    slo: SLO = BEST_EFFORT
    program: ProgramRef | None = None
    label: str | None = None
    preemptions: int = 0
    prompt_text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValidationError(f"request_id: expected a non-empty string, got {self.request_id!r}")
        if self.prompt_text is not None and not isinstance(self.prompt_text, str):
            raise ValidationError(
                f"prompt_text: expected a string or null, got {type(self.prompt_text).__name__}"
            )
        _check_count("prompt_tokens", self.prompt_tokens, minimum=1)
        _check_count("output_tokens", self.output_tokens, minimum=0)
        _check_count("preemptions", self.preemptions)
        if not isinstance(self.extra, dict):
            raise ValidationError(f"extra: expected an object, got {type(self.extra).__name__}")
        if self.outcome not in OUTCOMES:
            raise ValidationError(f"outcome: expected one of {', '.join(OUTCOMES)}, got {self.outcome!r}")
        if self.outcome == "finished":
            if self.first_token_s is None or self.finish_s is None:
                raise ValidationError("a finished request needs first_token_s and finish_s")
            if not self.arrival_s <= self.first_token_s <= self.finish_s:
                raise ValidationError(
                    f"times out of order: arrival {self.arrival_s} <= first token {self.first_token_s}"
                    f" <= finish {self.finish_s} does not hold"
                )

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def ttlt_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["program"] = None if self.program is None else asdict(self.program)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompletedRequest:
        data = dict(data)
        data["slo"] = SLO.from_dict(data.get("slo") or {})
        if data.get("program") is not None:
            data["program"] = ProgramRef.from_dict(data["program"])
        return cls(**data)
