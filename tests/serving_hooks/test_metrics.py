"""The scheduler's Prometheus recorder (`serving_hooks.metrics`) on hand-made requests: SLO
outcomes, goodput, latency histograms, the quality windows and the drift alarm, swap counting, and
bounded labels. The wiring into vLLM's scheduler is checked by tests/integration/test_metrics_serve."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from adapt.policy import Policy, RequestState
from adapt.requests import SLO
from serving_hooks.metrics import MAX_TIERS, SchedulerMetrics, goodput_tokens, slo_met
from tests.serving_helpers import fake_slot


def _request(
    slo: SLO, *, arrival=0.0, first=None, finish=None, generated=0, prompt=10, request_id="r"
) -> RequestState:
    state = RequestState(request_id, arrival, prompt, 64, slo)
    state.first_token_s, state.finish_s, state.tokens_generated = first, finish, generated
    return state


class _Bounded(Policy):
    """A policy whose bound is in the request's cache, as jitserve's is."""

    name = "bounded"
    components = {"qrf": "qrf-length"}  # noqa: RUF012

    def on_step(self, view):  # pragma: no cover - never scheduled here
        raise NotImplementedError

    def length_bound(self, request):
        return ("qrf-length", request.cache["bound"]) if "bound" in request.cache else None


def _value(metrics: SchedulerMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_slo_met_by_hand():
    latency = SLO("latency", ttft_s=1.0, tbt_s=0.1)
    # first token at 0.9 <= 1.0; last (11th) token by 1.0 + 10 * 0.1 = 2.0
    assert slo_met(_request(latency, first=0.9, finish=2.0, generated=11))
    assert not slo_met(_request(latency, first=0.9, finish=2.01, generated=11))
    assert not slo_met(_request(latency, first=1.1, finish=1.2, generated=2))  # TTFT missed
    tbt_only = SLO("latency", tbt_s=0.1)  # from the first token: 5.0 + 4 * 0.1 = 5.4
    assert slo_met(_request(tbt_only, first=5.0, finish=5.4, generated=5))
    assert not slo_met(_request(tbt_only, first=5.0, finish=5.5, generated=5))
    deadline = SLO("deadline", deadline_s=3.0)
    assert slo_met(_request(deadline, arrival=1.0, first=1.5, finish=4.0, generated=3))
    assert not slo_met(_request(deadline, arrival=1.0, first=1.5, finish=4.1, generated=3))
    assert slo_met(_request(SLO(), first=9.0, finish=99.0, generated=1))
    assert not slo_met(_request(SLO()))  # never finished
    assert goodput_tokens(_request(latency, generated=11)) == 11
    assert goodput_tokens(_request(deadline, generated=3)) == 13


def test_finished_requests_count_by_class_tier_and_outcome():
    metrics = SchedulerMetrics()
    policy = _Bounded()
    paying = SLO("deadline", deadline_s=2.0, tier="paying")
    metrics.finished(_request(paying, first=0.5, finish=1.5, generated=5), "finished", policy)
    metrics.finished(_request(paying, first=0.5, finish=2.5, generated=5), "finished", policy)
    metrics.finished(_request(paying), "dropped", policy)
    metrics.finished(_request(SLO(), first=0.2, finish=1.0, generated=3), "finished", policy)
    metrics.finished(_request(SLO()), "aborted", policy)
    assert (
        _value(metrics, "adapt_slo_requests_total", slo_class="best_effort", tier="none", outcome="met")
        is None
    )
    metrics.flush()  # held in memory until then (what `publish` does every second)
    slo = "adapt_slo_requests_total"
    assert _value(metrics, slo, slo_class="deadline", tier="paying", outcome="met") == 1
    assert _value(metrics, slo, slo_class="deadline", tier="paying", outcome="violated") == 1
    assert _value(metrics, slo, slo_class="deadline", tier="paying", outcome="dropped") == 1
    assert _value(metrics, slo, slo_class="best_effort", tier="none", outcome="met") == 1
    assert _value(metrics, "adapt_requests_aborted_total", slo_class="best_effort") == 1
    assert _value(metrics, "adapt_goodput_tokens_total", slo_class="deadline", tier="paying") == 15
    # TTFT 0.5, 0.5, 0.2; TBT (1.5 - 0.5) / 4 = 0.25, (2.5 - 0.5) / 4 = 0.5, (1.0 - 0.2) / 2 = 0.4
    assert _value(metrics, "adapt_ttft_seconds_count", slo_class="deadline") == 2
    assert _value(metrics, "adapt_ttft_seconds_sum", slo_class="deadline") == pytest.approx(1.0)
    assert _value(metrics, "adapt_tbt_seconds_sum", slo_class="deadline") == pytest.approx(0.75)
    assert _value(metrics, "adapt_tbt_seconds_sum", slo_class="best_effort") == pytest.approx(0.4)


def test_tiers_beyond_the_first_few_share_one_label():
    metrics = SchedulerMetrics()
    for i in range(MAX_TIERS + 3):
        state = _request(SLO(tier=f"t{i}"), first=0.1, finish=0.2, generated=1)
        metrics.finished(state, "finished", _Bounded())
    metrics.flush()
    labels = {
        sample.labels["tier"]
        for family in metrics.registry.collect()
        if family.name == "adapt_slo_requests"
        for sample in family.samples
    }
    assert len(labels) == MAX_TIERS + 1 and "other" in labels


def _finish_with_bound(metrics, policy, generated, bound, request_id="r"):
    state = _request(SLO(), first=0.1, finish=1.0, generated=generated, request_id=request_id)
    state.cache["bound"] = bound
    metrics.finished(state, "finished", policy)


def test_coverage_window_and_drift_alarm_reach_gauges_and_status():
    metrics = SchedulerMetrics(window=10, drift_margin=0.05, drift_least=10)
    policy = _Bounded()
    for i in range(10):  # outputs 1..10 under a bound of 7 tokens: coverage 0.7, ratios 7/n
        _finish_with_bound(metrics, policy, i + 1, 7.0, request_id=f"r{i}")
    held_out_figures = {"coverage_at_0": 0.93, "coverage_at_50": 0.95}
    slot = fake_slot("qrf-length", 3, swaps=1, held_out=held_out_figures, last=1e9)
    live = SimpleNamespace(slots={"qrf": slot}, config_slot=None)
    quality = metrics.publish(0.0, policy=policy, waiting=[], running=0, kv_usage=0.25, live=live)
    assert _value(metrics, "adapt_length_bound_coverage", component="qrf-length") == pytest.approx(0.7)
    expected_ratio = sum(7 / n for n in range(1, 11)) / 10
    overestimate = _value(metrics, "adapt_length_bound_overestimate_ratio", component="qrf-length")
    assert overestimate == pytest.approx(expected_ratio)
    held_out = _value(metrics, "adapt_length_bound_heldout_coverage", component="qrf-length")
    assert held_out == pytest.approx(0.94)
    assert _value(metrics, "adapt_length_bound_drift_alarm", component="qrf-length") == 1  # 0.7 < 0.89
    assert quality["qrf-length"]["drift_alarm"] is True and quality["qrf-length"]["requests"] == 10
    assert _value(metrics, "adapt_component_version", component="qrf-length") == 3
    assert _value(metrics, "adapt_component_last_swap_timestamp_seconds", component="qrf-length") == 1e9
    assert _value(metrics, "adapt_policy_info", policy="bounded") == 1
    assert _value(metrics, "adapt_kv_usage_ratio") == 0.25


def test_swaps_are_counted_once_and_restart_with_new_slots():
    metrics = SchedulerMetrics()
    policy = _Bounded()
    slot = fake_slot("qrf-length", 1, swaps=1)
    live = SimpleNamespace(slots={"qrf": slot}, config_slot=None)
    for swaps, failed in [(1, 0), (1, 0), (2, 1), (3, 1)]:
        slot.swaps, slot.failed_swaps = swaps, failed
        metrics.publish(0.0, policy=policy, waiting=[], running=0, kv_usage=0.0, live=live)
    assert _value(metrics, "adapt_component_swaps_total", component="qrf-length") == 3
    assert _value(metrics, "adapt_component_failed_swaps_total", component="qrf-length") == 1
    live.slots = {"qrf": fake_slot("qrf-length", 4, swaps=1)}  # a policy swap made a new slot
    metrics.publish(0.0, policy=policy, waiting=[], running=0, kv_usage=0.0, live=live)
    assert _value(metrics, "adapt_component_swaps_total", component="qrf-length") == 4


def test_step_counters_and_waiting_by_class():
    metrics = SchedulerMetrics(publish_interval_s=1.0)
    metrics.step(0.002, None, fallback=False)
    metrics.step(0.003, 0.03, fallback=True)
    metrics.admitted(4)
    metrics.deferred(2)
    metrics.preempted("kv_pressure", 1)
    metrics.dropped("admission_control", 2)
    metrics.policy_error()
    metrics.flush()
    assert _value(metrics, "adapt_step_seconds_count") == 2
    assert _value(metrics, "adapt_step_seconds_sum") == pytest.approx(0.005)
    assert _value(metrics, "adapt_engine_step_seconds_count") == 1
    assert _value(metrics, "adapt_fallback_steps_total") == 1
    assert _value(metrics, "adapt_requests_admitted_total") == 4
    assert _value(metrics, "adapt_requests_deferred_total") == 2
    assert _value(metrics, "adapt_requests_preempted_total", cause="kv_pressure") == 1
    assert _value(metrics, "adapt_requests_dropped_total", reason="admission_control") == 2
    assert _value(metrics, "adapt_policy_errors_total") == 1
    assert metrics.due(0.0)
    waiting = [_request(SLO("deadline", deadline_s=5.0)), _request(SLO()), _request(SLO())]
    metrics.publish(0.0, policy=_Bounded(), waiting=waiting, running=7, kv_usage=0.5)
    assert not metrics.due(0.5) and metrics.due(1.0)
    assert _value(metrics, "adapt_waiting_requests", slo_class="best_effort") == 2
    assert _value(metrics, "adapt_waiting_requests", slo_class="deadline") == 1
    assert _value(metrics, "adapt_waiting_requests", slo_class="latency") == 0
    assert _value(metrics, "adapt_running_requests") == 7


def test_slai_offset_and_threshold():
    from serving_hooks.policies import make_policy_from_spec

    metrics = SchedulerMetrics()
    slai = make_policy_from_spec("slai")
    metrics.publish(0.0, policy=slai, waiting=[], running=0, kv_usage=0.5)
    assert _value(metrics, "adapt_slai_kv_threshold") == pytest.approx(slai.offset.rule()["thresholds"][0])
    assert _value(metrics, "adapt_slai_offset_batches") == pytest.approx(slai.current_offset(0.5))


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("ADAPT_METRICS", raising=False)
    assert SchedulerMetrics.from_environment() is None
    monkeypatch.setenv("ADAPT_METRICS", "1")
    monkeypatch.setenv("ADAPT_DRIFT_MARGIN", "0.1")
    assert SchedulerMetrics.from_environment().drift_margin == 0.1


def test_batched_observations_expose_what_observe_would():
    """`_Buckets.flush_into` writes a histogram child's sum and bucket values directly (there is no
    batched observe): the exposition must be the one `observe` gives for the same values."""
    from prometheus_client import generate_latest

    values = [0.0001, 0.0004, 0.002, 0.002, 0.03, 0.3, 7.0, 0.0]
    observed, batched = SchedulerMetrics(), SchedulerMetrics()
    for value in values:
        observed.step_seconds.metric.observe(value)
        observed.ttft_seconds("latency").observe(value)
        batched.step(value, None, fallback=False)
        batched.finished(
            _request(SLO("latency", ttft_s=99.0), first=value, finish=value, generated=1),
            "finished",
            _Bounded(),
        )
    batched.flush()

    def exposition(metrics, name):
        lines = generate_latest(metrics.registry).decode().splitlines()
        return [line for line in lines if line.startswith(name) and "_created" not in line]

    for name in ("adapt_step_seconds", "adapt_ttft_seconds"):
        assert exposition(batched, name) == exposition(observed, name)
        assert any('le="+Inf"' in line and line.endswith(" 8.0") for line in exposition(batched, name))


class _Matching(Policy):
    """SageSched's signal alone: request i had enough close neighbours when i is even."""

    name = "matching"

    def on_step(self, view):  # pragma: no cover - never scheduled here
        raise AssertionError

    def neighbour_match(self, request):
        return None if request.id == "textless" else ("semantic-history", int(request.id[1:]) % 2 == 0)


