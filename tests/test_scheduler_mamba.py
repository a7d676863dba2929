"""Mamba-state prefix caching for hybrid models in the engine's scheduler (DESIGN.md §6).

`MambaHarness` extends the prefix harness (tests/test_scheduler_prefix.py: the real allocator
service answers BlockOps, the fake gpu checks that every sequence reads its own K/V) with the
real mamba_cache service (`MambaCacheService`, answering MambaOps) and a fake Mamba state per
slot: the tuple of the token ids the sequence has consumed so far. For each sequence of a step
the fake device reads its initial state (zeros: the empty tuple; else the slot `mamba_init`
names), checks that it stands for exactly the request's tokens before the chunk, and writes it
plus the chunk's tokens to `mamba_out`; it stores the snapshots (`mamba_snap_row`,
`mamba_snap_pos` -> `mamba_snap_dst`: the row's state after that many tokens of its chunk,
inside it or at its end), each of which must be the state after a whole number of prompt blocks
whose chained hash is the one the scheduler attached. So a restore from a stale,
evicted or wrong snapshot, or a skip deeper than a snapshot, fails at the step where it happens.

The harness applies the two replies of a step in the live engine's order, which replay follows
too (the MambaOpsReply before the BlockOpsReply, actors/engine/flow.py `StepFlow.settle`);
`engine_order=False` keeps the order of tests/test_scheduler.py's Harness (the BlockOpsReply
first): the mirror must end in the same state either way (a hash both pools evict in one step,
a cache drop).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from taipan.actors.config import InferenceConfig, RuntimePlan
from taipan.actors.engine import wire
from taipan.actors.engine.check import EngineReplay
from taipan.actors.engine.flow import apply_block_reply
from taipan.actors.engine.scheduler import StepBatch
from taipan.actors.mamba_cache.actor import MambaCacheService
from taipan.messages.allocator import AllocatorReady, BlockOpsReply
from taipan.messages.block_hash import block_hashes
from taipan.messages.codec import encode
from taipan.messages.gpu import GpuControlReply, ModelLoaded, StepResult
from taipan.messages.mamba_cache import MambaInit, MambaOps, MambaOpsReply, MambaReady
from taipan.messages.requests import AbortRequest, EngineSubmit, StepOutputs
from tests.fuzz import fuzz_settings
from tests.test_scheduler import drive, make_plan, true_tokens
from tests.test_scheduler_prefix import PrefixHarness, request, run_all


def hybrid_plan(plan: RuntimePlan, live: int, snaps: int) -> RuntimePlan:
    return dataclasses.replace(plan, mamba_slots=live, mamba_snapshot_slots=snaps)


def _tokens(req, n: int) -> tuple[int, ...]:
    return tuple(true_tokens(req, n).tolist())


class NegativeBlocks(AssertionError):
    """A chunk with a negative block count (test_an_admission_after_the_free_blocks_are_taken...:
    a hybrid admitted with fewer available blocks than its cached-idle prefix costs)."""


class StaleSnapshot(AssertionError):
    """A step snapshots a hash that its own BlockOpsReply evicts (a snapshot of no KV)."""


class Livelock(AssertionError):
    """More steps than any workload here needs (see test_snapshot_boundaries_never_livelock...)."""


class MambaHarness(PrefixHarness):
    """PrefixHarness + the mamba_cache service + a fake Mamba state per slot."""

    max_steps = 2000  # (the fuzz workloads finish in a few hundred)
    raise_on_stale = False  # raise StaleSnapshot at once (else only listed in `stale`)

    def __init__(
        self,
        plan: RuntimePlan,
        *,
        live: int | None = None,
        snaps: int = 8,
        overlap: bool = False,
        policy: str = "lru",
        chunked: bool = False,
        engine_order: bool = True,
    ):
        if not plan.mamba_slots:
            plan = hybrid_plan(plan, live or plan.max_requests, snaps)
        super().__init__(plan, chunked, overlap, policy)
        self.L, self.S = plan.mamba_slots, plan.mamba_snapshot_slots
        self.service = MambaCacheService()
        assert self.service.handle(MambaInit(self.L, self.S)) == MambaReady(self.L, self.S)
        self.engine_order = engine_order
        self.deferred: tuple[StepBatch, BlockOpsReply] | None = None
        self.states: dict[int, tuple[int, ...]] = {}  # slot -> the tokens its state stands for
        self.mamba_ops: list[MambaOps] = []
        self.restores_per_step: list[int] = []  # chunks that started from a snapshot, per step
        self.snapshots: list[tuple[int, int, int]] = []  # (request, tokens, hash) copied
        self.inner_snapshots = 0  # snapshots stored inside a chunk (not at its end)
        self.snap_evicted: list[int] = []  # hashes the pool evicted (LRU), from its replies
        self.kv_voided: list[tuple[int, int]] = []  # (step, hash): snapshots a KV eviction voided
        self.stale: list[tuple[int, int]] = []  # (step, hash): snapshots their own step evicts

    def step(self, in_flight=lambda: None) -> bool:
        if self.sched.step > self.max_steps:
            raise Livelock(f"{self.sched.step} steps, {len(self.ended)} of {len(self.added)} ended")
        return super().step(in_flight)

    # --- the two services ---------------------------------------------------------------------

    def apply_blocks(self, batch: StepBatch, reply: BlockOpsReply) -> None:
        if self.engine_order and batch.has_mamba_ops:
            self.deferred = (batch, reply)  # applied in check_blocks, after the Mamba reply
        else:
            self._apply_blocks(batch, reply)

    def _apply_blocks(self, batch: StepBatch, reply: BlockOpsReply) -> None:
        m = self.sched.mamba
        evicted = set(reply.evicted_hashes.tolist())
        stale = [(batch.step, h) for _, h, _ in batch.mamba_snaps if h in evicted]
        if stale and not batch.drop_cache:
            self.stale += stale
            if self.raise_on_stale:
                raise StaleSnapshot(f"step {batch.step} snapshots and evicts {stale}")
        before = dict(m.snap_of)
        apply_block_reply(self.sched, batch, reply)
        for h in reply.evicted_hashes.tolist():
            if h in before and not batch.drop_cache:
                assert h not in m.snap_of and h in m.pending_invalidate, h
                self.kv_voided.append((batch.step, h))

    def record(self, direction: str, channel: str, msg) -> None:
        if isinstance(msg, MambaOps):
            self.mamba_ops.append(msg)

    def mamba_slots(self, batch: StepBatch, ops: MambaOps) -> MambaOpsReply:
        pool = self.service.pool
        restored = {c.mamba_init for c in batch.chunks if c.mamba_init is not None}
        assert {pool.snapshot_slot(h) for h in ops.restore_hashes.tolist()} == restored
        reply = self.service.handle(ops)
        assert isinstance(reply, MambaOpsReply) and reply.ok, reply
        pool.check()
        new = set(ops.snap_hashes.tolist())
        for h in ops.invalidate_hashes.tolist():
            assert pool.snapshot_slot(h) is None or h in new, f"snapshot {h} survived"
        self.snap_evicted += reply.evicted_hashes.tolist()
        return reply

    # --- the fake device ------------------------------------------------------------------------

    def gpu(self, batch: StepBatch, a: dict[str, np.ndarray]) -> StepResult:
        self.run_mamba(batch, a)  # (before the base gpu: it replaces device_sampled)
        return super().gpu(batch, a)

    def run_mamba(self, batch: StepBatch, a: dict[str, np.ndarray]) -> None:
        L, S, bs = self.L, self.S, self.plan.block_size
        n = len(batch.chunks)
        init, out = a["mamba_init"].tolist(), a["mamba_out"].tolist()
        assert len(init) == len(out) == n and len(set(out)) == n
        assert all(0 <= o < L for o in out), out
        ids = a["input_ids"].astype(np.int64)
        prev = a["prev_rows"]
        if len(prev):  # the worker's rule: a row of the step before gives the input id
            ids = np.where(prev >= 0, self.device_sampled[np.maximum(prev, 0)], ids)
        qsl = a["query_start_loc"].tolist()
        written: dict[int, tuple[int, ...]] = {}
        restored = 0
        chunk_states = []  # per row: (initial state, the chunk's tokens)
        for i, c in enumerate(batch.chunks):
            r, lo, hi = c.request, qsl[i], qsl[i + 1]
            start, stop = int(a["positions"][lo]), int(a["seq_lens"][i])
            assert out[i] == r.mamba_slot
            if c.mamba_init is not None:  # a restored prefix: a snapshot slot, on a boundary
                assert L <= init[i] < L + S and init[i] == c.mamba_init, (init[i], L, S)
                assert start > 0 and start % bs == 0 and start <= r.shared_until
                assert r.admissions > 1 or start == r.num_cached_tokens
                restored += 1
            else:
                assert init[i] == (out[i] if start else -1), (init[i], out[i], start)
            state = () if init[i] == -1 else self.states[init[i]]
            assert state == _tokens(r, start), (
                f"step {batch.step}: request {r.request_id} starts at {start} from a state of "
                f"{len(state)} tokens that is not its prefix (slot {init[i]})"
            )
            chunk_states.append((state, tuple(ids[lo:hi].tolist())))
            written[out[i]] = state + tuple(ids[lo:hi].tolist())
            assert written[out[i]] == _tokens(r, stop)
        self.states.update(written)
        self.restores_per_step.append(restored)
        rows, pos = a["mamba_snap_row"].tolist(), a["mamba_snap_pos"].tolist()
        dst = a["mamba_snap_dst"].tolist()
        assert len(rows) == len(pos) == len(dst) == len(batch.mamba_snaps) <= S
        assert len(set(dst)) == len(dst)
        snapped = {}
        for (r, h, p), row, n, d in zip(batch.mamba_snaps, rows, pos, dst, strict=True):
            assert batch.chunks[row].request is r and p == n and L <= d < L + S
            assert d not in init, "a snapshot slot the step reads is written"
            initial, tokens = chunk_states[row]
            assert 1 <= n <= len(tokens)
            self.inner_snapshots += n < len(tokens)
            state = initial + tokens[:n]
            k = len(state)
            assert k and k % bs == 0 and k <= len(r.prompt), k
            assert int(r.hashes[k // bs - 1]) == h, "the snapshot is not of the state's block"
            assert int(block_hashes(np.asarray(state, np.int32), bs, self.sched.salt)[-1]) == h
            assert state == _tokens(r, k)
            self.snapshots.append((r.request_id, k, h))
            snapped[d] = state
        self.states.update(snapped)

    # --- invariants -----------------------------------------------------------------------------

    def check_batch(self, batch: StepBatch) -> None:
        if any(c.new_blocks < 0 for c in batch.chunks):
            raise NegativeBlocks(f"step {batch.step}: {[c.new_blocks for c in batch.chunks]}")
        super().check_batch(batch)

    def check_blocks(self, batch: StepBatch) -> None:
        if self.deferred is not None:
            deferred, self.deferred = self.deferred, None
            self._apply_blocks(*deferred)
        super().check_blocks(batch)
        self.check_mamba()

    def check_after_update(self) -> None:
        # Harness.check_after_update, except that a hybrid holds every block it shares from
        # admission on, also those past the snapshot it restored (and is recomputing).
        bs = self.plan.block_size
        for r in self.sched.running:
            if self.overlap:
                assert r.num_computed_tokens <= r.num_planned_tokens
            else:
                assert r.num_computed_tokens < r.num_tokens and not r.num_pending
            need = max(-(-r.num_computed_tokens // bs), r.shared_until // bs)
            assert len(r.blocks) == need, "blocks beyond need"
            assert len(r.generated) < r.sampling.max_tokens
        self.check_mamba()

    def check_mamba(self) -> None:
        """The mirror is the pool (less what waits for the next MambaOps), live slots are held
        once each by the running and paused requests, snapshots never exceed their slots."""
        sched, m, pool = self.sched, self.sched.mamba, self.service.pool
        pool.check()
        held = pool.lru_order()
        assert len(held) <= self.S and len(m.snap_of) <= self.S
        if m.drop_pending:
            assert not m.snap_of and not m.pending_invalidate
        else:
            assert set(m.pending_invalidate) <= set(held)
            want = {h: pool.snapshot_slot(h) for h in held if h not in m.pending_invalidate}
            assert m.snap_of == want, "the mirror's snapshot map differs from the pool's"
        assert set(m.writing) <= set(m.snap_of)
        px = sched.prefix
        assert all(h in px.block_of or h in px.writing for h in m.snap_of), "snapshot of no KV"
        holders = sched.running + sched.paused
        slots = [r.mamba_slot for r in holders]
        assert min(slots, default=0) >= 0 and len(set(slots)) == len(slots), slots
        for r in holders:
            assert pool.live_slot(r.request_id) == r.mamba_slot
        assert all(pool.live_slot(rid) is not None for rid in m.pending_free)
        assert self.L - pool.num_live_free == len(holders) + len(m.pending_free)
        assert m.live_free == pool.num_live_free + len(m.pending_free)
        for r in sched.requests.values():
            if r not in holders:
                assert r.mamba_slot == -1 and not r.snap_bounds

    def check_end(self) -> None:
        super().check_end()
        self.check_mamba()
        assert self.sched.mamba.live_free == self.L


def hashes(prompt, bs: int = 4) -> list[int]:
    return block_hashes(np.asarray(prompt, np.int32), bs).tolist()


def snapped(h: MambaHarness, rid: int) -> list[int]:
    """The prompt positions whose state request `rid`'s steps snapshotted."""
    return [k for r, k, _ in h.snapshots if r == rid]


