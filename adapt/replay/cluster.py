"""Several engine replicas behind a request router, for cluster-level questions.

Replicas advance independently; before each arrival is routed, every replica is stepped up to
the arrival time, so the router sees each replica's state as it is at that moment.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from adapt.replay.engine import ReplayEngine
from adapt.replay.metrics import ReplayResult
from adapt.requests import Request

Router = Callable[[Sequence[ReplayEngine], Request], int]
ROUTERS: tuple[str, ...] = ("round-robin", "random", "least-outstanding")


def make_router(name: str, seed: int = 0) -> Router:
    """`round-robin`, `random` (seeded) or `least-outstanding` (fewest requests in the replica)."""
    if name == "round-robin":
        counter = iter(range(1 << 62))
        return lambda engines, request: next(counter) % len(engines)
    if name == "random":
        rng = np.random.default_rng(seed)
        return lambda engines, request: int(rng.integers(len(engines)))
    if name == "least-outstanding":
        return lambda engines, request: min(range(len(engines)), key=lambda i: engines[i].outstanding)
    raise ValueError(f"router: unknown {name!r}; expected one of {', '.join(ROUTERS)}")


class Cluster:
    def __init__(self, engines: Sequence[ReplayEngine], router: Router) -> None:
        if not engines:
            raise ValueError("engines: need at least one replica")
        self.engines = list(engines)
        self.router = router

    def _advance(self, until_s: float) -> None:
        for engine in self.engines:
            engine.arrival_fence_s = until_s
            while (
                engine.has_work
                and engine.now < until_s
                and (engine.waiting or engine.running or engine.next_arrival_s < until_s)
            ):
                engine.step()

    def run(self, requests: Sequence[Request], *, progress=None) -> ReplayResult:
        wall_start = time.perf_counter()
        done = 0
        home: dict[str, int] = {}  # a compound program's requests stay on its first replica
        for request in requests:
            parents = request.program.parent_ids if request.program is not None else ()
            if parents:
                replica = home[parents[0]]
            else:
                self._advance(request.arrival_s)
                replica = self.router(self.engines, request)
            home[request.request_id] = replica
            self.engines[replica].add(request)
            if progress is not None:
                now_done = sum(e.recorder.done_count for e in self.engines)
                progress(now_done - done)
                done = now_done
        for engine in self.engines:
            engine.arrival_fence_s = math.inf
        self._advance(math.inf)
        for engine in self.engines:
            engine.drop_unreleased()
        if progress is not None:
            progress(sum(e.recorder.done_count for e in self.engines) - done)
        results = [engine.result(0.0) for engine in self.engines]
        return ReplayResult.merge(results, time.perf_counter() - wall_start)
