"""Model calls off the scheduling step: where a policy's predictions run, and when they are ready.

A policy whose prediction needs a model (SageSched embeds every prompt with MiniLM: ~20 ms per
prompt on these CPU cores) must not make the engine wait for it: every new prompt would stall the
whole batch. So the policy submits the work when a request arrives, ranks the request on a cheap
prior (what it knows without the model) until the result is ready, and re-ranks it then. The
*engine* decides when a result is ready, by the queue it gives the policy (`Policy.use_predictions`):

- `Delayed(delay_s)` (replay): the results of a poll's submissions are computed in one batch, and
  each is handed over at the first poll at least `delay_s` of simulated time after it was
  submitted. With the default delay 0 every result is ready at the next step, before the policy
  plans it -- a model that costs nothing, which is what the replay assumed before this module.
- `BackgroundWorker(max_pending)` (live, in vLLM's engine process): a daemon thread, started by
  the first submission, first runs the function's `warm_up` if it has one and the engine did not
  run it when it started (loading a model), then
  takes whatever is pending, computes it in one batch and hands the results over at the first poll
  after it is done; the step never waits. A live swap stops the old policy's workers (a batch in
  flight finishes in the background); the engine closes them all when it shuts down. The queue is
  bounded: a submission beyond `max_pending` waiting ones is refused and that request stays on its
  prior (the engine is never blocked, no request lost); a request that left frees its place.
- `Scripted(deliveries)` (a trace-driven replay, `adapt.conformance`): every result is handed over
  at the step at which the live engine handed it over, so decisions made on a prior agree too.

A policy swapped in live is handed the requests in flight with their arrival times; both engines
open its queues at the swap (`opened_s`), and a submission counts from then.

A result the request arrived with (`supply`: e.g. a prompt embedding the API server computed
before the request reached the engine) is ready at the next poll whatever the queue, as a delay-0
replay's would be. A queue hands results over in submission order (supplied ones first) and never
those of a request `discard`ed (it left before its result came). Each counts what it did
(`PredictionStats`): the share of requests whose first decision was made on the prior, and the
wait from submission to hand-over -- where a request left first, the time it waited in vain, a
lower bound on its wait (a replay that modelled the delay from delivered results alone would miss
exactly the slowest ones: under overload, most of them; `PredictionStats.summary`'s
`delay_estimate_s` counts them).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

BatchFunction = Callable[[list[Any]], Sequence[Any]]  # payloads -> one result per payload, in order
QueueFactory = Callable[[BatchFunction], "PredictionQueue"]


@dataclass
class PredictionStats:
    """What a queue did: `on_prior` counts requests still without a result at the first poll after
    their submission (their first scheduling decision used the prior); `refused` those never
    submitted (queue full); `supplied` those that arrived with their result, or whose result a
    policy swapped out had got (counted in `submitted`, as first decisions made on a result, and
    nowhere else: no model was waited for,
    and counting them delivered at no wait would tell a replay the model is faster than it is);
    `delivered` and `waited_s` count the model's results and sum submission to hand-over;
    `censored` counts results discarded before they came (the request left) and `censored_s` sums
    their submission to discard."""

    submitted: int = 0
    refused: int = 0
    supplied: int = 0
    delivered: int = 0
    on_prior: int = 0
    waited_s: float = 0.0
    censored: int = 0
    censored_s: float = 0.0

    @classmethod
    def combined(cls, parts: Sequence[PredictionStats]) -> PredictionStats:
        """Every part's counts added up (one engine's queues together)."""
        return cls(*(sum(getattr(p, name) for p in parts) for name in cls.__dataclass_fields__))

    def summary(self) -> dict[str, float | int]:
        """The counts, with `share_on_prior`, `mean_wait_s` (over delivered results) and
        `delay_estimate_s`: the mean wait estimated with the censored ones too -- all time waited
        over results delivered, the estimate for exponential waits cut off at random (it equals
        the delivered mean when none was cut off). Under overload most requests finish before their
        result and the delivered mean, which sees only the fast ones, would tell a replay that
        predictions come early; where all are censored it is their mean, a lower bound."""
        first_decisions = self.submitted + self.refused
        if self.delivered:
            estimate = (self.waited_s + self.censored_s) / self.delivered
        else:
            estimate = self.censored_s / self.censored if self.censored else 0.0
        return {
            **asdict(self),
            "share_on_prior": (self.on_prior + self.refused) / first_decisions if first_decisions else 0.0,
            "mean_wait_s": self.waited_s / self.delivered if self.delivered else 0.0,
            "delay_estimate_s": estimate,
        }


class PredictionQueue:
    """Base: submissions in order, discards, the statistics, and the hand-over log. Subclasses
    decide when results are computed and when they are ready (`ready`)."""

    def __init__(self, function: BatchFunction) -> None:
        self.function = function
        self.stats = PredictionStats()
        # Keys handed over since the engine last took this list, where it keeps one (None: not
        # kept); a live decision log records them, so a trace-driven replay hands over the same.
        self.handed_over: list[str] | None = None
        self._submitted_at: dict[str, float] = {}  # key -> when, until handed over or discarded
        self._unpolled: list[str] = []  # submitted since the last poll
        self._supplied: dict[str, tuple[Any, float]] = {}  # came with the request: (result, when)
        # When the engine gave this queue to its policy: a submission timed before it counts from
        # it. A policy swapped in live is handed the requests in flight with their arrival times,
        # but its model starts on them at the swap: counted from their arrival, every wait would
        # include the old policy's time and a replay's delay would be over at once.
        self.opened_s = -math.inf

    def supply(self, key: str, result: Any, now: float) -> None:
        """`key`'s result came with the request: no model call; handed over at the next poll."""
        self._supplied[key] = (result, max(now, self.opened_s))
        self.stats.submitted += 1
        self.stats.supplied += 1

    def submit(self, key: str, payload: Any, now: float) -> bool:
        """Queue `payload`'s prediction under `key`; False if refused (the request keeps its prior)."""
        self._submitted_at[key] = max(now, self.opened_s)
        self._unpolled.append(key)
        self.stats.submitted += 1
        return True

    def discard(self, key: str, now: float) -> None:
        """The request left at `now`: its result, if it comes, is dropped (and its wait so far
        counted as censored; a supplied one was never waited for)."""
        self._supplied.pop(key, None)
        submitted_at = self._submitted_at.pop(key, None)
        if submitted_at is not None:
            self.stats.censored += 1
            self.stats.censored_s += now - submitted_at

    def ready(self, now: float) -> list[tuple[str, Any]]:
        """The results ready by `now`, in submission order, each handed over once."""
        raise NotImplementedError

    def stop(self) -> None:
        """Take no more batches, without waiting for one in flight (`close` waits)."""

    def close(self) -> None:
        """Stop any worker (the engine is done with this queue)."""

    @property
    def awaited(self) -> bool:
        """Whether any submitted result has not been handed over yet."""
        return bool(self._submitted_at or self._supplied)

    @property
    def next_ready_s(self) -> float:
        """When the next result will be ready, where the queue knows (a policy's horizon)."""
        return math.inf

    def _hand_over(self, results: list[tuple[str, Any]], now: float) -> list[tuple[str, Any]]:
        """Keep the results of requests still here, count them, and count every request polled for
        the first time without its result as decided on its prior. Supplied results go first."""
        supplied = [(key, result) for key, (result, _) in self._supplied.items()]
        self._supplied = {}
        kept = [(key, value) for key, value in results if key in self._submitted_at]
        for key, _ in kept:
            self.stats.waited_s += now - self._submitted_at.pop(key)
        self.stats.delivered += len(kept)
        kept = [*supplied, *kept]
        if self.handed_over is not None:
            self.handed_over.extend(key for key, _ in kept)
        self.stats.on_prior += sum(key in self._submitted_at for key in self._unpolled)
        self._unpolled = []
        return kept


