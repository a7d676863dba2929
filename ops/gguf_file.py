"""A llama.cpp GGUF file -> (model, config, tokenizer): its hyper-parameters, its tensor names
mapped onto ours, and its tensors dequantized and un-permuted as `build_model` reads them.

GGUF tensors are dequantized to the model's dtype at load time (no quantized matmuls).
llama.cpp stores the rows of Q and K interleaved per head (pairs `(i, i + head_dim/2)` of
rotate-half RoPE made adjacent, for its interleaved RoPE); `_unpermute_rows` puts them back in
Hugging Face order. Under tensor parallelism a rank dequantizes only its rows of a tensor
(quantization blocks run along a row); a row-parallel matrix, split by columns, is dequantized
whole, then sliced. Only the `llama` architecture; RoPE scaling is refused.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

from taipan.ops.checkpoint import ModelLoadError, build_model
from taipan.ops.models.llama import LlamaConfig
from taipan.ops.parallel import TPGroup
from taipan.ops.sharding import Placement
from taipan.ops.tokenizer import Tokenizer

# GGUF tensor name -> our parameter name (`{n}` is the layer index).
_GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{n}.attn_norm.weight": "layers.{n}.input_layernorm.weight",
    "blk.{n}.ffn_norm.weight": "layers.{n}.post_attention_layernorm.weight",
    "blk.{n}.attn_q.weight": "layers.{n}.self_attn.q_proj.weight",
    "blk.{n}.attn_k.weight": "layers.{n}.self_attn.k_proj.weight",
    "blk.{n}.attn_v.weight": "layers.{n}.self_attn.v_proj.weight",
    "blk.{n}.attn_output.weight": "layers.{n}.self_attn.o_proj.weight",
    "blk.{n}.ffn_gate.weight": "layers.{n}.mlp.gate_proj.weight",
    "blk.{n}.ffn_up.weight": "layers.{n}.mlp.up_proj.weight",
    "blk.{n}.ffn_down.weight": "layers.{n}.mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def load_gguf(path: Path, dtype: torch.dtype, device, tp: TPGroup) -> tuple:
    """(model, config, tokenizer) of the GGUF file at `path`, this rank's shards only."""
    reader = _open(path)

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    tokenizer = Tokenizer.from_gguf_reader(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    config = _llama_config(field, tensors, tokenizer)
    if field("llama.rope.scaling.type") not in (None, "none") or "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path}: RoPE scaling (e.g. Llama 3.1's) is not supported yet")

    pieces = []
    for name, tensor in tensors.items():
        ours = _gguf_to_ours(name)
        if ours is None:
            raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a llama model")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # [out, in]
        read = functools.partial(_read_gguf, tensor, shape, config.head_dim)
        pieces.append((ours, shape, read))
    return build_model(path, config, pieces, dtype, device, tp), config, tokenizer


def _open(path: Path):
    """A `gguf.GGUFReader` of the file, or a ModelLoadError saying why not."""
    import gguf

    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF ({exc})") from exc


def _llama_config(field, tensors: dict, tokenizer: Tokenizer) -> LlamaConfig:
    """The LlamaConfig of the file's `llama.*` fields (`field(key, default)` reads one)."""
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


def _read_gguf(tensor, shape: tuple[int, ...], head_dim: int, p: Placement) -> torch.Tensor:
    """Dequantize this rank's slice of a GGUF tensor: only its rows (quantization blocks run
    along a row), or whole rows then the columns; Q and K rows back in Hugging Face order."""
    import gguf

    data, shape = tensor.data, list(shape)
    if p.dim == 0:  # whole heads / rows: llama.cpp's permutation stays within each head
        data, shape[0] = data[p.start : p.start + p.length], p.length
    # dequantize gives numpy float32 (float16 for F16 tensors) in row-major [out, in] order
    values = gguf.quants.dequantize(data, tensor.tensor_type)
    weight = torch.from_numpy(values.copy()).float().reshape(shape)
    if p.dim == 1:
        weight = p.take(weight)
    if tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
        weight = _unpermute_rows(weight, weight.shape[0] // head_dim)
    return weight


def _gguf_to_ours(name: str) -> str | None:
    layer = _LAYER.match(name)
    key = _LAYER.sub("blk.{n}.", name) if layer else name
    ours = _GGUF_NAMES.get(key)
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