def test_semantic_neighbour_share_reaches_gauge_and_status():
    metrics = SchedulerMetrics(window=4)
    policy = _Matching()
    for request_id in ("r1", "r2", "r3", "r4", "r6", "textless"):  # the window keeps r2, r3, r4, r6
        metrics.finished(_request(SLO(), finish=1.0, generated=5, request_id=request_id), "finished", policy)
    quality = metrics.publish(0.0, policy=policy, waiting=[], running=0, kv_usage=0.0)
    assert _value(metrics, "adapt_semantic_neighbour_share", component="semantic-history") == 0.75
    assert quality["semantic-history"]["neighbour_share"] == 0.75


def test_a_new_version_starts_its_windows_afresh_and_keeps_the_predecessors_figures():
    metrics = SchedulerMetrics(window=10)
    policy = _Bounded()
    slot = fake_slot("qrf-length", 3, swaps=1)
    live = SimpleNamespace(slots={"qrf": slot}, config_slot=None)
    for i in range(10):  # v3: outputs 1..10 under a bound of 7 tokens, coverage 0.7
        _finish_with_bound(metrics, policy, i + 1, 7.0, request_id=f"a{i}")
    quality = metrics.publish(0.0, policy=policy, waiting=[], running=0, kv_usage=0.0, live=live)
    assert quality["qrf-length"]["version"] == 3 and quality["qrf-length"]["predecessor"] is None
    assert quality["qrf-length"]["coverage"] == 0.7

    slot.version, slot.swaps = 4, 2  # v4 went live: nothing finished under it yet
    quality = metrics.publish(1.0, policy=policy, waiting=[], running=0, kv_usage=0.0, live=live)
    expected_ratio = round(sum(7 / n for n in range(1, 11)) / 10, 2)
    predecessor = {
        "version": 3,
        "coverage": 0.7,
        "overestimate": expected_ratio,
        "rank_correlation": None,
        "requests": 10,
    }
    assert quality["qrf-length"] == {
        "coverage": None,
        "overestimate": None,
        "requests": 0,
        "held_out_coverage": None,
        "drift_alarm": False,
        "version": 4,
        "predecessor": predecessor,
    }
    assert _value(metrics, "adapt_length_bound_window_requests", component="qrf-length") == 0
    assert math.isnan(_value(metrics, "adapt_length_bound_coverage", component="qrf-length"))  # not v3's

    for i in range(4):  # v4: outputs 1..4 under 7 tokens, all covered
        _finish_with_bound(metrics, policy, i + 1, 7.0, request_id=f"b{i}")
    quality = metrics.publish(2.0, policy=policy, waiting=[], running=0, kv_usage=0.0, live=live)
    assert quality["qrf-length"]["coverage"] == 1.0 and quality["qrf-length"]["requests"] == 4
    assert quality["qrf-length"]["predecessor"] == predecessor  # kept while v4 serves
    assert _value(metrics, "adapt_length_bound_coverage", component="qrf-length") == 1.0  # v4's window