class Delayed(PredictionQueue):
    """Replay: each poll computes what was submitted since the last one, in one batch; a result is
    handed over at the first poll `delay_s` or more after its submission (simulated time)."""

    def __init__(self, function: BatchFunction, delay_s: float = 0.0) -> None:
        if not delay_s >= 0:
            raise ValueError(f"prediction delay: must be >= 0 s, got {delay_s}")
        super().__init__(function)
        self.delay_s = delay_s
        self._pending: list[tuple[str, Any]] = []
        self._computed: list[tuple[float, str, Any]] = []  # (ready at, key, result), in order

    def submit(self, key: str, payload: Any, now: float) -> bool:
        self._pending.append((key, payload))
        return super().submit(key, payload, now)

    def ready(self, now: float) -> list[tuple[str, Any]]:
        batch = [(key, payload) for key, payload in self._pending if key in self._submitted_at]
        self._pending = []
        if batch:
            results = self.function([payload for _, payload in batch])
            for (key, _), result in zip(batch, results, strict=True):
                self._computed.append((self._ready_at(key), key, result))
        due = [(key, result) for at, key, result in self._computed if at <= now]
        self._computed = [item for item in self._computed if item[0] > now]
        return self._hand_over(due, now)

    def _ready_at(self, key: str) -> float:
        return self._submitted_at[key] + self.delay_s

    @property
    def next_ready_s(self) -> float:
        pending = (self._ready_at(key) for key, _ in self._pending if key in self._submitted_at)
        computed = (at for at, key, _ in self._computed if key in self._submitted_at)
        supplied = (at for _, at in self._supplied.values())
        return min(itertools.chain(pending, computed, supplied), default=math.inf)