PLAN = make_plan(block_size=4, max_tokens=64)
SHARED = list(range(100, 112))  # 12 tokens: 3 blocks of 4


# --- 1. exact counters ---------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_a_hybrid_skips_exactly_up_to_its_deepest_snapshot(overlap):
    h = MambaHarness(PLAN, overlap=overlap)
    a = SHARED + [500, 501]  # 14 tokens: the last boundary before the last token is 12
    h.add(request(1, a, max_tokens=3))
    run_all(h)
    assert snapped(h, 1) == [12] and set(h.sched.mamba.snap_of) == {hashes(a)[2]}
    assert h.computed == {1: 14} and h.ended[1].num_cached_tokens == 0
    h.add(request(2, SHARED + [600, 601, 602], max_tokens=3))  # 15 tokens, matches 3 blocks
    run_all(h)
    # k = min(3 matched, (15 - 1) // 4 = 3) = 3, and block 2 has a snapshot: 15 - 12 = 3.
    assert h.computed == {1: 14, 2: 3}
    assert h.ended[2].num_cached_tokens == 12 and h.sched.mamba.num_restored == 1
    assert h.restores_per_step.count(1) == 1 and snapped(h, 2) == []
    assert h.sched.prefix.cached_tokens == 12


@pytest.mark.parametrize("overlap", [False, True])
def test_a_block_aligned_prompt_snapshots_its_end(overlap):
    h = MambaHarness(PLAN, overlap=overlap)
    b = list(range(300, 316))  # 16 tokens, 4 whole blocks
    h.add(request(1, b, max_tokens=2))
    run_all(h)
    assert snapped(h, 1) == [12, 16]  # the last boundary before the last token, and the end
    h.add(request(2, b, max_tokens=2))  # identical: k = (16 - 1) // 4 = 3, computes 4
    run_all(h)
    assert h.computed[2] == 4 and h.ended[2].num_cached_tokens == 12
    assert h.ended[2].generated == h.ended[1].generated
    h.add(request(3, b + list(range(700, 705)), max_tokens=2))  # 21 tokens: k = 4, computes 5
    run_all(h)
    assert h.computed[3] == 5 and h.ended[3].num_cached_tokens == 16
    assert snapped(h, 3) == [20]  # its own last boundary before its last token
    assert h.computed == {1: 16, 2: 4, 3: 5} and h.sched.mamba.num_restored == 2


