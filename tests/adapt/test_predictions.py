"""Prediction queues (`adapt.predictions`): when a policy's model calls are handed over, by hand."""

import threading
import time

import pytest

from adapt.predictions import BackgroundWorker, Delayed, Scripted


def doubled(payloads):
    return [2 * p for p in payloads]


def test_delayed_hands_over_in_submission_order_after_the_delay():
    calls = []
    queue = Delayed(lambda batch: calls.append(list(batch)) or doubled(batch), delay_s=0.5)
    queue.submit("a", 1, now=0.0)
    queue.submit("b", 2, now=0.25)
    assert queue.next_ready_s == 0.5
    assert queue.ready(0.4) == []  # computed in one batch at the first poll, not yet due
    assert calls == [[1, 2]]
    assert queue.ready(0.5) == [("a", 2)]
    assert queue.next_ready_s == 0.75
    assert queue.ready(1.0) == [("b", 4)]
    assert queue.ready(2.0) == []
    stats = queue.stats.summary()
    # Both were polled without their result at their first poll (0.4): decided on the prior.
    assert (stats["submitted"], stats["delivered"], stats["on_prior"]) == (2, 2, 2)
    assert stats["share_on_prior"] == 1.0
    assert stats["mean_wait_s"] == pytest.approx((0.5 + 0.75) / 2)


def test_no_delay_means_ready_at_the_next_poll_and_never_on_the_prior():
    queue = Delayed(doubled)
    queue.submit("a", 1, now=3.0)
    assert queue.ready(3.0) == [("a", 2)]
    assert queue.stats.on_prior == 0 and queue.stats.summary()["share_on_prior"] == 0.0


def test_a_discarded_request_gets_nothing_and_is_not_computed_if_not_yet_polled():
    calls = []
    queue = Delayed(lambda batch: calls.append(list(batch)) or doubled(batch), delay_s=1.0)
    queue.submit("a", 1, now=0.0)
    queue.submit("b", 2, now=0.0)
    queue.discard("a", now=0.25)
    assert queue.ready(1.0) == [("b", 4)]
    assert calls == [[2]]
    queue.submit("c", 3, now=1.0)
    queue.ready(1.5)  # computed, not due
    queue.discard("c", now=1.75)
    queue.discard("b", now=2.0)  # already handed over: not a censored wait
    assert queue.ready(5.0) == [] and not queue.awaited
    stats = queue.stats.summary()
    # a and c left after waiting 0.25 s and 0.75 s in vain; b waited 1.0 s for its result.
    assert (stats["delivered"], stats["censored"]) == (1, 2)
    assert stats["censored_s"] == pytest.approx(1.0)
    assert stats["mean_wait_s"] == pytest.approx(1.0)  # the delivered one
    assert stats["delay_estimate_s"] == pytest.approx((1.0 + 0.25 + 0.75) / 1)  # all time waited


def test_the_delay_estimate_without_a_delivered_result_is_the_censored_mean():
    queue = Delayed(doubled, delay_s=10.0)
    assert queue.stats.summary()["delay_estimate_s"] == 0.0  # nothing submitted
    queue.submit("a", 1, now=0.0)
    queue.submit("b", 2, now=0.0)
    queue.discard("a", now=1.0)
    queue.discard("b", now=3.0)
    assert queue.stats.summary()["delay_estimate_s"] == pytest.approx(2.0)  # a lower bound


def test_scripted_hands_over_at_the_live_steps():
    queue = Scripted(doubled, deliveries={"a": [2.0], "b": [1.0]})
    queue.handed_over = []
    queue.submit("a", 1, now=0.0)
    queue.submit("b", 2, now=0.0)
    queue.submit("c", 3, now=0.0)  # never handed over live: never here either
    assert queue.ready(1.0) == [("b", 4)]
    assert queue.ready(2.0) == [("a", 2)]
    assert queue.ready(100.0) == []
    assert queue.handed_over == ["b", "a"]


def test_delay_must_not_be_negative():
    with pytest.raises(ValueError, match="prediction delay"):
        Delayed(doubled, delay_s=-1.0)


