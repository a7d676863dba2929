"""Qwen2, Qwen3, Mistral and Gemma 3 served end to end (issue 27 items 1-2): real coordinator and
engine processes, tiny random Hugging Face directories (tests/random_dense.py), greedy tokens and
log-probs against transformers on the same weights (fp32, CPU).

One runtime per family (the representative test) prefills in chunks (max_tokens 32 < the longer
prompts), with prefix caching on and a KV pool of 10 blocks for 4 running requests of up to 7
blocks each (requests pause and are evicted, then recompute), then serves a prompt twice (the
second time from the cache: num_cached_tokens > 0), then updates weights by Hugging Face name
(a bias, a q/k norm, Gemma's norms) through the lifecycle and gives transformers' tokens under
the same change. A Mistral whose sliding window is shorter than the prompts is served the same
way. Slow: the same at TP = 2 (gloo) for each family, and tied embeddings for Qwen2. GPU (marker
`gpu`): each family on CUDA with CUDA graphs against transformers on the same GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from taipan import LLM, SamplingParams
from taipan.messages.requests import FinishReason
from tests.random_dense import FAMILIES, GPU_HEAD_DIM, make_random_dense, make_random_mistral

transformers = pytest.importorskip("transformers")
BLOCK = 16
NEW = 10
ATOL = 1e-4
MARGIN = 1e-4  # HF's top-1 over top-2 logit at every greedy step: no near-ties in the data
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, return_log_probs=True)
# A prompt served twice: prompt log-probs would need every position computed (no cache hits).
CACHED = SamplingParams(
    max_tokens=NEW, temperature=0.0, ignore_eos=True, return_log_probs=True,
    skip_prompt_log_probs=True,
)  # fmt: skip
_gen = np.random.default_rng(27)
PROMPTS = [_gen.integers(0, 256, n).tolist() for n in (5, 16, 55, 100, 7, 33)]
SHARED = _gen.integers(0, 256, 70).tolist()
# The GPU test's models: seeds whose greedy steps (on the CPU) all lead by > 1e-3.
GPU_SEEDS = {"qwen2": 0, "qwen3": 2, "mistral": 1, "gemma3": 2}
# Hugging Face tensors each family's runtime updates: a bias, a q/k norm, a matrix the TP peers
# split.
UPDATES = {
    "qwen2": ["model.layers.0.self_attn.k_proj.bias", "model.layers.1.self_attn.q_proj.bias"],
    "qwen3": ["model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"],
    "mistral": ["model.layers.1.self_attn.v_proj.weight", "model.norm.weight"],
    "gemma3": [
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.1.mlp.down_proj.weight",
    ],
}


def block_bytes(path: str) -> int:
    """Bytes of one fp32 KV block of the model at `path` (both layers, K and V)."""
    c = transformers.AutoConfig.from_pretrained(path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * BLOCK * c.num_key_value_heads * head_dim * 4


def engine_config(path: str, tp: int = 1, blocks: int = 10) -> dict:
    """A pool of `blocks` KV blocks (each of T peers holds its kv heads' share of each)."""
    per_block = block_bytes(path) / tp / 1024**3
    return dict(
        block_size_tokens=BLOCK,
        enable_chunked_prefill=True,
        max_tokens=32,
        max_requests=4,
        max_sequence_length=256,
        enable_prefix_caching=True,
        prefix_caching_eviction_policy="lru",
        buffer_size_gb=(blocks + 0.5) * per_block,
        paused_buffer_size_gb=1.5 * per_block,  # paused requests hold 1 block, then evict
        tensor_parallel_size=tp,
    )


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Model directories by (family, tied), made once."""
    cache: dict[tuple, str] = {}

    def get(family: str, tie: bool = False) -> str:
        if (family, tie) not in cache:
            kw = dict(tie=True) if tie else {}
            path = str(tmp_path_factory.mktemp(f"{family}-tied" if tie else family))
            cache[family, tie] = make_random_dense(family, path, **kw)
        return cache[family, tie]

    return get


def hf_model(path: str, device: str = "cpu"):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device).eval()


def assert_equals_hf(done, hf, atol: float = ATOL) -> None:
    """Every completion is transformers' greedy continuation of its prompt (each token the
    argmax of HF's logits after the tokens before it, none a near-tie), with HF's log-probs for
    the generated tokens and, where returned, the prompt's."""
    device = next(hf.parameters()).device
    for i, d in enumerate(done):
        assert d.finish_reason == FinishReason.LENGTH and len(d.token_ids) == NEW, (i, d.error)
        ids = d.prompt_token_ids + d.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids], device=device)).logits[0].float().cpu()
        p = len(d.prompt_token_ids)
        picks = logits[p - 1 : -1]  # [NEW, vocab]: what each generated token was chosen from
        top2 = picks.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > MARGIN, f"prompt {i}: test data near a tie"
        assert d.token_ids == picks.argmax(-1).tolist(), f"prompt {i}"
        lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        np.testing.assert_allclose(d.log_probs, lp[p - 1 :].numpy(), atol=atol, rtol=0)
        if d.prompt_log_probs is not None:
            np.testing.assert_allclose(d.prompt_log_probs, lp[: p - 1].numpy(), atol=atol, rtol=0)