# --- 2. the divergence boundary ------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_the_divergence_point_is_snapshotted_for_the_next_request(overlap):
    h = MambaHarness(PLAN, overlap=overlap)
    x, y = list(range(100, 108)), list(range(200, 208))
    p1 = x + y
    h.add(request(1, p1, max_tokens=2))
    run_all(h)
    assert snapped(h, 1) == [12, 16]
    assert hashes(p1)[1] not in h.sched.mamba.snap_of  # no state at 8, where X ends
    p2 = x + list(range(300, 306))  # 14 tokens: shares 2 blocks of KV, no snapshot to restore
    h.add(request(2, p2, max_tokens=2))
    run_all(h)
    r2 = h.ended[2]
    assert h.computed[2] == 14 and r2.num_cached_tokens == 0 and r2.shared_until == 8
    assert snapped(h, 2) == [8, 12]  # the divergence point, then its last boundary
    p3 = x + list(range(400, 407))  # 15 tokens: restores the state at 8, computes 7
    h.add(request(3, p3, max_tokens=2))
    run_all(h)
    assert h.computed[3] == 15 - 8 and h.ended[3].num_cached_tokens == 8
    assert h.computed == {1: 16, 2: 14, 3: 7} and h.sched.mamba.num_restored == 1


# --- 3. several restores in one step -------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_several_prefills_restore_in_one_step(overlap):
    h = MambaHarness(PLAN, overlap=overlap)
    a, b = SHARED, list(range(200, 212))
    h.add(request(1, a + [1], max_tokens=1))
    h.add(request(2, b + [2], max_tokens=1))
    run_all(h)
    assert sorted(snapped(h, 1) + snapped(h, 2)) == [12, 12]
    for rid, prompt in [(3, a + [3, 4]), (4, a + [5]), (5, b + [6, 7]), (6, b + [8])]:
        h.add(request(rid, prompt, max_tokens=2))
    h.step()
    assert h.restores_per_step[-1] == 4  # four chunks start from snapshots in one step
    ops = h.mamba_ops[-1]
    assert sorted(ops.restore_hashes.tolist()) == sorted([hashes(a)[2], hashes(b)[2]])
    assert sorted(ops.live_ids.tolist()) == [3, 4, 5, 6]
    run_all(h)
    assert {r: h.computed[r] for r in (3, 4, 5, 6)} == {3: 2, 4: 1, 5: 2, 6: 1}
    assert all(h.ended[r].num_cached_tokens == 12 for r in (3, 4, 5, 6))


