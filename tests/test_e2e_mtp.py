"""Speculative decoding with the checkpoint's own MTP head (speculative_method "mtp", issue 29
item 2) served end to end: real coordinator and engine processes, a tiny random Qwen3-Next
with MoE layers and a random head (tests/random_qwen3_next.add_mtp_head), greedy tokens equal
to Hugging Face's incremental decoding on the same weights.

The waves of tests/test_e2e_hybrid_prefix.py with recurrent snapshots and steps of 24 tokens:
prompts cut into chunks (the head reads each chunk's next prompt token: StepPlan.mtp_next),
prefix hits (the cached blocks carry the head's KV too), drafts verified every step. The head
is random, so few drafts pass; what the drafts are is tests/test_qwen3_next_mtp.py's (the
worker's against a reference of Hugging Face's modules); here, that serving with them is
exact and they are verified.
"""

from __future__ import annotations

import pytest
import torch

from taipan.actors.config import InferenceConfig
from taipan.launcher import Runtime
from tests.random_qwen3_next import add_mtp_head, make_random_qwen3_next
from tests.test_e2e_hybrid import hf_generate
from tests.test_e2e_hybrid_prefix import GREEDY, PROMPTS
from tests.test_e2e_qwen3_next import GPU_SHAPE, WAVES, _model, config, run
from tests.test_e2e_tp_hybrid import per_peer

transformers = pytest.importorskip("transformers")
K = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _model(tmp_path_factory, mtp_head=True)


def test_mtp_drafts_keep_hugging_faces_tokens_with_chunks_and_prefix_hits(model):
    path, c, want = model
    cfg = config(c, 8, num_speculative_tokens=K, speculative_method="mtp")
    got, cached, stats = run(path, cfg)
    assert got == want
    assert sum(cached.values()) > 0  # (prefix hits: the head's KV came from the cache too)
    assert stats.spec_verify_rows > 0 and stats.spec_draft_tokens > stats.spec_verify_rows


def test_tp2_serves_hugging_faces_tokens_with_drafts(model):
    """Tensor parallel T = 2 (gloo): each peer runs the head's passes on its shard, in the same
    pipeline as the model's steps; the tokens and cached counts are T = 1's."""
    path, c, want = model
    cfg = per_peer(config(c, 8, num_speculative_tokens=K, speculative_method="mtp"), 2)
    got, cached, stats = run(path, cfg, tensor_parallel_size=2)
    assert got == want and sum(cached.values()) > 0
    assert stats.spec_verify_rows > 0


def test_expert_parallel_ranks_run_the_heads_passes_in_step(model):
    """Expert parallelism (data parallel 2 x expert parallel 2, gloo): each rank holds half of
    every MoE layer's experts, the head's layer's too, and every step of a rank runs the head's
    passes, whose MoE exchanges the other rank meets with its own step's or, with no request,
    in its dummy steps (one request alone at the end): Hugging Face's tokens, drafts verified."""
    from taipan.client import Client

    path, c, want = model
    cfg = config(c, 8, num_speculative_tokens=K, speculative_method="mtp")
    got = {}
    with Runtime(path, cfg, data_parallel_size=2, expert_parallel_size=2) as rt:
        with Client(rt.address) as client:
            for wave in WAVES:
                done = client.generate([PROMPTS[n] for n in wave], GREEDY)
                got |= {n: d.token_ids for n, d in zip(wave, done, strict=True)}
            name = next(iter(PROMPTS))
            [alone] = client.generate([PROMPTS[name]], GREEDY)
            ranks = client.stats().ranks
    assert got == want and alone.token_ids == want[name]
    assert all(r.steps_total > 0 for r in ranks)
    assert sum(r.spec_verify_rows for r in ranks) > 0


