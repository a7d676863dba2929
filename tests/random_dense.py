"""Tiny random dense models of the Llama skeleton saved as Hugging Face directories
(`save_pretrained`), with the byte-level tokenizer of tests/random_llama.py: Qwen2 (q/k/v
biases, tied or untied embeddings), Qwen3 (per-head q/k norms, a head_dim other than hidden /
heads) and Mistral (with or without a sliding window). Needs transformers (test-only).

Every matrix is drawn as tests/random_llama.py draws it (peaked, seed-stable distributions), and
so are the vectors Hugging Face initializes to constants (biases to zeros, norms to ones): a
bias or a norm weight our side dropped or misplaced then changes the logits.
"""

from __future__ import annotations

import json
import os

from tests.random_llama import CHATML, _byte_tokenizer_json

STD = 0.06  # matrices, as tests/random_llama.py
BIAS_STD = 0.2  # q/k/v biases (real Qwen2 k biases are large)
NORM_STD = 0.2  # norm weights: 1 + N(0, NORM_STD)
GPU_HEAD_DIM = 64  # GPU tests: the CUDA attention kernels take head_dim 64 or 128
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
FAMILIES = ("qwen2", "qwen3", "mistral")


def _save(path: str, config_cls: str, model_cls: str, seed: int, **fields) -> str:
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    vocab = _byte_tokenizer_json(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}, f)
    config = getattr(transformers, config_cls)(
        vocab_size=vocab,
        bos_token_id=None,
        eos_token_id=vocab - 1,  # <|im_end|>
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        **(TINY_DENSE | fields),
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
                p.normal_(1.0, NORM_STD)
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


def make_random_dense(family: str, path: str, **kwargs) -> str:
    """One of FAMILIES, by name."""
    make = {"qwen2": make_random_qwen2, "qwen3": make_random_qwen3, "mistral": make_random_mistral}
    return make[family](path, **kwargs)