# --- 4. snapshots off ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True])
def test_without_snapshots_hybrids_share_kv_but_compute_every_token(chunked):
    plan = make_plan(block_size=4, max_tokens=5 if chunked else 64)
    h = MambaHarness(plan, snaps=0, chunked=chunked)
    assert not h.sched.mamba_snapshots and h.sched.chunked_prefill == chunked
    h.add(request(1, SHARED + [1], max_tokens=2))
    run_all(h)
    h.add(request(2, SHARED + [2, 3], max_tokens=2))
    h.add(request(3, SHARED, max_tokens=2))  # a block-aligned full match
    run_all(h)
    assert h.computed == {1: 13, 2: 14, 3: 12}
    assert all(h.ended[r].num_cached_tokens == 0 for r in (1, 2, 3))
    assert h.ended[2].shared_until == 12 and h.ended[3].shared_until == 12  # KV is shared
    assert not h.snapshots and max(h.restores_per_step) == 0
    assert all(not len(o.restore_hashes) and not len(o.snap_hashes) for o in h.mamba_ops)


# --- 5. one snapshot slot ------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_one_snapshot_slot_evicts_lru_and_never_serves_a_wrong_state(overlap):
    h = MambaHarness(PLAN, snaps=1, overlap=overlap)
    families = [list(range(1000 + 50 * f, 1008 + 50 * f)) for f in range(6)]  # 8 tokens each
    for f, fam in enumerate(families):
        h.add(request(10 * f + 1, fam + [f], max_tokens=2))  # snapshots the state at 8
        run_all(h)
        h.add(request(10 * f + 2, fam + [100 + f], max_tokens=2))  # restores it: computes 1
        run_all(h)
        assert h.computed[10 * f + 2] == 1 and h.ended[10 * f + 2].num_cached_tokens == 8
    assert h.snap_evicted == [hashes(fam)[1] for fam in families[:-1]]  # each by the next
    assert h.sched.mamba.num_restored == 6
    # All at once, in one step: the last family restores the one snapshot left (computing its
    # 2 new tokens), which pins the only slot, so the other families take no snapshot.
    restored = h.sched.mamba.num_restored
    for f, fam in enumerate(families):
        h.add(request(100 + f, fam + [7, 7], max_tokens=2))
    run_all(h)
    assert h.sched.mamba.num_restored == restored + 1
    assert [h.computed[100 + f] for f in range(6)] == [10] * 5 + [2]
    assert max(len(o.snap_hashes) + len(o.restore_hashes) for o in h.mamba_ops) == 1


# --- 6. KV eviction voids snapshots --------------------------------------------------------------


