"""Speculative decoding of a hybrid (Mamba2 + attention) model through real processes on the
CPU (issue 29: hybrids, with prefix caching and chunked prefill): a tiny random NemotronH made
to loop (tests/looping.py `make_looping`: its greedy outputs settle into
cycles the n-gram drafts follow, with departures that reject drafts), served with k = 3 drafts
at tensor_parallel_size=2 (gloo: each process rolls its share of the states back), in a KV
pool too small for all its requests (they pause and are evicted), and without (T = 1). Greedy
outputs, and a seeded sampled request's, are the same; drafts were accepted (at every
position) and rejected, so the gpu rolled the Mamba states back (actors/gpu/forward.py
`_roll_back_states`). A second round of the same prompts starts from the cached prefixes'
Mamba snapshots and is the same again.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from taipan.actors.config import InferenceConfig
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams
from tests.looping import GREEDY, PROMPTS, make_looping
from tests.random_nemotron_h import make_random_nemotron_h

pytest.importorskip("transformers")
K = 3
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)


# KV blocks of the drafting runtime: four requests of up to 137 tokens (9 blocks each) do not
# fit, so requests pause and are evicted (then recompute from position 0, Mamba state from
# zeros). One block of a rank at T = 2: 2 (K, V) x 16 tokens x 1 of the 2 KV heads x 16 dims x
# 4 bytes, one attention layer.
PRESSED_BLOCKS = 14


def config(k: int, pressed: bool = True) -> InferenceConfig:
    return InferenceConfig(
        block_size_tokens=16,
        max_tokens=48,  # prompts of up to 97 tokens: chunked
        max_requests=4,
        buffer_size_gb=(PRESSED_BLOCKS + 0.5) * 2048 / 1024**3 if k and pressed else 0.05,
        max_sequence_length=256,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        prefix_caching_mamba_gb=0.002,
        num_speculative_tokens=k,
    )


@pytest.fixture(scope="module")
def looping(tmp_path_factory) -> str:
    path = make_random_nemotron_h(str(tmp_path_factory.mktemp("spec-hybrid")), "M-*-M-")
    outputs = ("out_proj.weight", "o_proj.weight", "down_proj.weight")
    return make_looping(path, "backbone.embeddings.weight", outputs, seed=3, scale=0.15)


def _serve(path: str, k: int, tp: int = 1):
    with Runtime(path, config(k), tensor_parallel_size=tp) as rt, Client(rt.address) as c:
        first = [list(x.token_ids) for x in c.generate(PROMPTS, GREEDY)]
        again = [list(x.token_ids) for x in c.generate(PROMPTS[::-1], GREEDY)]
        sampled = list(c.generate([PROMPTS[1]], SAMPLED)[0].token_ids)
        return first, again[::-1], sampled, c.stats().merged()


def test_hybrid_with_drafts_equals_without(looping):
    want = _serve(looping, 0)
    got = _serve(looping, K, tp=2)
    assert len({tuple(w) for w in want[0]}) == len(PROMPTS)
    assert got[:3] == want[:3]
    assert want[1] == want[0]
    stats = got[3]
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats
    assert (np.asarray(stats.spec_accepted_per_position) > 0).all(), stats
    assert stats.mamba_restored > 0, stats  # the second round restored snapshots
    assert stats.num_blocks == PRESSED_BLOCKS and stats.evicted_total > 0, stats


def test_hybrid_chained_verify_steps_equal_plain_decoding(looping):
    """Verify steps chained in the gpu actor (speculative_chain_steps): each inner step rolls
    the Mamba states back to its last accepted position and the next goes on from there."""
    cfg = dataclasses.replace(config(K, pressed=False), speculative_chain_steps=6)
    plain = config(0, pressed=False)
    outs = {}
    for name, c in (("plain", plain), ("chain", cfg)):
        with Runtime(looping, c) as rt, Client(rt.address) as client:
            one = [list(client.generate([p], GREEDY)[0].token_ids) for p in PROMPTS]
            sampled = list(client.generate([PROMPTS[1]], SAMPLED)[0].token_ids)
            outs[name] = (one, sampled, client.stats().merged())
    assert outs["chain"][:2] == outs["plain"][:2]
    stats = outs["chain"][2]
    assert stats.spec_chains > 0 and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


@pytest.mark.gpu
def test_gpu_hybrid_with_drafts_equals_without(tmp_path_factory):
    """On CUDA (fp32, Triton Mamba kernels; graphs and overlap for the plain steps, the
    verify steps in mixed graphs with their recurrent snapshots in the step buffers): the
    same equality, drafts accepted and rejected."""
    import torch

    from tests.random_nemotron_h import TINY_HYBRID

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = str(tmp_path_factory.mktemp("gpu-spec-hybrid"))
    path = make_random_nemotron_h(root, "M-*-M-", shape=TINY_HYBRID | {"head_dim": 64})
    outputs = ("out_proj.weight", "o_proj.weight", "down_proj.weight")
    make_looping(path, "backbone.embeddings.weight", outputs, seed=3, scale=0.15)
    got = {}
    for k in (0, K):
        with Runtime(path, config(k, False), device="cuda") as rt, Client(rt.address) as c:
            got[k] = [list(x.token_ids) for x in c.generate(PROMPTS, GREEDY)]
            got[k, "stats"] = c.stats().merged()
    assert got[K] == got[0]
    stats = got[K, "stats"]
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats
