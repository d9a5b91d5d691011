"""Test doubles for the replay engine: a constant-time cost model, an invariant-checking engine and
a synthetic step log."""

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

    arrival_overhead_s = 0.0


class CheckedEngine(ReplayEngine):
    """Asserts the engine's invariants at every step and records each completion."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.completions: dict[str, int] = {}
        self.violations: list[str] = []

    def _execute(self, scheduled, trace=None):
        tokens = sum(n for _, n in scheduled)
        ids = [s.id for s, _ in scheduled]
        limit = self.token_budget
        if self.policy.prefill_first:
            limit = max(limit, max(n for _, n in scheduled))
        if tokens > limit:
            self.violations.append(f"budget: {tokens} > {limit}")
        if len(set(ids)) != len(ids):
            self.violations.append("request scheduled twice in one step")
        self._check_limits()
        before = self.now
        super()._execute(scheduled, trace)
        if not self.now > before:
            self.violations.append(f"time did not advance at {before}")

    def _bulk_decode_step(self, plan):
        before, steps = self.now, self.recorder._steps
        taken = super()._bulk_decode_step(plan)
        if taken:
            self._check_limits()
            if not self.now > before or self.recorder._steps != steps + 1:
                self.violations.append(f"a bulk decode step at {before} took no step or several")
        return taken

    def _check_limits(self):
        if len(self.running) > self.config.max_running:
            self.violations.append(f"running cap: {len(self.running)}")
        held = sum(self.kv.held(s.id) for s in self.running)
        if held + self.kv.free_blocks != self.kv.num_blocks or self.kv.free_blocks < 0:
            self.violations.append(f"kv accounting: held {held} free {self.kv.free_blocks}")

    def _decode_run(self, view, order=None):
        before = self.now
        taken = super()._decode_run(view, order)
        if self.now < before:
            self.violations.append("time went backwards in a decode run")
        if self.kv.free_blocks < 0:
            self.violations.append("kv overflow in a decode run")
        return taken

    def _finish(self, state, now):
        if state.id in self.completions:
            self.violations.append(f"{state.id} finished twice")
        self.completions[state.id] = state.tokens_generated
        super()._finish(state, now)


def step_log(seed: int = 0, n: int = 400, noise: float = 0.0) -> dict[str, np.ndarray]:
    """Step-log columns of a made-up engine whose step time is linear in the features (with
    relative noise), for fitting and checking the `cost-model`."""
    rng = np.random.default_rng(seed)
    decodes = rng.integers(0, 64, n).astype(float)
    chunk = rng.integers(0, 512, n).astype(float)
    ctx = decodes * rng.integers(100, 2000, n)
    data = {
        "tokens": decodes + chunk,
        "sampled": decodes + (chunk > 0),
        "prefill_attn_units": chunk * (chunk + 1) / 2,
        "prefill_kv_read": np.zeros(n),
        "num_decodes": decodes,
        "decode_ctx_sum": ctx,
        "decode_ctx_max": ctx,
    }
    true = 0.004 + 2e-5 * data["tokens"] + 1e-9 * (data["prefill_attn_units"] + ctx + decodes) + 3e-8 * ctx
    data["duration_s"] = true * (1 + noise * rng.standard_normal(n))
    return data
