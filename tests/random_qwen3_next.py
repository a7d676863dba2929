"""A random-weight Qwen3-Next hybrid (Gated-DeltaNet + gated attention) saved as a Hugging Face
directory (`save_pretrained`), with the byte-level tokenizer of tests/random_llama.py. Needs
transformers (test-only).

Two tiny configs with more value heads than key heads (Hv = 2 Hk) and Dk != Dv: "moe" (three
GDN layers then one attention layer, MoE with a shared expert, one dense layer by
mlp_only_layers, partial RoPE 1/4) and "dense" (no experts: dense MLPs everywhere, GDN and
attention alternating, tied embeddings, partial RoPE 1/2). The weights are drawn larger than
transformers' init (peaked, seed-stable greedy picks), the zero-centred norms away from zero.
"""

from __future__ import annotations

import json
import os

from tests.random_llama import CHATML, _byte_tokenizer_json

L, F = "linear_attention", "full_attention"
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
CONFIGS = {
    "moe": dict(
        layer_types=[L, L, L, F],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
        partial_rotary_factor=0.25,
        tie_word_embeddings=False,
    ),
    "dense": dict(
        layer_types=[L, F, L, F],
        num_experts=0,
        partial_rotary_factor=0.5,
        tie_word_embeddings=True,
    ),
}


def make_random_qwen3_next(
    path: str,
    kind: str = "moe",
    shape: dict | None = None,
    seed: int = 0,
    std: float = 0.06,
    dtype=None,
) -> str:
    """Write config.json, model.safetensors and tokenizer files into `path`; return it."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    os.makedirs(path, exist_ok=True)
    vocab = _byte_tokenizer_json(path)
    eos = vocab - 1  # <|im_end|>
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}, f)
    fields = dict(CONFIGS[kind])
    layer_types = fields.pop("layer_types")
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    rope["partial_rotary_factor"] = fields.pop("partial_rotary_factor")
    config = Qwen3NextConfig(
        vocab_size=vocab,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
        **(shape or TINY),
        **fields,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)  # the gated norm: a plain weight
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)  # zero-centred: x * (1 + w)
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 0.5)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.3)
            else:  # projections, the experts' stacked matrices, routers
                p.normal_(0.0, std)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path
