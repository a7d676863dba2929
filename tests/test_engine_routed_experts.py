"""Routed experts in the engine's pure core (actors/engine/routing.py, issue 26 item 4): a
request's record keeps the routing of the first computation of each position, through
chunked prefill, preemption, eviction and recompute, and prefix-cache hits.

The fake gpu of tests/test_scheduler.py answers each step with routed experts [T, 2, 2] that
say who computed each position and how often it had been computed before: [t, 0] = (times
this (request, position) was computed before, position), [t, 1] = (request id, token id). So
a record that took a recomputation's routing, or a row of the wrong position, shows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from taipan.actors.engine.routing import RoutedExperts, fill_from_cache, shareable_with_routing
from taipan.messages.gpu import StepResult
from tests.test_scheduler import Harness, make_plan, make_request, true_tokens
from tests.test_scheduler_prefix import SYSTEM, PrefixHarness, request, run_all


class Routing:
    """Mixin: the fake gpu's routed experts, and the checks of every record."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sched.plan = dataclasses.replace(self.sched.plan, moe_layers=2)
        self.times: dict[tuple[int, int], int] = {}  # (request, position) -> computations
        self.always = False  # answer with routing whenever a chunk's request asks (not only
        # when the plan says a position is still wanted): recomputed rows come back too
        self.outputs = {}  # request id -> terminal RequestOutput

    def add(self, req):
        if req.sampling.return_routed_experts:
            req.routed = RoutedExperts()  # (as wire.submission)
        return super().add(req)

    def gpu(self, batch, a) -> StepResult:
        result = super().gpu(batch, a)
        rows = []
        drafts = a["num_drafts"] if len(a.get("num_drafts", ())) else None
        for i, c in enumerate(batch.chunks):
            r = c.request
            first = a["positions"][a["query_start_loc"][i]]
            for p in range(first, a["seq_lens"][i]):
                tok = int(true_tokens(r, p + 1)[p])
                if drafts is not None and drafts[i] and p > first:  # a draft: maybe wrong
                    fed = int(a["input_ids"][a["query_start_loc"][i] + p - first])
                    if fed != tok:  # routing of a wrong token: must never be kept
                        rows.append([[-1, p], [r.request_id, fed]])
                        continue
                seen = self.times.get((r.request_id, p), 0)
                self.times[r.request_id, p] = seen + 1
                rows.append([[seen, p], [r.request_id, tok]])
            if r.routed is not None and c.start + c.num_new_tokens > r.routed.filled:
                assert a["return_routed_experts"], "a position whose routing is wanted"
        asks = any(c.request.routed is not None for c in batch.chunks)
        if not (a["return_routed_experts"] or self.always and asks):
            return result
        return dataclasses.replace(result, routed_experts=np.asarray(rows, dtype=np.int16))

    def sent(self, outputs) -> None:
        self.outputs.update({o.request_id: o for o in outputs if o.finished})

    def check_blocks(self, batch) -> None:
        super().check_blocks(batch)
        px = self.sched.prefix
        if px is not None:  # a block's routing goes with it
            assert set(px.routing_of) <= set(px.block_of)

    def routed(self, rid: int) -> np.ndarray:
        """Request `rid`'s routed experts as its terminal output carried them, checked: one
        row per position but the last token's, each of the position's first computation."""
        r, out = self.ended[rid], self.outputs[rid]
        rows = out.routed_experts
        n = r.num_tokens - 1
        assert rows.shape == (n, 2, 2) and rows.dtype == np.int16
        assert (rows[:, 0, 0] == 0).all(), "a recomputation replaced the first routing"
        assert np.array_equal(rows[:, 0, 1], np.arange(n))
        assert np.array_equal(rows[:, 1, 1], true_tokens(r, n))
        return rows


class RoutingHarness(Routing, Harness):
    pass


class RoutingPrefixHarness(Routing, PrefixHarness):
    pass


@pytest.mark.parametrize("overlap", [False, True])
def test_routing_is_kept_through_chunked_prefill_preemption_and_recompute(overlap):
    # 10 blocks of 4 tokens for 5 requests growing to 4-5 blocks, 6 tokens a step, no room for
    # paused requests: they are chunked, pause, are evicted and recompute.
    plan = make_plan(num_blocks=10, block_size=4, max_tokens=6, max_paused_blocks=0)
    h = RoutingHarness(plan, chunked=True, overlap=overlap)
    h.always = True
    for rid in range(5):
        asks = rid != 2
        h.add(make_request(rid, 9 + rid, max_tokens=8, return_routed_experts=asks))
    h.run()
    h.check_end()
    assert h.sched.num_evicted_total > 0
    assert any(n > 1 for (rid, _), n in h.times.items() if rid != 2)  # real recomputes
    for rid in (0, 1, 3, 4):
        assert (h.routed(rid)[:, 1, 0] == rid).all()
    assert h.outputs[2].routed_experts.size == 0  # not asked


def test_a_prefix_cache_hit_takes_the_routing_kept_with_the_cached_blocks():
    h = RoutingPrefixHarness(make_plan(block_size=4, max_tokens=64), chunked=False)
    h.add(request(1, SYSTEM + [500, 501], max_tokens=4, return_routed_experts=True))
    run_all(h)
    h.add(request(2, SYSTEM + [600], max_tokens=4, return_routed_experts=True))
    run_all(h)
    assert h.ended[2].num_cached_tokens == 12 and h.computed[2] == 1
    owners = h.routed(2)[:, 1, 0]
    assert (owners[:12] == 1).all() and (owners[12:] == 2).all()  # cached, then its own


