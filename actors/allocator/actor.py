"""The allocator actor: a pure message -> reply service and the thin actor shell around it.

`AllocatorService` owns the rank's `PrefixBlockPool` (prefix caching on or off) and is the only
thing that mutates it. It is a deterministic function of the inbound message sequence (no
clock, no randomness, no unordered iteration), so `taipan replay --check` can re-drive it from
a recording and expect the same encoded replies byte for byte.

`AllocatorActor` owns nothing but the service and one channel to the engine of the same
rank (in the runtime an in-process pair, actors/local.py; any PAIR socket works, as in tests).
It must not hold pool state of its own: every decision lives in the service, so the replay
checker and the live actor agree.

Contract with the engine (messages/allocator.py): one `AllocatorInit` before anything else, then
at most one `BlockOps` per step (none for a step that changes no block). A `BlockOps` is
validated in full before any state changes: a malformed one gets
`ErrorReply(ErrorCode.BAD_REQUEST)` and the pool is untouched (an unknown `prefix_policy` in
`AllocatorInit` does not even decode).
"""

from __future__ import annotations

import numpy as np

from taipan.actors.allocator.core import AllocatorError
from taipan.actors.allocator.prefix import PrefixBlockPool
from taipan.actors.base import Service, ServiceActor
from taipan.actors.channel import Channel
from taipan.messages.allocator import AllocatorInit, AllocatorReady, BlockOps, BlockOpsReply
from taipan.messages.common import ErrorReply
from taipan.messages.errors import ErrorCode

# A pool is a Python heap of ints (~40 bytes per block); 4M blocks is far beyond any GPU's KV
# cache at useful block sizes, and the cap keeps a garbage AllocatorInit from eating the host.
MAX_BLOCKS = 1 << 22


class AllocatorService(Service):
    """Message in, reply out. `pool` is None until the first valid AllocatorInit."""

    def __init__(self, name: str = "allocator"):
        self.name = name
        self.pool: PrefixBlockPool | None = None
        self.handlers = {AllocatorInit: self._init, BlockOps: self._block_ops}

    # --- handlers -------------------------------------------------------------------------------

    def _init(self, msg: AllocatorInit) -> AllocatorReady | ErrorReply:
        if not 1 <= msg.num_blocks <= MAX_BLOCKS:
            return _bad(f"AllocatorInit.num_blocks ({msg.num_blocks}) must be in 1..{MAX_BLOCKS}")
        if msg.block_size < 1:
            return _bad(f"AllocatorInit.block_size ({msg.block_size}) must be >= 1")
        # Re-sizing an idle pool is harmless (e.g. after the KV cache was re-created); re-sizing
        # one that holds blocks would orphan them, so the engine must free everything first.
        if self.pool is not None and self.pool.num_held:
            return ErrorReply(
                ErrorCode.ILLEGAL_STATE,
                f"{self.name}: AllocatorInit while {self.pool.num_held} blocks are held; "
                "free every request first",
                None,
            )
        self.pool = PrefixBlockPool(msg.num_blocks, msg.prefix_policy or None)
        return AllocatorReady(msg.num_blocks, self.pool.num_free)

    def _block_ops(self, msg: BlockOps) -> BlockOpsReply | ErrorReply:
        if self.pool is None:
            return ErrorReply(
                ErrorCode.ILLEGAL_STATE,
                f"{self.name}: BlockOps (step {msg.step}) before AllocatorInit",
                None,
            )
        pool = self.pool
        prefix = pool.policy is not None
        problem = _check_block_ops(msg, prefix) or _check_releases(msg, pool)
        if problem is not None:
            return _bad(f"BlockOps step {msg.step}: {problem}")
        # Releases before frees: a request may let go of its window's tail and end in one step.
        # A request that pins this step releases with its pin.
        releases = dict(zip(msg.release_ids.tolist(), msg.release_upto.tolist(), strict=True))
        pinning = set(msg.pin_ids.tolist())
        for rid, upto in releases.items():
            if rid not in pinning:
                pool.release(rid, upto)
        for rid in msg.free_ids.tolist():
            pool.free_request(rid)
        if not prefix:
            allocs = zip(msg.alloc_ids.tolist(), msg.alloc_counts.tolist(), strict=True)
            try:
                ids = pool.pin_and_allocate([], list(allocs))
            except AllocatorError as e:
                # Frees and releases stay applied (the engine let go of those blocks either
                # way); allocation is all or nothing, and the engine learns the true free
                # count to plan the next step.
                return self._refused(msg, e, np.zeros(0, dtype=np.int32))
            return BlockOpsReply(
                msg.step, True, np.asarray(ids, dtype=np.int32), pool.num_free, None
            )
        if msg.drop_cache:
            pool.drop_hashes()
        ids: list[int] = []
        try:
            pins, offset = [], 0
            for rid, n in zip(msg.pin_ids.tolist(), msg.pin_counts.tolist(), strict=True):
                hashes = msg.pin_hashes[offset : offset + n].tolist()
                pins.append((rid, hashes, releases.get(rid, 0)))
                offset += n
            allocs = list(zip(msg.alloc_ids.tolist(), msg.alloc_counts.tolist(), strict=True))
            ids = pool.pin_and_allocate(pins, allocs)
            for rid, index, h, parent in zip(
                msg.reg_ids.tolist(),
                msg.reg_index.tolist(),
                msg.reg_hashes.tolist(),
                msg.reg_parents.tolist(),
                strict=True,
            ):
                pool.register(rid, index, h, parent)
        except AllocatorError as e:
            # Pins and allocations are all or nothing (nothing was pinned or taken); a refused
            # registration is an engine bug, reported after the blocks were handed out.
            return self._refused(msg, e, np.asarray(ids, dtype=np.int32))
        return self._prefix_reply(msg, True, np.asarray(ids, dtype=np.int32), None)

    def _refused(self, msg: BlockOps, e: AllocatorError, ids: np.ndarray) -> BlockOpsReply:
        error = f"step {msg.step}: {e}"
        if self.pool.policy is not None:
            return self._prefix_reply(msg, False, ids, error)
        return BlockOpsReply(msg.step, False, ids, self.pool.num_free, error)

    def _prefix_reply(self, msg: BlockOps, ok: bool, ids: np.ndarray, error: str | None):
        pool = self.pool
        added, evicted = pool.take_events()
        blocks = [pool.block_of_hash(h) for h in added]  # registration comes last: all present
        return BlockOpsReply(
            msg.step,
            ok,
            ids,
            pool.num_available,
            error,
            np.asarray(evicted, dtype=np.int64),
            np.asarray(added, dtype=np.int64),
            np.asarray(blocks, dtype=np.int32),
            pool.num_hashed,
            pool.num_cached_idle,
        )