def test_kv_pressure_and_a_weight_update_keep_hugging_faces_tokens(model, tmp_path):
    """A pool of 8.5 blocks (requests pause and are evicted, their head's KV recomputed with
    the rest), then `update_weights(path)` to another checkpoint, whose head comes with it:
    each time Hugging Face's tokens of the weights in place."""
    from taipan.client import Client

    path, c, want = model
    other = make_random_qwen3_next(str(tmp_path / "other"), "moe", seed=1)
    add_mtp_head(other, seed=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    prompts = [PROMPTS[n] for n in PROMPTS]
    kv_layers = c.layer_types.count("full_attention") + 1  # (the head's layer too)
    block = kv_layers * 2 * 16 * c.num_key_value_heads * c.head_dim * 4
    budgets = {
        "buffer_size_gb": 8.5 * block / 1024**3,
        "paused_buffer_size_gb": 1.5 * block / 1024**3,
    }
    cfg = config(c, 8, num_speculative_tokens=K, speculative_method="mtp", **budgets)
    with Runtime(path, cfg) as rt, Client(rt.address) as client:
        got = [d.token_ids for d in client.generate(prompts, GREEDY)]
        assert got == [want[n] for n in PROMPTS]
        [stats] = client.stats().ranks
        assert stats.paused_total > 0 and stats.spec_verify_rows > 0
        client.pause()
        client.update_weights(other)
        client.unpause()
        got = [d.token_ids for d in client.generate(prompts, GREEDY)]
    assert got == hf_generate(hf, prompts)


def test_grammar_rows_with_mtp_drafts_equal_plain_decoding_under_the_grammar(model):
    """Greedy and seeded requests under a regex (structured outputs) with MTP drafts: the head
    reads each step's final tokens (no check is left for collect), the verify rows walk or mask
    the grammar; the tokens equal those without speculation, and the text keeps to it."""
    import re

    from taipan.client import Client
    from taipan.messages.requests import SamplingParams, StructuredOutput

    path, c, _ = model
    grammar = StructuredOutput("regex", "[a-f]{3}( [a-f]{2,4}){4}")
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, structured=grammar),
        SamplingParams(max_tokens=24, temperature=0.8, seed=5, structured=grammar),
    ]
    prompts = [PROMPTS[n] for n in list(PROMPTS)[:2]]
    outs = {}
    for k in (0, K):
        cfg = config(c, 8, num_speculative_tokens=k, speculative_method="mtp")
        with Runtime(path, cfg) as rt, Client(rt.address) as client:
            outs[k] = [[d.token_ids for d in client.generate(prompts, sp)] for sp in params]
            texts = [d.text for d in client.generate(prompts, params[0])]
            [stats] = client.stats().ranks
    assert outs[K] == outs[0]
    assert all(re.fullmatch("[a-f]{3}( [a-f]{2,4}){4}", t) for t in texts), texts
    assert stats.spec_verify_rows > 0


def test_a_checkpoint_without_a_head_fails_at_start_with_the_reason(tmp_path):
    path = make_random_qwen3_next(str(tmp_path / "plain"), "dense")
    cfg = InferenceConfig(
        block_size_tokens=16,
        max_tokens=24,
        max_requests=4,
        buffer_size_gb=0.05,
        max_sequence_length=256,
        num_speculative_tokens=K,
        speculative_method="mtp",
    )
    with pytest.raises(Exception, match="no multi-token-prediction head"):
        with Runtime(path, cfg):
            pass


@pytest.mark.gpu
def test_gpu_mtp_drafts_with_mixed_graphs_keep_hugging_faces_tokens(tmp_path_factory):
    """On CUDA, fp32: every step replays a mixed graph that keeps its hidden states (an MTP
    config captures no decode-only graph) and then its bucket's graph of the head's passes,
    or runs both eagerly (a hybrid's verify step); Hugging Face's tokens."""
    path, c, want = _model(tmp_path_factory, GPU_SHAPE, mtp_head=True)
    cfg = config(c, 8, max_tokens=64, num_speculative_tokens=K, speculative_method="mtp")
    got, _, stats = run(path, cfg, device="cuda")
    assert got == want
    assert stats.steps_graphed > 0 and stats.spec_verify_rows > 0
