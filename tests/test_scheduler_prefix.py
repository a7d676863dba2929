"""Prefix caching in the engine's scheduler against the real allocator (DESIGN.md §5).

The harness of tests/test_scheduler.py (a fake gpu that writes each step's K/V into a token
map and checks that every sequence reads exactly its own tokens) drives a real Scheduler with
prefix caching on, and the allocator's real service (`AllocatorService` over a
`PrefixBlockPool`) answers its BlockOps. So a shared block that holds the wrong tokens, a
block freed while shared, or an engine index that drifts from the allocator's hash map fails
the step where it happens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from taipan.actors.allocator.actor import AllocatorService
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.scheduler import StepBatch
from taipan.messages.allocator import AllocatorInit, BlockOpsReply
from taipan.messages.requests import SamplingParams
from tests.fuzz import fuzz_settings
from tests.test_scheduler import Harness, drive, make_plan


class PrefixHarness(Harness):
    def __init__(self, plan, chunked: bool, overlap: bool = False, policy: str = "lru"):
        super().__init__(plan, chunked, overlap)
        self.sched.__init__(plan, chunked, track_paused_events=True, prefix_policy=policy)
        self.alloc = AllocatorService()
        self.alloc.handle(AllocatorInit(plan.num_blocks, plan.block_size, policy))
        self.computed: dict[int, int] = {}  # request id -> prompt tokens its chunks computed

    def add(self, req: EngineRequest) -> str | None:
        req.hashes = self.sched.hash_prompt(req.prompt)
        return super().add(req)

    def allocate(self, batch: StepBatch, ops) -> BlockOpsReply:
        reply = self.alloc.handle(ops)
        assert isinstance(reply, BlockOpsReply) and reply.ok, reply
        return reply

    def check_batch(self, batch: StepBatch) -> None:
        super().check_batch(batch)
        for c in batch.chunks:
            r = c.request
            prompt_part = max(0, min(c.start + c.num_new_tokens, len(r.prompt)) - c.start)
            if not r.generated:
                self.computed[r.request_id] = self.computed.get(r.request_id, 0) + prompt_part

    def check_blocks(self, batch: StepBatch) -> None:
        sched, pool = self.sched, self.alloc.pool
        pool.check()
        assert sched.num_free_blocks == pool.num_available
        holders = np.zeros(self.plan.num_blocks, dtype=np.int32)
        for r in sched.requests.values():
            if r.blocks:
                assert pool.blocks_of(r.request_id) == r.blocks
                np.add.at(holders, r.blocks, 1)
                assert len(r.blocks) <= -(-r.max_total_tokens // self.plan.block_size)
        assert np.array_equal(sched.prefix.refs, holders), "engine refs differ from holders"
        mirror = sched.prefix.block_of
        assert mirror == {
            pool.hash_of(b): b for b in range(self.plan.num_blocks) if pool.hash_of(b)
        }

    def check_end(self) -> None:
        pool = self.alloc.pool
        self.pool.held, self.pool.free = {}, list(range(self.plan.num_blocks))  # (FakePool unused)
        super().check_end()
        # The last frees reach the allocator with the step after the last one; none came.
        for rid in list(self.sched.pending_free):
            pool.free_request(rid)
        self.sched.pending_free.clear()
        assert pool.requests() == [] and pool.num_available == self.plan.num_blocks
        pool.check()


def request(rid: int, prompt, max_tokens: int = 3, **sampling) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.5, top_k=rid, **sampling)
    prompt = np.asarray(prompt, dtype=np.int32)
    return EngineRequest(rid, prompt, params, False, arrival_time=float(rid), seed=1000 + rid)


def run_all(h: PrefixHarness, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not h.step():
            assert not h.sched.has_work()
            h.check_end()
            return
    raise AssertionError("did not finish")


SYSTEM = list(range(100, 112))  # 12 tokens: 3 blocks of 4


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
def test_a_second_request_computes_exactly_what_is_not_cached(policy, overlap):
    h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False, overlap, policy)
    h.add(request(1, SYSTEM + [500, 501], max_tokens=8))  # 14 tokens: 3 complete blocks
    h.step()
    h.step()  # request 1's prefill result is applied: its 3 blocks are shareable
    h.add(request(2, SYSTEM + [600], max_tokens=2))
    run_all(h)
    assert h.computed == {1: 14, 2: 1}  # 13 - 3 * 4 = 1 prompt token computed
    assert h.ended[2].num_cached_tokens == 12
    assert h.sched.prefix.cached_tokens == 12 and h.sched.prefix.prompt_tokens == 27


def test_lru_keeps_released_blocks_and_ref_zero_does_not():
    for policy, cached in [("lru", 12), ("ref_zero", 0)]:
        h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False, False, policy)
        h.add(request(1, SYSTEM + [500], max_tokens=1))
        run_all(h)
        h.add(request(2, SYSTEM + [700, 701], max_tokens=1))
        run_all(h)
        assert h.ended[2].num_cached_tokens == cached, policy


def test_a_block_aligned_full_match_computes_one_token_and_writes_no_kv():
    h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False)
    h.add(request(1, SYSTEM, max_tokens=4))
    run_all(h)
    h.add(request(2, SYSTEM, max_tokens=4))
    h.step()
    plan = h.history[-1]
    assert plan == [(2, 1, True)]  # one token, which samples
    run_all(h)
    assert h.computed[2] == 1 and h.ended[2].num_cached_tokens == 11
    assert h.ended[2].generated == h.ended[1].generated


def test_same_step_duplicates_wait_one_step_then_share():
    h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False, overlap=True)
    for rid in (1, 2, 3):
        h.add(request(rid, SYSTEM + [rid], max_tokens=3))
    h.step()
    assert [rid for rid, _, _ in h.history[0]] == [1]  # 2 and 3 wait for 1's blocks
    run_all(h)
    assert h.computed == {1: 13, 2: 1, 3: 1}
    assert [h.ended[r].num_cached_tokens for r in (1, 2, 3)] == [0, 12, 12]


def test_prompt_log_probs_share_nothing_but_still_register():
    h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False)
    h.add(request(1, SYSTEM + [9], max_tokens=1, return_log_probs=True))
    run_all(h)
    assert h.ended[1].num_cached_tokens == 0
    h.add(request(2, SYSTEM + [9], max_tokens=1, return_log_probs=True))
    h.add(request(3, SYSTEM + [8], max_tokens=1))
    run_all(h)
    assert h.ended[2].num_cached_tokens == 0 and h.ended[3].num_cached_tokens == 12
    assert len(h.ended[2].prompt_log_probs) == 12


def test_new_weights_and_a_recompute_resume_drop_the_cache():
    h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False)
    h.add(request(1, SYSTEM + [9], max_tokens=1))
    run_all(h)
    h.sched.new_weights(1)
    h.add(request(2, SYSTEM + [9], max_tokens=1))
    run_all(h)
    assert h.ended[2].num_cached_tokens == 0  # same prompt, new salt: zero hits
    h.add(request(3, SYSTEM + [9], max_tokens=1))
    run_all(h)
    assert h.ended[3].num_cached_tokens == 12  # what request 2 cached under the new salt
    # Two requests share a prefix; a "recompute" resume drops every K/V: both recompute, the
    # second shares what the first recomputes, and the outputs are unchanged.
    h.add(request(4, SYSTEM + [1, 2], max_tokens=6))
    h.add(request(5, SYSTEM + [3, 4], max_tokens=6))
    for _ in range(4):
        h.step()
    h.sched.invalidate_kv()
    run_all(h)
    assert {4, 5} <= set(h.ended)


# --- property: random workloads with shared prefixes -----------------------------------------


@st.composite
def prefix_workloads(draw):
    bs = draw(st.sampled_from([2, 4]))
    max_seq = draw(st.integers(8, 40))
    need = -(-max_seq // bs)
    max_tokens = draw(st.integers(4, 40))
    plan = make_plan(
        num_blocks=draw(st.integers(need, 3 * need)),
        block_size=bs,
        max_requests=draw(st.integers(1, 5)),
        max_tokens=max_tokens,
        max_sequence_length=max_seq,
        eos=draw(st.lists(st.integers(10, 59), max_size=1)),
        max_paused_blocks=draw(st.none() | st.integers(0, need)),
    )
    bases = [list(range(200 + 50 * i, 200 + 50 * i + max_seq)) for i in range(2)]
    requests = []
    for rid in range(draw(st.integers(1, 8))):
        base = bases[draw(st.integers(0, 1))]
        shared = draw(st.integers(0, max_seq - 2))
        own = draw(st.integers(0 if shared else 1, max_seq - 1 - shared))
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
    chunked = draw(st.booleans()) or any(len(r.prompt) > max_tokens for _, _, r in requests)
    policy = draw(st.sampled_from(["lru", "ref_zero"]))
    return plan, chunked, requests, draw(st.booleans()), policy


@fuzz_settings(150)
@given(prefix_workloads())
def test_random_shared_prefix_workloads_keep_every_invariant(workload):
    plan, chunked, requests, overlap, policy = workload
    h = PrefixHarness(plan, chunked, overlap, policy)
    drive(h, requests)
    h.check_end()
    event(f"cached tokens: {h.sched.prefix.cached_tokens > 0}")
    event(f"evicted: {h.sched.num_evicted_total > 0}")


def test_submission_refuses_hashes_that_do_not_name_the_tokens():
    """Caching K/V under hashes of other tokens would poison every later request: the engine
    checks the hashes sent with a request (same salt) before it admits it."""
    from taipan.actors.engine import wire
    from taipan.messages.block_hash import block_hashes
    from taipan.messages.requests import EngineSubmit

    h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False)
    prompt = np.asarray(SYSTEM + [7], dtype=np.int32)
    good = block_hashes(prompt, 4, 0)
    submit = EngineSubmit(1, prompt, SamplingParams(max_tokens=2), False, 0.0, good, 0)
    req, problem = wire.submission(h.sched, 1000, submit)
    assert problem is None and np.array_equal(req.hashes, good)
    bad = good.copy()
    bad[1] += 1
    req, problem = wire.submission(h.sched, 1000, dataclasses.replace(submit, block_hashes=bad))
    assert req is None and "do not match the prompt tokens" in problem and "block 1" in problem
    # A stale salt (weights updated since the client hashed) is not an error: the engine hashes.
    stale = dataclasses.replace(submit, block_hashes=bad, hash_salt=5)
    req, problem = wire.submission(h.sched, 1000, stale)
    assert problem is None and np.array_equal(req.hashes, good)
