"""Generated compound programs for JITServe's workloads: chatbot-compound, deep-research and
agentic-codegen.

The JITServe paper gives length statistics for two of its applications (Table 2, per compound
request, summed over its calls): Chatbot compound input 1300 / output 4458 tokens (mean), Deep
Research compound input 12223 / output 3541. It does not publish the programs' shapes, so we assume
the usual ones and pick per-call lengths whose program totals land near those means:

- chatbot-compound (test-time scaling): 3-5 parallel answers (prompt ~150, output ~1000 tokens
  each), then one aggregating call (prompt ~700, output ~500). Mean totals ~1300 in / ~4500 out.
- deep-research (plan, search, read, report): a planning call (400 / 300), then one round (70%) or
  two (30%) of a search tool call (~1.5 s) followed by 3-6 parallel reading calls (1700 / 350
  each), then a report call (2500 / 1200). Mean totals ~12,800 in / ~3,500 out.
- agentic-codegen (AutoGen coder/executor loop; no Table 2 row, our assumption): 1-3 rounds of a
  coding call (prompt 800 + 400 per round, output 350) followed by a code-execution tool call
  (~2 s), then a closing call (1500 / 200).

Lengths are log-normal around those means (sigma 0.5; tool times sigma 0.6). Every LLM call of a
stage depends on every call of the previous LLM stage; a tool stage between them is the delay
`after_parents_s` before the next calls arrive. Tool identity is recorded as plain "tool": a
serving engine sees only the gap, so graphs it logs and graphs generated here must look alike.
Stage durations in the generated graphs are nominal (`NOMINAL_TOKEN_S` per output token of the
longest call plus `NOMINAL_PREFILL_S` per prompt token), used only for the oracle's phi(s) and for
training `pattern-graph`; the replay measures real ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from adapt.programs import ProgramGraph, StageNode
from adapt.requests import SLO, ProgramRef, Request

NOMINAL_TOKEN_S = 0.025
NOMINAL_PREFILL_S = 1e-4
DEADLINE_PER_LLM_STAGE_S = 20.0  # the paper: 20 s x number of stages
MODEL = "llm"


@dataclass(frozen=True)
class Stage:
    """An LLM stage (`calls` = (prompt, output) per parallel call) or a tool stage (`tool_s`)."""

    calls: tuple[tuple[int, int], ...] = ()
    tool_s: float = 0.0

    @property
    def is_tool(self) -> bool:
        return not self.calls

    def node(self) -> StageNode:
        if self.is_tool:
            return StageNode("tool", "tool", duration_s=self.tool_s)
        prompts = [p for p, _ in self.calls]
        outputs = [o for _, o in self.calls]
        duration = max(outputs) * NOMINAL_TOKEN_S + max(prompts) * NOMINAL_PREFILL_S
        return StageNode(
            "llm",
            MODEL,
            width=len(self.calls),
            input_tokens=float(np.mean(prompts)),
            output_tokens=float(np.mean(outputs)),
            max_output_tokens=float(max(outputs)),
            duration_s=duration,
        )


def _tokens(rng: np.random.Generator, mean: float, sigma: float = 0.5) -> int:
    return max(1, round(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma)))


def _seconds(rng: np.random.Generator, mean: float, sigma: float = 0.6) -> float:
    return float(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma))


def _calls(rng: np.random.Generator, width: int, prompt: float, output: float) -> Stage:
    return Stage(calls=tuple((_tokens(rng, prompt), _tokens(rng, output)) for _ in range(width)))


def chatbot_compound(rng: np.random.Generator) -> list[Stage]:
    width = int(rng.integers(3, 6))
    return [_calls(rng, width, 150, 1000), _calls(rng, 1, 700, 500)]


def deep_research(rng: np.random.Generator) -> list[Stage]:
    stages = [_calls(rng, 1, 400, 300)]
    for _ in range(1 if rng.random() < 0.7 else 2):
        stages.append(Stage(tool_s=_seconds(rng, 1.5)))
        stages.append(_calls(rng, int(rng.integers(3, 7)), 1700, 350))
    stages.append(_calls(rng, 1, 2500, 1200))
    return stages


def agentic_codegen(rng: np.random.Generator) -> list[Stage]:
    stages = []
    for round_ in range(int(rng.integers(1, 4))):
        stages.append(_calls(rng, 1, 800 + 400 * round_, 350))
        stages.append(Stage(tool_s=_seconds(rng, 2.0)))
    stages.append(_calls(rng, 1, 1500, 200))
    return stages


PROGRAMS: dict[str, Callable[[np.random.Generator], list[Stage]]] = {
    "chatbot-compound": chatbot_compound,
    "deep-research": deep_research,
    "agentic-codegen": agentic_codegen,
}


def program_graph(program_id: str, stages: list[Stage]) -> ProgramGraph:
    return ProgramGraph(program_id, tuple(stage.node() for stage in stages))


def program_requests(
    program_id: str, stages: list[Stage], start_s: float, label: str = "compound"
) -> list[Request]:
    """The LLM calls of one program as requests: stage-0 calls arrive at `start_s`, later ones
    when the engine releases them (parents finished, plus the tool time in between). The SLO is
    20 s per LLM stage from `start_s`; `deadline_share` is the true phi(s), for the oracle."""
    shares = program_graph(program_id, stages).shares()
    llm_stages = sum(1 for stage in stages if not stage.is_tool)
    slo = SLO(kind="compound", deadline_s=DEADLINE_PER_LLM_STAGE_S * llm_stages)
    requests: list[Request] = []
    parents: tuple[str, ...] = ()
    tool_s = 0.0
    for index, stage in enumerate(stages):
        if stage.is_tool:
            tool_s += stage.tool_s
            continue
        ids = tuple(f"{program_id}.s{index}.c{j}" for j in range(len(stage.calls)))
        for request_id, (prompt, output) in zip(ids, stage.calls, strict=True):
            program = ProgramRef(
                program_id,
                index,
                parent_ids=parents,
                num_stages=len(stages),
                start_s=start_s,
                after_parents_s=tool_s,
                deadline_share=float(min(1.0, shares[index])),
            )
            requests.append(
                Request(request_id, start_s, prompt, output, slo=slo, program=program, label=label)
            )
        parents, tool_s = ids, 0.0
    return requests


def generate_programs(
    n: int, seed: int, kinds: tuple[str, ...] = tuple(PROGRAMS)
) -> list[tuple[str, list[Stage]]]:
    """n programs, kinds drawn uniformly from `kinds`; ids are `<kind>-<seed>-<i>`."""
    unknown = set(kinds) - set(PROGRAMS)
    if unknown:
        raise ValueError(f"kinds: unknown {sorted(unknown)}; expected some of {', '.join(PROGRAMS)}")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(kinds), size=n)
    return [(f"{kinds[k]}-{seed}-{i}", PROGRAMS[kinds[k]](rng)) for i, k in enumerate(picks)]


def generate_graphs(n: int, seed: int) -> list[ProgramGraph]:
    """Training/evaluation data for `pattern-graph`: n generated programs as graphs."""
    return [program_graph(pid, stages) for pid, stages in generate_programs(n, seed)]
