"""What every KV block pool shares: `AllocatorError` and the invariant checks of the free list
and the ref counts (`check_free_and_refs`). The pool itself is actors/allocator/prefix.py's
PrefixBlockPool, with prefix caching on or off. Must not touch: sockets, messages, torch.
"""

from __future__ import annotations

import numpy as np


class AllocatorError(ValueError):
    """A request the pool cannot serve, e.g. more blocks than are free. Nothing was changed."""


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
