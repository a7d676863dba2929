"""Allocator family (tags 80-99): engine <-> allocator, one message each way per step.

Contract: the allocator owns the block pool (free list, ref counts, which request holds which
blocks). Only the engine of the same rank sends it operations; it batches every request's
operations of one step into one `BlockOps`, and the allocator answers with one `BlockOpsReply`.
"""

from __future__ import annotations

import numpy as np

from taipan.messages.codec import Array, message


@message(80)
class AllocatorInit:
    """Size the pool. Sent once, after the gpu actor has sized the KV cache."""

    num_blocks: int
    block_size: int


@message(81)
class AllocatorReady:
    num_blocks: int
    num_free: int


@message(82)
class BlockOps:
    """One step's block operations, applied in order: frees first, then allocations.

    free_ids: int64[F] requests whose blocks all go back to the pool.
    alloc_ids: int64[A] requests that need more blocks; alloc_counts: int32[A] how many each.
    Allocation is all-or-nothing per step: if the pool cannot serve every request, nothing is
    allocated and the reply says so (the engine plans with the free count, so this is a bug
    guard, not a scheduling mechanism).
    """

    step: int
    free_ids: Array[np.int64, 1]
    alloc_ids: Array[np.int64, 1]
    alloc_counts: Array[np.int32, 1]


@message(83)
class BlockOpsReply:
    """block_ids: int32[sum(alloc_counts)], the new blocks in request order."""

    step: int
    ok: bool
    block_ids: Array[np.int32, 1]
    num_free: int
    error: str | None
