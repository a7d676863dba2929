"""The request history (actors/engine/history.py): checkpoints, merge, staleness counters, and how
they reach the terminal output."""

from __future__ import annotations

import numpy as np

from taipan.actors.engine.history import RequestHistory
from taipan.actors.engine.outputs import output_of
from tests.test_scheduler import Harness, make_plan, make_request


def test_staleness_counts_updates_per_token_and_new_tokens_start_fresh():
    rec = RequestHistory()
    rec.increment_staleness(3)  # 3 tokens exist at the first update
    rec.increment_staleness(5)  # 2 more were produced before the second
    policy, kv = rec.staleness(7)  # and 2 more after it
    assert policy.tolist() == [2, 2, 2, 1, 1, 0, 0]
    assert kv.tolist() == [2, 2, 2, 1, 1, 0, 0]


def test_policy_only_leaves_kv_alone_and_a_checkpoint_resets_kv():
    rec = RequestHistory()
    rec.increment_staleness(4)
    rec.increment_staleness(4, policy_only=True)  # evicted: no KV to age
    assert rec.staleness(4)[0].tolist() == [2] * 4
    assert rec.staleness(4)[1].tolist() == [1] * 4
    rec.checkpoint(6)  # evicted at 6 tokens: the KV will be recomputed with today's weights
    assert rec.staleness(6)[1].tolist() == [0] * 6
    assert rec.staleness(6)[0].tolist() == [2] * 4 + [0, 0]


def test_merge_gives_the_spans_computed_together():
    rec = RequestHistory()
    assert rec.merge(5) == [(0, 5)]
    rec.checkpoint(7)
    rec.checkpoint(9)
    assert rec.merge(12) == [(0, 7), (7, 9), (9, 12)]


def test_terminal_output_carries_staleness_of_a_request_that_lived_through_updates():
    h = Harness(make_plan(block_size=4), chunked=False)
    h.add(make_request(1, 5, max_tokens=6))
    h.step()  # prefill: 1 token generated
    h.sched.new_weights(1)  # a weight update while the request runs
    h.run()
    out = output_of(h.ended[1])
    assert out.finished and len(out.policy_staleness) == 5 + 6
    # the 5 prompt tokens and the first generated token predate the update
    assert out.policy_staleness.tolist() == [1] * 6 + [0] * 5
    assert np.array_equal(out.kv_cache_staleness, out.policy_staleness)
