"""A random-weight Llama saved as a Hugging Face directory, for tests and the GPU device.

The GGUF is too large to carry to the device, so GPU runs use a model built here from a config:
the shape of SmolLM2-135M (or any other), random weights, and a byte-level tokenizer (256 byte
tokens plus the chat specials) with a ChatML template. Needs transformers (test-only).
"""

from __future__ import annotations

import json
import os

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A tiny shape for CPU tests of the machinery (workers, engines): 2 layers, GQA 4/2.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
# The same on a GPU: the CUDA attention kernels take head_dim 64 or 128.
GPU_TINY_SHAPE = TINY_SHAPE | {"head_dim": 64}
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
)


def _byte_tokenizer_json(path: str) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from taipan.ops.tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    return tok.get_vocab_size()


def make_random_llama(path: str, shape: dict | None = None, seed: int = 0) -> str:
    """Write config.json, model.safetensors, tokenizer files into `path`; return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    vocab = _byte_tokenizer_json(path)
    eos = vocab - 1  # <|im_end|>
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}, f)
    config = LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        **(shape or SMOLLM2_SHAPE),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than the default init: peaked, seed-stable distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.06)
    model.save_pretrained(path, safe_serialization=True)
    return path
