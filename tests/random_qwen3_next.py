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


MTP_SCALE = 0.8  # the MTP layer's weights: a full-attention layer's, scaled (not the same)


def mtp_source_layer(config) -> int:
    """The full-attention layer whose weights (times MTP_SCALE) become `mtp.layers.0`: one
    whose MLP is of the MTP layer's kind (sparse as layer 0 is), so Hugging Face's decoder
    layer of that index is the reference's module."""
    only, step = getattr(config, "mlp_only_layers", []), getattr(config, "decoder_sparse_step", 1)
    moe = [
        getattr(config, "num_experts", 0) > 0 and i not in only and (i + 1) % step == 0
        for i in range(config.num_hidden_layers)
    ]
    full = [i for i, kind in enumerate(config.layer_types) if kind == F and moe[i] == moe[0]]
    return full[0]


def add_mtp_head(path: str, seed: int = 1) -> dict:
    """Add a random multi-token-prediction head to the checkpoint in `path` (Qwen3-Next's or
    Qwen3.5's `mtp.*` tensors, which Hugging Face's model ignores): `mtp.layers.0.*` are the
    tensors of layer `mtp_source_layer` times MTP_SCALE (as saved: whatever the expert
    layout), `mtp.fc` [H, 2H] and the three zero-centred norms drawn from `seed`. Returns the
    head's own tensors (fc and norms) by their names."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    source = f"model.layers.{mtp_source_layer(config)}."
    for name in [n for n in tensors if n.startswith(source)]:
        tensors["mtp.layers.0." + name[len(source) :]] = tensors[name] * MTP_SCALE
    h = config.hidden_size
    g = torch.Generator().manual_seed(seed)
    dtype = tensors["model.norm.weight"].dtype
    own = {
        "mtp.fc.weight": torch.randn(h, 2 * h, generator=g) * 0.08,
        **{
            f"mtp.{norm}.weight": torch.randn(h, generator=g) * 0.1
            for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
        },
    }
    own = {name: t.to(dtype) for name, t in own.items()}
    save_file({**tensors, **own}, file, metadata={"format": "pt"})
    return own
