"""`experiments.live_loop`'s bookkeeping without a server: when a new layout went live, from
the status samples it polls (a promoted version, or an `ewsjf-online` adoption)."""

from experiments.live_loop import POLICY, StatusLog, summarise


def _log(samples: list[tuple[float, int | None, int]]) -> StatusLog:
    log = StatusLog(port=0)  # never started: the samples are set by hand
    log.samples = samples
    return log


def test_a_promoted_version_and_an_online_adoption_both_count_as_going_live():
    log = _log([(1.0, 1, 0), (2.0, 1, 0), (3.0, 3, 0), (4.0, 3, 1), (5.0, 3, 1), (6.0, 3, 2)])
    assert log.swaps() == [
        {"at_s": 3.0, "version": 3},
        {"at_s": 4.0, "adoption": 1},
        {"at_s": 6.0, "adoption": 2},
    ]


def test_nothing_goes_live_while_the_status_stands_still():
    assert _log([]).swaps() == []
    assert _log([(1.0, 2, 0)]).swaps() == []
    assert _log([(1.0, 2, 0), (2.0, 2, 0)]).swaps() == []


def test_the_online_arm_serves_ewsjf_online_and_its_first_adoption_after_the_shift_splits_the_windows():
    from types import SimpleNamespace

    from adapt.requests import Request
    from experiments.live_loop import Size

    assert POLICY == {"online": "ewsjf-online"}
    size = Size(num_requests=6, rate=1.0, window_s=2.0, retrain_every_s=1.0)  # shift at 2 s
    requests = [Request(f"r{i}", float(i), 16, 4, label="short") for i in range(6)]
    ttft = [0.5, 0.5, 2.0, 2.0, 1.0, 1.0]
    records = [SimpleNamespace(request_id=f"r{i}", ttft_s=t, ok=True, error=None) for i, t in enumerate(ttft)]
    arm = {"records": records, "swaps": [{"at_s": 4.0, "adoption": 1}], "champion": 1, "retrain": []}
    short = summarise(arm, requests, size)["headlines"]["short_ttft"]
    assert short["before_shift"] == 0.5
    assert short["after_shift_before_promotion"] == 2.0 and short["after_promotion"] == 1.0
