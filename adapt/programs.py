"""Compound programs as data: the stage sequence of an agent, a deep-research run or a test-time-
scaling chat, and the JSONL format they are stored in.

A program is a sequence of stages; stage s is one node -- a tool call (identity, duration) or a
fan-out of parallel calls to one model (identity, number of calls, mean prompt and output length per
call, longest output, duration) -- that consumes the previous stage's outputs. The workload generator
(`adapt.workloads.compound`), the `pattern-graph` matcher and the serving logs all speak it, so it
lives in the core.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StageNode:
    """One stage of a program: a tool call or `width` parallel calls to one model."""

    kind: str
    identity: str
    width: int = 1
    input_tokens: float = 0.0
    output_tokens: float = 0.0
    max_output_tokens: float = 0.0
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("llm", "tool"):
            raise ValueError(f"stage.kind: expected llm or tool, got {self.kind!r}")
        if self.width < 1 or self.duration_s < 0 or self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"stage {self.identity!r}: width >= 1 and non-negative lengths and duration")

    @property
    def key(self) -> str:
        """What must agree for two stages to be the same kind of step (the pruning rule)."""
        return f"{self.kind}:{self.identity}"


@dataclass(frozen=True)
class ProgramGraph:
    program_id: str
    stages: tuple[StageNode, ...]

    def shares(self) -> np.ndarray:
        """phi(s) for every stage: accumulated duration up to and including s over the total."""
        durations = np.array([max(stage.duration_s, 1e-9) for stage in self.stages])
        return np.cumsum(durations) / durations.sum()

    def to_dict(self) -> dict[str, Any]:
        return {"program_id": self.program_id, "stages": [asdict(s) for s in self.stages]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProgramGraph:
        return cls(data["program_id"], tuple(StageNode(**s) for s in data["stages"]))


def write_graphs(path: str | Path, graphs: Sequence[ProgramGraph]) -> Path:
    """Programs as JSONL, one graph per line (the format `adapt train pattern-graph --data` reads)."""
    path = Path(path)
    with open(path, "w") as handle:
        for graph in graphs:
            handle.write(json.dumps(graph.to_dict()) + "\n")
    return path


def read_graphs(path: str | Path) -> list[ProgramGraph]:
    """Read a JSONL file of programs; a bad line is reported with its number and the reason."""
    graphs = []
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                graphs.append(ProgramGraph.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a program graph ({exc})") from exc
    return graphs
