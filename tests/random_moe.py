"""Tiny random mixture-of-experts models saved as Hugging Face directories (`save_pretrained`: one
tensor per expert and matrix, `model.layers.1.mlp.experts.3.up_proj.weight`), with the byte-level
tokenizer of tests/random_llama.py: a Qwen3-MoE and NemotronH hybrids with `E` layers. Needs
transformers (test-only).

Routers are drawn so that choices are not near-ties: router rows have a larger scale than the other
matrices (logits spread over several units, so the k-th and (k+1)-th experts of a token are far
apart next to the ~1e-6 by which two implementations' hidden states differ), and NemotronH's
correction bias is drawn too (Hugging Face initializes it to zero), so that the bias steers
choices as it does in real checkpoints. `router_margin` measures what is left.
"""

from __future__ import annotations

import json
import os

from tests.random_llama import CHATML, _byte_tokenizer_json
from tests.random_nemotron_h import TINY_HYBRID, make_random_nemotron_h

STD = 0.06  # every other matrix, as tests/random_llama.py
GPU_HEAD_DIM = 64  # GPU tests: the CUDA attention kernels take head_dim 64 or 128
ROUTER_STD = 0.25  # router logits: std ~2 over a normalized hidden state of rms 1

# 4 layers, GQA 4/2, 8 experts of which 2 per token; layer 2 dense (mlp_only_layers).
TINY_QWEN3_MOE = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[2],
    tie_word_embeddings=False,
)
# The other settings' branches: every second layer sparse, unnormalized top-k, tied embeddings.
QWEN3_MOE_VARIANTS = {
    "mlp-only-2": {},
    "step-2-tied": dict(
        decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False, tie_word_embeddings=True
    ),
}

# NemotronH MoE settings: 8 experts in 4 groups, a token's 2 chosen from its 2 best groups.
TINY_NEMOTRON_MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
# pattern -> moe_latent_size (None: the experts work on the hidden size)
NEMOTRON_MOE_PATTERNS = {"M-*E-ME": None, "ME*EM": 32}


def _write_tokenizer(path: str) -> int:
    """The byte tokenizer files; returns the EOS id (<|im_end|>)."""
    vocab = _byte_tokenizer_json(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}, f)
    return vocab - 1


# Qwen3-30B-A3B's shape with 4 of its 48 layers (and the byte-level vocabulary): the GPU
# acceptance's expert-parallel model (tests/perf/four_gpu_acceptance.sh), 2.4 B parameters.
QWEN3_30B_A3B_4L = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=False,
)


def make_random_qwen3_moe(
    path: str, seed: int = 0, device: str = "cpu", save_dtype=None, **overrides
) -> str:
    """Write config.json, model.safetensors and tokenizer files into `path`; return it. The
    weights are drawn on `device` (a large shape draws fast on a GPU) and saved in
    `save_dtype` (None: fp32)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(path, exist_ok=True)
    eos = _write_tokenizer(path)
    config = Qwen3MoeConfig(
        vocab_size=eos + 1,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
        **(TINY_QWEN3_MOE | overrides),
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, ROUTER_STD)
            elif p.dim() >= 2:  # projections, embeddings, stacked experts
                p.normal_(0.0, STD)
            elif name.endswith("norm.weight"):  # q_norm / k_norm among them: not all ones
                p.uniform_(0.5, 1.5)
    if save_dtype is not None:
        model = model.to(save_dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_random_nemotron_h_moe(
    path: str,
    pattern: str = "M-*E-ME",
    latent_size: int | None = None,
    seed: int = 0,
    **overrides,
) -> str:
    """A NemotronH hybrid with `E` layers (tests/random_nemotron_h.py's weights for the rest),
    its routers, correction biases and experts redrawn; returns `path`. `overrides`: config
    fields over TINY_HYBRID and TINY_NEMOTRON_MOE."""
    import torch
    from transformers import NemotronHForCausalLM

    shape = TINY_HYBRID | TINY_NEMOTRON_MOE | {"moe_latent_size": latent_size} | overrides
    make_random_nemotron_h(path, pattern=pattern, shape=shape, seed=seed)
    model = NemotronHForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if ".mixer." not in name or ".experts" not in name and ".gate." not in name:
                continue
            if name.endswith("gate.weight"):
                t.copy_(torch.randn(t.shape, generator=generator) * ROUTER_STD)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.rand(t.shape, generator=generator) * 0.6 - 0.3)
            else:  # experts.up_proj / experts.down_proj, [E, rows, columns]
                t.copy_(torch.randn(t.shape, generator=generator) * STD)
    model.save_pretrained(path, safe_serialization=True)
    return path


def router_margin(model, input_ids) -> float:
    """The smallest gap, over every token and MoE layer of one Hugging Face forward, between
    the k-th and the (k+1)-th best choice score (and, with expert groups, between the last
    chosen group and the next): ~0 at a near-tie. How far the test data is from a flipped
    choice."""
    import torch

    gaps = []

    def gap(scores, k: int) -> torch.Tensor:
        top = scores.topk(k + 1, dim=-1).values
        return (top[:, k - 1] - top[:, k]).min()

    def record(module, args, output):
        logits = output[0].float()
        if not hasattr(module, "e_score_correction_bias"):  # Qwen3-MoE: softmax
            gaps.append(gap(logits.softmax(-1), module.top_k))
            return
        scores = logits.sigmoid() + module.e_score_correction_bias  # what NemotronH ranks
        groups, chosen = module.num_group, module.topk_group
        if chosen < groups:
            grouped = scores.view(len(scores), groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            gaps.append(gap(group_scores, chosen))
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(chosen, dim=-1).indices, True)
            scores = grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(scores)
        gaps.append(gap(scores, module.top_k))

    routers = [m for n, m in model.named_modules() if n.endswith(".gate") and hasattr(m, "top_k")]
    handles = [m.register_forward_hook(record) for m in routers]
    try:
        with torch.no_grad():
            model(torch.as_tensor(input_ids)[None])
    finally:
        for h in handles:
            h.remove()
    return float(torch.stack(gaps).min())
