"""`random:<shape>` (RANDOM_SHAPES) -> (model, config, tokenizer) from a config alone, no disk:
a model's real shape without its checkpoint, for benchmarks and tests. A shape is Llama's unless
its `family` says otherwise (`FAMILIES`: Mistral's sliding window, Qwen2's qkv biases, Gemma 3's
layers, Qwen3-Next's Gated-DeltaNet hybrid).

Owns the shapes, the seeded random weights made on the device (`random_state`, which the
benchmark's Hugging Face copy reuses, so both sides hold the same weights) and a byte-level
tokenizer with a ChatML template. Weights go through ops/checkpoint.py like a checkpoint's, so a
tensor-parallel rank keeps its shards only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from taipan.ops.checkpoint import ModelLoadError, Piece, build_model
from taipan.ops.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from taipan.ops.models.llama import LlamaConfig, LlamaForCausalLM
from taipan.ops.models.mistral import MistralConfig, MistralForCausalLM
from taipan.ops.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from taipan.ops.models.qwen3_next import FULL, LINEAR, Qwen3NextConfig, Qwen3NextForCausalLM
from taipan.ops.moe import MoEConfig
from taipan.ops.parallel import SINGLE, TPGroup
from taipan.ops.sharding import split_fused
from taipan.ops.tokenizer import Tokenizer

RANDOM_PREFIX = "random:"
RANDOM_SEED = 0
RANDOM_STD = 0.02  # of every matrix (embeddings and projections); norms are the identity
_RANDOM_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3's vocabulary size (so the LM head costs what it really costs) and RoPE base. Its
# checkpoints scale RoPE ("llama3" rope type, ops/rope_scaling.py): these shapes use plain RoPE,
# which costs the same (scaling only changes the table built at load). max_position_embeddings
# is the real 131072 (the fp32 cos/sin cache is then 131072 x head_dim x 4 bytes: 32 MiB for 1B,
# 64 MiB for 8B).
_LLAMA3 = dict(
    vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072
)
# What every Gemma 3 size shares: head_dim 256 (not hidden / heads), its norms' eps, the global
# layers' RoPE base 1e6 and the local ones' 1e4, queries scaled by 256^-0.5, tied embeddings.
_GEMMA3 = dict(
    family="gemma3",
    head_dim=256,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rope_local_theta=10000.0,
    query_pre_attn_scalar=256.0,
    tie_word_embeddings=True,
)


def _gemma3_local(num_layers: int) -> tuple[int, ...]:
    """Gemma 3's local (sliding-window) layers: all but every sixth."""
    return tuple(i for i in range(num_layers) if (i + 1) % 6)


