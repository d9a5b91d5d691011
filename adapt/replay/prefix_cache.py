"""vLLM's automatic prefix caching, as block accounting the replay engine can run.

With prefix caching on (vLLM's default) a KV block whose tokens are all computed is remembered by
its content, and a request admitted later whose prompt starts with the same content reuses it
instead of computing it again. Three things follow that the plain `BlockPool` cannot model:
- a request that shares a prefix (a system prompt, an earlier turn) schedules only its uncached
  tokens, so its prefill is shorter and cheaper;
- a request preempted by recompute finds its own blocks again when it resumes, if nothing has
  reused them since;
- a free block still holds content, so *which* free block an allocation takes decides what stays
  cached.

So this pool keeps block identities and vLLM's free-block order (its `FreeKVCacheBlockQueue`):
new blocks come from the head of the queue, and a freed request's blocks go back in reverse order,
those never cached to the head (reused first), cached ones to the tail (kept longest). A hit
takes a cached block out of the queue. The rules are vLLM V1's for a model with full attention
only: no sliding window, no KV connector, no speculative decoding.

A block's content is a key. A request's blocks take the keys it comes with
(`Request.prompt_blocks` and `Request.answer_blocks`: vLLM's block hashes, from a decision or
request log); every other block gets a key of its own, taken to differ from every other
request's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np

from adapt.replay.kv import BlockPool


class PrefixCachingBlockPool(BlockPool):
    """`BlockPool` with vLLM's prefix cache. The engine asks `lookup` for an arriving request's
    cached prefix, checks room with `fits`, takes it with `adopt`, and after each allocation
    registers the blocks whose tokens are computed with `cache`; `release` frees in vLLM's order."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(num_blocks, block_size)
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._content: list[Hashable | None] = [None] * num_blocks  # the key a block is cached under
        self._cached: dict[Hashable, dict[int, None]] = {}  # key -> blocks with it, oldest first
        self._blocks: dict[str, list[int]] = {}
        self._registered: dict[str, int] = {}  # how many of a request's blocks are cached
        self._keys: dict[str, tuple[Hashable, ...]] = {}
        self._not_reading: set[str] = set()
        # Tokens found in the cache over the pool's life, resumed requests' own included (vLLM's
        # hits metric counts those apart, as preempted hits).
        self.hit_tokens = 0

    # ------------------------------------------------------------- requests' content
    def register(self, request_id: str, block_keys: Sequence[Hashable], reads: bool = True) -> None:
        """The content keys of a request's first full blocks (may be empty: nothing shared);
        without `reads` it never takes cached blocks (vLLM's `skip_reading_prefix_cache`), but
        what it computes is cached all the same."""
        self._keys[request_id] = tuple(block_keys)
        if not reads:
            self._not_reading.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request left the engine: its blocks' content stays cached, its keys are not needed."""
        self._keys.pop(request_id, None)
        self._not_reading.discard(request_id)

    def _key(self, request_id: str, index: int) -> Hashable:
        keys = self._keys.get(request_id, ())
        return keys[index] if index < len(keys) else (request_id, index)

    # ------------------------------------------------------------- hits
    def lookup(self, request_id: str, num_tokens: int) -> list[int]:
        """The cached blocks the request's first tokens match, longest prefix first, leaving at
        least its last token to compute (vLLM needs its logits): `get_computed_blocks`."""
        hits: list[int] = []
        if request_id in self._not_reading:
            return hits
        for index in range((num_tokens - 1) // self.block_size):
            blocks = self._cached.get(self._key(request_id, index))
            if not blocks:
                break
            hits.append(next(iter(blocks)))
        return hits

    def fits(self, request_id: str, hits: Sequence[int], tokens: int) -> bool:
        """Whether the request can hold `tokens` tokens, `hits` among its blocks. A hit on a free
        block takes that block out of the free queue, so it counts against the room as vLLM's
        `get_num_blocks_to_allocate` counts it."""
        needed = max(self.blocks_for(tokens) - self._held.get(request_id, 0) - len(hits), 0)
        evictable = sum(1 for block in hits if self._refs[block] == 0)
        return needed + evictable <= self.free_blocks

    def adopt(self, request_id: str, hits: Sequence[int]) -> None:
        """The request takes its cached prefix (vLLM's `touch`), before any new block."""
        if not hits:
            return
        for block in hits:
            if self._refs[block] == 0:
                del self._queue[block]
                self.free_blocks -= 1
            self._refs[block] += 1
        self._blocks[request_id] = list(hits)
        self._held[request_id] = len(hits)
        self._registered[request_id] = len(hits)
        self.hit_tokens += len(hits) * self.block_size

    def cache(self, request_id: str, tokens: int) -> None:
        """Remember the content of the request's blocks that `tokens` fills (vLLM's
        `cache_blocks`, run after each allocation with the tokens computed by the end of the
        step, capped at the tokens the request has)."""
        full = tokens // self.block_size
        start = self._registered.get(request_id, 0)
        if full <= start:
            return
        blocks = self._blocks[request_id]
        for index in range(start, full):
            block, key = blocks[index], self._key(request_id, index)
            self._content[block] = key
            self._cached.setdefault(key, {})[block] = None
        self._registered[request_id] = full

    def reset(self) -> bool:
        """Forget all cached content (vLLM's `BlockPool.reset_prefix_cache`): only when no block
        is in use, else False and nothing changes. The free queue keeps its order."""
        if self.free_blocks != self.num_blocks:
            return False
        self._cached.clear()
        self._content = [None] * self.num_blocks
        return True

    # ------------------------------------------------------------- allocation
    def _take(self, request_id: str, count: int) -> None:
        """New blocks come from the head of the free queue, and lose the content they held."""
        blocks = self._blocks.setdefault(request_id, [])
        for _ in range(count):
            block, _ = self._queue.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            blocks.append(block)

    def grow_many(self, request_ids: Sequence[str], held: np.ndarray, tokens: np.ndarray) -> None:
        """`grow` each request to its `tokens` (a decode run's blocks, taken at once). Which free
        blocks each request gets differs from taking them step by step, but not what is evicted
        (the same blocks from the head of the queue) nor what each block will hold: a block is
        only a place for its request's content."""
        needed = np.maximum(-(-tokens // self.block_size) - held, 0)
        if (total := int(needed.sum())) > self.free_blocks:
            raise RuntimeError(f"KV pool exhausted: a decode run needs {total}, {self.free_blocks} free")
        for i in np.flatnonzero(needed).tolist():
            self.try_grow(request_ids[i], int(tokens[i]))

    def _evict(self, block: int) -> None:
        """A free block is reused: its old content is no longer cached."""
        key = self._content[block]
        if key is None:
            return
        self._content[block] = None
        holders = self._cached[key]
        del holders[block]
        if not holders:
            del self._cached[key]

    def release(self, request_id: str) -> None:
        """Free the request's blocks last first: those holding no cached content go to the head
        of the free queue (reused first), cached ones to the tail (`BlockPool.free_blocks`)."""
        blocks = self._blocks.pop(request_id, [])
        self._held.pop(request_id, None)
        self._registered.pop(request_id, None)
        uncached = []
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._content[block] is None:
                    uncached.append(block)
                else:
                    self._queue[block] = None
                self.free_blocks += 1
        for block in reversed(uncached):
            self._queue[block] = None
            self._queue.move_to_end(block, last=False)