def _until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_background_worker_never_blocks_the_caller_and_refuses_beyond_its_bound():
    release = threading.Event()

    def slow(batch):
        release.wait(5)
        return doubled(batch)

    queue = BackgroundWorker(slow, max_pending=2)
    try:
        assert queue.submit("a", 1, now=0.0)  # the worker takes it and blocks on `release`
        _until(lambda: not queue._pending)
        started = time.monotonic()
        assert queue.submit("b", 2, now=0.0) and queue.submit("c", 3, now=0.0)
        assert not queue.submit("d", 4, now=0.0)  # two waiting: refused, stays on its prior
        assert queue.ready(0.0) == []  # nothing done: returns at once
        assert time.monotonic() - started < 1.0
        release.set()
        got = []
        _until(lambda: got.extend(queue.ready(1.0)) or len(got) == 3)
        assert got == [("a", 2), ("b", 4), ("c", 6)]
        assert queue.stats.refused == 1 and queue.stats.summary()["share_on_prior"] == 1.0
    finally:
        release.set()
        queue.close()


def test_background_worker_survives_a_failing_batch():
    def flaky(batch):
        if 0 in batch:
            raise RuntimeError("model down")
        return doubled(batch)

    queue = BackgroundWorker(flaky)
    try:
        queue.submit("bad", 0, now=0.0)
        _until(lambda: queue.errors == 1)
        queue.submit("good", 5, now=0.0)
        got = []
        _until(lambda: got.extend(queue.ready(1.0)) or got)
        assert got == [("good", 10)] and queue.awaited  # "bad" stays on its prior
    finally:
        queue.close()


def test_a_batch_that_fails_after_stop_ends_the_worker_quietly(caplog):
    """At shutdown the engine stops its workers, then kills the embedding process under a batch
    in flight: that failure is the shutdown, not an error to report."""
    started, release = threading.Event(), threading.Event()

    def killed(batch):
        started.set()
        release.wait(5)
        raise RuntimeError("embedding process stopped")

    queue = BackgroundWorker(killed)
    queue.submit("a", 1, now=0.0)
    assert started.wait(5)
    queue.stop()
    release.set()
    queue.close()
    assert queue.errors == 0 and "failed" not in caplog.text


def test_drain_waits_until_every_submission_is_computed():
    release = threading.Event()

    def slow(batch):
        release.wait(5)
        return doubled(batch)

    queue = BackgroundWorker(slow)
    try:
        assert queue.drain(0.1)  # nothing submitted: nothing to wait for
        queue.submit("a", 1, now=0.0)
        queue.submit("b", 2, now=0.0)
        assert not queue.drain(0.2)  # still computing: it times out, nothing handed over
        release.set()
        assert queue.drain(5.0)
        assert queue.ready(1.0) == [("a", 2), ("b", 4)]
    finally:
        release.set()
        queue.close()


class _Model:
    """A batch function with a warm-up that counts its calls and the thread it ran in."""

    def __init__(self):
        self.warm_ups = []

    def warm_up(self):
        self.warm_ups.append(threading.current_thread().name)

    def __call__(self, batch):
        return doubled(batch)


@pytest.mark.parametrize("now", [True, False])
def test_the_model_warms_up_once_at_start_or_in_the_worker(now):
    model = _Model()
    queue = BackgroundWorker(model, warm_up_now=now)
    try:
        assert model.warm_ups == ([threading.current_thread().name] if now else [])
        queue.submit("a", 1, now=0.0)
        got = []
        _until(lambda: got.extend(queue.ready(1.0)) or got)
        assert got == [("a", 2)]
        assert len(model.warm_ups) == 1 and (now or model.warm_ups == ["adapt-predictions"])
    finally:
        queue.close()


@pytest.mark.parametrize("make", [lambda f: Delayed(f, delay_s=10.0), lambda f: BackgroundWorker(f)])
def test_a_supplied_result_is_ready_at_the_next_poll_whatever_the_queue(make):
    calls = []
    queue = make(lambda batch: calls.append(list(batch)) or doubled(batch))
    queue.supply("a", "vector", now=1.0)
    assert queue.awaited
    assert isinstance(queue, BackgroundWorker) or queue.next_ready_s == 1.0
    assert queue.ready(1.0) == [("a", "vector")]
    assert calls == [] and not queue.awaited
    stats = queue.stats.summary()
    # A first decision made on a result; not a model result delivered (no wait to count).
    assert (stats["submitted"], stats["supplied"], stats["delivered"], stats["on_prior"]) == (1, 1, 0, 0)
    assert stats["waited_s"] == 0.0 and stats["share_on_prior"] == 0.0
    queue.close()


