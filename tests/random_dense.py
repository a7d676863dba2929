"""Tiny random dense models saved as Hugging Face directories (`save_pretrained`), with the
byte-level tokenizer of tests/random_llama.py: Qwen2 (q/k/v biases, tied or untied embeddings),
Qwen3 (per-head q/k norms, a head_dim other than hidden / heads), Mistral (with or without a
sliding window) and Gemma 3 (Gemma's norms, local and global layers, two RoPE bases, a
query_pre_attn_scalar other than head_dim). Needs transformers (test-only).

Every matrix is drawn as tests/random_llama.py draws it (peaked, seed-stable distributions), and
so are the vectors Hugging Face initializes to constants (biases to zeros, norms to ones, Gemma's
(1 + w) norms to zeros): a bias or a norm weight our side dropped or misplaced then changes the
logits.
"""

from __future__ import annotations

import json
import os

from tests.random_llama import CHATML, _byte_tokenizer_json

STD = 0.06  # matrices, as tests/random_llama.py
BIAS_STD = 0.2  # q/k/v biases (real Qwen2 k biases are large)
NORM_STD = 0.2  # norm weights: 1 + N(0, NORM_STD)
GPU_HEAD_DIM = 64  # GPU tests: a head_dim the CUDA attention kernels take
# 2 layers, GQA 4/2, hidden 64 (head_dim 16 unless the config sets another).
TINY_DENSE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)
FAMILIES = ("qwen2", "qwen3", "mistral", "gemma3")
# Gemma 3's layers: one local (sliding window, local RoPE), then one global.
GEMMA3_LAYERS = ["sliding_attention", "full_attention"]


def _save(
    path: str, config_cls: str, model_cls: str, seed: int, norm_mean: float = 1.0, **fields
) -> str:
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    vocab = _byte_tokenizer_json(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}, f)
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    config = getattr(transformers, config_cls)(
        vocab_size=vocab,
        bos_token_id=None,
        eos_token_id=vocab - 1,  # <|im_end|>
        **(TINY_DENSE | {"rope_parameters": rope} | fields),
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, STD)
            elif name.endswith(".bias"):
                p.normal_(0.0, BIAS_STD)
            else:  # a norm's weight
                p.normal_(norm_mean, NORM_STD)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_random_qwen2(path: str, tie: bool = False, seed: int = 0, **fields) -> str:
    """A Qwen2 directory (q/k/v biases); `tie`: the LM head is the embedding matrix."""
    return _save(path, "Qwen2Config", "Qwen2ForCausalLM", seed, tie_word_embeddings=tie, **fields)


def make_random_qwen3(path: str, seed: int = 0, head_dim: int = 32, **fields) -> str:
    """A Qwen3 directory (q/k norms); head_dim 32 by default, twice hidden / heads."""
    fields = dict(tie_word_embeddings=False) | fields
    return _save(path, "Qwen3Config", "Qwen3ForCausalLM", seed, head_dim=head_dim, **fields)


def make_random_mistral(
    path: str, sliding_window: int | None = None, seed: int = 0, **fields
) -> str:
    """A Mistral directory; `sliding_window` as its config sets it (None: none)."""
    fields = dict(tie_word_embeddings=False) | fields
    return _save(
        path, "MistralConfig", "MistralForCausalLM", seed, sliding_window=sliding_window, **fields
    )


def make_random_gemma3(
    path: str,
    seed: int = 0,
    head_dim: int = 32,
    sliding_window: int = 512,
    rope_scaling: dict | None = None,
    **fields,
) -> str:
    """A Gemma3ForCausalLM directory: head_dim 32 (twice hidden / heads), query_pre_attn_scalar
    24 (not head_dim), GEMMA3_LAYERS with `sliding_window` (512: longer than any sequence of the
    tests), global RoPE base 50000 (`rope_scaling`: e.g. linear, on the global layers), local
    10000, tied embeddings."""
    full = {"rope_type": "default", "rope_theta": 50000.0} | (rope_scaling or {})
    local = {"rope_type": "default", "rope_theta": 10000.0}
    rope = {"full_attention": full, "sliding_attention": local}
    fields = (
        dict(
            head_dim=head_dim,
            sliding_window=sliding_window,
            layer_types=GEMMA3_LAYERS,
            query_pre_attn_scalar=24,
            rope_parameters=rope,
        )
        | fields
    )
    return _save(path, "Gemma3TextConfig", "Gemma3ForCausalLM", seed, norm_mean=0.0, **fields)


def make_random_dense(family: str, path: str, **kwargs) -> str:
    """One of FAMILIES, by name."""
    make = {
        "qwen2": make_random_qwen2,
        "qwen3": make_random_qwen3,
        "mistral": make_random_mistral,
        "gemma3": make_random_gemma3,
    }
    return make[family](path, **kwargs)