def test_a_cached_block_without_routing_is_recomputed_by_a_request_that_asks():
    h = RoutingPrefixHarness(make_plan(block_size=4, max_tokens=64), chunked=False)
    h.add(request(1, SYSTEM + [500], max_tokens=2))  # caches 3 blocks, without routing
    run_all(h)
    h.add(request(2, SYSTEM + [600], max_tokens=2, return_routed_experts=True))
    run_all(h)
    assert h.ended[2].num_cached_tokens == 0 and h.computed[2] == 13
    assert (h.routed(2)[:, 1, 0] == 2).all()
    h.add(request(3, SYSTEM + [700], max_tokens=2))  # one that does not ask still shares
    run_all(h)
    assert h.ended[3].num_cached_tokens == 12


def test_an_evicted_request_that_shared_a_prefix_keeps_its_routing():
    # 8 blocks: the shared system prompt (3) and two requests growing past them.
    plan = make_plan(num_blocks=8, block_size=4, max_tokens=8, max_paused_blocks=0)
    h = RoutingPrefixHarness(plan, chunked=True)
    h.always = True
    h.add(request(1, SYSTEM + [500], max_tokens=6, return_routed_experts=True))
    run_all(h)
    for rid in (2, 3, 4):
        h.add(request(rid, SYSTEM + [600 + rid], max_tokens=7, return_routed_experts=True))
    run_all(h)
    assert h.sched.num_evicted_total > 0 and max(h.times.values()) > 1
    for rid in (2, 3, 4):
        assert (h.routed(rid)[:12, 1, 0] == 1).all()  # the shared system prompt's routing


def test_a_model_without_moe_layers_refuses_the_option_at_submission():
    h = Harness(make_plan(), chunked=True)  # moe_layers 0
    problem = h.add(make_request(1, 5, return_routed_experts=True))
    assert problem is not None and "return_routed_experts" in problem
    assert h.add(make_request(2, 5)) is None


def test_the_record_takes_each_position_once_and_grows():
    rec = RoutedExperts()
    assert rec.first(5).shape == (0, 0, 0)
    rows = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)
    rec.put(0, rows)
    rec.put(1, rows + 100)  # positions 1, 2 known: only 3 is taken
    rec.put(9, rows)  # past what is known: a gap, not taken
    assert rec.filled == 4
    assert np.array_equal(rec.first(10), np.concatenate([rows, rows[2:] + 100]))
    rec.put(4, np.zeros((200, 2, 2), np.int16))  # grows past its first capacity
    assert rec.filled == 204 and rec.first(3).tolist() == rows.tolist()
    assert rec.block(0, 4)[3].tolist() == (rows[2] + 100).tolist() and rec.block(51, 4) is None
    with pytest.raises(ValueError, match="shape"):
        rec.put(204, np.zeros((1, 3, 2), np.int16))


def test_a_request_shares_the_cached_blocks_whose_routing_it_has_or_the_cache_keeps():
    r = request(1, list(range(20)), return_routed_experts=True)
    r.hashes, r.routed = np.arange(10, 15, dtype=np.int64), RoutedExperts()  # 5 blocks of 4
    kept = {12: np.zeros((4, 2, 2), np.int16)}  # block 2's routing only
    assert shareable_with_routing(r, 5, kept, 4) == 0
    r.routed.put(0, np.ones((9, 2, 2), np.int16))  # (an earlier admission computed 0..8)
    assert shareable_with_routing(r, 5, kept, 4) == 3  # its own 2 blocks, then block 2
    assert shareable_with_routing(r, 2, kept, 4) == 2
    fill_from_cache(r, 3, kept, 4)
    got = r.routed.first(20)
    assert len(got) == 12 and (got[:9] == 1).all() and (got[9:] == 0).all()


def test_speculating_requests_keep_the_routing_of_accepted_positions_only():
    """Verify rows (speculative decoding) route their drafts too; a rejected draft's position
    is computed again with its real token, and only that routing is kept."""
    import tests.test_scheduler as ts
    from tests.test_speculative_engine import PERIOD, SpecHarness, periodic_request

    class SpecRoutingHarness(Routing, SpecHarness):
        pass

    mp = pytest.MonkeyPatch()
    mp.setattr(ts, "fake_token", lambda position: position % PERIOD + 10)  # (drafts are found)
    try:
        _speculate_with_routing(SpecRoutingHarness, periodic_request)
    finally:
        mp.undo()


def _speculate_with_routing(harness, periodic_request) -> None:
    h = harness(make_plan(), chunked=False, overlap=False, k=3)
    h.always = True
    good = periodic_request(1, 12, 14, return_routed_experts=True)
    wrong = periodic_request(2, 12, 10, return_routed_experts=True)
    wrong.prompt[-2] = 99  # (a suffix seen nowhere else: some drafts go wrong later)
    for r in (good, wrong):
        h.add(r)
    assert good.speculates and wrong.speculates
    h.run()
    h.check_end()
    assert h.verify_rows and any(a < d for _, d, a in h.verify_rows)  # some rejected
    for rid in (1, 2):
        assert (h.routed(rid)[:, 1, 0] == rid).all()