def update_state(path: str, family: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    saved = load_file(os.path.join(path, "model.safetensors"))
    gen = np.random.default_rng(5)
    names = UPDATES[family]
    return {n: saved[n] + gen.normal(0, 0.3, saved[n].shape).astype(np.float32) for n in names}


def serve_and_check(
    path: str, family: str, tp: int = 1, blocks: int = 10, pressure: bool = True
) -> None:
    """The whole scenario of the module docstring on one runtime (a pool of `blocks`; with
    `pressure`, requests must pause and be evicted)."""
    hf = hf_model(path)
    with LLM(path, **engine_config(path, tp, blocks)) as llm:
        done = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_equals_hf(done, hf)
        assert done[0].prompt_log_probs is not None
        [rank] = llm.stats().ranks
        if pressure:
            assert rank.paused_total > 0 and rank.evicted_total > 0, rank
        first = llm.generate([SHARED], CACHED, use_tqdm=False)
        again = llm.generate([SHARED], CACHED, use_tqdm=False)
        assert again[0].num_cached_tokens >= 4 * BLOCK and first[0].num_cached_tokens == 0
        assert again[0].token_ids == first[0].token_ids
        assert_equals_hf(first + again, hf)
        state = update_state(path, family)
        assert llm.pause().state == "PAUSED"
        assert llm.suspend("offload").state == "SUSPENDED"
        assert llm.update_weights(state=state).weight_version == 1
        llm.resume()
        llm.unpause()
        updated = llm.generate(PROMPTS[2:4], GREEDY, use_tqdm=False)
    hf.load_state_dict({n: torch.from_numpy(v) for n, v in state.items()}, strict=False)
    assert_equals_hf(updated, hf)
    for u, d in zip(updated, done[2:4], strict=True):  # the update reached the weights
        assert np.abs(np.subtract(u.prompt_log_probs, d.prompt_log_probs)).max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_served_equal_hf(made, family):
    serve_and_check(made(family), family)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_served_at_tp2_equal_hf(made, family):
    """Two processes per rank over gloo: each holds half the heads, its rows of the q/k/v
    biases and whole q/k norms; the update splits the same way."""
    serve_and_check(made(family), family, tp=2)


@pytest.mark.slow
def test_qwen2_with_tied_embeddings_served_equal_hf(made):
    serve_and_check(made("qwen2", tie=True), "qwen2")


def test_a_sliding_window_shorter_than_the_prompts_served_equal_hf(tmp_path):
    """A window of 24 keys: chunks of 32 tokens, cached prefixes and decode rows all attend
    within it, as transformers' sliding-window mask. Every layer has the window, so a request
    holds only its window's blocks: a pool of 6 (not 10) puts the 4 requests under pressure."""
    path = make_random_mistral(str(tmp_path / "windowed"), sliding_window=24)
    serve_and_check(path, "mistral", blocks=6)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_served_with_cuda_graphs_equal_hf(tmp_path, family):
    """On CUDA (CUDA graphs on, the default there; head_dim 64 for the attention kernels), fp32
    with TF32 off: greedy tokens and log-probs as transformers' on the same GPU, with chunked
    prefill, prefix caching and a small pool as on the CPU."""
    serve_on_gpu(tmp_path, family)


@pytest.mark.gpu
@pytest.mark.parametrize("gemv_sum", ["0", "1"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_gpu_served_at_tp2_with_cuda_graphs_equal_hf(tmp_path, family, gemv_sum, monkeypatch):
    """The same on two GPUs (TP = 2, the custom all-reduce): the one-row decode steps take the
    fused rank path (DecoderLayer._fused_tp_forward), with RoPE inside the qkv product (Qwen2)
    or after it (Qwen3's q/k norms); with TAIPAN_TP_GEMV_SUM=1 (read by the ranks' processes)
    o_proj and down_proj with their sums and norms in one launch each."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    monkeypatch.setenv("TAIPAN_TP_GEMV_SUM", gemv_sum)
    serve_on_gpu(tmp_path, family, tp=2)


def serve_on_gpu(tmp_path, family: str, tp: int = 1) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(hidden_size=256)  # head_dim 256 / 4 heads
    if family in ("qwen3", "gemma3"):  # (head_dim from the config)
        kw = dict(head_dim=GPU_HEAD_DIM)
    path = make_random_dense(family, str(tmp_path / family), seed=GPU_SEEDS[family], **kw)
    hf = hf_model(path, "cuda")
    with LLM(path, device="cuda", **engine_config(path, tp)) as llm:
        done = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        first = llm.generate([SHARED], CACHED, use_tqdm=False)
        again = llm.generate([SHARED], CACHED, use_tqdm=False)
        stats = llm.stats().merged()
    assert stats.steps_graphed > 0  # decode steps ran as CUDA graphs
    assert again[0].num_cached_tokens >= 4 * BLOCK
    assert_equals_hf(done + first + again, hf, atol=1e-3)
