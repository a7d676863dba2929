"""Per-layer-group KV in the engine's pure core (actors/engine/local_kv.py): random workloads on a
real Scheduler whose model has windowed layers among global ones (RuntimePlan.local_window).

The harnesses of tests/test_scheduler.py drive it. Their fake gpu, besides the main pool (which
now holds the global layers, read over the whole context), keeps the windowed layers' pool slot
by slot: each step it runs the plan's cached-window copies (one gather, then one scatter), writes
the step's tokens at their local slots, checks that every query at p reads its own tokens at
the keys p - W < k <= p through its local block table, then runs the saves. Rings outgrow
nothing they hold, wrapping ones run in chunks, no block is held twice, and with prefix caching
a hit's window comes back from the cache intact. At the end every ring is back.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import event, given
from hypothesis import strategies as st

from taipan.actors.config import local_chunk, ring_blocks
from tests.fuzz import fuzz_settings
from tests.test_scheduler import Harness, draw_requests, drive, make_plan, make_request, true_tokens
from tests.test_scheduler_prefix import PrefixHarness


class LocalKV:
    """Mixin: the windowed layers' pool of the fake gpu and its checks."""

    def __init__(self, *args, window: int, **kw):
        super().__init__(*args, **kw)
        self.window = window
        plan = self.plan
        self.local_token = np.full(plan.num_local_blocks * plan.block_size, -1, dtype=np.int64)
        self.copied = self.saved = 0

    def gpu(self, batch, a):
        bs, pool = self.plan.block_size, self.sched.local
        src, dst = a["local_copy_src"], a["local_copy_dst"]
        if len(src):  # a hit's cached window into its ring, before the forward
            self._copy_blocks(src, dst)
            self.copied += len(src)
        ids = a["input_ids"].astype(np.int64)
        prev = a["prev_rows"]
        if len(prev):
            ids = np.where(prev >= 0, self.device_sampled[np.maximum(prev, 0)], ids)
        slots = a["local_slot_mapping"]
        assert len(slots) == len(ids) and a["local_block_tables"].shape == a["block_tables"].shape
        self.local_token[slots] = ids
        for i, c in enumerate(batch.chunks):
            r, seq_len = c.request, int(a["seq_lens"][i])
            start = int(a["positions"][a["query_start_loc"][i]])
            pos = np.arange(max(0, start - self.window + 1), seq_len)  # what the window reads
            table = a["local_block_tables"][i]
            read = table[pos // bs].astype(np.int64) * bs + pos % bs
            assert np.array_equal(self.local_token[read], true_tokens(r, seq_len)[pos]), (
                "a windowed query reads a key its ring no longer holds"
            )
            assert set(table[pos // bs].tolist()) <= set(r.ring)
            if pool.wraps(r.max_total_tokens):
                assert c.num_new_tokens <= pool.chunk  # (a wrapping ring's chunks are cut)
        result = super().gpu(batch, a)
        src, dst = a["local_save_src"], a["local_save_dst"]
        if len(src):  # computed prompt blocks into the cache, after the forward
            self._copy_blocks(src, dst)
            self.saved += len(src)
        return result

    def _copy_blocks(self, src, dst) -> None:
        bs = self.plan.block_size
        offsets = np.arange(bs)
        values = self.local_token[(src[:, None] * bs + offsets).ravel()].copy()
        self.local_token[(dst[:, None] * bs + offsets).ravel()] = values

    def check_blocks(self, batch) -> None:
        super().check_blocks(batch)
        pool = self.sched.local
        rings = [b for r in self.sched.requests.values() for b in r.ring]
        cached = list(pool._cache.values())
        assert len(rings) == len(set(rings)), "a local block in two rings"
        assert not set(rings) & set(cached) and not set(rings) & set(pool._free)
        assert len(rings) + len(cached) + len(pool._free) == pool.num_blocks
        for r in self.sched.requests.values():
            if r.ring:
                assert len(r.ring) == pool.ring_size(r.max_total_tokens)
                assert list(r.ring_row[: len(r.ring)]) == r.ring

    def check_end(self) -> None:
        super().check_end()
        pool = self.sched.local
        assert pool.num_free == pool.num_blocks and pool.num_blocks - pool.num_cached == len(
            pool._free
        )


class LocalHarness(LocalKV, Harness):
    def __init__(self, plan, chunked, overlap, window):
        super().__init__(plan, chunked, overlap, window=window)


class LocalPrefixHarness(LocalKV, PrefixHarness):
    def __init__(self, plan, chunked, overlap, window):
        super().__init__(plan, chunked, overlap, window=window)


@st.composite
def local_workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    window = draw(st.integers(1, 10))
    max_tokens = draw(st.integers(2, 24))
    max_seq = draw(st.integers(4, 48))
    plan = make_plan(
        num_blocks=draw(st.integers(-(-max_seq // bs), -(-max_seq // bs) + 12)),
        block_size=bs,
        max_requests=draw(st.integers(1, min(max_tokens, 5))),
        max_tokens=max_tokens,
        max_sequence_length=max_seq,
        eos=draw(st.lists(st.integers(10, 59), max_size=2, unique=True)),
    )
    ring = ring_blocks(window, bs, local_chunk(window, bs, max_tokens, max_seq))
    num_local = draw(st.integers(min(ring, -(-max_seq // bs)), 3 * ring + 4))
    plan = dataclasses.replace(plan, local_window=window, num_local_blocks=num_local)
    requests = draw_requests(draw, max_seq, 8, stop_token_ids=False)
    return plan, window, requests, draw(st.booleans()), draw(st.booleans())


def _run(workload):
    plan, window, requests, overlap, prefix = workload
    if prefix:  # shared prompts, so hits happen
        for _, _, req in requests[1:]:
            head = requests[0][2].prompt
            n = min(len(head), len(req.prompt))
            req.prompt[:n] = head[:n]
    harness = LocalPrefixHarness if prefix else LocalHarness
    h = harness(plan, False, overlap, window)  # (chunked prefill: the local pool turns it on)
    assert h.sched.chunked_prefill and h.sched.local.caching == prefix
    drive(h, requests)
    h.check_end()
    event(f"prefix {prefix}: copied {h.copied > 0}, saved {h.saved > 0}")
    event(f"wrapped: {any(h.sched.local.wraps(r.max_total_tokens) for r in h.ended.values())}")


def test_two_prompts_that_each_need_most_of_the_pool_do_not_evict_each_other_forever():
    """A livelock hypothesis found (tests/perf/logs/session28_local_kv_livelock.txt): two
    prompts of 37 and 38 tokens, each needing 10 of the 11 blocks, both admitted under chunked
    prefill (the local pool turns it on); the one evicted for room came back with a chunk at
    once and evicted the other in turn, for ever. An evicted request now comes back only when
    all it had, and one more, fits: every request ends."""
    plan = dataclasses.replace(
        make_plan(num_blocks=11, block_size=4, max_requests=3, max_tokens=21,
                  max_sequence_length=41),
        local_window=8, num_local_blocks=18,
    )  # fmt: skip
    work = [(1, 0, 1, 15), (1, 1, 38, 1), (0, 2, 37, 1), (0, 3, 1, 1), (1, 4, 1, 1),
            (1, 5, 1, 1), (0, 6, 1, 1), (0, 7, 9, 1)]  # fmt: skip
    h = LocalHarness(plan, False, False, 8)
    drive(h, [(at, None, make_request(rid, n, max_tokens=m)) for at, rid, n, m in work])
    h.check_end()
    assert set(h.ended) == set(range(8)) and h.sched.num_evicted_total > 0


@fuzz_settings(150)
@given(local_workloads())
def test_random_workloads_read_every_window_intact(workload):
    _run(workload)
