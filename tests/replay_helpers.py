"""Test doubles for the replay engine: a constant-time cost model and an invariant-checking engine."""

from __future__ import annotations

import numpy as np

from adapt.replay.engine import ReplayEngine


class ConstantCost:
    """Every step takes `seconds`: makes hand-computed TTFT/TBT cases exact."""

    def __init__(self, seconds: float = 0.1, kv_tokens: int = 1_000_000) -> None:
        self.seconds = seconds
        self.kv_tokens = kv_tokens

    def time(self, batch):
        return self.seconds

    def decode_run_times(self, num_decodes, context_sum, context_max, steps):
        return np.full(steps, self.seconds)

    def kv_capacity_tokens(self) -> int:
        return self.kv_tokens


class CheckedEngine(ReplayEngine):
    """Asserts the engine's invariants at every step and records each completion."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.completions: dict[str, int] = {}
        self.violations: list[str] = []

    def _execute(self, scheduled):
        tokens = sum(n for _, n in scheduled)
        ids = [s.id for s, _ in scheduled]
        limit = self.token_budget
        if self.policy.prefill_first:
            limit = max(limit, max(n for _, n in scheduled))
        if tokens > limit:
            self.violations.append(f"budget: {tokens} > {limit}")
        if len(self.running) > self.config.max_running:
            self.violations.append(f"running cap: {len(self.running)}")
        if len(set(ids)) != len(ids):
            self.violations.append("request scheduled twice in one step")
        held = sum(self.kv.held(s.id) for s in self.running)
        if held + self.kv.free_blocks != self.kv.num_blocks or self.kv.free_blocks < 0:
            self.violations.append(f"kv accounting: held {held} free {self.kv.free_blocks}")
        before = self.now
        super()._execute(scheduled)
        if not self.now > before:
            self.violations.append(f"time did not advance at {before}")

    def _decode_run(self, view):
        before = self.now
        super()._decode_run(view)
        if self.now < before:
            self.violations.append("time went backwards in a decode run")
        if self.kv.free_blocks < 0:
            self.violations.append("kv overflow in a decode run")

    def _finish(self, state):
        if state.id in self.completions:
            self.violations.append(f"{state.id} finished twice")
        self.completions[state.id] = state.tokens_generated
        super()._finish(state)
