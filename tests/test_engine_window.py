"""Sliding-window KV release in the engine's pure core (issue 27 item 3): with a model whose every
attention layer reads at most W keys back (ModelLoaded.sliding_window), each request gives back
the blocks no later query of it reads, in the step's one BlockOps, so a long request holds only
its window's KV and one longer than the whole pool runs when its window fits.

The harness of tests/test_scheduler.py drives a real Scheduler. Its fake gpu runs each step when
it is sent (in order, as the device's one stream) and checks that every query at position p
reads its own tokens at the keys p - W < k <= p (`keys_read`) from blocks its request still
holds: a block released too early and handed to another request in the same step shows there.
A fake pool with releases answers the BlockOps, or the real allocator with prefix caching.
"""

from __future__ import annotations

import collections
import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from taipan.actors.config import InferenceConfig
from taipan.actors.engine import scheduler as scheduler_module
from taipan.actors.engine import wire
from taipan.actors.engine.request import blocks_behind_window
from taipan.actors.engine.scheduler import Scheduler
from taipan.actors.gpu.window import kv_window
from taipan.messages.allocator import AllocatorReady, BlockOps
from taipan.messages.block_hash import NO_HASH
from taipan.messages.codec import decode, same_encoding
from taipan.messages.gpu import ModelLoaded
from tests.fuzz import fuzz_settings
from tests.test_engine_check import RecordingHarness, replay
from tests.test_scheduler import Harness, draw_requests, drive, make_plan, make_request
from tests.test_scheduler_prefix import PrefixHarness, request, run_all


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- the arithmetic ---------------------------------------------------------------------------


@given(st.integers(0, 500), st.integers(1, 80), st.integers(1, 32), st.integers(1, 64))
def test_released_blocks_hold_no_key_a_later_query_reads(n, window, bs, chunk):
    """Blocks behind the window hold only positions no query at p >= n reads (keys > p - W),
    and the first block kept holds one the query at n reads. A request that computes `chunk`
    tokens from n then holds at most ceil((W - 1 + chunk) / bs) + 1 blocks: with one-token
    chunks (decoding), ceil(W / bs) + 1."""
    k = blocks_behind_window(n, window, bs)
    earliest = n - window + 1  # the first key the query at n reads
    assert k * bs <= max(0, earliest)  # every released position is < earliest
    assert (k + 1) * bs > earliest  # block k holds a key a query at n may read
    held = ceil_div(n + chunk, bs) - k
    assert held <= ceil_div(window - 1 + chunk, bs) + 1
    if chunk == 1:
        assert held <= ceil_div(window, bs) + 1
    assert blocks_behind_window(n, 0, bs) == 0


# --- harnesses --------------------------------------------------------------------------------


