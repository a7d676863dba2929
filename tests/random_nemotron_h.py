"""A random-weight NemotronH hybrid saved as a Hugging Face directory (`save_pretrained`: its
tensors carry `backbone.*` names), with the byte-level tokenizer of tests/random_llama.py. Needs
transformers (test-only).

dt_bias is drawn so that softplus(dt + dt_bias) stays above time_step_min for these weights:
Hugging Face clamps prefill dt there and decode dt not at all, so only then is its own output the
same whichever way a token is computed (ours clamps both ways alike: ops/mamba.py).
"""

from __future__ import annotations

import json
import os

from tests.random_llama import CHATML, _byte_tokenizer_json

# A tiny shape for CPU tests: chunk 16 (prompts shorter than, equal to and several times it).
TINY_HYBRID = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=16,
)
PATTERNS = ("M-*-M-", "M-M-*-M-M-*-", "*-M-M-")
# The shape of NVIDIA's Nemotron-H-8B (52 layers: 24 Mamba2, 4 attention, 24 MLP) with the
# byte-level tokenizer's small vocabulary: about 7B parameters. For `taipan bench` on the GPU.
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H_8B = dict(
    hidden_size=4096,
    intermediate_size=21504,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    mamba_num_heads=128,
    mamba_head_dim=64,
    n_groups=8,
    ssm_state_size=128,
    conv_kernel=4,
    chunk_size=128,
)


def make_random_nemotron_h(
    path: str,
    pattern: str = "M-*-M-",
    shape: dict | None = None,
    seed: int = 0,
    std=0.06,
    device: str = "cpu",
    dtype=None,
) -> str:
    """Write config.json, model.safetensors and tokenizer files into `path`; return it. The
    weights are drawn on `device` (a large shape: "cuda") and saved in `dtype` (default fp32)."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    os.makedirs(path, exist_ok=True)
    vocab = _byte_tokenizer_json(path)
    eos = vocab - 1  # <|im_end|>
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}, f)
    config = NemotronHConfig(
        vocab_size=vocab,
        hybrid_override_pattern=pattern,
        max_position_embeddings=4096,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
        **(shape or TINY_HYBRID),
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = NemotronHForCausalLM(config)
    with torch.no_grad():  # larger than the default init: peaked, seed-stable distributions
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 0.5)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("conv1d.bias") or name.endswith(".D"):
                p.normal_(0.0, 0.5)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.3)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path