def test_a_kv_eviction_voids_the_snapshot_in_the_mirror_then_in_the_pool():
    h = MambaHarness(make_plan(num_blocks=8, block_size=4, max_tokens=64), snaps=8)
    a = SHARED + [9]  # 13 tokens: 4 blocks, the state at 12 snapshotted under hash a[2]
    h.add(request(1, a, max_tokens=1))
    run_all(h)
    ha = hashes(a)
    assert set(h.sched.mamba.snap_of) == {ha[2]}
    # 25 tokens: the first chunk (to 24) takes 6 blocks of 5 free + 3 cached-idle: the
    # allocator evicts the deepest idle leaf, a[2], whose snapshot goes with it.
    h.add(request(2, list(range(500, 525)), max_tokens=1))
    h.step()
    m, pool = h.sched.mamba, h.service.pool
    assert [hh for _, hh in h.kv_voided] == [ha[2]]
    assert ha[2] not in m.snap_of and m.pending_invalidate == [ha[2]]
    assert pool.snapshot_slot(ha[2]) is not None  # the invalidation waits for a MambaOps
    run_all(h)  # request 2 ends with no MambaOps: still pending
    assert m.pending_invalidate == [ha[2]] and pool.snapshot_slot(ha[2]) is not None
    # Request 3 (prompt a again) matches only a[0] of KV (a[1] went with request 2's last
    # block): no snapshot up to there, so it computes everything in one chunk, snapshotting
    # inside it; its MambaOps carries the invalidation, which the pool applies before it takes
    # a[2]'s new snapshot (the harness checks that slot's state).
    h.add(request(3, a, max_tokens=1))
    inner = h.inner_snapshots
    h.step()
    ops = h.mamba_ops[-1]
    assert ops.invalidate_hashes.tolist() == [ha[2]] and ha[2] not in m.pending_invalidate
    # (Its 4 new blocks evict request 2's idle ones: the snapshot at 24 of that prompt is
    # voided in turn, and waits for the next MambaOps.)
    assert m.pending_invalidate == [h.kv_voided[-1][1]] and h.kv_voided[-1][0] == ops.step
    assert ops.snap_hashes.tolist() == [ha[0], ha[2]]
    assert h.inner_snapshots == inner + 2  # at 4 and 12 of its 13-token chunk
    run_all(h)
    assert h.computed[3] == 13 and h.ended[3].num_cached_tokens == 0
    assert snapped(h, 3) == [4, 12]  # the divergence point (a[0]), then a[2] again
    assert pool.snapshot_slot(ha[2]) is not None and ha[2] in m.snap_of


def test_new_weights_and_a_recompute_resume_drop_every_snapshot():
    h = MambaHarness(PLAN)
    a = SHARED + [9]
    h.add(request(1, a, max_tokens=1))
    run_all(h)
    assert set(h.sched.mamba.snap_of) == {hashes(a)[2]}
    h.sched.new_weights(1)  # every hash changes: no snapshot may be restored
    assert not h.sched.mamba.snap_of and h.sched.mamba.drop_pending
    h.add(request(2, a, max_tokens=1))
    run_all(h)
    assert h.mamba_ops[-1].drop_snapshots and h.computed[2] == 13
    salted = block_hashes(np.asarray(a, np.int32), 4, 1).tolist()
    assert h.service.pool.lru_order() == [salted[2]] and h.ended[2].num_cached_tokens == 0
    # A "recompute" resume while two restored requests decode: both let go of everything
    # and recompute (the first from zeros, the second from what the first snapshots).
    h.add(request(3, a + [1, 2], max_tokens=6))
    h.add(request(4, a + [3], max_tokens=6))
    for _ in range(3):
        h.step()
    assert h.restores_per_step.count(2) == 1
    h.sched.invalidate_kv()
    assert not h.sched.mamba.snap_of and h.sched.mamba.live_free == h.L
    restored = h.sched.mamba.num_restored
    run_all(h)
    assert [h.ended[r].finish_reason for r in (3, 4)] == ["length", "length"]
    assert h.sched.mamba.num_restored == restored + 1


# --- 7. property: random hybrid workloads --------------------------------------------------------


