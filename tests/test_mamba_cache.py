"""The Mamba slot pool (pure core), its message service, and the actor driven through a zmq PAIR."""

from __future__ import annotations

import asyncio
import random

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan.actors.channel import make_socket
from taipan.actors.config import ConfigError, mamba_snapshot_slots
from taipan.actors.mamba_cache.actor import MAX_SLOTS, MambaCacheActor, MambaCacheService
from taipan.actors.mamba_cache.core import MambaCacheError, MambaSlotPool
from taipan.messages.codec import decode, encode
from taipan.messages.common import ErrorReply, Heartbeat
from taipan.messages.errors import ErrorCode
from taipan.messages.mamba_cache import MambaInit, MambaOps, MambaOpsReply, MambaReady


def state(pool: MambaSlotPool) -> tuple:
    """Everything the pool holds, copied: equal before and after means untouched."""
    return (
        dict(pool._live_of),
        sorted(pool._live_free),
        list(pool._snaps.items()),
        sorted(pool._snap_free),
    )


def ints(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def ops(step, free=(), live=(), inv=(), restore=(), snap=(), drop=False) -> MambaOps:
    return MambaOps(step, ints(free), ints(live), ints(inv), ints(restore), ints(snap), drop)


# --- the snapshot budget (actors/config.py) ------------------------------------------------------


@pytest.mark.parametrize("slot_bytes", [1, 7, 4096, 3 * 1024 * 1024 + 5])
def test_snapshot_slots_exact_boundaries(slot_bytes):
    for k in (1, 2, 3, 17):
        assert mamba_snapshot_slots(k * slot_bytes, slot_bytes) == k
        assert mamba_snapshot_slots(k * slot_bytes + slot_bytes - 1, slot_bytes) == k
        if k > 1:
            assert mamba_snapshot_slots(k * slot_bytes - 1, slot_bytes) == k - 1
    assert mamba_snapshot_slots(slot_bytes, slot_bytes) == 1
    assert mamba_snapshot_slots(0, slot_bytes) == 0
    assert mamba_snapshot_slots(-1, slot_bytes) == 0
    assert mamba_snapshot_slots(-10 * slot_bytes, slot_bytes) == 0


def test_snapshot_budget_below_one_slot_is_a_configuration_error():
    with pytest.raises(ConfigError, match=r"prefix_caching_mamba_gb \(4095 bytes\)") as e:
        mamba_snapshot_slots(4095, 4096)
    assert "holds no Mamba snapshot slot" in str(e.value) and "4096 bytes" in str(e.value)
    with pytest.raises(ConfigError, match="prefix_caching_mamba_gb"):
        mamba_snapshot_slots(1, 2)


@pytest.mark.parametrize("slot_bytes", [0, -1, -4096])
@pytest.mark.parametrize("budget", [-5, 0, 1, 1 << 30])
def test_snapshot_slot_size_must_be_positive(slot_bytes, budget):
    with pytest.raises(ConfigError, match=f"must take >= 1 byte, not {slot_bytes}"):
        mamba_snapshot_slots(budget, slot_bytes)


# --- the pool: snapshots, LRU ---------------------------------------------------------------------


def test_bad_pool_sizes():
    for live, snap in [(0, 0), (-1, 2), (2, -1)]:
        with pytest.raises(MambaCacheError):
            MambaSlotPool(live, snap)
    pool = MambaSlotPool(1)
    assert pool.snapshot_slots == 0 and pool.num_snapshots == 0
    pool.check()


def test_free_snapshot_slots_first_lowest_first_then_lru_eviction():
    pool = MambaSlotPool(2, 4)  # snapshot slots 2..5
    assert pool.restore_and_snapshot([], [10, 11]) == ([2, 3], [])
    assert pool.restore_and_snapshot([], [12]) == ([4], [])
    assert pool.lru_order() == [10, 11, 12]
    pool.invalidate([11])  # slot 3 is free again, below the untouched slot 5
    assert pool.restore_and_snapshot([], [13]) == ([3], [])
    assert pool.restore_and_snapshot([], [14]) == ([5], [])
    assert pool.lru_order() == [10, 12, 13, 14] and pool.num_snapshots == 4
    # Full: restores make 10 and 13 the most recent (13 last), so 12 then 14 go first.
    assert pool.restore_and_snapshot([10, 13], []) == ([], [])
    assert pool.lru_order() == [12, 14, 10, 13]
    assert pool.restore_and_snapshot([], [15]) == ([4], [12])
    assert pool.lru_order() == [14, 10, 13, 15]
    assert pool.restore_and_snapshot([], [16, 17]) == ([2, 5], [14, 10])
    assert pool.lru_order() == [13, 15, 16, 17]
    assert [pool.snapshot_slot(h) for h in pool.lru_order()] == [3, 4, 2, 5]
    assert pool.snapshot_slot(10) is None and pool.snapshot_slot(12) is None
    pool.check()


def test_eviction_takes_free_slots_before_evicting_anything():
    pool = MambaSlotPool(1, 3)
    pool.restore_and_snapshot([], [1, 2])
    # One free slot (3), two new: one eviction only (the least recent, 1, in slot 1). The
    # evicted slot joins the free ones and the lowest is handed out first.
    assert pool.restore_and_snapshot([], [3, 4]) == ([1, 3], [1])
    assert pool.lru_order() == [2, 3, 4]
    pool.check()


def test_restored_snapshots_are_pinned_for_their_step():
    pool = MambaSlotPool(1, 4)  # slots 1..4
    pool.restore_and_snapshot([], [1, 2, 3, 4])
    # 1 and 2 are the least recent, but pinned: 3 and 4 go, in LRU order.
    assert pool.restore_and_snapshot([2, 1], [5, 6]) == ([3, 4], [3, 4])
    assert pool.lru_order() == [2, 1, 5, 6]
    # Restoring a hash twice in one step pins it once and moves it once to the end.
    assert pool.restore_and_snapshot([2, 2], [7]) == ([1], [1])
    assert pool.lru_order() == [5, 6, 2, 7]
    pool.check()


@pytest.mark.parametrize(
    "restore, new, match",
    [
        ([1, 2, 3], [9], "1 new Mamba snapshots need slots, but 0 of 3 are free"),
        ([1, 2], [8, 9], "2 new Mamba snapshots need slots"),  # one unpinned, two needed
        ([], [7, 8, 9, 10], "4 new Mamba snapshots need slots"),  # more than the pool
    ],
)
def test_too_few_unpinned_slots_refuses_the_whole_step(restore, new, match):
    pool = MambaSlotPool(2, 3)
    pool.restore_and_snapshot([], [1, 2, 3])
    pool.restore_and_snapshot([1], [])  # LRU: 2, 3, 1
    before = state(pool)
    with pytest.raises(MambaCacheError, match=match) as e:
        pool.restore_and_snapshot(restore, new)
    assert "pinned" in str(e.value)
    assert state(pool) == before and pool.lru_order() == [2, 3, 1]  # no restore was applied
    pool.check()


def test_mixed_pins_with_free_slots():
    pool = MambaSlotPool(1, 5)  # slots 1..5
    pool.restore_and_snapshot([], [1, 2, 3, 4])  # slot 5 free
    pool.restore_and_snapshot([3], [])  # LRU: 1, 2, 4, 3
    # Three new: the free slot 5, then the two least recent unpinned (1 is pinned: 2, 4).
    slots, evicted = pool.restore_and_snapshot([1, 3], [10, 11, 12])
    assert evicted == [2, 4] and slots == [2, 4, 5]
    assert pool.lru_order() == [1, 3, 10, 11, 12]
    pool.check()


@pytest.mark.parametrize(
    "restore, new, match",
    [
        ([99], [], "no snapshot of hash 99 to restore"),
        ([1, 99], [5], "no snapshot of hash 99 to restore"),
        ([], [2], "hash 2 already has a snapshot"),
        ([1], [1], "hash 1 already has a snapshot"),  # restored and re-snapshotted
        ([], [5, 5], "hash 5 already has a snapshot \\(or is snapshotted twice\\)"),
    ],
)
def test_bad_restore_and_snapshot_changes_nothing(restore, new, match):
    pool = MambaSlotPool(1, 4)
    pool.restore_and_snapshot([], [1, 2])
    before = state(pool)
    with pytest.raises(MambaCacheError, match=match):
        pool.restore_and_snapshot(restore, new)
    assert state(pool) == before


def test_no_snapshot_slots_at_all():
    pool = MambaSlotPool(2, 0)
    assert pool.restore_and_snapshot([], []) == ([], [])
    with pytest.raises(MambaCacheError, match="0 of 0 are free"):
        pool.restore_and_snapshot([], [1])
    assert pool.lru_order() == [] and pool.drop() == []
    pool.check()


# --- the pool: invalidation and drop -------------------------------------------------------------


def test_invalidate_frees_slots_and_missing_hash_changes_nothing():
    pool = MambaSlotPool(2, 4)  # slots 2..5
    pool.restore_and_snapshot([], [1, 2, 3, 4])
    pool.invalidate([3, 1])
    assert pool.lru_order() == [2, 4] and pool.num_snapshots == 2
    assert pool.snapshot_slot(1) is None and pool.snapshot_slot(3) is None
    assert pool.restore_and_snapshot([], [5, 6]) == ([2, 4], [])  # lowest freed first
    before = state(pool)
    with pytest.raises(MambaCacheError, match="no snapshot of hash 99 to invalidate"):
        pool.invalidate([2, 99])  # 2 exists but the call is all or nothing
    assert state(pool) == before
    with pytest.raises(MambaCacheError, match="no snapshot of hash 1 to invalidate"):
        pool.invalidate([1])  # already invalidated
    assert state(pool) == before
    pool.invalidate([])
    assert state(pool) == before
    pool.check()


def test_drop_returns_every_hash_lru_first_and_frees_every_slot():
    pool = MambaSlotPool(3, 3)  # slots 3..5
    pool.take_live([7])
    pool.restore_and_snapshot([], [30, 10, 20])
    pool.restore_and_snapshot([30], [])
    assert pool.drop() == [10, 20, 30]
    assert pool.num_snapshots == 0 and pool.lru_order() == []
    assert pool.live_slot(7) == 0 and pool.num_live_free == 2  # live slots are not snapshots
    assert pool.restore_and_snapshot([], [1, 2, 3]) == ([3, 4, 5], [])
    assert pool.drop() == [1, 2, 3] and pool.drop() == []
    pool.check()


def test_invalidate_with_a_duplicate_hash_raises_and_changes_nothing():
    pool = MambaSlotPool(1, 2)
    pool.restore_and_snapshot([], [5, 6])
    before = state(pool)
    with pytest.raises(MambaCacheError):
        pool.invalidate([5, 5])
    assert state(pool) == before


# --- the pool: live slots ------------------------------------------------------------------------


def test_live_slots_lowest_first_all_or_nothing():
    pool = MambaSlotPool(4, 2)
    assert pool.take_live([10, 11]) == [0, 1]
    assert pool.take_live([]) == []
    before = state(pool)
    with pytest.raises(MambaCacheError, match="3 requests need a live Mamba slot but only 2 of 4"):
        pool.take_live([12, 13, 14])
    assert state(pool) == before and pool.live_slot(12) is None
    with pytest.raises(MambaCacheError, match="request 11 already holds a live Mamba slot"):
        pool.take_live([12, 11])
    assert state(pool) == before
    with pytest.raises(MambaCacheError, match="a request asks for two live Mamba slots"):
        pool.take_live([12, 12])
    assert state(pool) == before
    pool.free_live(10)
    assert pool.num_live_free == 3
    assert pool.take_live([13, 12]) == [0, 2]  # the freed low slot first, in request order
    assert [pool.live_slot(r) for r in (10, 11, 12, 13)] == [None, 1, 2, 0]
    pool.check()


def test_free_live_unknown_request_raises_and_changes_nothing():
    pool = MambaSlotPool(2)
    pool.take_live([1])
    before = state(pool)
    with pytest.raises(MambaCacheError, match="request 2 holds no live Mamba slot"):
        pool.free_live(2)
    assert state(pool) == before
    pool.free_live(1)
    with pytest.raises(MambaCacheError, match="request 1 holds no live Mamba slot"):
        pool.free_live(1)  # twice
    assert pool.num_live_free == 2
    pool.check()


def test_live_and_snapshot_slots_never_overlap():
    pool = MambaSlotPool(3, 2)
    assert pool.take_live([1, 2, 3]) == [0, 1, 2]
    assert pool.restore_and_snapshot([], [9, 8]) == ([3, 4], [])
    pool.check()


# --- the pool against a reference model, at random -----------------------------------------------


class Model:
    """The pool as plain lists: live slots by request, snapshots as an LRU list of hashes."""

    def __init__(self, live: int, snaps: int):
        self.live_free = set(range(live))
        self.live_of: dict[int, int] = {}
        self.snap_free = set(range(live, live + snaps))
        self.slot_of: dict[int, int] = {}
        self.lru: list[int] = []

    def take_live(self, ids):
        if any(r in self.live_of for r in ids) or len(set(ids)) != len(ids):
            return None
        if len(ids) > len(self.live_free):
            return None
        out = []
        for r in ids:
            slot = min(self.live_free)
            self.live_free.remove(slot)
            self.live_of[r] = slot
            out.append(slot)
        return out

    def free_live(self, r):
        if r not in self.live_of:
            return None
        self.live_free.add(self.live_of.pop(r))
        return True

    def restore_and_snapshot(self, restore, new):
        if any(h not in self.slot_of for h in restore):
            return None
        if any(h in self.slot_of for h in new) or len(set(new)) != len(new):
            return None
        unpinned = [h for h in self.lru if h not in set(restore)]
        need = max(len(new) - len(self.snap_free), 0)
        if need > len(unpinned):
            return None
        for h in restore:
            self.lru.remove(h)
            self.lru.append(h)
        evicted = unpinned[:need]
        for h in evicted:
            self.lru.remove(h)
            self.snap_free.add(self.slot_of.pop(h))
        slots = []
        for h in new:
            slot = min(self.snap_free)
            self.snap_free.remove(slot)
            self.slot_of[h] = slot
            self.lru.append(h)
            slots.append(slot)
        return slots, evicted

    def invalidate(self, hashes):
        if any(h not in self.slot_of for h in hashes):
            return None
        for h in hashes:
            self.lru.remove(h)
            self.snap_free.add(self.slot_of.pop(h))
        return True

    def drop(self):
        out = list(self.lru)
        self.invalidate(out)
        return out


def _random_op(rng: random.Random, model: Model):
    """(method name, args): valid about two thirds of the time, invalid otherwise."""
    held = sorted(model.lru)
    live = sorted(model.live_of)
    kind = rng.choice(["take", "take", "free", "snap", "snap", "snap", "inv", "drop"])
    if kind == "take":
        ids = rng.sample(range(40), rng.randint(0, 4))
        if rng.random() < 0.15 and ids:
            ids.append(ids[0])  # a duplicate
        return "take_live", (ids,)
    if kind == "free":
        if live and rng.random() < 0.75:
            return "free_live", (rng.choice(live),)
        return "free_live", (rng.randrange(40),)
    if kind == "snap":
        restore = rng.sample(held, min(len(held), rng.randint(0, 3)))
        if rng.random() < 0.1:
            restore.append(rng.randint(1, 60))  # maybe missing
        new = rng.sample(range(1, 60), rng.randint(0, 4))
        if rng.random() < 0.5:
            new = [h for h in new if h not in model.slot_of]
        if rng.random() < 0.05 and new:
            new.append(new[-1])
        return "restore_and_snapshot", (restore, new)
    if kind == "inv":
        hashes = rng.sample(held, min(len(held), rng.randint(0, 2)))
        if rng.random() < 0.2:
            hashes.append(rng.randint(1, 60))  # maybe missing
            hashes = list(dict.fromkeys(hashes))
        return "invalidate", (hashes,)
    return "drop", ()


@pytest.mark.parametrize("seed, live, snaps", [(0, 4, 6), (1, 2, 3), (2, 6, 1), (3, 3, 0)])
def test_random_cycles_match_the_reference_model(seed, live, snaps):
    rng = random.Random(seed)
    pool, model = MambaSlotPool(live, snaps), Model(live, snaps)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(1000):
        name, args = _random_op(rng, model)
        before = state(pool)
        expected = getattr(model, name)(*args)
        if expected is None:
            with pytest.raises(MambaCacheError):
                getattr(pool, name)(*args)
            assert state(pool) == before, (name, args)
            outcomes["refused"] += 1
        else:
            got = getattr(pool, name)(*args)
            if name in ("take_live", "restore_and_snapshot", "drop"):
                assert got == expected, (name, args)
            outcomes["ok"] += 1
        pool.check()
        assert pool.lru_order() == model.lru
        assert dict(pool._snaps) == model.slot_of
        assert {h: pool.snapshot_slot(h) for h in model.lru} == model.slot_of
        assert pool.num_snapshots == len(model.lru)
        assert {r: pool.live_slot(r) for r in range(41)} == {
            r: model.live_of.get(r) for r in range(41)
        }
        assert pool.num_live_free == len(model.live_free)
    assert outcomes["ok"] > 300 and outcomes["refused"] > 100, outcomes


# --- the service ---------------------------------------------------------------------------------


def ready_service(live=4, snaps=3) -> MambaCacheService:
    svc = MambaCacheService()
    assert svc.handle(MambaInit(live, snaps)) == MambaReady(live, snaps)
    return svc


def test_ops_before_init_is_illegal_state():
    svc = MambaCacheService()
    r = svc.handle(ops(0, live=[1]))
    assert isinstance(r, ErrorReply) and r.code == "illegal_state"
    assert "MambaOps (step 0) before MambaInit" in r.text
    assert svc.pool is None


@pytest.mark.parametrize(
    "init",
    [MambaInit(0, 0), MambaInit(-1, 2), MambaInit(MAX_SLOTS + 1, 0)]
    + [MambaInit(2, -1), MambaInit(2, MAX_SLOTS + 1)],
)
def test_bad_init(init):
    svc = MambaCacheService()
    r = svc.handle(init)
    assert isinstance(r, ErrorReply) and r.code == "bad_request"
    assert "live_slots" in r.text and svc.pool is None
    # A bad re-init leaves the running pool as it was.
    svc = ready_service(2, 1)
    svc.handle(ops(0, snap=[5]))
    before = state(svc.pool)
    assert svc.handle(init).code == "bad_request" and state(svc.pool) == before


def test_init_at_the_limits_and_reinit_only_without_live_slots():
    assert MambaCacheService().handle(MambaInit(MAX_SLOTS, 0)) == MambaReady(MAX_SLOTS, 0)
    svc = ready_service(2, 2)
    assert svc.handle(MambaInit(3, 1)) == MambaReady(3, 1)
    assert svc.handle(ops(0, live=[1], snap=[9])).ok
    r = svc.handle(MambaInit(5, 5))
    assert isinstance(r, ErrorReply) and r.code == "illegal_state" and "free them first" in r.text
    assert svc.pool.live_slots == 3 and svc.pool.live_slot(1) == 0
    assert svc.handle(ops(1, free=[1])).ok
    assert svc.handle(MambaInit(5, 5)) == MambaReady(5, 5)
    assert svc.pool.num_snapshots == 0 and svc.pool.num_live_free == 5


BAD_OPS = [
    ("free_ids lists a value more than once", dict(free=[1, 1])),
    ("live_ids lists a value more than once", dict(live=[5, 6, 5])),
    ("invalidate_hashes lists a value more than once", dict(inv=[100, 100])),
    ("restore_hashes lists a value more than once", dict(restore=[100, 100])),
    ("snap_hashes lists a value more than once", dict(snap=[7, 7])),
    ("free_ids: request 9 holds no live Mamba slot", dict(free=[1, 9])),
    ("live_ids: request 2 already holds a live Mamba slot", dict(free=[1], live=[5, 2])),
    ("invalidate_hashes: hash 55 has no snapshot", dict(free=[1], inv=[100, 55])),
    ("restore_hashes: hash 55 has no snapshot", dict(free=[1], restore=[55])),
    ("restore_hashes: hash 100 has no snapshot", dict(free=[1], inv=[100], restore=[100])),
    ("restore_hashes: hash 200 has no snapshot", dict(free=[1], restore=[200], drop=True)),
    ("invalidate_hashes with drop_snapshots", dict(free=[1], inv=[100], drop=True)),
    ("block hashes must be >= 1", dict(free=[1], snap=[0])),
    ("block hashes must be >= 1", dict(free=[1], restore=[-3])),
    ("block hashes must be >= 1", dict(free=[1], inv=[0], snap=[8])),
]


@pytest.mark.parametrize("expected, fields", BAD_OPS)
def test_malformed_ops_are_bad_requests_and_change_nothing(expected, fields):
    svc = ready_service(4, 3)
    assert svc.handle(ops(0, live=[1, 2], snap=[100, 200])).ok
    before = state(svc.pool)
    r = svc.handle(ops(1, **fields))
    assert isinstance(r, ErrorReply) and r.code == "bad_request", r
    assert expected in r.text and "MambaOps step 1" in r.text
    assert state(svc.pool) == before  # the valid free of request 1 was not applied either


def test_snapshots_without_snapshot_slots_are_bad_requests():
    svc = ready_service(2, 0)
    assert svc.handle(ops(0, live=[1])).ok
    before = state(svc.pool)
    r = svc.handle(ops(1, free=[1], snap=[5]))
    assert isinstance(r, ErrorReply) and r.code == "bad_request"
    assert "snap_hashes, but this pool has no snapshot slots (prefix_caching_mamba_gb)" in r.text
    assert state(svc.pool) == before
    # Live slots alone are fine on such a pool.
    r = svc.handle(ops(2, free=[1], live=[2, 3]))
    assert r.ok and r.live_slots.tolist() == [0, 1] and r.num_snapshots == 0


def test_a_request_freed_and_readmitted_in_one_step():
    svc = ready_service(2, 1)
    assert svc.handle(ops(0, live=[1, 2])).live_slots.tolist() == [0, 1]
    r = svc.handle(ops(1, free=[2, 1], live=[1]))
    assert r.ok and r.live_slots.tolist() == [0] and r.num_live_free == 1


def test_too_few_live_slots_keeps_the_frees_and_changes_nothing_else():
    svc = ready_service(2, 3)
    r = svc.handle(ops(0, live=[1, 2], snap=[100, 200, 300]))
    assert r.ok and r.live_slots.tolist() == [0, 1] and r.snap_slots.tolist() == [2, 3, 4]
    r = svc.handle(ops(1, free=[1], live=[3, 4], inv=[300], restore=[100], snap=[400]))
    assert isinstance(r, MambaOpsReply) and not r.ok and r.step == 1
    assert r.error == "step 1: 2 requests need a live Mamba slot but only 1 of 2 are free"
    assert r.live_slots.size == 0 and r.snap_slots.size == 0 and r.evicted_hashes.size == 0
    assert r.live_slots.dtype == np.int32 and r.evicted_hashes.dtype == np.int64
    assert r.num_live_free == 1 and r.num_snapshots == 2
    pool = svc.pool
    assert pool.live_slot(1) is None and pool.live_slot(2) == 1  # the free stayed applied
    assert pool.live_slot(3) is None and pool.live_slot(4) is None
    # The invalidation stayed applied (messages/mamba_cache.py); the restore did not reorder.
    assert pool.lru_order() == [100, 200] and pool.snapshot_slot(400) is None
    pool.check()


def test_every_snapshot_slot_pinned_refuses_the_step():
    svc = ready_service(3, 2)
    assert svc.handle(ops(0, live=[1], snap=[100, 200])).ok
    r = svc.handle(ops(1, free=[1], live=[2], restore=[200, 100], snap=[300]))
    assert isinstance(r, MambaOpsReply) and not r.ok
    assert r.error.startswith("step 1: 1 new Mamba snapshots need slots, but 0 of 2 are free")
    assert "pinned by this step (2 restored)" in r.error
    assert r.num_live_free == 3 and r.num_snapshots == 2
    pool = svc.pool
    assert pool.lru_order() == [100, 200] and pool.live_slot(2) is None
    assert pool.live_slot(1) is None  # freed
    # The same step with one restore fewer goes through, evicting the unpinned one.
    r = svc.handle(ops(2, live=[2], restore=[200], snap=[300]))
    assert r.ok and r.live_slots.tolist() == [0] and r.snap_slots.tolist() == [3]
    assert r.evicted_hashes.tolist() == [100] and pool.lru_order() == [200, 300]


def test_happy_path_sequence():
    svc = ready_service(3, 3)  # live 0..2, snapshots 3..5

    def step(msg, live, snaps, evicted, live_free, num_snaps, lru):
        r = svc.handle(msg)
        assert isinstance(r, MambaOpsReply) and r.ok and r.error is None and r.step == msg.step
        assert r.live_slots.dtype == np.int32 and r.snap_slots.dtype == np.int32
        assert r.evicted_hashes.dtype == np.int64
        assert r.live_slots.tolist() == live and r.snap_slots.tolist() == snaps
        assert r.evicted_hashes.tolist() == evicted
        assert (r.num_live_free, r.num_snapshots) == (live_free, num_snaps)
        assert svc.pool.lru_order() == lru
        svc.pool.check()
        wire = decode(encode(r))
        assert wire.live_slots.tolist() == live and wire.evicted_hashes.tolist() == evicted

    step(ops(1, live=[10, 11], snap=[101]), [0, 1], [3], [], 1, 1, [101])
    step(
        ops(2, free=[10], live=[12, 13], restore=[101], snap=[102, 103]),
        [0, 2],
        [4, 5],
        [],
        0,
        3,
        [101, 102, 103],
    )
    step(ops(3, restore=[102], snap=[104]), [], [3], [101], 0, 3, [103, 102, 104])
    step(
        ops(4, inv=[103], restore=[104], snap=[105, 106]), [], [4, 5], [102], 0, 3, [104, 105, 106]
    )
    step(ops(5, drop=True, snap=[107]), [], [3], [], 0, 1, [107])
    step(ops(6, free=[11, 12, 13], live=[11]), [0], [], [], 2, 1, [107])
    step(
        ops(7, inv=[107], snap=[107]), [], [3], [], 2, 1, [107]
    )  # invalidated, then snapshotted again
    step(ops(8), [], [], [], 2, 1, [107])  # an empty step
    assert svc.pool.live_slot(11) == 0 and svc.pool.snapshot_slot(107) == 3


@pytest.mark.parametrize("extra", [dict(snap=[100]), dict(restore=[100], snap=[100])])
def test_snapshot_of_a_hash_that_has_one_is_a_bad_request(extra):
    svc = ready_service(2, 3)
    assert svc.handle(ops(0, live=[1], snap=[100, 200])).ok
    before = state(svc.pool)
    r = svc.handle(ops(1, free=[1], inv=[200], **extra))
    assert isinstance(r, ErrorReply) and r.code == "bad_request", r
    assert state(svc.pool) == before


def test_garbage_frames_unexpected_messages_and_errors():
    svc = ready_service()
    before = state(svc.pool)
    for frames in (
        [b"\xc1garbage"],
        [b""],
        [],
        [msgpack.packb([999, 1])],
        [msgpack.packb(7)],
        [msgpack.packb([MambaOps.TAG, 1, "step", [], [], [], [], [], False])],
        [msgpack.packb([MambaOps.TAG, 1, 1])],
        [msgpack.packb([MambaInit.TAG, 1, "four", 0])],
    ):
        r = svc.handle_frames(frames)
        assert isinstance(r, ErrorReply) and r.code not in ("bad_request", "internal"), frames
        assert len(r.text) <= 2000
    assert state(svc.pool) == before
    r = svc.handle(Heartbeat(1.0))
    assert r == ErrorReply("unexpected_message", "mamba_cache does not take Heartbeat", None)
    r = svc.handle(MambaReady(1, 1))
    assert isinstance(r, ErrorReply) and r.code == "unexpected_message"
    assert svc.handle(ErrorReply(ErrorCode.INTERNAL, "y", None)) is None
    assert svc.handle_frames(encode(ErrorReply(ErrorCode.INTERNAL, "y", None))) is None
    # Valid frames go through the same path as handle().
    r = svc.handle_frames(encode(ops(1, live=[1], snap=[5])))
    assert r.ok and r.live_slots.tolist() == [0] and r.snap_slots.tolist() == [4]


def test_wrong_array_dtype_never_reaches_the_pool():
    svc = ready_service()
    before = state(svc.pool)
    arr = np.asarray([1], dtype=np.int32)
    body = msgpack.packb([arr.dtype.name, list(arr.shape), arr.tobytes()], use_bin_type=True)
    bad = msgpack.ExtType(1, body)  # EXT_ARRAY_INLINE
    empty = encode(ops(0))
    fields = msgpack.unpackb(empty[0], raw=False, strict_map_key=False)
    fields[3] = bad  # free_ids as int32
    r = svc.handle_frames([msgpack.packb(fields, use_bin_type=True)])
    assert isinstance(r, ErrorReply) and r.code == "bad_array" and "free_ids" in r.text, r
    assert state(svc.pool) == before


# --- the actor, through its socket only ----------------------------------------------------------


async def _drive_actor(messages):
    ctx = zmq.asyncio.Context()
    chan = make_socket(ctx, zmq.PAIR, "inproc://mamba-cache-test", bind=True, name="engine")
    engine = ctx.socket(zmq.PAIR)
    engine.setsockopt(zmq.LINGER, 0)
    engine.connect("inproc://mamba-cache-test")
    actor = MambaCacheActor(chan)

    async def ask(frames):
        await engine.send_multipart(frames)
        return decode(await asyncio.wait_for(engine.recv_multipart(), 5))

    replies = []
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(actor.run())
            try:
                for frames in messages:
                    replies.append(await ask(frames))
            finally:
                actor.stop()
    finally:
        chan.close()
        engine.close(linger=0)
        ctx.term()
    return actor, replies


@pytest.mark.asyncio
async def test_actor_over_inproc_pair():
    actor, replies = await _drive_actor(
        [
            encode(ops(0, live=[1])),
            encode(MambaInit(2, 2)),
            encode(ops(1, live=[1, 2], snap=[100])),
            [b"\x93\xff not a message"],
            encode(ops(2, free=[7])),
            encode(Heartbeat(0.0)),
            encode(ops(3, live=[3])),
            encode(ops(4, free=[1], live=[3], restore=[100], snap=[200])),
            encode(ops(5, restore=[200], snap=[300])),
        ]
    )
    early, ready, first, garbage, bad, unexpected, too_many, after, evicting = replies
    assert isinstance(early, ErrorReply) and early.code == "illegal_state"
    assert ready == MambaReady(2, 2)
    assert isinstance(first, MambaOpsReply) and first.ok and first.step == 1
    assert first.live_slots.tolist() == [0, 1] and first.snap_slots.tolist() == [2]
    assert first.num_live_free == 0 and first.num_snapshots == 1
    assert isinstance(garbage, ErrorReply) and garbage.code not in ("internal", "bad_request")
    assert isinstance(bad, ErrorReply) and bad.code == "bad_request" and "request 7" in bad.text
    assert unexpected == ErrorReply(
        "unexpected_message", "mamba_cache does not take Heartbeat", None
    )
    assert isinstance(too_many, MambaOpsReply) and not too_many.ok and too_many.step == 3
    assert "1 requests need a live Mamba slot but only 0 of 2 are free" in too_many.error
    assert isinstance(after, MambaOpsReply) and after.ok and after.step == 4
    assert after.live_slots.tolist() == [0] and after.snap_slots.tolist() == [3]
    assert after.evicted_hashes.tolist() == [] and after.num_live_free == 0
    assert after.num_snapshots == 2
    assert evicting.ok and evicting.snap_slots.tolist() == [2]
    assert evicting.evicted_hashes.tolist() == [100] and evicting.num_snapshots == 2
    assert actor.service.pool.lru_order() == [200, 300]
    actor.service.pool.check()