def test_without_live_slots_the_loaded_versions_decide_the_windows():
    metrics = SchedulerMetrics(window=50)
    policy = _Ranking()
    policy.estimator = SimpleNamespace(metadata={"registry_version": 1})
    for i in range(20):  # v1 orders perfectly
        metrics.finished(_ranked(i + 1, i + 1, f"a{i}"), "finished", policy)
    first = metrics.publish(0.0, policy=policy, waiting=[], running=0, kv_usage=0.0)["semantic-history"]
    assert (first["version"], first["rank_correlation"], first["requests"]) == (1, 1.0, 20)
    policy.estimator = SimpleNamespace(metadata={"registry_version": 2})
    for i in range(20):  # v2 orders backwards, but these finish before a publish sees it: v1's
        metrics.finished(_ranked(i + 1, 20 - i, f"b{i}"), "finished", policy)
    metrics.publish(1.0, policy=policy, waiting=[], running=0, kv_usage=0.0)
    for i in range(20):
        metrics.finished(_ranked(i + 1, 20 - i, f"c{i}"), "finished", policy)
    entry = metrics.publish(2.0, policy=policy, waiting=[], running=0, kv_usage=0.0)["semantic-history"]
    assert (entry["version"], entry["rank_correlation"], entry["requests"]) == (2, -1.0, 20)
    assert entry["predecessor"]["version"] == 1 and entry["predecessor"]["requests"] == 40


