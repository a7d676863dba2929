"""A random-weight Qwen3.5 text model (Qwen3_5ForCausalLM, or Qwen3_5MoeForCausalLM) saved as a
Hugging Face directory, with the byte-level tokenizer of tests/random_llama.py and a stray
multi-token-prediction tensor (`mtp.*`, which the loader must skip). Needs transformers.

"dense": GDN and attention alternating, tied embeddings, partial RoPE 1/4 as Qwen3.5's text
"mrope" (mrope_section, interleaved); "moe": three GDN layers then attention, every layer a MoE
with a shared expert, partial RoPE 1/2. Shapes and weight draws: tests/random_qwen3_next.py's.
"""

from __future__ import annotations

import json
import os

from tests.random_llama import CHATML, _byte_tokenizer_json
from tests.random_qwen3_next import TINY, F, L

CONFIGS = {
    "dense": dict(layer_types=[L, F, L, F], partial_rotary_factor=0.25, tie_word_embeddings=True),
    "moe": dict(
        layer_types=[L, L, L, F],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        partial_rotary_factor=0.5,
        tie_word_embeddings=False,
    ),
}


def make_random_qwen3_5(path: str, kind: str = "dense", shape: dict | None = None, seed: int = 0,
                        std: float = 0.06) -> str:  # fmt: skip
    """Write config.json, model.safetensors (with an `mtp.` tensor) and tokenizer files."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    os.makedirs(path, exist_ok=True)
    vocab = _byte_tokenizer_json(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}, f)
    fields = dict(CONFIGS[kind])
    layer_types = fields.pop("layer_types")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True}
    shape = dict(shape or TINY)
    partial = fields.pop("partial_rotary_factor")
    half = int(shape["head_dim"] * partial) // 2  # (the rotary pairs the sections split)
    rope |= {
        "mrope_section": [half // 2, half // 4, half - half // 2 - half // 4],
        "partial_rotary_factor": partial,
    }
    if kind == "moe":
        shape.pop("intermediate_size")
    config_cls, model_cls = (
        (Qwen3_5TextConfig, Qwen3_5ForCausalLM)
        if kind == "dense"
        else (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM)
    )
    config = config_cls(
        vocab_size=vocab,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=vocab - 1,
        pad_token_id=None,
        **shape,
        **fields,
    )
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config)
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
            else:
                p.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = torch.randn(8, 8)  # Qwen3.5's MTP head: never loaded
    save_file(tensors, file, metadata={"format": "pt"})
    return path
