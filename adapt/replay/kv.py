"""Paged KV-cache accounting, kept apart from scheduling as vLLM keeps its KV manager apart.

Only block counts matter to timing and admission, so a request's blocks are an integer, not a
list of block ids: ceil(tokens / block_size).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockPool:
    """Fixed pool of KV blocks. A request holds ceil(cached tokens / block_size) blocks."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks = num_blocks
        self._held: dict[str, int] = {}

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def held(self, request_id: str) -> int:
        return self._held.get(request_id, 0)

    def extra_blocks(self, request_id: str, tokens: int) -> int:
        """Blocks needed beyond those held for the request to cache `tokens` tokens in total."""
        return max(0, self.blocks_for(tokens) - self._held.get(request_id, 0))

    def can_grow(self, request_id: str, tokens: int) -> bool:
        return self.extra_blocks(request_id, tokens) <= self.free_blocks

    # What a prefix cache (`adapt.replay.prefix_cache`) does at admission; without one nothing is
    # ever cached, so a request computes all its tokens and only the room counts.
    def lookup(self, request_id: str, num_tokens: int) -> list[int]:
        """The cached blocks the request's first tokens match: none here."""
        return []

    def fits(self, request_id: str, hits: Sequence[int], tokens: int) -> bool:
        """Whether the request can hold `tokens` tokens, `hits` among its blocks."""
        return self.can_grow(request_id, tokens)

    def adopt(self, request_id: str, hits: Sequence[int]) -> None:
        """The request takes its cached blocks: there are none here."""

    def cache(self, request_id: str, tokens: int) -> None:
        """Remember the content of the request's computed blocks: nothing is remembered here."""

    def try_grow(self, request_id: str, tokens: int) -> bool:
        """`grow` if the blocks are free, else False: the scheduler's check and allocation in one
        call (it runs once per scheduled request per step)."""
        held = self._held.get(request_id, 0)
        extra = -(-tokens // self.block_size) - held
        if extra <= 0:
            return True
        if extra > self.free_blocks:
            return False
        self._take(request_id, extra)
        self._held[request_id] = held + extra
        self.free_blocks -= extra
        return True

    def grow(self, request_id: str, tokens: int) -> None:
        """Make the request hold enough blocks for `tokens` cached tokens (caller checked room)."""
        held = self._held.get(request_id, 0)
        extra = -(-tokens // self.block_size) - held  # `extra_blocks`, inlined: a decode run's hot path
        if extra <= 0:
            return
        if extra > self.free_blocks:
            raise RuntimeError(f"KV pool exhausted: {request_id} needs {extra}, {self.free_blocks} free")
        self._take(request_id, extra)
        self._held[request_id] = held + extra
        self.free_blocks -= extra

    def _take(self, request_id: str, count: int) -> None:
        """Which free blocks a growing request takes: only their count matters here (a prefix
        cache overrides this, as there a block holds content)."""

    @property
    def held_by_request(self) -> dict[str, int]:
        """Blocks held per request, to be read only: the scheduler checks each running request's
        room with one lookup and calls `try_grow` only when it needs a block (1 step in 16)."""
        return self._held

    def held_many(self, request_ids: Sequence[str]) -> np.ndarray:
        """`held` of each request, as an array (the decode-run fast path)."""
        get = self._held.get
        return np.fromiter((get(r, 0) for r in request_ids), dtype=np.int64, count=len(request_ids))

    def grow_many(self, request_ids: Sequence[str], held: np.ndarray, tokens: np.ndarray) -> None:
        """`grow` each request, holding `held` blocks (`held_many`), to its `tokens` at once (a
        decode run grows every running request; the caller checked room)."""
        blocks = np.maximum(held, -(-tokens // self.block_size))
        extra = int((blocks - held).sum())
        if extra > self.free_blocks:
            raise RuntimeError(f"KV pool exhausted: a decode run needs {extra}, {self.free_blocks} free")
        for i in np.flatnonzero(blocks != held).tolist():
            self._held[request_ids[i]] = int(blocks[i])
        self.free_blocks -= extra

    def release(self, request_id: str) -> None:
        self.free_blocks += self._held.pop(request_id, 0)

    @property
    def usage(self) -> float:
        return 1.0 - self.free_blocks / self.num_blocks