class _Ranking(Policy):
    """A policy with a length estimate per request, as sagesched's semantic history gives."""

    name = "ranking"
    components = {"estimator": "semantic-history"}  # noqa: RUF012

    def on_step(self, view):  # pragma: no cover - never scheduled here
        raise AssertionError

    def length_estimate(self, request):
        return ("semantic-history", request.cache["estimate"])


def _ranked(generated: int, estimate: float, request_id: str) -> RequestState:
    state = _request(SLO(), first=0.1, finish=1.0, generated=generated, request_id=request_id)
    state.cache["estimate"] = estimate
    return state


def _sagesched_like(history: str = "semantic-history") -> SimpleNamespace:
    """What `publish` and `finished` read of a policy holding a length predictor (bounds and
    estimates from it), with SLAI's offset."""
    return SimpleNamespace(
        name="sagesched",
        components={"history": history},
        length_bound=lambda state: (history, 100),
        length_estimate=lambda state: (history, state.tokens_generated),
        neighbour_match=lambda state: (history, True),
        current_offset=lambda kv_usage: 2.0,
        offset=SimpleNamespace(rule=lambda: {"thresholds": [0.6]}),
    )


PER_COMPONENT = (
    "adapt_component_version",
    "adapt_component_last_swap_timestamp_seconds",
    "adapt_length_bound_coverage",
    "adapt_length_bound_overestimate_ratio",
    "adapt_length_bound_window_requests",
    "adapt_length_bound_heldout_coverage",
    "adapt_length_bound_drift_alarm",
    "adapt_semantic_neighbour_share",
    "adapt_length_rank_correlation",
)


