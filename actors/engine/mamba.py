"""The engine's mirror of the mamba_cache actor's slot pool (DESIGN.md §6), for planning.

Owns: how many live slots are free (`live_free`, counting the frees not yet sent), the snapshot
map as of the last reply (`snap_of`: block hash -> snapshot slot), the snapshots being written
by steps whose results have not come back (`writing`), and the operations waiting for the next
`MambaOps` (frees, invalidations, the drop). It turns an admission into a skip and the
boundaries to snapshot (`match`) and a planned chunk into its snapshots (`snapshots_in_chunk`),
as PrefixIndex turns them into pins and registrations; the scheduler decides who runs. It
takes in the mamba_cache actor's answer to each step (`served`, or `unserved` when none came
that the pool acted on; actors/engine/flow.py says when).
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

# How the scheduler plans a hybrid model (DESIGN.md §6; the contract that actors/engine/scheduler.py
# and admission.py follow): each admitted request takes a live Mamba slot from the mamba_cache actor
# (one MambaOps per step, beside the BlockOps). Mamba state is recurrent, so a hybrid skips only up
# to the deepest matched block with a Mamba snapshot (`MambaMirror.match`); the chunks that reach
# the boundaries whose state it snapshots say where, inside the chunk or at its end
# (`MambaMirror.snapshots_in_chunk`), and the kernels store those states, so chunks are cut by the
# token budget only. A request waits for a snapshot of its prefix that a running chunk is about to
# take.

from __future__ import annotations

import numpy as np

from taipan.actors.engine.batch import StepBatch
from taipan.actors.engine.prefix import PrefixIndex, writes_done
from taipan.actors.engine.request import EngineRequest
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

    # --- planning (the scheduler decides who runs; these say what a hybrid skips and saves) --

    def match(
        self, req: EngineRequest, matched: int, running: list[EngineRequest], bs: int
    ) -> tuple[int, int, int] | None:
        """A hybrid's prefix skip (DESIGN.md §6): Mamba state is recurrent, so `req` skips
        only the k <= `matched` cached blocks up to the deepest one with a snapshot (and keeps
        one prompt token to compute): (k, that block's hash, its snapshot slot), k = 0 without
        one. It still shares all `matched` blocks (their K/V is not written again).
        None: a `running` request's chunks are about to snapshot a deeper matched block (or a
        step in flight is writing one): `req` waits for it, as it waits for a KV block being
        written, instead of computing the same state again (the second of several requests
        sharing a prefix snapshots its divergence point, and the others restore it).
        Also sets the boundaries whose states its chunks snapshot: the KV divergence point
        (the end of the match), the last block boundary before its last token, and the end of
        a block-aligned prompt; those beyond k with no snapshot yet."""
        k, h, slot = 0, 0, -1
        limit = min(matched, (req.num_tokens - 1) // bs)
        if matched:
            k, h, slot = self.deepest(req.hashes, limit)
        if k < limit:
            coming = set(self.writing)
            for r in running:
                coming.update(int(r.hashes[b // bs - 1]) for b in r.snap_bounds)
            if any(int(x) in coming for x in req.hashes[k:limit]):
                return None
        n = len(req.hashes)  # complete prompt blocks
        wanted = {matched, (len(req.prompt) - 1) // bs, n if len(req.prompt) == n * bs else 0}
        req.snap_bounds = [
            b * bs
            for b in sorted(wanted)
            if k < b <= n and int(req.hashes[b - 1]) not in self.snap_of
        ]
        return k, h, slot

    def snapshots_in_chunk(
        self,
        r: EngineRequest,
        start: int,
        prefix: PrefixIndex,
        num_restored: int,
        snaps: list[tuple[EngineRequest, int, int]],
        bs: int,
    ) -> None:
        """`r`'s chunk of tokens [start, r.num_computed_tokens) was planned: for each of its
        snapshot boundaries inside the chunk or at its end, add (r, hash, tokens into the
        chunk) to the step's `snaps` (the kernels store a state inside a chunk, so chunks need
        not end there), unless a snapshot of that hash exists or is planned, the hash is not
        cached KV a request holds or is writing, or every snapshot slot is taken by the step's
        `num_restored` restores and its snapshots (then that boundary is skipped)."""
        end = r.num_computed_tokens
        while r.snap_bounds and r.snap_bounds[0] <= end:
            b = r.snap_bounds.pop(0)
            if b <= start:
                continue  # (behind the chunk: never planned that way)
            h = int(r.hashes[b // bs - 1])
            if h in self.snap_of or any(h == x for _, x, _ in snaps):
                continue
            block = prefix.block_of.get(h)
            if (block is None and h not in prefix.writing) or (
                block is not None and not prefix.refs[block]
            ):
                # A private block (its hash never matches, so its state would never be read),
                # or a cached copy no request holds, which this very step's allocations (or,
                # REF_ZERO, its frees) may evict: also one a step in flight is still writing
                # whose writer ended in this one (an abort: hypothesis found it).
                continue
            if num_restored + len(snaps) < self.snapshot_slots:
                snaps.append((r, h, b - start))

    # --- replies --------------------------------------------------------------------------------

    def served(self, batch: StepBatch, reply: MambaOpsReply) -> None:
        """The mamba_cache actor answered `batch`'s MambaOps: live slots go to the admitted
        requests, and its evictions, then its new snapshots (written by that step), into the
        mirror (a refused step changes neither: its requests fail). Either way the reply's free
        count is the truth. Whether the step's BlockOpsReply was applied before or after gives
        the same state: a hash both pools evicted in this step is gone from the pool, so it is
        no invalidation to send."""
        if reply.ok:
            if len(reply.live_slots) != len(batch.mamba_live):
                raise ValueError(
                    f"mamba_cache returned {len(reply.live_slots)} live slots, expected "
                    f"{len(batch.mamba_live)}"
                )
            for r, slot in zip(batch.mamba_live, reply.live_slots.tolist(), strict=True):
                r.mamba_slot = slot
            self._snapshots(reply, [h for _, h, _ in batch.mamba_snaps], batch.step)
            batch.mamba_snap_slots = reply.snap_slots.tolist()
        self.live_free = reply.num_live_free + len(self.pending_free)

    def _snapshots(self, reply: MambaOpsReply, snap_hashes: list[int], step: int) -> None:
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

    def unserved(self, batch: StepBatch) -> None:
        """`batch`'s MambaOps got no reply the pool acted on (an error answer, or none): its
        taken operations come back here, so the next MambaOps carries them."""
        self.live_free += len(batch.mamba_live)
        self.live_free -= len(batch.mamba_free)  # (release() counted them; they are pending again)
        for rid in batch.mamba_free:
            self.release(rid)
        self.pending_invalidate[:0] = batch.mamba_invalidate
        self.drop_pending |= batch.mamba_drop
        if self.drop_pending:
            self.pending_invalidate.clear()
        batch.mamba_live, batch.mamba_restore, batch.mamba_snaps = [], [], []

    def done_writing(self, step: int, hashes: list[int]) -> None:
        writes_done(self.writing, step, hashes)

    def stats(self) -> dict[str, int]:
        return {
            "mamba_live_free": self.live_free,
            "mamba_snapshots": len(self.snap_of),
            "mamba_restored": self.num_restored,
            "mamba_snapshots_taken": self.num_snapshots_taken,
        }
