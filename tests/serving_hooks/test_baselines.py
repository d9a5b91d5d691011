"""The baselines' formulas by hand: FastServe's skip-join MLFQ, PLAS's program-level attained
service, TRAIL's remaining-length order with limited preemption, LTR's point prediction."""

from __future__ import annotations

import pytest

from adapt.policy import EngineView, RequestState
from adapt.requests import SLO, ProgramRef
from serving_hooks.policies.baselines import LTR, PLAS, FastServe, Trail


def state(rid: str, prompt: int = 100, arrival: float = 0.0, program: str | None = None) -> RequestState:
    ref = ProgramRef(program, 0) if program is not None else None
    return RequestState(rid, arrival, prompt, 1000, SLO(), program=ref)


def view(waiting, running, max_running=8, kv_usage=0.1) -> EngineView:
    return EngineView(1.0, waiting, running, kv_usage, 2048, max_running, 0.03, step_index=0)


@pytest.mark.parametrize(
    ("prompt", "level"),
    # Level L covers 512 * 2**L prompt tokens; a request joins the first level that covers its
    # prompt. The former floor(log2(1 + prompt / 512)) put 512 at 1, 1,280 at 1 (1,024 < 1,280),
    # 2,560 at 2 and 5,000 at 3: one level too high in priority.
    [(1, 0), (512, 0), (513, 1), (1024, 1), (1025, 2), (1280, 2), (2048, 2), (2049, 3), (2560, 3),
     (5000, 4), (16384, 5), (10**6, 5)],
)  # fmt: skip
def test_fastserve_joins_the_first_level_whose_quantum_covers_the_prompt(prompt, level):
    assert FastServe()._level(state("r", prompt)) == level


def test_fastserve_demotes_after_each_levels_quantum_and_preempts_a_lower_level_when_full():
    policy = FastServe(base_quantum=32)
    running = state("long", 100)
    policy.on_arrival(running, 0.0)
    policy.on_admit(running, 0.0)
    for generated, level in ((31, 0), (32, 1), (95, 1), (96, 2)):  # quanta 32, then 64
        running.tokens_generated = generated
        policy.on_step(view([], [running]))
        assert policy._level(running) == level, generated
    newcomer = state("new", 100, arrival=0.5)
    policy.on_arrival(newcomer, 0.5)
    assert policy.on_step(view([newcomer], [running], max_running=1)).preempt == [running]
    assert policy.on_step(view([newcomer], [running], max_running=2)).preempt == []  # not full


def test_plas_counts_a_programs_service_once_however_often_a_call_is_preempted():
    policy = PLAS()
    p1 = state("p1", program="P")
    policy.on_arrival(p1, 0.0)
    policy.on_admit(p1, 0.0)
    for generated in (10, 30):  # preempted twice; it keeps its tokens across each (recompute)
        p1.tokens_generated = generated
        policy.on_preempt(p1, 1.0)
        policy.on_admit(p1, 1.0)
    p1.tokens_generated = 50
    policy.on_finish(p1, 2.0)
    assert policy._attained["P"] == 50  # was 60: the first 10 tokens counted twice
    q1 = state("q1", program="Q")
    policy.on_arrival(q1, 0.0)
    policy.on_admit(q1, 0.0)
    q1.tokens_generated = 55
    policy.on_finish(q1, 2.0)
    later_p, later_q = state("p2", arrival=3.0, program="P"), state("q2", arrival=3.0, program="Q")
    assert policy.key(later_p, 3.0) == (50, 3.0) and policy.key(later_q, 3.0) == (55, 3.0)


def test_trail_orders_by_predicted_remaining_refines_and_preempts_only_young_requests():
    predictions = {"a": 40.0, "b": 300.0, "c": 10.0}
    policy = Trail(predict=lambda r: predictions[r.id], refresh=50, preempt_before=256)
    a, b = state("a"), state("b")
    for request in (a, b):
        policy.on_arrival(request, 0.0)
        policy.on_admit(request, 0.0)
    a.tokens_generated, b.tokens_generated = 60, 100
    policy.on_step(view([], [a, b]))  # 60 >= 50: a's total refined to max(40, 61)
    assert a.cache["trail_total"] == 61.0 and policy._remaining(a) == 1.0
    assert policy._remaining(b) == 200.0  # refined too: max(300, 101) - 100
    c = state("c", arrival=1.0)
    policy.on_arrival(c, 1.0)
    full = policy.on_step(view([c], [a, b], max_running=2))
    assert full.preempt == [b]  # the longest remaining (200 > c's 10) among those under 256 tokens
    b.tokens_generated = 256
    assert policy.on_step(view([c], [a, b], max_running=2)).preempt == []  # too old to displace


def test_ltr_ranks_by_the_prediction_made_on_arrival():
    calls = []

    def predict(request):
        calls.append(request.id)
        return {"x": 300.0, "y": 20.0}[request.id]

    policy = LTR(predict=predict)
    x, y = state("x", arrival=0.0), state("y", arrival=1.0)
    for request in (x, y):
        policy.on_arrival(request, request.arrival_s)
    assert [r.id for r in policy.waiting_in_order()] == ["y", "x"]
    assert policy.key(x, 5.0) == (300.0, 0.0) and calls == ["x", "y"]  # predicted once each


def test_plas_and_ewsjf_keep_bounded_state_however_many_requests_they_serve(monkeypatch):
    # 100,000 finished requests left 100,000 entries in PLAS (about 1 GB a day at 100 req/s) and
    # 100,000 lengths in EWSJF's queues.
    import serving_hooks.policies.baselines as baselines
    import serving_hooks.policies.ewsjf as ewsjf

    monkeypatch.setattr(baselines, "MAX_PROGRAMS", 10)
    plas = PLAS()
    for i in range(50):
        for request in (state(f"own{i}"), state(f"call{i}", program=f"prog{i}")):
            plas.on_arrival(request, 0.0)
            plas.on_admit(request, 0.0)
            request.tokens_generated = 5
            plas.on_finish(request, 1.0)
    assert list(plas._attained) == [f"prog{i}" for i in range(40, 50)]  # the 10 most recent
    monkeypatch.setattr(ewsjf, "ROUTED_KEPT", 7)
    policy = ewsjf.EWSJF()
    for i in range(30):
        policy.on_arrival(state(f"r{i}", prompt=100), 0.0)
    assert sum(len(queue.assigned) for queue in policy.queues) <= 7 * len(policy.queues)