class WindowPool:
    """The allocator's contract with releases (messages/allocator.py BlockOps): releases, frees,
    allocations, all or nothing; a table keeps its released columns; lowest free block first."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.released: dict[int, int] = {}

    @property
    def held(self) -> dict[int, list[int]]:
        return {rid: t[self.released.get(rid, 0) :] for rid, t in self.tables.items()}

    def release(self, rid: int, upto: int) -> None:
        done = self.released.get(rid, 0)
        assert done <= upto <= len(self.tables[rid]), (rid, done, upto)
        self.free.extend(self.tables[rid][done:upto])
        self.released[rid] = upto

    def apply(self, free_ids, allocs: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
        for rid in free_ids:
            if rid in self.tables:
                self.free.extend(self.tables.pop(rid)[self.released.pop(rid, 0) :])
        self.free.sort()
        assert sum(n for _, n in allocs) <= len(self.free), "planned more blocks than are free"
        out = []
        for rid, n in allocs:
            taken, self.free = self.free[:n], self.free[n:]
            self.tables.setdefault(rid, []).extend(taken)
            out.extend(taken)
        return np.asarray(out, dtype=np.int32), len(self.free)


class Window:
    """Mixin: a sliding window of `window` keys on the harness's scheduler, its fake gpu
    reading only the window, and the checks of every release."""

    def __init__(self, *args, window: int = 4, **kw):
        super().__init__(*args, **kw)
        self.window = window
        self.sched.set_sliding_window(window)
        self.releases_sent = 0
        self.strict = True  # check each release against the rule (off: only what is read)

    def keys_read(self, start: int, seq_len: int) -> np.ndarray:
        return np.arange(max(0, start - self.window + 1), seq_len)

    def table_of(self, rid: int) -> tuple[list[int], int]:
        """(the pool's table of `rid`, its released columns)."""
        raise NotImplementedError

    def gpu(self, batch, a):
        bs = self.plan.block_size
        for i, c in enumerate(batch.chunks if self.strict else ()):
            pos = self.keys_read(
                int(a["positions"][a["query_start_loc"][i]]), int(a["seq_lens"][i])
            )
            table, done = self.table_of(c.request.request_id)
            read = set(a["block_tables"][i][pos // bs].tolist())
            assert read <= set(table[done:]), "a query reads a block its request let go of"
        return super().gpu(batch, a)

    def check_window(self, batch) -> collections.Counter:
        """Every request's releases as of this step; returns how many requests hold each block."""
        bs, w = self.plan.block_size, self.window
        chunk = {c.request.request_id: c.num_new_tokens for c in batch.chunks}
        holders = collections.Counter()
        for r in self.sched.requests.values():
            if not r.blocks:
                assert r.num_released == 0
                continue
            assert self.table_of(r.request_id) == (r.blocks, r.num_released)
            c = chunk.get(r.request_id, 0)
            before = r.num_computed_tokens - c  # the first position this step computes
            holders.update(r.held_blocks)
            if not self.strict:
                continue
            # Nothing a query of this step or a later one reads is released, and all else is.
            assert r.num_released * bs <= max(0, before - w + 1)
            assert r.num_released == blocks_behind_window(before, w, bs)
            assert len(r.held_blocks) <= ceil_div(w - 1 + c, bs) + 1
            if c <= 1:  # decoding: ceil(W / bs) + 1 (within the ceil(W / bs) + 2)
                assert len(r.held_blocks) <= ceil_div(w, bs) + 1
        self.releases_sent += len(batch.releases)
        return holders


class PoolWindow(Window):
    """Mixin: the window over the fake pool with releases (`WindowPool`)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.pool = WindowPool(self.plan.num_blocks)

    def table_of(self, rid):
        return self.pool.tables.get(rid, []), self.pool.released.get(rid, 0)

    def allocate(self, batch, ops):
        for rid, upto in zip(ops.release_ids.tolist(), ops.release_upto.tolist(), strict=True):
            self.pool.release(rid, upto)
        return super().allocate(batch, ops)

    def check_blocks(self, batch) -> None:
        assert self.sched.num_free_blocks == len(self.pool.free)
        holders = self.check_window(batch)
        assert all(n == 1 for n in holders.values()), "a block has two holders"
        assert not set(holders) & set(self.pool.free)


class WindowHarness(PoolWindow, Harness):
    def __init__(self, plan, chunked: bool, overlap: bool = False, window: int = 4):
        super().__init__(plan, chunked, overlap, window=window)


class PrefixWindowHarness(Window, PrefixHarness):
    def table_of(self, rid):
        pool = self.alloc.pool
        return pool.blocks_of(rid), pool.num_released(rid)

    def check_blocks(self, batch) -> None:
        sched, pool = self.sched, self.alloc.pool
        pool.check()
        assert sched.num_free_blocks == pool.num_available
        holders = self.check_window(batch)
        refs = np.zeros(self.plan.num_blocks, dtype=np.int32)
        for b, n in holders.items():
            refs[b] = n
        assert np.array_equal(sched.prefix.refs, refs), "engine refs differ from holders"
        mirror = sched.prefix.block_of
        assert mirror == {
            pool.hash_of(b): b for b in range(self.plan.num_blocks) if pool.hash_of(b)
        }


def window_need(plan, chunked: bool, window: int, prompt_len: int, total: int) -> int:
    """The blocks a request needs at once: its window's (1 + ceil((W - 1) / bs), what a step
    of one token needs), or its whole prompt's without chunked prefill, or all it has."""
    bs = plan.block_size
    first = 0 if chunked else ceil_div(prompt_len, bs)
    return min(ceil_div(total, bs), max(first, 1 + ceil_div(window - 1, bs)))


# --- property: random workloads ---------------------------------------------------------------


@st.composite
def window_workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    window = draw(st.integers(1, 8))
    max_tokens = draw(st.integers(1, 24))
    max_seq = draw(st.integers(2, 48))
    steady = 1 + ceil_div(window - 1, bs)
    plan = make_plan(
        num_blocks=draw(st.integers(max(1, steady - 1), steady + 8)),
        block_size=bs,
        max_requests=draw(st.integers(1, min(max_tokens, 5))),
        max_tokens=max_tokens,
        max_sequence_length=max_seq,
        eos=draw(st.lists(st.integers(10, 59), max_size=2, unique=True)),
        max_paused_blocks=draw(st.none() | st.integers(0, 2 * steady)),
    )
    requests = draw_requests(draw, max_seq, 8, stop_token_ids=False)
    return plan, window, draw(st.booleans()), requests, draw(st.booleans())


@fuzz_settings(150)
@given(window_workloads())
def test_random_windowed_workloads_keep_every_invariant(workload):
    plan, window, chunked, requests, overlap = workload
    h = WindowHarness(plan, chunked, overlap, window=window)

    def added(req, problem):
        total = len(req.prompt) + req.sampling.max_tokens
        too_long = not chunked and len(req.prompt) > plan.max_tokens
        too_big = window_need(plan, chunked, window, len(req.prompt), total) > plan.num_blocks
        assert (problem is None) == (not too_long and not too_big), problem

    drive(h, requests, added)
    h.check_end()
    longer = any(
        ceil_div(r.num_tokens, plan.block_size) > plan.num_blocks for r in h.ended.values()
    )
    event(f"a request longer than the pool: {longer}")
    event(f"released: {h.releases_sent > 0}, evicted: {h.sched.num_evicted_total > 0}")


@st.composite
def prefix_window_workloads(draw):
    bs = draw(st.sampled_from([2, 4]))
    window = draw(st.integers(1, 12))
    max_seq = draw(st.integers(8, 40))
    steady = 1 + ceil_div(window - 1, bs)
    max_tokens = draw(st.integers(4, 40))
    plan = make_plan(
        num_blocks=draw(st.integers(steady + 1, steady + 10)),
        block_size=bs,
        max_requests=draw(st.integers(1, 5)),
        max_tokens=max_tokens,
        max_sequence_length=max_seq,
        max_paused_blocks=draw(st.none() | st.integers(0, 2 * steady)),
    )
    base = list(range(200, 200 + max_seq))
    requests = []
    for rid in range(draw(st.integers(1, 8))):
        shared = draw(st.integers(0, max_seq - 2))
        own = draw(st.integers(0 if shared else 1, max_seq - 1 - shared))
        prompt = base[:shared] + [900 + rid * 7 + j for j in range(own)]
        arrival = draw(st.integers(0, 12))
        abort_at = draw(st.none() | st.none() | st.integers(arrival, arrival + 20))
        req = request(rid, prompt, max_tokens=draw(st.integers(1, max_seq - len(prompt))))
        requests.append((arrival, abort_at, req))
    return plan, window, requests, draw(st.booleans()), draw(st.sampled_from(["lru", "ref_zero"]))


@fuzz_settings(100)
@given(prefix_window_workloads())
def test_random_windowed_workloads_with_prefix_caching_keep_every_invariant(workload):
    """The real allocator: released blocks are decrefs (a hashed one stays cached under "lru",
    matchable, evicted last while a descendant is held), and the engine's index stays exact."""
    plan, window, requests, overlap, policy = workload
    h = PrefixWindowHarness(plan, True, overlap, policy, window=window)
    drive(h, requests)
    h.check_end()
    event(f"cached tokens: {h.sched.prefix.cached_tokens > 0}")
    event(f"released: {h.releases_sent > 0}")


# --- examples ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_request_longer_than_the_pool_completes_when_its_window_fits(chunked, overlap):
    # W = 6 keys, 4-token blocks: 1 + ceil(5 / 4) = 3 blocks let it make progress; the pool
    # has 3 (12 tokens) for a request of 8 + 40 = 48 tokens (12 blocks).
    plan = make_plan(num_blocks=3, block_size=4, max_tokens=8, max_sequence_length=64)
    long = make_request(1, 8, max_tokens=40, ignore_eos=True)
    assert "needs 12 KV blocks" in Scheduler(plan, chunked).check(8, long.sampling)
    h = WindowHarness(plan, chunked, overlap, window=6)
    assert h.add(long) is None
    h.run()
    h.check_end()
    assert h.ended[1].finish_reason == "length" and len(h.ended[1].generated) == 40
    # It computed positions 0..46: the blocks wholly before 47 - 6 + 1 = 42 came back early.
    assert h.sched.num_released_total == 10
    # Its prompt must fit in one step without chunked prefill; with it, only the window must.
    wide = make_request(2, 20, max_tokens=4)
    problem = Scheduler(plan, chunked, sliding_window=6).check(20, wide.sampling)
    assert (problem is None) == chunked


def test_two_long_requests_share_a_pool_that_holds_neither():
    """Each needs 12 blocks; the pool has 7: both run at once (3 blocks each at most), blocks
    one lets go of are taken by the other, and the outputs are exact."""
    plan = make_plan(num_blocks=7, block_size=4, max_tokens=16, max_sequence_length=64)
    for overlap in (False, True):
        h = WindowHarness(plan, True, overlap, window=6)
        for rid in (1, 2):
            assert h.add(make_request(rid, 16, max_tokens=32, ignore_eos=True)) is None
        h.run()
        h.check_end()
        assert h.sched.num_paused_total == 0 and h.sched.num_evicted_total == 0
        assert max(len(step) for step in h.history) == 2  # (they ran together)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_release_one_position_early_lets_another_request_overwrite_a_key_still_read(overlap):
    """The rule is tight. A step's BlockOps may hand a released block to another request,
    whose chunk in that step writes it: the step's own queries start at n (the request's
    num_computed_tokens when the step is planned), so only blocks wholly before n - W + 1 may
    go. (Step N in flight, planned before, may still read such a block: the device runs it
    before step N + 1 writes anything.) Releasing from n + 1 instead lets a query of the
    step read K/V another request just wrote there; the fake gpu sees it."""
    plan = make_plan(num_blocks=4, block_size=2, max_tokens=8, max_sequence_length=64)

    def run():
        h = WindowHarness(plan, True, overlap, window=3)
        h.strict = False  # (only what the gpu reads is checked)
        h.add(make_request(1, 6, max_tokens=12, ignore_eos=True))
        h.add(make_request(2, 9, max_tokens=10, ignore_eos=True))
        h.run()
        h.check_end()
        return h

    assert run().releases_sent
    real = blocks_behind_window
    scheduler_module.blocks_behind_window = lambda n, w, bs: real(n + 1, w, bs)
    try:
        with pytest.raises(AssertionError, match="reads another's KV"):
            run()
    finally:
        scheduler_module.blocks_behind_window = real


def test_a_recompute_resume_requeues_windowed_requests_with_the_same_outputs():
    plan = make_plan(num_blocks=6, block_size=2, max_tokens=6, max_sequence_length=64)
    h = WindowHarness(plan, True, window=3)
    h.add(make_request(1, 5, max_tokens=20, ignore_eos=True))
    h.add(make_request(2, 3, max_tokens=20, ignore_eos=True))
    for _ in range(8):
        h.step()
    assert any(r.num_released for r in h.sched.running)
    h.sched.invalidate_kv()  # (released blocks are gone: each request starts over)
    assert not h.sched.running and [r.request_id for r in h.sched.waiting] == [1, 2]
    h.run()
    h.check_end()


@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
def test_a_released_prompt_block_stays_cached_under_lru_only(policy):
    """Request 1 (a 16-token prompt, W = 4) lets go of its prompt blocks while it decodes. A
    request with the same prompt coming meanwhile matches all of them under "lru" (idle at ref
    0, still cached); under "ref_zero" the first release freed the chain's root and took the
    chain's hashes with it (a chain without its root is never matched): nothing is shared."""
    system = list(range(100, 116))
    plan = make_plan(num_blocks=16, block_size=4, max_tokens=32, max_sequence_length=64)
    h = PrefixWindowHarness(plan, True, False, policy, window=4)
    h.add(request(1, system + [7], max_tokens=12))
    for _ in range(4):
        h.step()
    assert h.sched.requests[1].num_released == 4
    assert h.alloc.pool.num_cached_idle == (4 if policy == "lru" else 0)
    h.add(request(2, system + [8], max_tokens=2))
    run_all(h)
    assert h.ended[2].num_cached_tokens == (16 if policy == "lru" else 0)


def test_an_idle_block_whose_child_is_held_is_evicted_last_with_its_descendants():
    """Under "lru" a windowed request's released prompt blocks are idle but the child of the
    last one is held: leaf-first eviction never reaches them (a cached child keeps its cached
    ancestors), yet the pool counts them as available, and they are. A request needing them
    gets the free block, then the least recently used idle block with a held child (whose
    held descendants lose their hashes: private now), then the leaves that leaves behind."""
    plan = make_plan(num_blocks=8, block_size=2, max_tokens=16, max_sequence_length=64)
    h = PrefixWindowHarness(plan, True, False, "lru", window=4)
    prompt = list(range(100, 112))  # 6 complete blocks
    h.add(request(1, prompt, max_tokens=20))
    h.step()  # the prompt: blocks 0..5, registered
    h.step()  # n = 12: blocks 0..3 hold no key a query from 12 on reads; block 6 is taken
    r, pool = h.sched.requests[1], h.alloc.pool
    assert r.blocks == list(range(7)) and r.num_released == 4
    assert pool.num_cached_idle == 4 and pool.num_free == 1 and pool.num_available == 5
    assert pool.ref_count(4) == 1 and pool.hash_of(4) != NO_HASH  # block 3's held child
    h.add(request(2, list(range(300, 308)), max_tokens=2))  # 4 blocks
    h.step()  # request 1 releases block 4 too (its child 5 is held): 6 available
    assert h.sched.requests[2].blocks == [7, 4, 3, 2]
    assert pool.hash_of(5) == NO_HASH and pool.ref_count(5) == 1  # request 1's, private
    hashes = [int(x) for x in h.sched.requests[1].hashes]
    assert pool.match(hashes) == [0, 1]  # what is left of the chain is still shared
    run_all(h)
    assert h.ended[1].finish_reason == "length" and h.ended[2].finish_reason == "length"


def test_an_evicted_request_sharing_a_cached_prefix_comes_back_within_its_window():
    """Found by the fuzz above (CI, hypothesis): a windowed request longer than the pool, evicted
    after its first tokens, re-matches its cached prompt prefix. Its comeback needs what its
    window holds at a time less the shared blocks it already holds (they count toward it);
    counting them twice asked for 9 of 8 blocks, and it waited forever."""
    plan = make_plan(
        num_blocks=8, block_size=2, max_requests=2, max_tokens=4, max_sequence_length=20
    )
    h = PrefixWindowHarness(plan, True, False, "lru", window=12)  # 7 blocks at a time
    reqs = [
        (1, None, request(0, [200, 201, 202, 203, 900], max_tokens=1)),
        (0, None, request(1, [907], max_tokens=1)),
        (0, None, request(2, [914], max_tokens=1)),
        (0, None, request(3, [200, 201, 202, 203, *range(921, 932)], max_tokens=5)),
    ]
    drive(h, reqs)
    h.check_end()
    assert h.ended[3].admissions == 2 and h.ended[3].finish_reason == "length"
    assert len(h.ended[3].generated) == 5


# --- replay -----------------------------------------------------------------------------------


class WindowRecordingHarness(PoolWindow, RecordingHarness):
    """tests/test_engine_check.py's recording harness with a window the ModelLoaded tells."""

    def __init__(self, window: int, overlap: bool = False):
        super().__init__(overlap, window=window)
        loaded = dataclasses.replace(self.records[0][2], sliding_window=window)
        self.records[0] = ("in", "gpu", loaded, 0.0)


@pytest.mark.parametrize("overlap", [False, True])
def test_replay_plans_the_same_releases(overlap):
    """6 blocks of 2 tokens, W = 3: three requests of 22 tokens each (11 blocks) run; the
    replay checker learns the window from the recorded ModelLoaded and re-plans every
    BlockOps, releases included, byte for byte."""
    h = WindowRecordingHarness(3, overlap)
    for rid in (1, 2, 3):
        h.submit(make_request(rid, 2, max_tokens=20, ignore_eos=True))
    h.step()
    h.step(in_flight=lambda: h.abort(3))
    h.run()
    ops = [r[2] for r in h.records if isinstance(r[2], BlockOps)]
    assert any(len(o.release_ids) for o in ops)
    assert replay(h.records) == (None, sum(type(r[2]).__name__ == "StepPlan" for r in h.records))
    # A replay that does not know the window plans other steps.
    records = [h.records[0][:2] + (dataclasses.replace(h.records[0][2], sliding_window=0), 0.0)]
    what, _ = replay(records + h.records[1:])
    assert what is not None


def test_logs_from_before_the_window_still_decode_and_compare():
    """A recorded ModelLoaded without sliding_window is a model without one; a recorded
    BlockOps without releases equals one planned with none (codec `required=`)."""
    loaded = ModelLoaded("m", 6, 2, 2000, 64, "{}", (), 1)
    old = _drop_trailing(loaded, 1)
    assert decode(old) == loaded and decode(old).sliding_window == 0
    ops = BlockOps(3, np.asarray([1], np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32))
    old = _drop_trailing(ops, 2)
    assert same_encoding(ops, old) and not len(decode(old).release_ids)
    released = dataclasses.replace(ops, release_ids=np.asarray([2], np.int64))
    released = dataclasses.replace(released, release_upto=np.asarray([4], np.int32))
    assert not same_encoding(released, old)


def _drop_trailing(msg, n: int) -> list[bytes]:
    """`msg` encoded as a sender without its last `n` fields sent it (every field written out,
    as an older sender did: today's encoder leaves trailing defaults off by itself)."""
    from taipan.messages.codec import _to_wire

    fields = [_to_wire(getattr(msg, f.name), None) for f in dataclasses.fields(msg)]
    items = [type(msg).TAG, type(msg).VERSION, *fields]
    return [msgpack.packb(items[:-n], use_bin_type=True)]


def test_runtime_window_comes_from_model_loaded():
    config = InferenceConfig(block_size_tokens=2, max_tokens=16, max_sequence_length=64)
    loaded = ModelLoaded("m", 6, 2, 2000, 64, "{}", (), 1, sliding_window=5)
    sched = wire.new_scheduler(config, wire.runtime_plan(config, loaded, AllocatorReady(6, 6)))
    sched.set_sliding_window(loaded.sliding_window)  # (as the engine actor does)
    assert sched.window == 5 and sched.window_blocks == 3
    with pytest.raises(ValueError, match="sliding_window"):
        sched.set_sliding_window(-1)


# --- the window a loaded model reports ----------------------------------------------------------


class Layers:
    """A config as the gpu worker reads it: `num_layers` and each layer's window."""

    def __init__(self, *windows):
        self.num_layers = len(windows)
        self.layer_window = lambda i: windows[i]


def test_the_gpu_reports_a_window_only_when_every_layer_has_one():
    assert kv_window(Layers(4096, 4096)) == 4096  # Mistral
    assert kv_window(Layers(512, 1024)) == 1024  # the largest: what the engine must keep
    assert kv_window(Layers(512, None, 512)) == 0  # Gemma 3: a global layer reads everything
    assert kv_window(Layers(None, None)) == 0
    assert kv_window(object()) == 0  # a family that says nothing of windows


def test_the_gpu_reads_the_llama_family_configs():
    pytest.importorskip("torch")
    from taipan.ops.models.llama import LlamaConfig

    if not hasattr(LlamaConfig, "layer_window"):
        pytest.skip("per-layer windows are not in the model configs yet")
    fields = dict(
        vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2,
        num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
        tie_word_embeddings=False, max_position_embeddings=64, bos_token_id=None,
        eos_token_ids=(1,),
    )  # fmt: skip
    assert kv_window(LlamaConfig(**fields)) == 0
    assert kv_window(LlamaConfig(**fields, sliding_window=16)) == 16
    assert kv_window(LlamaConfig(**fields, sliding_window=16, sliding_layers=(1, 2))) == 0
