"""The Mamba slot pool: who holds which live slot, and which block hash has a snapshot where.

Owns: the free live slots, the live slot of each request, the snapshot map (block hash -> slot)
in least-recently-used order, and the free snapshot slots. Only the mamba_cache actor (through
`MambaCacheService`) calls the mutating methods.
Must not touch: sockets, messages, torch. Plain ints, lists and dicts only.

Slots are numbered as the gpu worker's state tensors hold them: live slots 0..L-1, snapshot
slots L..L+S-1. A snapshot is the Mamba state (conv + SSM, every Mamba layer) after the prompt
block whose chained hash keys it, so it stands for every token up to that block's end
(DESIGN.md §6). Snapshots are evicted least recently used first; a restore or a new snapshot
makes it the most recent. A snapshot read or written by the step being applied is *pinned*
for that step and never evicted by it; a step that needs more new snapshots than there are
free or unpinned slots is refused in full.

Determinism: the lowest free slot is handed out first and the LRU order is the order of use,
so the same sequence of calls gives the same slots (what `taipan replay --check` relies on).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence


class MambaCacheError(ValueError):
    """An operation the pool cannot serve; nothing was changed."""


class MambaSlotPool:
    def __init__(self, live_slots: int, snapshot_slots: int = 0):
        if live_slots < 1 or snapshot_slots < 0:
            raise MambaCacheError(
                f"live_slots ({live_slots}) must be >= 1 and snapshot_slots ({snapshot_slots}) >= 0"
            )
        self.live_slots = live_slots
        self.snapshot_slots = snapshot_slots
        self._live_free = list(range(live_slots))  # a min-heap (sorted is a valid heap)
        self._live_of: dict[int, int] = {}  # request id -> live slot
        self._snap_free = list(range(live_slots, live_slots + snapshot_slots))
        self._snaps: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recent first

    # --- queries --------------------------------------------------------------------------------

    @property
    def num_live_free(self) -> int:
        return len(self._live_free)

    @property
    def num_snapshots(self) -> int:
        return len(self._snaps)

    def live_slot(self, request_id: int) -> int | None:
        return self._live_of.get(request_id)

    def snapshot_slot(self, h: int) -> int | None:
        return self._snaps.get(h)

    def lru_order(self) -> list[int]:
        """Snapshot hashes, least recently used first."""
        return list(self._snaps)

    def check(self) -> None:
        """Raise AssertionError unless every slot is in exactly one place."""
        live = sorted(self._live_free) + sorted(self._live_of.values())
        assert sorted(live) == list(range(self.live_slots)), "live slots lost or duplicated"
        snaps = sorted(self._snap_free) + sorted(self._snaps.values())
        total = self.live_slots + self.snapshot_slots
        assert sorted(snaps) == list(range(self.live_slots, total)), "snapshot slots broken"

    # --- live slots -----------------------------------------------------------------------------

    def free_live(self, request_id: int) -> None:
        slot = self._live_of.pop(request_id, None)
        if slot is None:
            raise MambaCacheError(f"request {request_id} holds no live Mamba slot")
        heapq.heappush(self._live_free, slot)

    def take_live(self, request_ids: Sequence[int]) -> list[int]:
        """A live slot for each request (all or nothing)."""
        held = [r for r in request_ids if r in self._live_of]
        if held:
            raise MambaCacheError(f"request {held[0]} already holds a live Mamba slot")
        if len(set(request_ids)) != len(request_ids):
            raise MambaCacheError("a request asks for two live Mamba slots")
        if len(request_ids) > len(self._live_free):
            raise MambaCacheError(
                f"{len(request_ids)} requests need a live Mamba slot but only "
                f"{len(self._live_free)} of {self.live_slots} are free"
            )
        out = []
        for r in request_ids:
            slot = heapq.heappop(self._live_free)
            self._live_of[r] = slot
            out.append(slot)
        return out

    # --- snapshots ------------------------------------------------------------------------------

    def drop(self) -> list[int]:
        """Forget every snapshot; returns their hashes (least recent first)."""
        hashes = list(self._snaps)
        for slot in self._snaps.values():
            heapq.heappush(self._snap_free, slot)
        self._snaps.clear()
        return hashes

    def invalidate(self, hashes: Sequence[int]) -> None:
        """The KV blocks of these hashes are gone: so are their snapshots (each must exist)."""
        missing = [h for h in hashes if h not in self._snaps]
        if missing:
            raise MambaCacheError(f"no snapshot of hash {missing[0]} to invalidate")
        if len(set(hashes)) != len(hashes):
            raise MambaCacheError("a hash is invalidated twice")
        for h in hashes:
            heapq.heappush(self._snap_free, self._snaps.pop(h))

    def restore_and_snapshot(
        self, restore: Sequence[int], new: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """One step's snapshot traffic: `restore` (hashes read as initial states) become the
        most recent and are pinned; each of `new` (hashes without a snapshot) takes a slot,
        free ones first, then the least recently used unpinned one (evicted). All or nothing.
        Returns (the new snapshots' slots, the evicted hashes)."""
        missing = [h for h in restore if h not in self._snaps]
        if missing:
            raise MambaCacheError(f"no snapshot of hash {missing[0]} to restore")
        present = [h for h in new if h in self._snaps]
        if present or len(set(new)) != len(new):
            h = present[0] if present else new[0]
            raise MambaCacheError(f"hash {h} already has a snapshot (or is snapshotted twice)")
        pinned = set(restore)
        need = len(new) - len(self._snap_free)
        evictable = [h for h in self._snaps if h not in pinned][: max(need, 0)]
        if need > len(evictable):
            raise MambaCacheError(
                f"{len(new)} new Mamba snapshots need slots, but {len(self._snap_free)} of "
                f"{self.snapshot_slots} are free and every other one is pinned by this step "
                f"({len(pinned)} restored)"
            )
        for h in restore:
            self._snaps.move_to_end(h)
        for h in evictable:
            heapq.heappush(self._snap_free, self._snaps.pop(h))
        slots = []
        for h in new:
            slot = heapq.heappop(self._snap_free)
            self._snaps[h] = slot
            slots.append(slot)
        return slots, evictable
