import math

import pytest

from adapt.policy import RequestState
from adapt.requests import SLO, CompletedRequest, ProgramRef, Request, ValidationError


def test_slo_kinds_need_their_targets():
    assert SLO().kind == "best_effort"
    assert SLO(kind="latency", ttft_s=2.0, tbt_s=0.1).tbt_s == 0.1
    with pytest.raises(ValidationError, match="latency' needs ttft_s or tbt_s"):
        SLO(kind="latency")
    with pytest.raises(ValidationError, match="needs deadline_s"):
        SLO(kind="deadline")
    with pytest.raises(ValidationError, match=r"slo\.kind"):
        SLO(kind="urgent")  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["ttft_s", "tbt_s", "deadline_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "2"])
def test_slo_rejects_bad_numbers(field, value):
    with pytest.raises(ValidationError, match=f"slo.{field}"):
        SLO(**{"kind": "deadline", "deadline_s": 5.0, field: value})


def test_request_validation_names_the_field():
    ok = Request("a", 0.0, 10, 5)
    assert ok.slo.kind == "best_effort"
    with pytest.raises(ValidationError, match="prompt_tokens"):
        Request("a", 0.0, 0, 5)
    with pytest.raises(ValidationError, match="output_tokens"):
        Request("a", 0.0, 10, -1)
    with pytest.raises(ValidationError, match="arrival_s"):
        Request("a", -1.0, 10, 5)
    with pytest.raises(ValidationError, match="program"):
        Request("a", 0.0, 10, 5, slo=SLO(kind="compound", deadline_s=20.0))


def test_program_ref_stage_bounds():
    ProgramRef("p1", stage=2, num_stages=3)
    with pytest.raises(ValidationError, match=r"program\.stage"):
        ProgramRef("p1", stage=3, num_stages=3)
    with pytest.raises(ValidationError, match="node_kind"):
        ProgramRef("p1", stage=0, node_kind="gpu")  # type: ignore[arg-type]


def test_completed_request_round_trip_and_order_check():
    record = CompletedRequest(
        "r1",
        1.0,
        100,
        20,
        first_token_s=1.5,
        finish_s=3.0,
        slo=SLO(kind="latency", ttft_s=1.0, tbt_s=0.2, tier="paying"),
        program=ProgramRef("p", 0, parent_ids=("x",)),
    )
    again = CompletedRequest.from_dict(record.to_dict())
    assert again == record
    assert again.ttft_s == pytest.approx(0.5)
    assert again.ttlt_s == pytest.approx(2.0)
    with pytest.raises(ValidationError, match="out of order"):
        CompletedRequest("r1", 1.0, 100, 20, first_token_s=0.5, finish_s=3.0)
    dropped = CompletedRequest("r2", 1.0, 100, 0, None, None, outcome="dropped")
    assert dropped.ttft_s is None


def test_a_tokens_due_time_by_hand():
    both = RequestState("r", 3.0, 10, 100, SLO(kind="latency", ttft_s=2.0, tbt_s=0.1))
    assert both.token_due_s(0) == 5.0 and both.token_due_s(10) == pytest.approx(6.0)
    assert both.token_due_s(10, intake_delay_s=0.5) == pytest.approx(5.5)  # the server saw it first
    ttft_only = RequestState("r", 3.0, 10, 100, SLO(kind="latency", ttft_s=2.0))
    assert ttft_only.token_due_s(0) == 5.0 and ttft_only.token_due_s(1) == math.inf
    tbt_only = RequestState("r", 3.0, 10, 100, SLO(kind="latency", tbt_s=0.1))
    assert tbt_only.token_due_s(3) == math.inf  # no first token yet: nothing to count from
    tbt_only.first_token_s = 4.0
    assert tbt_only.token_due_s(0) == math.inf and tbt_only.token_due_s(3) == pytest.approx(4.3)
