"""Speculative decoding (n-gram drafts, issue 29) through real processes on the CPU, beyond
tests/test_e2e_speculative.py. The model: a tiny Llama (fp32, random weights, 4/2 heads that
split over 2 peers) made to loop: its untied head maps each byte token's embedding to a
successor's (a permutation of short cycles), and its attention and MLP outputs, scaled down,
bend that by context now and then. Its greedy outputs settle into loops of 3 to 7 tokens that
the drafts follow (accepted at every draft position), with departures that reject drafts. Its
greedy outputs with drafts equal those without

- at tensor_parallel_size=2 (gloo: the engine's gpu actor leads, one tp-follower child runs
  the same verify steps, whose logits are gathered over both peers), against T = 1 without
  drafts, with prefix caching and chunked prefill, and again with the prompts' blocks cached;
- across a weight update between two speculative requests (pause, update_weights with a state
  dict that changes the weights, unpause): the first requests' tokens are the old weights',
  the second's (the same prompts again: the prefix cache must not serve the old weights' KV)
  the new ones', equal to a runtime without drafts given the same update, with the weight
  version of every token right (Completion.weight_versions, policy_staleness);
- across an update in a keep-mode pause that lands inside speculative requests (weights that
  change nothing, only the version): two spans, well formed, where the update landed.

Hybrid models speculate in tests/test_e2e_speculative_hybrid.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np
import pytest

from taipan.actors.config import InferenceConfig
from taipan.client import AsyncClient, Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams
from taipan.outputs import join_versions
from tests.looping import BASE, GREEDY, PROMPTS, make_looping_llama
from tests.random_llama import TINY_SHAPE
from tests.test_e2e_versions import _stream_until, check_completion, check_versions


def config(k: int = 0) -> InferenceConfig:
    return InferenceConfig(**BASE, num_speculative_tokens=k)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_looping_llama(str(tmp_path_factory.mktemp("spec-more") / "tiny"))


@pytest.fixture(scope="module")
def plain(tiny):
    """T = 1 without drafts: the reference."""
    with Runtime(tiny, config()) as rt, Client(rt.address) as c:
        yield c


@pytest.fixture(scope="module")
def spec(tiny):
    """T = 1 with k = 4 drafts."""
    with Runtime(tiny, config(4)) as rt, Client(rt.address) as c:
        yield rt, c


def _ids(completions) -> list[list[int]]:
    return [list(x.token_ids) for x in completions]


def _update(tiny: str, seed: int) -> dict[str, np.ndarray]:
    """New values for tensors of each kind the peers split (q rows, down columns, the
    embedding and the head's vocabulary rows), in Hugging Face names; small enough that the
    outputs still loop (drafts are accepted after the update too)."""
    from safetensors.numpy import load_file

    state = load_file(os.path.join(tiny, "model.safetensors"))
    gen = np.random.default_rng(seed)
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ]
    return {n: state[n] + gen.normal(0, 0.02, state[n].shape).astype(np.float32) for n in names}


def _original(tiny: str, update: dict) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    state = load_file(os.path.join(tiny, "model.safetensors"))
    return {n: state[n] for n in update}


@pytest.fixture(scope="module")
def spec2(tiny):
    """T = 2 (gloo) with k = 4 drafts."""
    with Runtime(tiny, config(4), tensor_parallel_size=2) as rt, Client(rt.address) as c:
        yield c


def test_tp2_with_drafts_equals_tp1_without(plain, spec2):
    c = spec2
    want = _ids(plain.generate(PROMPTS, GREEDY))
    assert len({tuple(w) for w in want}) == len(PROMPTS)  # the prompts lead somewhere different
    start = c.stats().merged()
    assert _ids(c.generate(PROMPTS, GREEDY)) == want
    # Again: now the prompts' blocks are cached, so the first steps differ.
    cached = c.stats().merged()
    assert _ids(c.generate(PROMPTS[::-1], GREEDY)) == want[::-1]
    end = c.stats().merged()
    assert end.prefix_cached_tokens > cached.prefix_cached_tokens, end
    for before, after in ((start, cached), (cached, end)):
        drafted = after.spec_draft_tokens - before.spec_draft_tokens
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        assert 0 < accepted < drafted, after  # accepted, and some rejected
    per_position = np.subtract(end.spec_accepted_per_position, start.spec_accepted_per_position)
    assert (per_position > 0).all(), per_position  # runs of all k = 4 drafts accepted too
    assert plain.stats().merged().spec_draft_tokens == 0


def test_tp2_chained_verify_steps_equal_tp1_without(tiny, plain):
    """T = 2 (gloo) with k = 4 drafts and verify steps chained in the gpu actors (the
    follower runs the same chain: its decisions come from the gathered logits, the same on
    both peers), one request at a time and all together."""
    want = _ids(plain.generate(PROMPTS, GREEDY))
    cfg = InferenceConfig(**BASE, num_speculative_tokens=4, speculative_chain_steps=6)
    with Runtime(tiny, cfg, tensor_parallel_size=2) as rt, Client(rt.address) as c:
        assert [_ids(c.generate([p], GREEDY))[0] for p in PROMPTS] == want
        assert _ids(c.generate(PROMPTS[:4], GREEDY)) == want[:4]
        rank = c.stats().merged()
    assert rank.spec_chains > 0 and rank.spec_verify_rows > rank.spec_chains, rank


def test_no_speculation_above_the_batch_limit_and_the_tail_speculates(tiny, plain):
    """speculative_disable_by_batch_size=1: three short requests beside a long one run their
    steps without drafts (4 and then 2 or 3 running), and the long one speculates once it
    runs alone; outputs equal T = 1 without drafts."""
    short, long = dataclasses.replace(GREEDY, max_tokens=8), GREEDY
    want = _ids(plain.generate(PROMPTS[:3], short)) + _ids(plain.generate(PROMPTS[3:4], long))
    cfg = InferenceConfig(**BASE, num_speculative_tokens=4, speculative_disable_by_batch_size=1)

    async def together(address):
        async with AsyncClient(address) as ac:
            a, b = await asyncio.gather(
                ac.generate(PROMPTS[:3], short), ac.generate(PROMPTS[3:4], long)
            )
            return _ids(a) + _ids(b), (await ac.stats()).merged()

    with Runtime(tiny, cfg) as rt:
        got, rank = asyncio.run(together(rt.address))
    assert got == want
    assert rank.spec_batch_off_steps > 0 and rank.spec_verify_rows > 0, rank
    assert rank.spec_accepted_tokens > 0, rank


@pytest.mark.slow
def test_a_weight_update_between_two_speculative_requests(tiny, plain, spec, spec2):
    """T = 1 without drafts, T = 1 and T = 2 with: each serves PROMPTS[:4], takes the update
    (paused), serves them again, then gets its old weights back (a third version)."""
    update, prompts = _update(tiny, seed=5), PROMPTS[:4]
    outs = {}
    for name, c in (("plain", plain), ("spec", spec[1]), ("spec2", spec2)):
        start = c.stats().merged()
        v0 = start.weight_version
        a = c.generate(prompts, GREEDY)
        middle = c.stats().merged()
        assert c.pause().state == "PAUSED"
        assert c.update_weights(state=update).weight_version == v0 + 1
        assert c.unpause().state == "RUNNING"
        b = c.generate(prompts, GREEDY)
        end = c.stats().merged()
        assert end.weight_version == v0 + 1
        accepted = [y.spec_accepted_tokens - x.spec_accepted_tokens for x, y in
                    ((start, middle), (middle, end))]  # fmt: skip
        outs[name] = (_ids(a), _ids(b), accepted)
        assert c.pause().state == "PAUSED"
        assert c.update_weights(state=_original(tiny, update)).weight_version == v0 + 2
        assert c.unpause().state == "RUNNING"
        for x, version in [(x, v0) for x in a] + [(x, v0 + 1) for x in b]:
            assert x.weight_versions == [(version, 0)], (name, x.weight_versions)
            assert set(x.policy_staleness) == {0} and set(x.kv_cache_staleness) == {0}
            check_completion(x)
    (a, b, none), spec1, spec2_ = outs["plain"], outs["spec"], outs["spec2"]
    assert a != b  # the update reached the weights
    assert none == [0, 0]
    for got_a, got_b, accepted in (spec1, spec2_):
        assert got_a == a and got_b == b  # (b: no KV of the old weights served from the cache)
        assert min(accepted) > 0, accepted


# HF initialises RMSNorm weights to ones (make_random_llama randomises only matrices): an
# update with these changes no output, only the version.
SAME_WEIGHTS = {"model.norm.weight": np.ones(TINY_SHAPE["hidden_size"], np.float32)}
LONG = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_an_update_inside_speculative_requests_splits_their_versions(plain, spec):
    prompts = [PROMPTS[0], PROMPTS[5]]
    want = _ids(plain.generate(prompts, LONG))
    async with AsyncClient(spec[0].address) as ac:
        start = (await ac.stats()).merged()
        deltas, seen = [], asyncio.Event()
        streamed = asyncio.create_task(_stream_until(ac, prompts[0], LONG, deltas, seen, 10))
        whole = asyncio.create_task(ac.generate([prompts[1]], LONG))
        await asyncio.wait_for(seen.wait(), 120)
        v0 = (await ac.pause()).weight_version
        assert (await ac.update_weights(state=SAME_WEIGHTS)).weight_version == v0 + 1
        await ac.unpause()
        await streamed
        [c] = await whole
        rank = (await ac.stats()).merged()
    assert rank.spec_accepted_tokens > start.spec_accepted_tokens, rank
    tokens = [t for d in deltas for t in d.token_ids]
    assert [tokens, list(c.token_ids)] == want
    spans, offset = [], 0
    for d in deltas:  # each delta's spans cover its own tokens
        if d.token_ids:
            firsts = [f for _, f in d.weight_versions]
            assert firsts[0] == offset and firsts[-1] < offset + len(d.token_ids), (d, offset)
        offset += len(d.token_ids)
        spans = join_versions(spans, d.weight_versions)
    assert len(spans) == 2 and spans[0] == (v0, 0) and spans[1][0] == v0 + 1, spans
    assert 10 <= spans[1][1] < len(tokens), spans
    check_versions(spans, len(prompts[0]), len(tokens), deltas[-1].policy_staleness)
    assert c.weight_versions[0] == (v0, 0) and c.weight_versions[-1][0] == v0 + 1
    check_completion(c)
