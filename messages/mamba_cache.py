"""Mamba cache family (tags 100-119): engine <-> mamba_cache, one message each way per step.

Contract: the mamba_cache actor (actors/mamba_cache) owns the assignment of a hybrid model's
Mamba state slots: the live slots (one per request holding Mamba state) and, with
`prefix_caching_mamba_gb`, the snapshot slots (the state after a cached prompt block, keyed by
that block's hash, LRU; DESIGN.md §6). It never touches tensors: the gpu worker holds every slot
in one tensor per kind, live slots numbered 0..live_slots-1 and snapshot slots after them, and
copies states as the StepPlan says. Only the engine of the same rank sends it operations; it
batches every request's operations of one step into one `MambaOps`, sent next to that step's
`BlockOps`, and keeps an exact mirror of the snapshot map from the replies.
"""

from __future__ import annotations

import numpy as np

from taipan.messages.codec import Array, message
from taipan.messages.requests import empty_array_field


@message(100)
class MambaInit:
    """Size the slot pool. Sent once, after the gpu actor has allocated the state tensors.
    Live slots are 0..live_slots-1, snapshot slots live_slots..live_slots+snapshot_slots-1."""

    live_slots: int
    snapshot_slots: int = 0


@message(101)
class MambaReady:
    live_slots: int
    snapshot_slots: int


@message(102)
class MambaOps:
    """One step's slot operations, applied in this order: frees, the drop, invalidations, live
    slots, restores, snapshots.

    free_ids: int64[F] requests that give back their live slot (finished, evicted).
    drop_snapshots: forget every snapshot (the KV they extend is gone or stale).
    invalidate_hashes: int64[I] snapshots whose KV block the allocator evicted (each must be
    held: the engine forwards only the evictions of hashes it knows have a snapshot).
    live_ids: int64[L] requests that take a live slot (admitted this step).
    restore_hashes: int64[R] snapshots this step reads as initial states: each becomes the most
    recently used and is pinned for the step.
    snap_hashes: int64[S] new snapshots, each of a hash without one: a slot is taken (free
    first, else the least recently used unpinned snapshot is evicted) and pinned for the step;
    the gpu copies the state into it after the step's forward.
    Live slots and snapshots are all-or-nothing per step: if either cannot be served in full,
    nothing of them changes and the reply says why (frees, the drop and invalidations stay
    applied). The engine plans within its mirror, so this is a bug guard.
    """

    step: int
    free_ids: Array[np.int64, 1] = empty_array_field(np.int64)
    live_ids: Array[np.int64, 1] = empty_array_field(np.int64)
    invalidate_hashes: Array[np.int64, 1] = empty_array_field(np.int64)
    restore_hashes: Array[np.int64, 1] = empty_array_field(np.int64)
    snap_hashes: Array[np.int64, 1] = empty_array_field(np.int64)
    drop_snapshots: bool = False


@message(103)
class MambaOpsReply:
    """live_slots: int32[L] the live slot of each of `live_ids`; snap_slots: int32[S] the slot of
    each new snapshot; evicted_hashes: int64 snapshots evicted (least recently used first) to
    make room for them. `num_live_free`: live slots free after the step; `num_snapshots`:
    snapshots held."""

    step: int
    ok: bool
    error: str | None
    live_slots: Array[np.int32, 1] = empty_array_field(np.int32)
    snap_slots: Array[np.int32, 1] = empty_array_field(np.int32)
    evicted_hashes: Array[np.int64, 1] = empty_array_field(np.int64)
    num_live_free: int = 0
    num_snapshots: int = 0
