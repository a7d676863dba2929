"""A llama.cpp GGUF file -> (model, config, tokenizer): its hyper-parameters, its tensor names
mapped onto ours, and its tensors dequantized (and for Llama un-permuted) as `build_model` reads
them. Architectures `llama` and `gemma3` (text); RoPE scaling other than Gemma 3's linear one is
refused.

GGUF tensors are dequantized to the model's dtype at load time (no quantized matmuls).
llama.cpp stores the rows of Llama's Q and K interleaved per head (pairs `(i, i + head_dim/2)` of
rotate-half RoPE made adjacent, for its interleaved RoPE); `_unpermute_rows` puts them back in
Hugging Face order. Gemma 3's rows are Hugging Face's (llama.cpp rotates Gemma NeoX-style), but
its converter stores every norm weight plus one (its RMSNorm multiplies by the weight, Gemma's by
1 + weight): we subtract it again, as transformers' GGUF loader does. Under tensor parallelism a
rank dequantizes only its rows of a tensor (quantization blocks run along a row); a row-parallel
matrix, split by columns, is dequantized whole, then sliced.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from taipan.ops.checkpoint import ModelLoadError, build_model
from taipan.ops.gguf_reader import gguf_reader
from taipan.ops.models.gemma3 import Gemma3Config
from taipan.ops.models.llama import LlamaConfig
from taipan.ops.parallel import TPGroup
from taipan.ops.sharding import Placement
from taipan.ops.tokenizer import Tokenizer

# GGUF tensor name -> our parameter name (`{n}` is the layer index), the part every
# architecture shares.
_COMMON_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{n}.attn_norm.weight": "layers.{n}.input_layernorm.weight",
    "blk.{n}.attn_q.weight": "layers.{n}.self_attn.q_proj.weight",
    "blk.{n}.attn_k.weight": "layers.{n}.self_attn.k_proj.weight",
    "blk.{n}.attn_v.weight": "layers.{n}.self_attn.v_proj.weight",
    "blk.{n}.attn_output.weight": "layers.{n}.self_attn.o_proj.weight",
    "blk.{n}.ffn_gate.weight": "layers.{n}.mlp.gate_proj.weight",
    "blk.{n}.ffn_up.weight": "layers.{n}.mlp.up_proj.weight",
    "blk.{n}.ffn_down.weight": "layers.{n}.mlp.down_proj.weight",
}
_LLAMA_NAMES = _COMMON_NAMES | {
    "blk.{n}.ffn_norm.weight": "layers.{n}.post_attention_layernorm.weight",
}
_GEMMA3_NAMES = _COMMON_NAMES | {
    "blk.{n}.attn_q_norm.weight": "layers.{n}.self_attn.q_norm.weight",
    "blk.{n}.attn_k_norm.weight": "layers.{n}.self_attn.k_norm.weight",
    "blk.{n}.post_attention_norm.weight": "layers.{n}.post_attention_layernorm.weight",
    "blk.{n}.ffn_norm.weight": "layers.{n}.pre_feedforward_layernorm.weight",
    "blk.{n}.post_ffw_norm.weight": "layers.{n}.post_feedforward_layernorm.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class _Arch:
    """What one GGUF architecture needs: its tensor names, its config, whether Q/K rows are
    permuted, and what llama.cpp's converter added to its norm weights."""

    names: dict[str, str]
    config: object  # (field, tensors, tokenizer, path) -> our config
    permuted_qk: bool
    norm_shift: float


def load_gguf(path: Path, dtype: torch.dtype, device, tp: TPGroup) -> tuple:
    """(model, config, tokenizer) of the GGUF file at `path`, this rank's shards only."""
    reader = _open(path)

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    name = field("general.architecture")
    arch = _ARCHS.get(name)
    if arch is None:
        raise ModelLoadError(
            f"{path}: GGUF architecture {name!r} is not supported (only {', '.join(_ARCHS)})"
        )
    tokenizer = Tokenizer.from_gguf_reader(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    config = arch.config(field, tensors, tokenizer, path)

    pieces = []
    for tensor_name, tensor in tensors.items():
        ours = _gguf_to_ours(tensor_name, arch.names)
        if ours is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor_name!r} for a {name} model")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # [out, in]
        head_dim = config.head_dim if arch.permuted_qk else None
        read = functools.partial(_read_gguf, tensor, shape, head_dim, arch.norm_shift)
        pieces.append((ours, shape, read))
    return build_model(path, config, pieces, dtype, device, tp), config, tokenizer


