"""Prefix caching through the real runtime (SmolLM2 on CPU, real processes and sockets): greedy
outputs with caching on equal those with it off, for shared prefixes that are block-aligned,
unaligned, exact duplicates and diverging inside a block; with chunked prefill on and off and
under KV pressure; exact cached-token counts; and no hits after a weight update."""

from __future__ import annotations

import numpy as np
import pytest

from taipan.actors.config import InferenceConfig
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams

BS = 16  # block_size_tokens of every runtime here (and of tests/conftest.py's TEST_CONFIG)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
# SmolLM2 K and V in fp32: 30 layers x 2 x 16 tokens x 3 kv heads x 64 dims x 4 bytes per block.
POOL_8_BLOCKS_GB = 8.5 * (30 * 2 * BS * 3 * 64 * 4) / 1024**3


def prompt_set(tokenizer) -> list[list[int]]:
    """Token-id prompts over one 64-token system prompt (4 complete blocks)."""
    system = tokenizer.encode("You are a careful assistant. Answer briefly and exactly. " * 8)
    system = system[: 4 * BS]
    assert len(system) == 4 * BS
    q = [tokenizer.encode(f" Question {i}: what is {i} plus {i + 3}?") for i in range(3)]
    return [
        system + q[0],  # shares 4 blocks, unaligned tail
        system + q[1],
        system,  # block-aligned, a full match once cached
        system,  # exact duplicate
        system + q[0],  # exact duplicate of the first
        system[: 3 * BS + 5] + q[2],  # diverges inside block 4
        system[:40] + q[1],  # diverges inside block 3
        q[2],  # shares nothing
    ]


def config(**extra) -> InferenceConfig:
    base = dict(
        block_size_tokens=BS,
        max_tokens=256,
        max_requests=32,
        buffer_size_gb=1,
        max_sequence_length=512,
        enable_prefix_caching=True,
    )
    return InferenceConfig(**(base | extra))


def staggered(c: Client, prompts) -> list:
    """The first prompt alone (so its blocks are cached), then the rest at once."""
    first = c.generate(prompts[:1], GREEDY)
    return first + c.generate(prompts[1:], GREEDY)


@pytest.fixture(scope="module")
def expected(client):
    prompts = prompt_set(client.tokenizer)
    outs = client.generate(prompts, GREEDY)  # the shared runtime: caching off
    assert all(o.num_cached_tokens == 0 for o in outs)
    return prompts, [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "extra",
    [
        dict(enable_chunked_prefill=True, max_tokens=48, prefix_caching_eviction_policy="lru"),
        dict(prefix_caching_eviction_policy="ref_zero"),
        # KV pressure: 8 blocks of 16 tokens for 8 requests of ~80 tokens, and no room for
        # paused requests: they pause and are evicted, and recompute what is not cached.
        dict(
            enable_chunked_prefill=True,
            max_tokens=64,
            buffer_size_gb=POOL_8_BLOCKS_GB,
            paused_buffer_size_gb=0,
        ),
    ],
    ids=["chunked-lru", "whole-ref_zero", "pressure"],
)
def test_outputs_with_prefix_caching_equal_outputs_without(model_path, expected, extra):
    prompts, want = expected
    with Runtime(model_path, config(**extra)) as rt, Client(rt.address) as c:
        got = staggered(c, prompts)
        again = c.generate(prompts, GREEDY)  # everything submitted at once, cache warm or not
        stats = c.stats().ranks[0]
    assert [o.token_ids for o in got] == want
    assert [o.token_ids for o in again] == want
    assert stats.prefix_cached_tokens == sum(o.num_cached_tokens for o in got + again)
    assert stats.prefix_cached_tokens > 0
    if extra.get("buffer_size_gb"):
        assert stats.paused_total > 0 and stats.evicted_total > 0, stats  # real pressure
    if "pressure" not in str(extra) and extra.get("prefix_caching_eviction_policy") == "lru":
        # Staggered: the first request cached 4 blocks; the others share what they can.
        cached = [o.num_cached_tokens for o in got]
        n0 = len(prompts[0])
        assert cached == [0, 64, 63, 63, min(n0 // BS * BS, n0 - 1), 48, 32, 0]


def test_a_shared_prefix_computes_exactly_the_rest(model_path, client):
    system = client.tokenizer.encode("Rules: be kind, be brief, be right. " * 10)[: 3 * BS]
    tail = client.tokenizer.encode(" Now say hello.")
    with Runtime(model_path, config()) as rt, Client(rt.address) as c:
        c.generate([system + [tail[0]]], GREEDY)
        before = c.stats().ranks[0]
        [done] = c.generate([system + tail], GREEDY)
        after = c.stats().ranks[0]
    assert done.num_cached_tokens == 3 * BS
    computed = after.prefill_tokens_computed - before.prefill_tokens_computed
    assert computed == len(tail)  # len - k * bs prompt tokens
    assert after.blocks_hashed >= 3 and after.prefix_hit_rate > 0
    assert after.blocks_active == after.blocks_hashed - after.blocks_evictable >= 0


def test_after_update_weights_a_repeated_prompt_gets_no_hits(model_path, client):
    prompt = client.tokenizer.encode("Tell me about the moon. " * 8)[: 2 * BS + 3]
    with Runtime(model_path, config()) as rt, Client(rt.address) as c:
        [first] = c.generate([prompt], GREEDY)
        [second] = c.generate([prompt], GREEDY)
        assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 2 * BS)
        c.pause()
        c.suspend("persist")
        c.update_weights(state={"model.norm.weight": np.ones(576, dtype=np.float32)})
        c.resume()
        c.unpause()
        [third] = c.generate([prompt], GREEDY)
        [fourth] = c.generate([prompt], GREEDY)
    assert third.num_cached_tokens == 0
    assert fourth.num_cached_tokens == 2 * BS  # cached again under the new weights


@pytest.fixture(scope="module")
def caching_runtime(model_path):
    with Runtime(model_path, config(enable_chunked_prefill=True, max_tokens=64)) as rt:
        yield rt


@pytest.mark.asyncio
async def test_suspend_in_each_mode_keeps_outputs_with_prefix_caching(caching_runtime, expected):
    """Requests sharing a prefix are suspended mid-generation in each mode ("recompute" drops
    every K/V and the cache with it) and finish with the tokens they would have had."""
    from tests.test_e2e_lifecycle import suspended_in_each_mode

    prompts, want = expected
    outs = await suspended_in_each_mode(caching_runtime.address, GREEDY, prompts[:4])
    assert outs == dict.fromkeys(("persist", "offload", "recompute"), want[:4])