def test_supplied_results_go_first_and_a_discarded_one_is_never_handed_over():
    queue = Delayed(doubled)
    queue.submit("a", 1, now=0.0)
    queue.supply("b", "vb", now=0.0)
    queue.supply("c", "vc", now=0.0)
    queue.discard("c", now=0.5)  # left before its first step: nothing waited for, nothing censored
    assert queue.ready(1.0) == [("b", "vb"), ("a", 2)]
    stats = queue.stats.summary()
    assert (stats["delivered"], stats["censored"], stats["supplied"], stats["submitted"]) == (1, 0, 2, 3)
    # the model's one result waited 1.0 s: the supplied ones do not pull the estimate down
    assert stats["mean_wait_s"] == stats["delay_estimate_s"] == 1.0


def test_a_discarded_payload_leaves_the_worker_queue_and_frees_its_place():
    """Requests that left while their payloads waited behind a batch in flight: their places go to
    the next arrivals, and nothing is computed for them. Before, they stayed in the queue, counted
    toward its bound (the next arrival was refused: on its prior for life) and were computed."""
    release, batches = threading.Event(), []

    def slow(batch):
        batches.append(list(batch))
        release.wait(5)
        return doubled(batch)

    queue = BackgroundWorker(slow, max_pending=2)
    try:
        queue.submit("busy", 1, now=0.0)
        _until(lambda: not queue._pending)  # the worker is inside the first batch
        assert queue.submit("gone1", 2, now=0.0) and queue.submit("gone2", 3, now=0.0)
        queue.discard("gone1", now=1.0)
        queue.discard("gone2", now=1.0)
        assert queue.submit("new", 4, now=1.0) and queue.stats.refused == 0
        release.set()
        got = []
        _until(lambda: got.extend(queue.ready(2.0)) or len(got) == 2)
        assert got == [("busy", 2), ("new", 8)] and queue.drain(5.0)
        assert batches == [[1], [4]]
        assert queue.stats.censored == 2
    finally:
        release.set()
        queue.close()


def test_a_batch_with_the_wrong_number_of_results_fails_and_the_worker_goes_on():
    """A batch function that returns one result too few: which result is whose is unknown, so the
    batch fails (its requests stay on their prior) and is counted; the worker takes the next one.
    Before, the worker thread died: later submissions were never computed, `drain` never returned
    True, and no error was counted."""

    def short_by_one(batch):
        return doubled(batch)[:-1] if 0 in batch else doubled(batch)

    queue = BackgroundWorker(short_by_one)
    try:
        queue.submit("bad", 0, now=0.0)
        _until(lambda: queue.errors == 1)
        assert queue._thread.is_alive() and queue.drain(5.0)
        queue.submit("good", 3, now=1.0)
        got = []
        _until(lambda: got.extend(queue.ready(2.0)) or got)
        assert got == [("good", 6)] and queue.errors == 1 and queue.awaited  # "bad" on its prior
    finally:
        queue.close()


def test_submissions_before_a_queue_opened_count_from_its_opening():
    """A policy swapped in at 10 s is handed requests that arrived at 1 s: their model calls start
    at the swap. The replay's delay runs from there (not over at once), and the wait counts from
    there (not the old policy's time as well); a supplied result is due at the swap too."""
    queue = Delayed(doubled, delay_s=0.5)
    queue.opened_s = 10.0
    queue.submit("a", 1, now=1.0)
    queue.supply("b", "vb", now=1.0)
    assert queue.next_ready_s == 10.0  # the supplied one, at the next poll
    assert queue.ready(10.0) == [("b", "vb")]
    assert queue.next_ready_s == 10.5
    assert queue.ready(10.4) == []
    assert queue.ready(10.5) == [("a", 2)]
    stats = queue.stats.summary()
    assert stats["mean_wait_s"] == stats["delay_estimate_s"] == 0.5


def test_scripted_hands_a_key_over_again_at_its_own_live_step():
    """Live, a key was handed to a policy at 1.0, then -- submitted again to the one swapped in at
    2.0 -- to that one at 2.5. Each replayed queue gets its own: the first at 1.0, the second at 2.5
    (not at the swap, not the last time for both)."""
    deliveries = {"X": [1.0, 2.5]}
    old = Scripted(doubled, deliveries=deliveries)
    old.submit("X", 1, now=0.0)
    assert old.ready(0.9) == [] and old.ready(1.0) == [("X", 2)]
    new = Scripted(doubled, deliveries=deliveries)
    new.opened_s = 2.0
    new.submit("X", 1, now=0.0)  # handed over with its arrival time
    assert new.ready(2.0) == [] and new.next_ready_s == 2.5
    assert new.ready(2.5) == [("X", 2)]
    late = Scripted(doubled, deliveries=deliveries)
    late.submit("X", 1, now=3.0)  # after every live hand-over: none for it
    assert late.ready(100.0) == []