@st.composite
def hybrid_workloads(draw):
    bs = draw(st.sampled_from([2, 4]))
    max_seq = draw(st.integers(8, 32))
    need = -(-max_seq // bs)
    max_requests = draw(st.integers(1, 5))
    plan = make_plan(
        num_blocks=draw(st.integers(need, 3 * need)),
        block_size=bs,
        max_requests=max_requests,
        max_tokens=draw(st.integers(1, 32)),
        max_sequence_length=max_seq,
        eos=draw(st.lists(st.integers(10, 59), max_size=1)),
        max_paused_blocks=draw(st.none() | st.integers(0, need)),
    )
    plan = hybrid_plan(plan, draw(st.integers(1, max_requests)), draw(st.sampled_from([1, 2, 8])))
    bases = [list(range(200 + 50 * i, 200 + 50 * i + max_seq)) for i in range(3)]
    requests = []
    for rid in range(draw(st.integers(1, 10))):
        if requests and draw(st.booleans()):  # an earlier prompt, cut or extended
            base = draw(st.sampled_from([r.prompt.tolist() for _, _, r in requests]))
            shared = draw(st.integers(1, len(base)))
        else:
            base = bases[draw(st.integers(0, 2))]
            shared = draw(st.integers(0, max_seq - 2))
        most = max_seq - 1 - shared
        most = min(most, draw(st.sampled_from([2, most])))  # short tails share more states
        own = draw(st.integers(0 if shared else 1, most))
        prompt = base[:shared] + [900 + rid * 7 + j for j in range(own)]
        arrival = draw(st.integers(0, 12))
        abort_at = draw(st.none() | st.none() | st.none() | st.integers(arrival, arrival + 20))
        req = request(
            rid,
            prompt,
            max_tokens=draw(st.integers(1, max_seq - len(prompt))),
            return_log_probs=draw(st.booleans()) and draw(st.booleans()),
        )
        requests.append((arrival, abort_at, req))
    policy = draw(st.sampled_from(["lru", "lru", "ref_zero"]))
    return plan, requests, draw(st.booleans()), policy


@fuzz_settings(50)
@given(hybrid_workloads())
def test_random_hybrid_workloads_keep_every_invariant(workload):
    plan, requests, overlap, policy = workload
    runs = []
    # The live engine's reply order (Mamba first), then the allocator's reply first: same
    # plans, same messages.
    for engine_order in (True, False):
        h = MambaHarness(plan, overlap=overlap, policy=policy, engine_order=engine_order)
        h.raise_on_stale = True
        drive(h, copy.deepcopy(requests))
        h.check_end()
        assert set(h.ended) == {r.request_id for _, _, r in requests}
        ops = [tuple(bytes(f) for f in encode(o)) for o in h.mamba_ops]
        outputs = {rid: r.generated for rid, r in h.ended.items()}
        runs.append((h.history, h.snapshots, ops, outputs))
    assert runs[0] == runs[1], "the two reply orders planned differently"
    event(f"restored: {h.sched.mamba.num_restored > 0}")
    event(f"snapshot LRU evictions: {len(h.snap_evicted) > 0}")
    event(f"snapshots voided by KV evictions: {len(h.kv_voided) > 0}")
    event(f"same-step restores: {max(h.restores_per_step, default=0) > 1}")
    event(f"evicted requests: {h.sched.num_evicted_total > 0}")


# --- 8. replay check ----------------------------------------------------------------------------

HYBRID_CONFIG = InferenceConfig(
    block_size_tokens=4,
    max_tokens=16,
    max_requests=4,
    max_sequence_length=64,
    buffer_size_gb=1,
    enable_prefix_caching=True,
    prefix_caching_mamba_gb=1.0,
)


def hybrid_loaded(num_blocks: int, snaps: int) -> ModelLoaded:
    return ModelLoaded(
        "m", num_blocks, 4, 2000, 64, "{}", (), 1,
        mamba_slots=3, mamba_slot_bytes=1, mamba_snapshot_slots=snaps,
    )  # fmt: skip


class RecordingMambaHarness(MambaHarness):
    """A hybrid rank's log, as tests/test_engine_check.py's RecordingHarness writes a plain
    one: every message the engine sends or reads, in its order, with the engine's clock."""

    def __init__(self, loaded: ModelLoaded, overlap: bool = False, config=HYBRID_CONFIG):
        ready = AllocatorReady(loaded.num_blocks, loaded.num_blocks)
        plan = wire.runtime_plan(config, loaded, ready)
        policy = wire.prefix_policy(config)
        super().__init__(plan, overlap=overlap, policy=policy, chunked=False)
        self.sched = wire.new_scheduler(config, plan)
        init = wire.mamba_init(loaded)
        self.records = [
            ("in", "gpu", loaded, 0.0),
            ("in", "allocator", ready, 0.0),
            ("out", "mamba_cache", init, 0.0),
            ("in", "mamba_cache", MambaReady(init.live_slots, init.snapshot_slots), 0.0),
        ]

    def record(self, direction: str, channel: str, msg) -> None:
        super().record(direction, channel, msg)
        self.records.append((direction, channel, msg, self.now))

    def submit(self, req) -> None:
        msg = EngineSubmit(req.request_id, req.prompt, req.sampling, False, req.arrival_time)
        self.record("in", "coordinator", msg)
        new, problem = wire.submission(self.sched, 2000, msg)
        assert problem is None, problem
        assert self.add(new) is None

    def abort(self, rid: int) -> None:
        self.record("in", "coordinator", AbortRequest(rid))
        super().abort(rid)

    def sent(self, outputs) -> None:
        self.record("out", "coordinator", StepOutputs.of(outputs))


def replay(records, config=HYBRID_CONFIG) -> tuple[str | None, int]:
    checker = EngineReplay(config)
    for direction, channel, msg, time in records:
        if direction == "in":
            what = checker.inbound(channel, msg, time)
        else:
            what = checker.outbound(msg, tuple(encode(msg)))
        if what is not None:
            return what, checker.steps_checked
    return None, checker.steps_checked


def hybrid_workload(overlap: bool, num_blocks: int = 14) -> RecordingMambaHarness:
    """Shared prefixes with restores (two in one step), divergence snapshots and an abort in
    flight; 14 blocks of 4: pauses, an evicted request and KV evictions that void snapshots;
    20 blocks: snapshot LRU evictions instead (4 snapshot slots)."""
    h = RecordingMambaHarness(hybrid_loaded(num_blocks, snaps=4), overlap)
    x = list(range(100, 116))
    h.submit(request(1, x + [1, 2], max_tokens=3))
    for _ in range(4):
        h.step()
    h.submit(request(2, x + [3], max_tokens=4))
    h.submit(request(3, x[:8] + [4, 5, 6, 7, 8], max_tokens=4))
    h.step()
    h.submit(request(4, x[:8] + [9] * 9, max_tokens=20))
    h.step(in_flight=lambda: h.abort(2))
    h.run()
    h.submit(request(5, x[:8] + [10, 11], max_tokens=5))
    h.submit(request(6, x + [12], max_tokens=5))
    h.submit(request(7, list(range(600, 640)), max_tokens=8))
    h.run()
    return h


@pytest.mark.parametrize("num_blocks", [14, 20])
@pytest.mark.parametrize("overlap", [False, True])
def test_replay_of_a_hybrid_log_has_no_divergence(overlap, num_blocks):
    h = hybrid_workload(overlap, num_blocks)
    h.check_end()
    assert h.sched.mamba.num_restored >= 4 and max(h.restores_per_step) >= 2
    assert len(h.snapshots) >= 6 and 2 in h.abort_called
    if num_blocks == 14:
        assert h.kv_voided and h.sched.num_evicted_total and not h.snap_evicted
    else:
        assert h.snap_evicted and not h.kv_voided
    what, steps = replay(h.records)
    assert what is None, what
    assert steps == sum(1 for r in h.records if type(r[2]).__name__ == "StepPlan")
    mops = [r[2] for r in h.records if isinstance(r[2], MambaOps)]
    assert any(len(o.restore_hashes) for o in mops) and any(len(o.snap_hashes) for o in mops)
    assert any(len(o.invalidate_hashes) for o in mops) == (num_blocks == 14)


def test_replay_names_an_altered_mamba_reply():
    records = hybrid_workload(False).records
    i = next(
        i for i, r in enumerate(records) if isinstance(r[2], MambaOpsReply) and len(r[2].snap_slots)
    )
    d, ch, msg, t = records[i]
    records[i] = (d, ch, dataclasses.replace(msg, snap_slots=msg.snap_slots + 1), t)
    what, _ = replay(records)
    assert what is not None and "StepPlan differs" in what, what


# --- a KV eviction and a snapshot eviction of the same hash in one step --------------------------


def _same_hash_evicted_twice(h: MambaHarness) -> int:
    """4 blocks of 4, one snapshot slot: request 1 (13 tokens) leaves its state at 12 in the
    only snapshot slot and its 3 prompt blocks cached; request 2's first chunk (8 tokens) takes
    the free block and evicts the cached leaf a[2] (KV), and its snapshot at 8 evicts a[2]'s
    snapshot (LRU): the step's two replies both evict hash a[2]. Returns it."""
    a = SHARED + [9]
    h.add(request(1, a, max_tokens=1))
    run_all(h)
    h.add(request(2, list(range(500, 509)), max_tokens=1))
    run_all(h)
    return hashes(a)[2]


def test_one_step_evicting_a_hash_from_both_pools_ends_alike_in_either_order():
    plan = make_plan(num_blocks=4, block_size=4, max_tokens=64)
    ends = []
    for engine_order in (True, False):
        h = MambaHarness(plan, snaps=1, engine_order=engine_order)
        ha = _same_hash_evicted_twice(h)
        assert h.snap_evicted == [ha]
        # The engine's order sees the LRU eviction first; the replay's the KV eviction.
        assert [x for _, x in h.kv_voided] == ([] if engine_order else [ha])
        m = h.sched.mamba
        assert ha not in m.snap_of and not m.pending_invalidate
        ends.append((dict(m.snap_of), h.service.pool.lru_order(), h.computed))
    assert ends[0] == ends[1]


def test_replay_of_a_step_evicting_a_hash_from_both_pools():
    h = RecordingMambaHarness(hybrid_loaded(4, snaps=1))
    a = SHARED + [9]
    h.submit(request(1, a, max_tokens=1))
    h.run()
    h.submit(request(2, list(range(500, 509)), max_tokens=1))
    h.run()
    assert h.snap_evicted == [hashes(a)[2]]  # the live engine's order copes
    what, _ = replay(h.records)
    assert what is None, what


# --- a hybrid admitted when the blocks its cached prefix costs are gone ------------------------

Y16 = list(range(100, 116))  # 16 tokens: snapshots at 12 and 16, none at 8


@pytest.mark.parametrize(
    "snaps, first, second, third",
    [
        # no snapshots (chunked prefill on): every hybrid skips nothing (k = 0 < m = 3)
        (0, SHARED + [9], list(range(500, 524)), SHARED + [7]),
        # snapshots, but none where the match ends (m = 2, snapshots at 12 and 16): k = 0
        (8, Y16, list(range(500, 529)), Y16[:8] + [7, 7, 7]),
    ],
)
def test_an_admission_after_the_free_blocks_are_taken_never_plans_negative_blocks(
    snaps, first, second, third
):
    # 8 blocks of 4. `first` leaves its prompt blocks cached-idle; `second` (admitted first)
    # takes all but one of the available blocks; `third` matches 2 or 3 idle blocks (cost
    # 2 or 3 > 1 left): it must wait for a later step, not run with new_blocks = -1.
    plan = make_plan(num_blocks=8, block_size=4, max_tokens=64)
    h = MambaHarness(plan, snaps=snaps, chunked=True)  # (snapshots force chunking on)
    h.add(request(1, first, max_tokens=1))
    run_all(h)
    h.add(request(2, second, max_tokens=1))
    h.add(request(3, third, max_tokens=1))
    run_all(h)


# --- a cache drop and the snapshots of its own step ----------------------------------------------


def _recompute_resume(h: MambaHarness, submit) -> int:
    """Requests 3 and 4 share 12 tokens; after a 'recompute' resume, 3 recomputes first and
    snapshots the state at 12 (in the step whose BlockOps drops the cache); 4 follows one
    step later and should restore it. Returns the restores before the resume."""
    a = SHARED + [9]
    submit(request(3, a + [1, 2], max_tokens=6))
    submit(request(4, a + [3], max_tokens=6))
    submit(request(1, a, max_tokens=1))
    for _ in range(2):
        h.step()
    before = h.sched.mamba.num_restored
    h.record("in", "gpu", GpuControlReply("resume", None, False, 0))  # kv_valid False
    h.sched.invalidate_kv()
    h.run()
    return before


@pytest.mark.parametrize("engine_order", [True, False])
def test_a_cache_drop_keeps_the_snapshots_its_own_step_takes(engine_order):
    h = MambaHarness(PLAN, engine_order=engine_order)
    before = _recompute_resume(h, h.add)
    assert h.ended[4].finish_reason == "length"
    assert not any(len(o.invalidate_hashes) for o in h.mamba_ops), "a valid snapshot voided"
    assert h.sched.mamba.num_restored == before + 1  # request 4's recompute starts from 12


def test_replay_of_a_recompute_resume_with_snapshots():
    h = RecordingMambaHarness(hybrid_loaded(24, snaps=4))
    _recompute_resume(h, h.submit)
    h.check_end()
    what, _ = replay(h.records)
    assert what is None, what


# --- snapshot boundaries and the paused budget -------------------------------------------------


def test_snapshot_boundaries_never_livelock_two_requests_over_the_paused_budget():
    plan = make_plan(
        num_blocks=16, block_size=2, max_tokens=10, max_sequence_length=26, max_paused_blocks=6
    )
    h = MambaHarness(plan, policy="ref_zero")
    h.max_steps = 200
    h.add(request(6, list(range(200, 220)), max_tokens=4))
    h.add(request(3, list(range(300, 312)), max_tokens=1))
    run_all(h)


# --- a snapshot of a hash that the same step's BlockOpsReply evicts ----------------------------


def _snapshot_of_a_block_being_freed(h: MambaHarness, submit, run) -> int:
    """ref_zero, one request at a time (max_requests 1): request 1 (14 tokens) frees its 3
    prompt blocks with the step that admits request 2 (the first 8 of its tokens, waiting
    behind it), which cannot match them (refs 0) and snapshots its state at 4 under hash s[0]:
    that step's BlockOpsReply evicts s[0] (and s[1], s[2])."""
    submit(request(1, SHARED + [5, 6], max_tokens=1))
    submit(request(2, SHARED[:8], max_tokens=1))
    run()
    return hashes(SHARED)[0]


def _private_copy_of_an_evicted_block(h: MambaHarness) -> None:
    """lru, 5 blocks of 2, one request at a time: request 0 leaves 4 prompt blocks cached-idle
    (request 1 reuses one); request 2 wants prompt log-probs, so it shares nothing and computes
    private copies of 3 of them, snapshotting at 4 and 6 while its allocations evict the idle
    leaves with those very hashes."""
    h.add(request(0, list(range(200, 207)) + [900], max_tokens=1))
    h.add(request(1, [200], max_tokens=1))
    h.add(request(2, list(range(200, 206)), max_tokens=1, return_log_probs=True))
    run_all(h)


@pytest.mark.parametrize("engine_order", [True, False])
@pytest.mark.parametrize("case", ["ref_zero", "lru"])
def test_no_snapshot_of_a_block_its_own_step_evicts(case, engine_order):
    if case == "ref_zero":
        plan = make_plan(num_blocks=16, block_size=4, max_requests=1, max_tokens=64)
        h = MambaHarness(plan, snaps=1, policy="ref_zero", engine_order=engine_order)
        _snapshot_of_a_block_being_freed(h, h.add, lambda: run_all(h))
    else:
        plan = make_plan(num_blocks=5, block_size=2, max_requests=1, max_tokens=2)
        h = MambaHarness(plan, live=1, snaps=1, engine_order=engine_order)
        _private_copy_of_an_evicted_block(h)
    # (In the replay's order the run already fails: "snapshot of no KV".)
    assert not h.stale, "a step snapshots a hash its own BlockOpsReply evicts"


@pytest.mark.parametrize("engine_order", [True, False])
def test_no_snapshot_of_a_block_in_flight_whose_writer_an_abort_ends(engine_order):
    """ref_zero, overlapped steps, one request at a time (hypothesis found it): request 0's
    first chunk registers [200, 201] in step 9, whose forward is still in flight when an
    abort ends request 0 with step 10; request 5 (prompt log-probs: it shares nothing)
    computes the same two tokens in step 10 and must not snapshot under that hash, which
    step 10's own reply evicts (no request holds it)."""
    plan = dataclasses.replace(
        make_plan(num_blocks=4, block_size=2, max_requests=1, max_tokens=2),
        max_sequence_length=8, mamba_slots=1, mamba_snapshot_slots=1,
    )  # fmt: skip
    h = MambaHarness(plan, overlap=True, policy="ref_zero", engine_order=engine_order)
    h.raise_on_stale = True
    work = [(1, 12, 0, [200, 201, 202, 900, 901], 1, False), (0, None, 1, [907], 1, False),
            (2, None, 2, [914], 1, False), (0, None, 3, [921], 2, False),
            (0, None, 4, [928], 1, False), (1, None, 5, [200, 201], 1, True),
            (1, None, 6, [942], 1, False), (1, None, 7, [949], 1, False),
            (1, None, 8, [956], 1, False), (0, None, 9, [963], 4, False)]  # fmt: skip
    requests = [
        (at, abort, request(rid, prompt, max_tokens=n, return_log_probs=lp))
        for at, abort, rid, prompt, n, lp in work
    ]
    drive(h, requests)
    h.check_end()
    assert set(h.ended) == set(range(10)) and not h.stale


def test_replay_of_a_snapshot_of_a_block_its_own_step_frees():
    config = dataclasses.replace(HYBRID_CONFIG, prefix_caching_eviction_policy="ref_zero")
    config = dataclasses.replace(config, max_requests=1)
    h = RecordingMambaHarness(hybrid_loaded(16, snaps=1), config=config)
    _snapshot_of_a_block_being_freed(h, h.submit, h.run)
    h.submit(request(3, list(range(700, 709)), max_tokens=1))  # a MambaOps after it
    h.run()
    h.check_end()
    what, _ = replay(h.records, config)
    assert what is None, what