def _bad(text: str) -> ErrorReply:
    return ErrorReply(ErrorCode.BAD_REQUEST, text, None)


def _check_block_ops(msg: BlockOps, prefix: bool) -> str | None:
    """The first thing wrong with `msg`, or None (the codec already checked dtypes and ranks).
    Pure: looks, never changes anything."""
    if len(msg.alloc_ids) != len(msg.alloc_counts):
        return (
            f"alloc_ids has {len(msg.alloc_ids)} entries but alloc_counts has "
            f"{len(msg.alloc_counts)}"
        )
    uses_prefix = len(msg.pin_ids) or len(msg.reg_ids) or msg.drop_cache
    if uses_prefix and not prefix:
        return "pins, registrations or drop_cache, but prefix caching is off in this allocator"
    if len(msg.pin_ids) != len(msg.pin_counts):
        return f"pin_ids has {len(msg.pin_ids)} entries but pin_counts has {len(msg.pin_counts)}"
    if (msg.pin_counts < 0).any() or int(msg.pin_counts.sum()) != len(msg.pin_hashes):
        return (
            f"pin_counts (sum {int(msg.pin_counts.sum())}) must be >= 0 and add up to the "
            f"{len(msg.pin_hashes)} pin_hashes"
        )
    n = len(msg.reg_ids)
    if not n == len(msg.reg_index) == len(msg.reg_hashes) == len(msg.reg_parents):
        return "reg_ids, reg_index, reg_hashes and reg_parents must have one entry each"
    if (msg.reg_index < 0).any() or (msg.reg_hashes < 1).any() or (msg.reg_parents < 0).any():
        return "reg_index must be >= 0, reg_hashes >= 1 and reg_parents >= 0"
    for field in ("free_ids", "alloc_ids", "pin_ids"):
        dup = _first_duplicate(getattr(msg, field))
        if dup is not None:
            return f"{field} lists request {dup} more than once"
    negative = np.flatnonzero(msg.alloc_counts < 0)
    if negative.size:
        i = int(negative[0])
        return f"alloc_counts[{i}] = {int(msg.alloc_counts[i])} (request {msg.alloc_ids[i]}) is < 0"
    return None


def _check_releases(msg: BlockOps, pool: PrefixBlockPool) -> str | None:
    """The first sliding-window release of `msg` the pool would refuse, or None. Pure."""
    if len(msg.release_ids) != len(msg.release_upto):
        return (
            f"release_ids has {len(msg.release_ids)} entries but release_upto has "
            f"{len(msg.release_upto)}"
        )
    dup = _first_duplicate(msg.release_ids)
    if dup is not None:
        return f"release_ids lists request {dup} more than once"
    pins = dict(zip(msg.pin_ids.tolist(), msg.pin_counts.tolist(), strict=True))
    for rid, upto in zip(msg.release_ids.tolist(), msg.release_upto.tolist(), strict=True):
        if rid in pins:  # (released with its pin)
            if not 0 <= upto <= pins[rid]:
                return f"request {rid} releases {upto} of the {pins[rid]} blocks it pins"
            continue
        problem = pool.release_problem(rid, upto)
        if problem is not None:
            return problem
    return None


def _first_duplicate(ids: np.ndarray) -> int | None:
    if ids.size < 2:
        return None
    ordered = np.sort(ids)
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    return int(ordered[same[0]]) if same.size else None


class AllocatorActor(ServiceActor):
    """Serves one channel through `self.service` (actors/base.py ServiceActor)."""

    def __init__(self, channel: Channel, name: str = "allocator"):
        super().__init__(name, channel, AllocatorService(name))
