"""A replay paused at fixed points of simulated time, for work that must happen between steps.

Online adaptation in replay (retraining on the requests served so far, swapping a promoted model
into the running policy) has to run at the engine's simulated time, between two steps, as a live
engine applies a swap between two scheduling steps. `run_with_checkpoints` drives a
`ReplayEngine` step by step and calls `on_checkpoint(t)` before the first step that starts at or
after each checkpoint time t. The engine's `arrival_fence_s` stops a run of identical decode steps
at the next checkpoint, so a checkpoint is never skipped past by the fast path; it is late by at
most one step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from adapt.replay.engine import ReplayEngine
from adapt.replay.metrics import ReplayResult
from adapt.requests import Request


def checkpoint_times(every_s: float, until_s: float) -> list[float]:
    """every_s, 2 * every_s, ... up to and including until_s."""
    if not every_s > 0:
        raise ValueError(f"every_s: must be > 0, got {every_s}")
    return [k * every_s for k in range(1, math.floor(until_s / every_s + 1e-9) + 1)]


def run_with_checkpoints(
    engine: ReplayEngine,
    requests: Sequence[Request],
    times: Sequence[float],
    on_checkpoint: Callable[[float], None],
) -> ReplayResult:
    """Replay `requests`, calling `on_checkpoint(t)` between steps at each of `times` (ascending)
    that the replay reaches; returns the replay's result as `ReplayEngine.run` does."""
    wall_start = time.perf_counter()
    for request in requests:
        engine.add(request)
    pending = sorted(times)
    position = 0
    while engine.has_work:
        while position < len(pending) and engine.now >= pending[position]:
            on_checkpoint(pending[position])
            position += 1
        engine.arrival_fence_s = pending[position] if position < len(pending) else math.inf
        engine.step()
    engine.drop_unreleased()
    return engine.result(time.perf_counter() - wall_start)
