"""`ReplayEngine.abort`: a request that did not finish (its client aborted it, or it ended in an
error) leaves between two steps, as vLLM's `finish_requests` frees it."""

from __future__ import annotations

from adapt.policy import EngineView, Plan, Policy, RequestState
from adapt.replay.engine import EngineConfig, ReplayEngine
from adapt.requests import Request
from tests.replay_helpers import ConstantCost


class Heard(Policy):
    """Admits by arrival; remembers what it heard: arrivals, and each finish's time."""

    name = "heard"

    def __init__(self) -> None:
        self.arrived: list[str] = []
        self.finished: dict[str, float | None] = {}

    def on_arrival(self, request: RequestState, now: float) -> None:
        self.arrived.append(request.id)

    def on_finish(self, request: RequestState, now: float) -> None:
        self.finished[request.id] = request.finish_s

    def on_step(self, view: EngineView) -> Plan:
        return Plan(admit=list(view.waiting))


def test_an_aborted_request_is_not_served_and_its_policy_hears_no_finish():
    """a runs with a token in flight (async scheduling), b waits behind it (one may run), c has not
    reached the engine: each aborted leaves its queue and blocks, and counts as dropped ("aborted"),
    never as completed; c first arrives (it reached the live engine before the abort). a's token
    in flight is discarded when it comes; d, untouched, is served."""
    policy = Heard()
    config = EngineConfig(block_size=4, kv_capacity_tokens=64, max_running=1, async_scheduling=True)
    engine = ReplayEngine(policy, ConstantCost(0.1), config)
    for request in (Request("a", 0.0, 8, 10), Request("b", 0.0, 8, 10), Request("c", 0.35, 8, 10)):
        engine.add(request)
    engine.add(Request("d", 0.5, 8, 3))
    for _ in range(3):
        engine.step()
    assert [s.id for s in engine.running] == ["a"] and engine.kv.free_blocks < engine.kv.num_blocks
    assert engine._placeholders["a"] == 1  # its next token is in flight
    assert engine.abort("a") and engine.abort("b")
    assert not engine.running and not engine.waiting and engine.kv.free_blocks == engine.kv.num_blocks
    assert engine.abort("c", at=0.4) and policy.arrived == ["a", "b", "c"]
    assert not engine.abort("a")  # gone already
    while engine.has_work:
        engine.step()
    metrics = engine.result(0.0).metrics()
    assert policy.finished.keys() == {"a", "b", "c", "d"} and policy.finished["d"] is not None
    assert [policy.finished[key] for key in "abc"] == [None, None, None]
    assert metrics["completed"] == 1 and metrics["dropped_by_reason"] == {"aborted": 3}