class Scripted(Delayed):
    """A trace-driven replay: `deliveries[key]` lists, in order, the starts of the live steps that
    got a result for `key`; each submission's is handed over at the first poll at or after the
    first of them at or after the submission, computed as in `Delayed`. A key can be handed over
    more than once live -- to a policy, then again to the one swapped in for it (submitted at the
    swap) -- and each policy gets its own; a submission whose result never came live (refused, or
    its policy swapped out first) gets a later one only where no poll of its policy follows."""

    def __init__(self, function: BatchFunction, deliveries: Mapping[str, Sequence[float]]) -> None:
        super().__init__(function)
        self.deliveries = deliveries

    def _ready_at(self, key: str) -> float:
        times = self.deliveries.get(key, ())
        first = bisect.bisect_left(times, self._submitted_at[key])
        return times[first] if first < len(times) else math.inf


class BackgroundWorker(PredictionQueue):
    """Live: a daemon thread computes pending payloads in batches; `ready` only takes finished
    results (never waits). At most `max_pending` submissions wait at once; more are refused."""

    def __init__(self, function: BatchFunction, max_pending: int = 256, warm_up_now: bool = False) -> None:
        """`warm_up_now`: run the function's `warm_up` here, in the caller's thread -- an engine
        that is starting (nothing to serve yet) loads the model before its first request instead
        of serving the first ones on their prior; a live swap leaves it to the worker thread."""
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        super().__init__(function)
        self._warmed = False
        if warm_up_now:
            self._warm_up()
        self.max_pending = max_pending
        self.errors = 0
        self._lock = threading.Condition()
        self._pending: list[tuple[str, Any]] = []
        self._done: list[tuple[str, Any]] = []
        self._computing = 0  # payloads taken by the thread, not yet in `_done`
        self._closed = False
        # Started by the first submission, not here: the engine is still starting up when it
        # creates the queue, and a model loading in another thread meanwhile (torch initialising
        # twice at once) can abort the process.
        self._thread: threading.Thread | None = None

    def submit(self, key: str, payload: Any, now: float) -> bool:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="adapt-predictions", daemon=True)
                self._thread.start()
            if len(self._pending) >= self.max_pending:
                self.stats.refused += 1
                return False
            self._pending.append((key, payload))
            self._lock.notify_all()  # the worker, and any `drain` waiting
        return super().submit(key, payload, now)

    def discard(self, key: str, now: float) -> None:
        """As `PredictionQueue.discard`, and a payload still waiting is taken out: it would be
        computed for nobody and hold a place in the bound, refusing the arrivals behind it."""
        with self._lock:
            self._pending = [(k, payload) for k, payload in self._pending if k != key]
            self._lock.notify_all()  # a `drain` waiting on it
        super().discard(key, now)

    def ready(self, now: float) -> list[tuple[str, Any]]:
        with self._lock:
            done, self._done = self._done, []
        return self._hand_over(done, now)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every payload submitted so far is computed (at most `timeout_s`); True if it
        was. The engine never calls this (a step must not wait on a model); a benchmark or a test
        that needs the results at a known point does."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending and not self._computing, timeout_s)

    def stop(self) -> None:
        """Take no more batches; a batch in flight finishes (or fails, quietly) in the background.
        An engine stops its workers, then stops what they compute with, then `close`s them."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()  # the worker, and any `drain` waiting

    def close(self) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)  # a batch in flight finishes (or fails, if stopped under it)

    def _warm_up(self) -> None:
        """The function's `warm_up` (e.g. loading its model), once."""
        warm_up = getattr(self.function, "warm_up", None)
        if warm_up is not None and not self._warmed:
            try:
                warm_up()
            except Exception:
                log.exception("prediction worker: warm-up failed (the first batch will retry)")
        self._warmed = True

    def _work(self) -> None:
        self._warm_up()
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                batch, self._pending = self._pending, []
                self._computing = len(batch)
            try:
                results = list(self.function([payload for _, payload in batch]))
                if len(results) != len(batch):  # which result is whose is unknown: none is used
                    raise ValueError(f"{len(results)} results for a batch of {len(batch)}")
            except Exception:  # a failed batch leaves its requests on their prior
                with self._lock:
                    if self._closed:  # stopped meanwhile: the engine took the model away
                        self._computing = 0
                        self._lock.notify_all()
                        log.debug("prediction worker: a batch failed after stop", exc_info=True)
                        return
                log.exception("prediction worker: a batch of %d failed", len(batch))
                with self._lock:
                    self.errors += 1
                    self._computing = 0
                    self._lock.notify_all()
                continue
            with self._lock:
                self._done.extend((key, result) for (key, _), result in zip(batch, results, strict=True))
                self._computing = 0
                self._lock.notify_all()
