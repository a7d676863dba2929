"""The mamba_cache actor: a pure message -> reply service and the thin actor shell around it.

`MambaCacheService` owns the rank's `MambaSlotPool` and is the only thing that mutates it. It is
a deterministic function of the inbound message sequence, so `taipan replay --check` re-drives
it from a recording and expects the same encoded replies byte for byte (runtime/replay.py).

`MambaCacheActor` owns nothing but the service and one channel to the engine of the same
rank (in the runtime an in-process pair, actors/local.py; any PAIR socket works, as in tests).
Contract (messages/mamba_cache.py): one `MambaInit`, then at most one `MambaOps` per step.
A `MambaOps` is validated in full before any state changes: a malformed one gets
`ErrorReply(ErrorCode.BAD_REQUEST)` and the pool is untouched.
"""

from __future__ import annotations

import numpy as np

from taipan.actors.base import Service, ServiceActor
from taipan.actors.channel import Channel
from taipan.actors.mamba_cache.core import MambaCacheError, MambaSlotPool
from taipan.messages.common import ErrorReply
from taipan.messages.errors import ErrorCode
from taipan.messages.mamba_cache import MambaInit, MambaOps, MambaOpsReply, MambaReady

# One slot is every Mamba layer's state (megabytes for a real model): a million is far beyond
# any device, and the cap keeps a garbage MambaInit from eating the host.
MAX_SLOTS = 1 << 20


class MambaCacheService(Service):
    """Message in, reply out. `pool` is None until the first valid MambaInit."""

    def __init__(self, name: str = "mamba_cache"):
        self.name = name
        self.pool: MambaSlotPool | None = None
        self.handlers = {MambaInit: self._init, MambaOps: self._ops}

    def _init(self, msg: MambaInit) -> MambaReady | ErrorReply:
        if not 1 <= msg.live_slots <= MAX_SLOTS or not 0 <= msg.snapshot_slots <= MAX_SLOTS:
            return _bad(
                f"MambaInit: live_slots ({msg.live_slots}) must be in 1..{MAX_SLOTS} and "
                f"snapshot_slots ({msg.snapshot_slots}) in 0..{MAX_SLOTS}"
            )
        if self.pool is not None and self.pool.num_live_free < self.pool.live_slots:
            return ErrorReply(
                ErrorCode.ILLEGAL_STATE,
                f"{self.name}: MambaInit while requests hold live slots; free them first",
                None,
            )
        self.pool = MambaSlotPool(msg.live_slots, msg.snapshot_slots)
        return MambaReady(msg.live_slots, msg.snapshot_slots)

    def _ops(self, msg: MambaOps) -> MambaOpsReply | ErrorReply:
        pool = self.pool
        if pool is None:
            return ErrorReply(
                ErrorCode.ILLEGAL_STATE,
                f"{self.name}: MambaOps (step {msg.step}) before MambaInit",
                None,
            )
        problem = _check_ops(msg, pool)
        if problem is not None:
            return _bad(f"MambaOps step {msg.step}: {problem}")
        for rid in msg.free_ids.tolist():
            pool.free_live(rid)
        if msg.drop_snapshots:
            pool.drop()
        pool.invalidate(msg.invalidate_hashes.tolist())
        try:
            if len(msg.live_ids) > pool.num_live_free:
                raise MambaCacheError(
                    f"{len(msg.live_ids)} requests need a live Mamba slot but only "
                    f"{pool.num_live_free} of {pool.live_slots} are free"
                )
            snaps, evicted = pool.restore_and_snapshot(
                msg.restore_hashes.tolist(), msg.snap_hashes.tolist()
            )
            live = pool.take_live(msg.live_ids.tolist())
        except MambaCacheError as e:
            return MambaOpsReply(
                msg.step,
                False,
                f"step {msg.step}: {e}",
                num_live_free=pool.num_live_free,
                num_snapshots=pool.num_snapshots,
            )
        return MambaOpsReply(
            msg.step,
            True,
            None,
            np.asarray(live, dtype=np.int32),
            np.asarray(snaps, dtype=np.int32),
            np.asarray(evicted, dtype=np.int64),
            pool.num_live_free,
            pool.num_snapshots,
        )


def _bad(text: str) -> ErrorReply:
    return ErrorReply(ErrorCode.BAD_REQUEST, text, None)


def _check_ops(msg: MambaOps, pool: MambaSlotPool) -> str | None:
    """The first thing wrong with `msg` that no step could serve, or None. Pure."""
    for field in ("free_ids", "live_ids", "invalidate_hashes", "restore_hashes", "snap_hashes"):
        values = getattr(msg, field)
        if len(np.unique(values)) != len(values):
            return f"{field} lists a value more than once"
    for rid in msg.free_ids.tolist():
        if pool.live_slot(rid) is None:
            return f"free_ids: request {rid} holds no live Mamba slot"
    freed = set(msg.free_ids.tolist())
    for rid in msg.live_ids.tolist():
        if pool.live_slot(rid) is not None and rid not in freed:
            return f"live_ids: request {rid} already holds a live Mamba slot"
    if len(msg.snap_hashes) and not pool.snapshot_slots:
        return "snap_hashes, but this pool has no snapshot slots (prefix_caching_mamba_gb)"
    hashes = np.concatenate([msg.invalidate_hashes, msg.restore_hashes, msg.snap_hashes])
    if (hashes < 1).any():
        return "block hashes must be >= 1"
    if not msg.drop_snapshots:
        for h in msg.invalidate_hashes.tolist():
            if pool.snapshot_slot(h) is None:
                return f"invalidate_hashes: hash {h} has no snapshot"
    elif len(msg.invalidate_hashes):
        return "invalidate_hashes with drop_snapshots (the drop already forgets them)"
    gone = set(msg.invalidate_hashes.tolist())
    for h in msg.restore_hashes.tolist():
        if msg.drop_snapshots or h in gone or pool.snapshot_slot(h) is None:
            return f"restore_hashes: hash {h} has no snapshot"
    for h in msg.snap_hashes.tolist():
        if not msg.drop_snapshots and h not in gone and pool.snapshot_slot(h) is not None:
            return f"snap_hashes: hash {h} already has a snapshot"
    return None


class MambaCacheActor(ServiceActor):
    """Serves one channel through `self.service` (actors/base.py ServiceActor)."""

    def __init__(self, channel: Channel, name: str = "mamba_cache"):
        super().__init__(name, channel, MambaCacheService(name))
