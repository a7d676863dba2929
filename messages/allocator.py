"""Allocator family (tags 80-99): engine <-> allocator, one message each way per step.

Contract: the allocator owns the block pool (free list, ref counts, which request holds which
blocks, and with prefix caching the block hashes). Only the engine of the same rank sends it
operations; it batches every request's operations of one step into one `BlockOps`, and the
allocator answers with one `BlockOpsReply`, which also carries the step's hash events (the engine
keeps its index of cached hashes from them and relays them to the coordinator's routing table).
"""

from __future__ import annotations

import enum
from typing import Literal

import numpy as np

from taipan.messages.codec import Array, message
from taipan.messages.requests import empty_array_field


class PrefixCachingEvictionPolicy(enum.StrEnum):
    """What the allocator does with a cached block no request holds any more
    (actors/allocator/prefix.py); InferenceConfig's `prefix_caching_eviction_policy`."""

    REF_ZERO = "ref_zero"  # unregister and free it at once: only running requests share
    LRU = "lru"  # keep it cached until its block is needed, least recently used first


@message(80)
class AllocatorInit:
    """Size the pool. Sent once, after the gpu actor has sized the KV cache. `prefix_policy`:
    the eviction policy with prefix caching on, "" with it off (the wire form of "off" since
    before the enum: recorded logs keep decoding)."""

    num_blocks: int
    block_size: int
    prefix_policy: PrefixCachingEvictionPolicy | Literal[""] = ""


@message(81)
class AllocatorReady:
    num_blocks: int
    num_free: int


@message(82, required=12)  # (the sliding-window releases came later)
class BlockOps:
    """One step's block operations, applied in this order: releases, frees, the cache drop,
    pins, allocations, registrations.

    release_ids: int64[K] requests with a sliding window that no longer read the leading
    blocks of their table; release_upto: int32[K] how many leading blocks each has let go of
    in all (an absolute count, never less than the last one sent): the blocks up to it it had
    not released yet lose this request's reference, as at a free. The table keeps their columns
    (block indices still count from the sequence's start) and a later free covers only the
    rest. A request that pins a prefix in the same step releases with its pin: the leading
    blocks it releases fill its table's first columns but take no reference (its first query
    is already past them).

    free_ids: int64[F] requests whose blocks all go back to the pool (with prefix caching a
    block returns only when no request holds it, and under "lru" a hashed one stays cached).
    drop_cache: forget every block hash (the KV they name is gone or stale: a "recompute"
    resume, a weight update, a failed step); idle cached blocks become free.
    pin_ids: int64[M] newly admitted requests that share a cached prefix; pin_counts: int32[M]
    how many blocks each; pin_hashes: int64[sum(pin_counts)] those blocks' hashes, request
    after request. Every pin must match in full (the engine matched it on the same state).
    alloc_ids: int64[A] requests that need more blocks; alloc_counts: int32[A] how many each
    (after its pinned blocks, in its block table).
    reg_ids / reg_index / reg_hashes / reg_parents: [R] block `reg_index` of request `reg_ids`
    is a complete prompt block written by this step, with that hash and parent hash (0 for
    block 0): register it. A registration the pool declines (the hash is cached elsewhere, the
    previous block is private or released) leaves the block private.
    Pins and allocations are all-or-nothing per step: if the pool cannot serve every request,
    nothing is pinned or allocated and the reply says so (the engine plans with the count of
    available blocks, so this is a bug guard, not a scheduling mechanism).
    """

    step: int
    free_ids: Array[np.int64, 1]
    alloc_ids: Array[np.int64, 1]
    alloc_counts: Array[np.int32, 1]
    pin_ids: Array[np.int64, 1] = empty_array_field(np.int64)
    pin_counts: Array[np.int32, 1] = empty_array_field(np.int32)
    pin_hashes: Array[np.int64, 1] = empty_array_field(np.int64)
    reg_ids: Array[np.int64, 1] = empty_array_field(np.int64)
    reg_index: Array[np.int32, 1] = empty_array_field(np.int32)
    reg_hashes: Array[np.int64, 1] = empty_array_field(np.int64)
    reg_parents: Array[np.int64, 1] = empty_array_field(np.int64)
    drop_cache: bool = False
    release_ids: Array[np.int64, 1] = empty_array_field(np.int64)
    release_upto: Array[np.int32, 1] = empty_array_field(np.int32)


@message(83)
class BlockOpsReply:
    """block_ids: int32[sum(alloc_counts)], the new blocks in request order (pinned blocks are
    not repeated: the engine knows them). `num_free`: blocks a later step may take, free or
    cached and idle (evictable). The step's hash events, in the order they happened (every
    eviction comes before every registration within a step): `evicted_hashes` int64, and
    `added_hashes` int64 with the block of each in `added_blocks` int32. `num_hashed`: blocks
    with a hash; `num_idle`: those no request holds (cached, evictable)."""

    step: int
    ok: bool
    block_ids: Array[np.int32, 1]
    num_free: int
    error: str | None
    evicted_hashes: Array[np.int64, 1] = empty_array_field(np.int64)
    added_hashes: Array[np.int64, 1] = empty_array_field(np.int64)
    added_blocks: Array[np.int32, 1] = empty_array_field(np.int32)
    num_hashed: int = 0
    num_idle: int = 0
