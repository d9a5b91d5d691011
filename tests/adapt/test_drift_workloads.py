"""The drift workloads change their mix where they say, and only there."""

import numpy as np
import pytest

from adapt.workloads import WORKLOADS
from adapt.workloads.drift import long_share_at, shift_time


def _long_share(requests, low: float, high: float) -> float:
    chosen = [r for r in requests if low <= r.arrival_s < high]
    return sum(r.label == "long" for r in chosen) / len(chosen)


def test_long_share_at_steps_or_ramps():
    times = np.array([0.0, 9.9, 10.0, 15.0, 20.0, 30.0])
    assert long_share_at(times, 10.0, 0.0, 0.3).tolist() == [0.0, 0.0, 0.3, 0.3, 0.3, 0.3]
    assert np.allclose(long_share_at(times, 10.0, 10.0, 0.3), [0.0, 0.0, 0.0, 0.15, 0.3, 0.3])
    assert shift_time(12.0, 5400, 1 / 3) == 150.0


def test_abrupt_and_gradual_scenarios():
    abrupt = WORKLOADS["drift-chat-to-summaries"]
    gradual = WORKLOADS["drift-chat-to-summaries-gradual"]
    requests = abrupt.build(abrupt.rate, 5400, 0)
    assert _long_share(requests, 0, 150) == 0.0
    assert 0.25 < _long_share(requests, 150, 450) < 0.35
    assert all(1024 <= r.prompt_tokens <= 4096 for r in requests if r.label == "long")
    assert all(32 <= r.prompt_tokens <= 512 for r in requests if r.label == "short")
    ramp = gradual.build(gradual.rate, 5400, 0)
    assert _long_share(ramp, 0, 150) == 0.0
    assert 0.05 < _long_share(ramp, 150, 300) < 0.25  # rising through the middle third
    assert 0.25 < _long_share(ramp, 300, 450) < 0.35
    assert [r.prompt_tokens for r in abrupt.build(12.0, 300, 3)] == [
        r.prompt_tokens for r in abrupt.build(12.0, 300, 3)
    ]


def test_the_answers_get_shorter_at_the_shift_and_nothing_else_changes():
    """`drift-shorter-answers`: jitserve-mix's arrivals, classes, SLOs and programs throughout;
    its latency and deadline requests answered by GPT-4 1106-preview before the shift and by
    GPT-4 0613 (answers about half as long) from it on, over every AlpacaEval instruction."""
    from adapt.workloads import jitserve_mix
    from adapt.workloads.drift import TERSE_MODEL, VERBOSE_MODEL, model_answers

    spec = WORKLOADS["drift-shorter-answers"]
    requests = spec.build(3.0, 450, 2)
    shift_s = shift_time(3.0, 450, 1 / 3)
    mix = jitserve_mix(3.0, 450, 2)
    assert [(r.request_id, r.arrival_s, r.label, r.slo) for r in requests] == [
        (r.request_id, r.arrival_s, r.label, r.slo) for r in mix
    ]
    answers = {
        name: set(zip(t.prompt_text, t.output_tokens.tolist(), strict=True))
        for name, t in (("verbose", model_answers(VERBOSE_MODEL)), ("terse", model_answers(TERSE_MODEL)))
    }
    served = [r for r in requests if r.program is None]
    before = [r for r in served if r.arrival_s < shift_s]
    after = [r for r in served if r.arrival_s >= shift_s]
    assert before and after
    assert all((r.prompt_text, r.output_tokens) in answers["verbose"] for r in before)
    assert all((r.prompt_text, r.output_tokens) in answers["terse"] for r in after)
    assert np.median([r.output_tokens for r in after]) < 0.75 * np.median([r.output_tokens for r in before])
    assert all(r == m for r, m in zip(requests, mix, strict=True) if r.program is not None)


def test_answered_by_keeps_one_models_answers_and_names_a_missing_one():
    from adapt.traces import load_trace, split_by_instruction
    from adapt.workloads import bundled
    from adapt.workloads.drift import answered_by

    _, test = split_by_instruction(load_trace(bundled("alpaca_eval_lengths.jsonl.gz")))
    verbose = answered_by(test, ("Yi-34B-Chat",))
    assert len(verbose) and set(verbose.columns["generator"]) == {"Yi-34B-Chat"}
    with pytest.raises(ValueError, match="no answers from gpt-9"):
        answered_by(test, ("gpt-9",))
