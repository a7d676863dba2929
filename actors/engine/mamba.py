"""The engine's mirror of the mamba_cache actor's slot pool (DESIGN.md §6), for planning.

Owns: how many live slots are free (`live_free`, counting the frees not yet sent), the snapshot
map as of the last reply (`snap_of`: block hash -> snapshot slot), the snapshots being written
by steps whose results have not come back (`writing`), and the operations waiting for the next
`MambaOps` (frees, invalidations, the drop).
Must not touch: sockets, torch, the pool itself (the mamba_cache actor owns it and decides).

Why a mirror: to plan a step the scheduler must know which prompt blocks have a snapshot (a
hybrid may skip only up to the deepest one) and whether a live slot is free, before the one
mamba_cache hop of the step. It is exact: only this engine changes the pool, every reply names
the slots it handed out and the snapshots it evicted, and the KV evictions that invalidate
snapshots come from the allocator's replies, which the engine sees first.
Sharing rule: a snapshot is restorable once the step that writes it has returned its result (a
failed step drops every snapshot, as it drops the KV hashes).
Frees, invalidations and a drop wait for the next MambaOps (the pool applies them before that
step's allocations), so a step that only frees sends nothing here.

Determinism: plain dicts and lists, a function of the scheduler's calls and the replies.
"""

from __future__ import annotations

import numpy as np

from taipan.messages.mamba_cache import MambaOpsReply


class MambaMirror:
    def __init__(self, live_slots: int, snapshot_slots: int):
        self.live_slots = live_slots
        self.snapshot_slots = snapshot_slots
        self.live_free = live_slots
        self.snap_of: dict[int, int] = {}
        self.writing: dict[int, int] = {}  # hash -> the step that writes its snapshot
        self.pending_free: list[int] = []  # request ids
        self.pending_invalidate: list[int] = []  # hashes
        self.drop_pending = False
        self.num_restored = 0  # prefills started from a snapshot (stats)
        self.num_snapshots_taken = 0

    def restorable(self, h: int) -> int | None:
        """The snapshot slot of hash `h` if a step may read it now, else None."""
        if h in self.writing:
            return None
        return self.snap_of.get(h)

    def deepest(self, hashes: np.ndarray, limit: int) -> tuple[int, int, int]:
        """(k, hash, slot): the largest k <= `limit` whose block k-1 has a restorable snapshot
        (k = 0: none, hash 0 and slot -1)."""
        for k in range(min(limit, len(hashes)), 0, -1):
            h = int(hashes[k - 1])
            slot = self.restorable(h)
            if slot is not None:
                return k, h, slot
        return 0, 0, -1

    def release(self, request_id: int) -> None:
        """A request lets go of its live slot (sent with the next MambaOps)."""
        self.pending_free.append(request_id)
        self.live_free += 1

    def kv_evicted(self, hashes) -> None:
        """The allocator evicted these KV blocks: their snapshots go too."""
        for h in hashes:
            if self.snap_of.pop(h, None) is not None:
                self.writing.pop(h, None)
                self.pending_invalidate.append(h)

    def drop(self) -> None:
        """Every snapshot is void (the KV it extends is gone or stale)."""
        self.snap_of.clear()
        self.writing.clear()
        self.pending_invalidate.clear()
        self.drop_pending = True

    def take_pending(self) -> tuple[list[int], list[int], bool]:
        """(frees, invalidations, drop) for the MambaOps about to be sent."""
        out = self.pending_free, self.pending_invalidate, self.drop_pending
        self.pending_free, self.pending_invalidate, self.drop_pending = [], [], False
        return out

    def apply(self, reply: MambaOpsReply, snap_hashes: list[int], step: int) -> None:
        """A served step: its evictions, then its new snapshots (written by `step`). Whether
        the step's BlockOpsReply was applied before or after gives the same state: a hash both
        pools evicted in this step is gone from the pool, so it is no invalidation to send."""
        for h in reply.evicted_hashes.tolist():
            if self.snap_of.pop(h, None) is None:
                if h not in self.pending_invalidate:
                    raise RuntimeError(f"mamba_cache evicted snapshot {h}, never seen here")
                self.pending_invalidate.remove(h)
            self.writing.pop(h, None)
        for h, slot in zip(snap_hashes, reply.snap_slots.tolist(), strict=True):
            self.snap_of[h] = slot
            self.writing[h] = step
        self.num_snapshots_taken += len(snap_hashes)

    def done_writing(self, step: int, hashes: list[int]) -> None:
        for h in hashes:
            if self.writing.get(h) == step:
                del self.writing[h]

    def stats(self) -> dict[str, int]:
        return {
            "mamba_live_free": self.live_free,
            "mamba_snapshots": len(self.snap_of),
            "mamba_restored": self.num_restored,
            "mamba_snapshots_taken": self.num_snapshots_taken,
        }
