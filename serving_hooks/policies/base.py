"""Shared machinery for policies that admit waiting requests in the order of a sort key.

The waiting index is a `SortedList`: O(log n) per arrival, admission and preemption, and the plan's
admission order is a lazy iterator over it, so a step costs nothing per waiting request the engine
does not look at.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from sortedcontainers import SortedList

from adapt.policy import EngineView, Plan, Policy, RequestState

VICTIMS = ("priority", "newest")


class PriorityPolicy(Policy):
    """Admit waiting requests by ascending `key`, and order the running ones by `running_key`, so
    that the running request with the largest key gets tokens last and is the first evicted under
    KV pressure (vLLM's priority-scheduling rule). Subclasses define `key`; those with
    `orders_running = False` keep vLLM's FCFS running order (admission order: the last admitted
    is evicted first).

    `victim` (default: the class's own rule) "newest" keeps the FCFS running order for a policy that
    orders admissions by its key, "priority" sorts the running requests by it:
    under recompute preemption an evicted request loses every token it computed, and the newest
    admitted has computed the fewest, while the largest key (the longest predicted, the longest
    prompt) is often the one that has computed the most (`experiments.sagesched_study`)."""

    orders_running = True

    def __init__(self, victim: str | None = None) -> None:
        own = "priority" if self.orders_running else "newest"  # None: the class's own rule
        if victim is not None and victim not in VICTIMS:
            raise ValueError(f"victim: expected one of {', '.join(VICTIMS)}, got {victim!r}")
        if victim is not None and victim != own and not self.orders_running:
            raise ValueError(f"victim: {self.name} keeps vLLM's running order, evicting the newest admitted")
        self.victim = victim or own
        self._waiting = SortedList()
        self._entries: dict[str, tuple[Any, ...]] = {}
        self._seq = itertools.count()

    def key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        raise NotImplementedError

    def _insert(self, request: RequestState, now: float) -> None:
        entry = (*self.key(request, now), next(self._seq), request)
        self._entries[request.id] = entry
        self._waiting.add(entry)

    def _remove(self, request: RequestState) -> None:
        entry = self._entries.pop(request.id, None)
        if entry is not None:
            self._waiting.remove(entry)

    def on_arrival(self, request: RequestState, now: float) -> None:
        self._insert(request, now)

    def on_preempt(self, request: RequestState, now: float) -> None:
        self._insert(request, now)

    def on_admit(self, request: RequestState, now: float) -> None:
        self._remove(request)

    def on_finish(self, request: RequestState, now: float) -> None:
        self._remove(request)

    def waiting_in_order(self) -> Iterator[RequestState]:
        return (entry[-1] for entry in self._waiting)

    def on_step(self, view: EngineView) -> Plan:
        return Plan(admit=self.waiting_in_order(), running_order=self.running_in_order(view.running))

    def running_key(self, request: RequestState, now: float) -> tuple[Any, ...]:
        """Key of a running request in the running order (default: its admission key)."""
        return self.key(request, now)

    def running_in_order(self, running: Sequence[RequestState]) -> list[RequestState] | None:
        """The running requests by ascending `running_key` (None: keep admission order). The
        sort is stable: ties keep admission order (the last admitted is evicted first)."""
        if not self.orders_running or self.victim == "newest":
            return None
        return sorted(running, key=lambda r: self.running_key(r, r.last_token_s or r.arrival_s))