def _open(path: Path):
    """A `gguf.GGUFReader` of the file (`gguf_reader`), or a ModelLoadError saying why not."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return gguf_reader()(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF ({exc})") from exc


def _llama_config(field, tensors: dict, tokenizer: Tokenizer, path: Path) -> LlamaConfig:
    """The LlamaConfig of the file's `llama.*` fields (`field(key, default)` reads one)."""
    if field("llama.rope.scaling.type") not in (None, "none") or "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path}: RoPE scaling (e.g. Llama 3.1's) is not supported yet")
    hidden = field("llama.embedding_length")
    num_heads = field("llama.attention.head_count")
    return LlamaConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=field("llama.feed_forward_length"),
        num_layers=field("llama.block_count"),
        num_heads=num_heads,
        num_kv_heads=field("llama.attention.head_count_kv", num_heads),
        head_dim=field("llama.attention.key_length", hidden // num_heads),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=field("llama.context_length", 4096),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )


def _gemma3_config(field, tensors: dict, tokenizer: Tokenizer, path: Path) -> Gemma3Config:
    """The Gemma3Config of the file's `gemma3.*` fields, with what llama.cpp fixes for the
    architecture rather than stores: every 6th layer global (unless the file says otherwise),
    the local layers' RoPE base 10000, and a softmax scale of head_dim ** -0.5 except for the
    27B (62 layers), whose query_pre_attn_scalar is hidden / heads."""
    a = "gemma3."
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if field(a + key):
            raise ModelLoadError(f"{path}: {a}{key} is not supported for Gemma 3")
    scaling, factor = field(a + "rope.scaling.type"), 1.0
    if scaling == "linear":
        factor = float(field(a + "rope.scaling.factor"))
    elif scaling not in (None, "none") or "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path}: RoPE scaling {scaling!r} is not supported for Gemma 3")
    hidden, num_heads = field(a + "embedding_length"), field(a + "attention.head_count")
    num_layers, head_dim = field(a + "block_count"), field(a + "attention.key_length", 256)
    pattern = field(a + "attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: true = sliding window
        local = tuple(i for i, windowed in enumerate(pattern) if windowed)
    else:
        local = tuple(i for i in range(num_layers) if (i + 1) % int(pattern))
    eos = list(tokenizer.eos_token_ids)
    for extra in (field("tokenizer.ggml.eot_token_id"), tokenizer.token_to_id("<end_of_turn>")):
        if extra is not None and extra not in eos:  # llama.cpp ends a turn there too
            eos.append(int(extra))
    return Gemma3Config(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=field(a + "feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=field(a + "attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(field(a + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(a + "rope.freq_base", 1_000_000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=field(a + "context_length", 131_072),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(eos),
        sliding_window=field(a + "attention.sliding_window"),
        sliding_layers=local,
        rope_local_theta=float(field(a + "rope.freq_base_swa", 10_000.0)),
        rope_scaling_factor=factor,
        query_pre_attn_scalar=float(hidden // num_heads if num_layers == 62 else head_dim),
    )


_ARCHS = {
    "llama": _Arch(_LLAMA_NAMES, _llama_config, permuted_qk=True, norm_shift=0.0),
    "gemma3": _Arch(_GEMMA3_NAMES, _gemma3_config, permuted_qk=False, norm_shift=1.0),
}


def _read_gguf(
    tensor, shape: tuple[int, ...], head_dim: int | None, norm_shift: float, p: Placement
) -> torch.Tensor:
    """Dequantize this rank's slice of a GGUF tensor: only its rows (quantization blocks run
    along a row), or whole rows then the columns; Q and K rows back in Hugging Face order
    (`head_dim` None: not permuted); `norm_shift` taken off every norm weight (in fp32)."""
    import gguf

    data, shape = tensor.data, list(shape)
    if p.dim == 0:  # whole heads / rows: llama.cpp's permutation stays within each head
        data, shape[0] = data[p.start : p.start + p.length], p.length
    # float32 (float16 for F16 tensors) in row-major [out, in] order; a plain array, not the
    # reader's memmap (numpy's memmap hooks cost more than the arithmetic)
    data = np.ascontiguousarray(data)
    fast = _DEQUANTIZE.get(tensor.tensor_type.name)
    if fast is not None:
        values = fast(data)  # (a new array)
    else:
        values = np.array(gguf.quants.dequantize(data, tensor.tensor_type), copy=True)
    weight = torch.from_numpy(values).float().reshape(shape)
    if p.dim == 1:
        weight = p.take(weight)
    if head_dim is not None and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
        weight = _unpermute_rows(weight, weight.shape[0] // head_dim)
    if norm_shift and tensor.name.endswith("norm.weight"):
        weight = weight - norm_shift
    return weight


def _dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_1, whole blocks at once: per 32 weights a float16 scale d and minimum m,
    then 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31 (w = q * d + m).
    The gguf package's loop over row groups took ~3 s of SmolLM2's load."""
    blocks = data.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    out = np.empty((len(blocks), 32), dtype=np.float32)  # (each product rounded, then the sum)
    np.multiply(qs & 0x0F, d, out=out[:, :16], casting="unsafe")
    np.multiply(qs >> 4, d, out=out[:, 16:], casting="unsafe")
    out += m
    return out.reshape(-1)


def _dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """llama.cpp's Q8_0: per 32 weights a float16 scale d, then 32 int8 (w = q * d)."""
    blocks = data.reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    out = np.empty((len(blocks), 32), dtype=np.float32)
    np.multiply(blocks[:, 2:].view(np.int8), d, out=out, casting="unsafe")
    return out.reshape(-1)


# Quantization types dequantized here (the others by the gguf package).
_DEQUANTIZE = {"Q4_1": _dequantize_q4_1, "Q8_0": _dequantize_q8_0}


def _gguf_to_ours(name: str, names: dict[str, str]) -> str | None:
    layer = _LAYER.match(name)
    key = _LAYER.sub("blk.{n}.", name) if layer else name
    ours = names.get(key)
    return None if ours is None else ours.format(n=layer.group(1) if layer else "")


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`).

    Within each head llama.cpp stores row `2*i + j` what Hugging Face stores at `j*half + i`
    (i < half = head_dim/2, j in {0, 1}), so reshape rows to [heads, half, 2] and swap the last two.
    weight: [num_heads * head_dim, in_features].
    """
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.view(num_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)
