"""The KV block pool: which blocks are free, which request holds which, and their ref counts.

Owns: the free list, per-block ref counts and the owner map (request id -> block ids, in the
order they were handed out, which is the request's block table order). Only the allocator actor
(through `AllocatorService`) calls the mutating methods; nothing else holds a `BlockPool`.
Must not touch: sockets, messages, torch. Plain ints, lists and numpy only.

Determinism: the lowest-numbered free block is always handed out first (a min-heap), so the same
sequence of calls gives the same block ids, which is what `taipan replay --check` relies on.

Ref counts: every block handed out today has ref 1 and one owner. Prefix caching (DESIGN.md §5)
will let several requests share a block (ref > 1); `free_request` already only returns a block to
the free list when its count reaches zero, so that change adds a "pin" call, not a rewrite.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


class AllocatorError(ValueError):
    """A request the pool cannot serve, e.g. more blocks than are free. Nothing was changed."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise AllocatorError(f"num_blocks ({num_blocks}) must be >= 1")
        self.num_blocks = num_blocks
        # list(range(n)) is already a valid min-heap: no heapify needed.
        self._free: list[int] = list(range(num_blocks))
        self._refs = np.zeros(num_blocks, dtype=np.int32)
        # Dict order is insertion order, so iterating owners is deterministic.
        self._owned: dict[int, list[int]] = {}

    # --- queries --------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_of(self, request_id: int) -> list[int]:
        """A copy of the request's blocks in block-table order ([] for an unknown request)."""
        return list(self._owned.get(request_id, ()))

    def ref_count(self, block_id: int) -> int:
        return int(self._refs[block_id])

    def requests(self) -> list[int]:
        """Ids of the requests that hold blocks, in the order they first got one."""
        return list(self._owned)

    # --- mutations ------------------------------------------------------------------------------

    def allocate(self, request_id: int, n: int) -> list[int]:
        """Hand `n` more blocks to `request_id` (appended to its table). All or nothing."""
        return self.allocate_batch([request_id], [n])

    def allocate_batch(self, request_ids: Sequence[int], counts: Sequence[int]) -> list[int]:
        """Serve every (request, count) pair or none of them; returns the new ids in order.

        The check runs before the first block moves, so an AllocatorError leaves the pool as it
        was. A request id may appear more than once; its blocks are appended in call order.
        """
        if len(request_ids) != len(counts):
            raise AllocatorError(f"{len(request_ids)} request ids but {len(counts)} counts")
        counts = [int(c) for c in counts]
        for rid, c in zip(request_ids, counts, strict=True):
            if c < 0:
                raise AllocatorError(f"request {rid}: block count {c} is negative")
        total = sum(counts)
        if total > len(self._free):
            raise AllocatorError(
                f"asked for {total} blocks but only {len(self._free)} of {self.num_blocks} are free"
            )
        out: list[int] = []
        for rid, c in zip(request_ids, counts, strict=True):
            if c == 0:
                continue
            new = [heapq.heappop(self._free) for _ in range(c)]
            self._refs[new] += 1
            self._owned.setdefault(int(rid), []).extend(new)
            out.extend(new)
        return out

    def free_request(self, request_id: int) -> int:
        """Drop every reference `request_id` holds; returns how many blocks became free.

        An unknown id is a no-op returning 0: the engine may free a request that never got a
        block (aborted while waiting), and that is not an error.
        """
        blocks = self._owned.pop(int(request_id), None)
        if not blocks:
            return 0
        freed = 0
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                heapq.heappush(self._free, b)
                freed += 1
        return freed

    # --- checks ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (tests and debugging only)."""
        free = self._free
        free_set = check_free_and_refs(free, self._refs, self._owned)
        held = np.flatnonzero(self._refs > 0)
        both = free_set.intersection(held.tolist())
        if both:
            raise AssertionError(f"blocks {sorted(both)[:8]} are both free and held")
        if len(free) + len(held) != self.num_blocks:
            raise AssertionError(f"{len(free)} free + {len(held)} held != {self.num_blocks} blocks")


def check_free_and_refs(free: list[int], refs: np.ndarray, owned: dict[int, list[int]]) -> set:
    """The checks every block pool shares (AssertionError naming the first broken one): the free
    list is a min-heap of distinct ids in range, no owner holds a block twice or holds nothing,
    and each ref count equals the number of owners holding the block. Returns the free set."""
    n = len(refs)
    free_set = set(free)
    if len(free_set) != len(free):
        raise AssertionError("a block is on the free list twice")
    if any(not 0 <= b < n for b in free):
        raise AssertionError("the free list holds an id outside the pool")
    if any(free[(i - 1) // 2] > free[i] for i in range(1, len(free))):
        raise AssertionError("the free list is not a min-heap (lowest id first is broken)")
    counted = np.zeros(n, dtype=np.int64)
    for rid, blocks in owned.items():
        if not blocks:
            raise AssertionError(f"request {rid} is an owner with no blocks")
        if len(set(blocks)) != len(blocks):
            raise AssertionError(f"request {rid} holds a block twice")
        np.add.at(counted, blocks, 1)
    if not np.array_equal(counted, refs):
        bad = int(np.flatnonzero(counted != refs)[0])
        raise AssertionError(
            f"block {bad}: ref count {refs[bad]} but {counted[bad]} owners hold it"
        )
    return free_set