def _per_component(metrics: SchedulerMetrics, name: str) -> dict[str, float | None]:
    return {gauge: _value(metrics, gauge, component=name) for gauge in PER_COMPONENT}


def test_a_whole_policy_swap_retires_the_old_components_figures_and_a_swap_back_is_no_new_version():
    """After sagesched -> spf the status still reported semantic-history v3 over 300 requests, its
    gauges and SLAI's and the prediction gauges kept their values, and swapping back to the same
    v3 counted a second swap though one version only ever went live."""
    metrics = SchedulerMetrics()
    sagesched, spf = _sagesched_like(), SimpleNamespace(name="spf", components={})
    for i in range(300):
        metrics.finished(
            _request(SLO(), first=0.1, finish=1.0, generated=50 + i % 100), "finished", sagesched
        )
    slot = fake_slot("semantic-history", 3, swaps=1, held_out={"coverage_at_0": 0.9}, last=1e9)
    live = SimpleNamespace(slots={"history": slot}, config_slot=None)
    predictions = {"share_on_prior": 0.25, "mean_wait_s": 0.01, "refused": 2}
    quality = metrics.publish(
        0.0, policy=sagesched, waiting=[], running=0, kv_usage=0.5, live=live, predictions=predictions
    )
    assert quality["semantic-history"]["requests"] == 300
    assert all(value is not None for value in _per_component(metrics, "semantic-history").values())

    spf_live = SimpleNamespace(slots={}, config_slot=None)
    assert metrics.publish(1.0, policy=spf, waiting=[], running=0, kv_usage=0.5, live=spf_live) == {}
    assert _per_component(metrics, "semantic-history") == dict.fromkeys(PER_COMPONENT)
    for gauge in (
        "adapt_slai_offset_batches",
        "adapt_slai_kv_threshold",
        "adapt_prediction_prior_share",
        "adapt_prediction_wait_seconds",
        "adapt_prediction_refused",
    ):
        assert math.isnan(_value(metrics, gauge)), gauge
    assert _value(metrics, "adapt_policy_info", policy="spf") == 1

    back = _sagesched_like()  # a fresh policy and slot, whose first load is v3 again
    fresh = fake_slot("semantic-history", 3, swaps=0)  # the version shows before the swap is counted
    live = SimpleNamespace(slots={"history": fresh}, config_slot=None)
    for swaps in (0, 1):
        fresh.swaps = swaps
        quality = metrics.publish(2.0 + swaps, policy=back, waiting=[], running=0, kv_usage=0.5, live=live)
    assert _value(metrics, "adapt_component_swaps_total", component="semantic-history") == 1
    assert _value(metrics, "adapt_component_version", component="semantic-history") == 3
    assert quality == {}  # nothing finished under the policy that came back
    assert _value(metrics, "adapt_length_bound_coverage", component="semantic-history") is None
    fresh.version, fresh.swaps = 4, 2
    metrics.publish(4.0, policy=back, waiting=[], running=0, kv_usage=0.5, live=live)
    assert _value(metrics, "adapt_component_swaps_total", component="semantic-history") == 2


def test_in_a_multiprocess_directory_a_retired_components_gauges_turn_nan(monkeypatch):
    """prometheus_client cannot remove a child there: its last value stays in the file scrapes read."""
    metrics = SchedulerMetrics()
    sagesched = _sagesched_like()
    sagesched.history = SimpleNamespace(metadata={"registry_version": 3})  # loaded without live slots
    metrics.publish(1.0, policy=sagesched, waiting=[], running=0, kv_usage=0.0)
    assert _value(metrics, "adapt_component_version", component="semantic-history") == 3
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent")  # only read to decide, here
    metrics.publish(
        2.0, policy=SimpleNamespace(name="spf", components={}), waiting=[], running=0, kv_usage=0.0
    )
    assert math.isnan(_value(metrics, "adapt_component_version", component="semantic-history"))