RANDOM_SHAPES = {
    # Llama-3.2-1B: tied embeddings.
    "llama-1b": dict(
        _LLAMA3,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    # Llama-3.1-8B: untied LM head.
    "llama-8b": dict(
        _LLAMA3,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    # CPU tests of the machinery: 2 layers, GQA 4/2.
    "tiny": dict(
        _LLAMA3,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    # Gemma-3-1B (google/gemma-3-1b-pt's config.json): head_dim 256 (not hidden / heads), one kv
    # head, a 262,144-token vocabulary, tied embeddings; every 6th layer global (the whole
    # context, RoPE base 1e6), the others local (a 512-key window, base 1e4).
    "gemma3-1b": dict(
        _GEMMA3,
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        sliding_window=512,
        sliding_layers=_gemma3_local(26),
        max_position_embeddings=32768,
    ),
    # Gemma-3-4B and -12B (the text part of google/gemma-3-4b-pt's and -12b-pt's config.json):
    # the same layer pattern at widths where a layer's weights outweigh its launches (issue 27's
    # decode row). Their checkpoints scale the global layers' RoPE linearly (factor 8), which
    # changes only the table built at load: plain RoPE here costs the same.
    "gemma3-4b": dict(
        _GEMMA3,
        vocab_size=262208,
        hidden_size=2560,
        intermediate_size=10240,
        num_layers=34,
        num_heads=8,
        num_kv_heads=4,
        sliding_window=1024,
        sliding_layers=_gemma3_local(34),
        max_position_embeddings=131072,
    ),
    "gemma3-12b": dict(
        _GEMMA3,
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_layers=48,
        num_heads=16,
        num_kv_heads=8,
        sliding_window=1024,
        sliding_layers=_gemma3_local(48),
        max_position_embeddings=131072,
    ),
    # Mistral-7B-v0.1: Llama's layers, every one with a 4096-key window (so the engine frees
    # the KV blocks behind it: actors/gpu/window.py `kv_window`), untied LM head.
    "mistral-7b-window": dict(
        family="mistral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=4096,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    # Qwen2.5-7B (Qwen/Qwen2.5-7B-Instruct's config.json): qkv biases, 28 heads over 4 kv heads,
    # a 152,064-token vocabulary, untied LM head; no window (use_sliding_window false).
    "qwen2.5-7b": dict(
        family="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    # Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct's config.json) at 8 of its 48 layers:
    # its pattern (three Gated-DeltaNet layers, then one gated attention layer) twice; 512
    # experts (top 10) and a shared expert in every layer, partial RoPE over 64 of 256 channels.
    "qwen3-next-80b-a3b-8l": dict(
        family="qwen3_next",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2,
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel=4,
        rms_norm_eps=1e-6,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        moe=MoEConfig(
            num_experts=512,
            top_k=10,
            intermediate_size=512,
            activation="swiglu",
            scoring="softmax",
            renormalize=True,
        ),
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
        max_position_embeddings=262144,
    ),
}
# A shape's `family` (default "llama") -> its config and model classes.
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "gemma3": (Gemma3Config, Gemma3ForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
}


def random_config(spec: str) -> LlamaConfig:
    """The config of `random:<shape>` (its family's: LlamaConfig or a subclass); EOS is the
    tokenizer's <|im_end|> (id 258)."""
    shape = spec.removeprefix(RANDOM_PREFIX)
    if shape not in RANDOM_SHAPES:
        raise ModelLoadError(
            f"{spec}: unknown random shape {shape!r} (known: {', '.join(RANDOM_SHAPES)})"
        )
    fields = dict(RANDOM_SHAPES[shape])
    config_cls, _ = FAMILIES[fields.pop("family", "llama")]
    eos = 256 + _RANDOM_SPECIALS.index("<|im_end|>")
    return config_cls(**fields, bos_token_id=None, eos_token_ids=(eos,))


def random_model_class(config: LlamaConfig) -> type:
    """The model class of a `random_config` (LlamaForCausalLM or its family's)."""
    return next(model for cfg, model in FAMILIES.values() if type(config) is cfg)


def random_state(
    config: LlamaConfig, dtype: torch.dtype, device, seed: int = RANDOM_SEED
) -> dict[str, torch.Tensor]:
    """Seeded random weights in our parameter names (fused qkv_proj / gate_up_proj), made on
    `device` in `dtype`: the same (config, dtype, device type, seed) gives the same tensors, in
    any process. Matrices are normal(0, RANDOM_STD); norms are the identity: weights 1, Gemma's
    and Qwen3-Next's (1 + w) norms 0 (its GDN layers' gated norm is a plain weight: 1)."""
    return dict(_random_tensors(config, dtype, device, seed))


def _random_tensors(
    config: LlamaConfig, dtype: torch.dtype, device, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """`random_state`'s tensors one at a time (a sharded load keeps one whole tensor alive)."""
    with torch.device("meta"):
        model = random_model_class(config)(config)
        shapes = {name: t.shape for name, t in model.state_dict().items()}
    norm_weight = 0.0 if isinstance(config, (Gemma3Config, Qwen3NextConfig)) else 1.0
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes.items():  # state_dict order: the same on every call
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("linear_attn.norm.weight"):
            yield name, t.fill_(1.0)
        elif name.endswith("norm.weight"):
            yield name, t.fill_(norm_weight)
        else:
            yield name, t.normal_(0.0, RANDOM_STD, generator=generator)


def random_tokenizer() -> Tokenizer:
    """Byte-level: the 256 byte tokens, then <|endoftext|>, <|im_start|>, <|im_end|>, and a ChatML
    template. Ids from 259 up to the model's vocabulary have no token: decoding skips them (the
    `tokenizers` backend drops unknown ids), so a random model's output decodes to little text
    but never fails."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    from taipan.ops.tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    backend = BackendTokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(_RANDOM_SPECIALS))
    eos = backend.token_to_id("<|im_end|>")
    return Tokenizer(
        backend, chat_template=_CHATML, bos_token_id=None, eos_token_ids=(eos,), add_bos=False
    )


def load_random_model(spec: str, *, dtype: torch.dtype, device, tp: TPGroup = SINGLE) -> tuple:
    """`random:<shape>` -> (model, config, tokenizer), weights from `random_state` (each
    tensor made whole, as the seed's stream gives it, then this rank's slice kept)."""
    config = random_config(spec)

    def pieces() -> Iterator[Piece]:
        for param, tensor in _random_tensors(config, dtype, device, RANDOM_SEED):
            for name, part in split_fused(param, tensor, config):
                yield name, tuple(part.shape), lambda p, part=part: p.take(part)

    model = build_model(Path(spec), config, pieces(), dtype, device, tp)
    return model, config, random_tokenizer()
