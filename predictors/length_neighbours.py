"""Nearest prompt lengths: the length-only prior of `semantic-history` (SageSched on a trace without
prompt text, or a prompt unlike anything in the window).

"Nearest" is by ratio -- the larger length over the smaller, the order of |log a - log b| -- and
among equally near entries the most recent win. The choice must be the same on every machine, or a
replay's numbers depend on the CPU it ran on: numpy's `argpartition` picks a different one of equal
entries with its AVX-512, AVX2 and baseline x86 kernels, and `np.log`'s last bit differs between
them too. Here ratios are compared exactly, in integers, and ties are broken by id.

A prediction per arrival over a 10,000-entry window is SageSched's main cost in replay, so
`LengthNeighbours` keeps the window's entries grouped by length, the lengths sorted: a query walks
outward from the target over the few lengths it needs instead of scanning every entry.
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np


def nearest_by_ratio(lengths: np.ndarray, ids: np.ndarray, target: int, count: int) -> np.ndarray:
    """The ids of the `count` entries (`lengths` and `ids`) nearest `target` by ratio, equally near
    ones by largest id; every entry if there are no more than `count`. A scan of every entry: the
    reference `LengthNeighbours` must agree with, and the path for a filtered window."""
    if len(ids) <= count:
        return ids
    goal = float(max(int(target), 1))
    lengths = np.maximum(np.asarray(lengths, dtype=np.float64), 1.0)
    # IEEE division rounds the same everywhere; ratios of lengths below 2**26 that are equal as
    # fractions are equal as floats, and unequal ones differ by more than a rounding.
    ratio = np.maximum(lengths, goal) / np.minimum(lengths, goal)
    farthest = np.partition(ratio, count - 1)[count - 1]  # the count-th nearest ratio (a value)
    candidates = np.flatnonzero(ratio <= farthest)
    tied = ratio[candidates] == farthest
    closer, tied = candidates[~tied], candidates[tied]
    newest_tied = tied[np.argsort(ids[tied], kind="stable")[len(tied) - (count - len(closer)) :]]
    return ids[np.concatenate((closer, newest_tied))]


class LengthNeighbours:
    """A FIFO window's entries by length: the distinct lengths sorted, and each length's ids in
    the order they came. Entries must arrive in id order and leave oldest first. The lengths are
    a plain sorted list: a window holds about a thousand distinct ones, so an insertion's move is
    cheap, and a query reads a dozen of them by index."""

    def __init__(self) -> None:
        self._lengths: list[int] = []
        self._ids: dict[int, deque[int]] = {}

    def add(self, length: int, entry: int) -> None:
        length = max(int(length), 1)
        ids = self._ids.get(length)
        if ids is None:
            ids = self._ids[length] = deque()
            bisect.insort(self._lengths, length)
        ids.append(entry)

    def remove_oldest(self, length: int, entry: int) -> None:
        """Remove `entry`, the oldest of those of `length` (the window evicts in id order)."""
        length = max(int(length), 1)
        ids = self._ids[length]
        if ids.popleft() != entry:
            raise ValueError(f"length neighbours: entry {entry} is not the oldest of length {length}")
        if not ids:
            del self._ids[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]

    def copy(self) -> LengthNeighbours:
        twin = LengthNeighbours()
        twin._lengths = self._lengths.copy()
        twin._ids = {length: ids.copy() for length, ids in self._ids.items()}
        return twin

    def nearest(self, target: int, count: int) -> list[int]:
        """`nearest_by_ratio` over the entries held: whole lengths, nearest first, until `count`
        are taken; of the last length (or the two, one each side, that are equally near) the most
        recent. Ratios are compared exactly: a shorter length a and a longer b are equally near
        `target` t when t / a == b / t, i.e. t * t == a * b."""
        target = max(int(target), 1)
        lengths, by_length, square, end = self._lengths, self._ids, target * target, len(self._lengths)
        below = bisect.bisect_left(lengths, target) - 1  # the next shorter length to take
        above = below + 1  # the next length at least as long as the target
        taken: list[int] = []
        need = count
        while need > 0 and (below >= 0 or above < end):
            # which side is nearer: t / shorter against longer / t, in integers (0: both)
            if below < 0:
                side = 1
            elif above >= end:
                side = -1
            else:
                side = square - lengths[below] * lengths[above]
            if side == 0:
                ids = sorted([*by_length[lengths[below]], *by_length[lengths[above]]])
                below, above = below - 1, above + 1
            elif side < 0:
                ids = by_length[lengths[below]]  # in id order
                below -= 1
            else:
                ids = by_length[lengths[above]]
                above += 1
            if len(ids) > need:
                ids = list(ids)[len(ids) - need :]  # the most recent
            taken.extend(ids)
            need -= len(ids)
        return taken
