"""Model loading: a GGUF file, a Hugging Face directory or a random-weight shape -> (model,
config, tokenizer). Hugging Face directories: Llama, NemotronH (with or without MoE layers) and
Qwen3-MoE.

Owns reading hyper-parameters, mapping checkpoint tensor names onto our modules, undoing
llama.cpp's layout changes, and turning every failure into a `ModelLoadError` that names the path
and the cause. Does not allocate the KV cache or pick a block count (the GPU actor does).

GGUF tensors are dequantized to `dtype` at load time (no quantized matmuls). llama.cpp stores
the rows of Q and K interleaved per head (pairs `(i, i + head_dim/2)` of rotate-half RoPE made
adjacent, for its interleaved RoPE); `_unpermute_rows` puts them back in Hugging Face order.

Tensor parallelism (`tp`, ops/parallel.py): every rank builds the model's module tree with its
shards and reads only its slices of each checkpoint tensor (ops/sharding.py `placement`): row
ranges of a safetensors tensor, whole rows of a GGUF tensor before they are dequantized (a
row-parallel matrix, split by columns, is dequantized whole, then sliced); a MoE layer's
experts split along their intermediate size (ops/moe.py), a Mamba mixer by heads and groups
(ops/mamba.py). Every model family splits.

Mixture-of-experts checkpoints name each expert's matrices (`mlp.experts.3.up_proj.weight`, what
transformers' `save_pretrained` writes) or stack them (`mlp.experts.gate_up_proj` [E, 2I, H], what
its modules hold); both are stacked at load into our `w1` / `w2` (ops/moe.py). `expert_range`
loads only some experts (an expert-parallel rank): the others' tensors are never read.

Weight updates in place (the gpu worker's update_weights) are ops/weight_updates.py's.

`random:<shape>` (RANDOM_SHAPES) builds a model from a config alone, no disk: seeded random
weights made on the device (`random_state`, which the benchmark's Hugging Face copy reuses, so
both sides hold the same weights) and a byte-level tokenizer.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from taipan.ops.models.llama import LlamaConfig, LlamaForCausalLM
from taipan.ops.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM
from taipan.ops.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from taipan.ops.moe import ExpertRange, MoEConfig
from taipan.ops.parallel import SINGLE, TPError, TPGroup
from taipan.ops.sharding import (
    EXPERT_NAME,
    STACKED_EXPERTS_NAME,
    Placement,
    checkpoint_names,
    placement,
    placements,
    split_fused,
    with_experts,
)
from taipan.ops.tokenizer import Tokenizer, TokenizerError

# One checkpoint tensor, not read yet: (name without `model.`, its whole shape, a reader of the
# slice a Placement names).
Piece = tuple[str, tuple[int, ...], Callable[[Placement], torch.Tensor]]

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


class ModelLoadError(Exception):
    """The checkpoint at a path cannot be loaded; the message says which path and why."""


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    expert_range: tuple[int, int] | ExpertRange | None = None,
    tp: TPGroup = SINGLE,
) -> tuple:
    """Load a `.gguf` file or a Hugging Face directory, weights in `dtype` on `device`:
    (model, config, tokenizer); with `tp`, this rank's shards only (the config is the whole
    model's).

    A directory without config.json but with exactly one .gguf file loads that file;
    `random:<shape>` builds a random-weight model of that shape (`load_random_model`).
    `expert_range` (start, count): only those experts of every MoE layer (default: all); a
    model without experts refuses one.
    """
    if str(path).startswith(RANDOM_PREFIX):
        _no_experts(path, expert_range)
        return load_random_model(str(path), dtype=dtype, device=device, tp=tp)
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(
                f"{path}: not a Hugging Face model directory (no config.json) and holds "
                f"{len(ggufs)} .gguf files; pass the model file itself"
            )
        path = ggufs[0]
    try:
        if path.is_dir():
            return _load_hf_dir(path, dtype, device, expert_range, tp)
        _no_experts(path, expert_range)
        return _load_gguf(path, dtype, device, tp)
    except TokenizerError as exc:  # its message already names the file
        raise ModelLoadError(str(exc)) from exc


def _no_experts(path, expert_range) -> None:
    if expert_range is not None:
        raise ModelLoadError(f"{path}: expert_range {expert_range!r}: the model has no experts")


# ---- GGUF ---------------------------------------------------------------------------------------


def _load_gguf(path: Path, dtype: torch.dtype, device, tp: TPGroup) -> tuple:
    import gguf

    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF ({exc})") from exc

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
    hidden = field("llama.embedding_length")
    num_heads = field("llama.attention.head_count")
    config = LlamaConfig(
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
    return _build(path, config, pieces, dtype, device, tp), config, tokenizer


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


# ---- Hugging Face directory ---------------------------------------------------------------------


def _load_hf_dir(path: Path, dtype: torch.dtype, device, expert_range, tp: TPGroup) -> tuple:
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json: cannot read ({exc})") from exc
    family = _check_hf_architecture(path, hf)
    tokenizer = Tokenizer.from_hf_dir(path)
    config = _HF_CONFIGS[family](path, hf, tokenizer)
    moe = getattr(config, "moe", None)
    if moe is None:
        _no_experts(path, expert_range)
        experts = None
    else:
        try:
            experts = ExpertRange.of(expert_range, moe.num_experts)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    with contextlib.ExitStack() as files_open:
        pieces = _safetensors_pieces(files, files_open, config.tie_word_embeddings)
        if experts is not None:
            pieces = _expert_pieces(path, config, experts, pieces, tp)
        model = _build(path, config, pieces, dtype, device, tp, experts)
    return model, config, tokenizer


def _safetensors_pieces(files: list[Path], files_open, tied: bool) -> Iterator[Piece]:
    """Every tensor of the files, not read yet (a piece reads its slice through the file's
    memory map)."""
    from safetensors import safe_open

    for file in files:
        try:
            f = files_open.enter_context(safe_open(str(file), framework="pt", device="cpu"))
        except Exception as exc:  # safetensors raises its own untyped errors
            raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from exc
        for name in f.keys():
            ours = name.removeprefix("model.").removeprefix("backbone.")
            if ours.endswith("rotary_emb.inv_freq") or ours.startswith("mtp."):
                # A buffer older checkpoints saved (recomputed from rope_theta); NemotronH's
                # multi-token-prediction head (Hugging Face ignores it too).
                continue
            if tied and ours == "lm_head.weight":
                continue  # the embedding is the LM head
            tensor = f.get_slice(name)
            yield ours, tuple(tensor.get_shape()), functools.partial(_read_slice, file, tensor)


def _read_slice(file: Path, tensor, p: Placement) -> torch.Tensor:
    try:
        return p.take(tensor)
    except Exception as exc:  # safetensors raises its own untyped errors
        raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from exc


# Kept in fp32 whatever the model dtype (as Hugging Face keeps them): a bf16 correction bias
# would change which experts are chosen.
_FP32_TENSORS = ("e_score_correction_bias",)


def _param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(_FP32_TENSORS) else dtype


def _expert_pieces(
    path: Path, config, experts: ExpertRange, pieces: Iterator[Piece], tp: TPGroup
) -> Iterator[Piece]:
    """The pieces with each MoE block's expert tensors replaced by two pieces, our stacked
    `w1` [E_local, N, H] (SwiGLU: gate rows, then up rows; ReLU²: up) and `w2` [E_local, H, I]
    of the local experts, from per-expert or stacked checkpoint tensors; an expert outside
    `experts` is never read, nor (under `tp`) another rank's share of an expert's intermediate
    size. Checked in full before the first piece is handed on."""
    total = config.moe.num_experts
    others, parts = [], {}  # parts[(prefix, matrix, local expert or None: stacked)] = piece
    for piece in pieces:
        name, shape, _ = piece
        one, stacked = EXPERT_NAME.match(name), STACKED_EXPERTS_NAME.match(name)
        if one is not None:
            expert = int(one.group(2))
            if expert >= total:
                raise ModelLoadError(f"{path}: {name}: expert {expert}, but the config has {total}")
            if expert in experts:
                parts[(one.group(1), one.group(3), expert - experts.start)] = piece
        elif stacked is not None:
            if shape[0] != total:
                raise ModelLoadError(
                    f"{path}: {name} stacks {shape[0]} experts, the config has {total}"
                )
            parts[(stacked.group(1), stacked.group(2), None)] = piece
        else:
            others.append(piece)
    return iter(others + _stacked_expert_pieces(path, config, experts, parts, tp))


def _moe_prefixes(config) -> list[str]:
    """The module prefix of every MoE block of the model (`layers.3.mlp`, `layers.1.mixer`)."""
    if isinstance(config, Qwen3MoeConfig):
        return [f"layers.{i}.mlp" for i in range(config.num_layers) if config.is_moe_layer(i)]
    return [f"layers.{i}.mixer" for i, kind in enumerate(config.pattern) if kind == "E"]


def _stacked_expert_pieces(
    path: Path, config, experts: ExpertRange, parts: dict, tp: TPGroup
) -> list[Piece]:
    """Per MoE block, the `w1` and `w2` pieces of `_expert_pieces`, whole shapes in the layout of
    a stacked checkpoint tensor (so `placement` splits them alike). Their readers, when `_build`
    reads them, take the local experts' slices of a stacked tensor, or stack this rank's slices
    (`placement` of each per-expert tensor) of the local experts' tensors."""

    def part(piece: Piece) -> torch.Tensor:
        return piece[2](placement(piece[0], config, tp))

    swiglu = config.moe.activation == "swiglu"
    w1_parts = ("gate", "up") if swiglu else ("up",)
    w1_stacked = "gate_up" if swiglu else "up"
    prefixes = _moe_prefixes(config)
    stray = sorted({key[0] for key in parts} - set(prefixes))
    if stray:
        raise ModelLoadError(
            f"{path}: expert tensors for {stray[:3]}, which the config does not make MoE layers"
        )
    out: list[Piece] = []
    for prefix in prefixes:
        mine = {key[1:]: piece for key, piece in parts.items() if key[0] == prefix}
        stacked = {matrix for matrix, expert in mine if expert is None}
        if stacked:
            want = {w1_stacked, "down"}
            if stacked != want or len(mine) != len(want):
                raise ModelLoadError(
                    f"{path}: {prefix}.experts: expected stacked {sorted(want)} and nothing "
                    f"per expert, found {sorted(f'{m}:{e}' for m, e in mine)[:6]}"
                )
            for param, piece in (("w1", mine[w1_stacked, None]), ("w2", mine["down", None])):
                shape = (experts.count, *piece[1][1:])
                read = functools.partial(_read_experts, piece[2], experts)
                out.append((f"{prefix}.{param}", shape, read))
            continue
        for e in range(experts.count):
            for matrix in (*w1_parts, "down"):
                if (matrix, e) not in mine:
                    raise ModelLoadError(
                        f"{path}: no expert tensors for {prefix}.experts.{experts.start + e}."
                        f"{matrix}_proj.weight (a {config.moe.activation} expert)"
                    )
        w1 = [[mine.pop((m, e)) for m in w1_parts] for e in range(experts.count)]
        w2 = [mine.pop(("down", e)) for e in range(experts.count)]
        if mine:
            raise ModelLoadError(
                f"{path}: unexpected expert tensors in {prefix}.experts: "
                f"{sorted(f'{m}_proj' for m, _ in mine)[:4]} ({config.moe.activation} experts)"
            )
        rows = sum(p[1][0] for p in w1[0])
        out.append(
            (
                f"{prefix}.w1",
                (experts.count, rows, *w1[0][0][1][1:]),
                lambda p, w1=w1: torch.stack([torch.cat([part(x) for x in e]) for e in w1]),
            )
        )
        out.append(
            (
                f"{prefix}.w2",
                (experts.count, *w2[0][1]),
                lambda p, w2=w2: torch.stack([part(x) for x in w2]),
            )
        )
    return out


def _read_experts(read, experts: ExpertRange, p: Placement) -> torch.Tensor:
    """A stacked [E, ...] checkpoint tensor's slice `p` of the experts in `experts` only."""
    return read(with_experts(p, experts.start, experts.count))


_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "NemotronHForCausalLM": "nemotron_h",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def _check_hf_architecture(path: Path, hf: dict) -> str:
    """The model family of a Hugging Face config: "llama", "nemotron_h" or "qwen3_moe" (the
    launcher's torch-free runtime/models.has_mamba_layers tells a hybrid the same way)."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    if hf.get("model_type") in _ARCHITECTURES.values():
        return hf["model_type"]
    raise ModelLoadError(
        f"{path}: architecture {archs or hf.get('model_type')!r} is not supported "
        f"(supported: {', '.join(_ARCHITECTURES)})"
    )


def _eos_ids(hf: dict, tokenizer: Tokenizer) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    eos_ids = list(tokenizer.eos_token_ids)
    for token_id in eos if isinstance(eos, list) else [eos]:
        if isinstance(token_id, int) and token_id not in eos_ids:
            eos_ids.append(token_id)
    return tuple(eos_ids)


# Hugging Face's layer type names (and their legacy spellings) -> our pattern characters.
_HF_LAYER_TYPES = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}


def _nemotron_h_pattern(path: Path, hf: dict) -> str:
    pattern = hf.get("hybrid_override_pattern")
    if pattern is None:
        types = hf.get("layers_block_type") or hf.get("layer_types")
        if not isinstance(types, list):
            raise ModelLoadError(
                f"{path}/config.json: no hybrid_override_pattern or layers_block_type"
            )
        unknown = sorted({t for t in types if t not in _HF_LAYER_TYPES})
        if unknown:
            raise ModelLoadError(f"{path}/config.json: unknown layer types {unknown}")
        pattern = "".join(_HF_LAYER_TYPES[t] for t in types)
    return pattern


def _json_float(value) -> float:
    """A float from config.json, where transformers writes infinity as {"__float__": ...}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _hf_nemotron_h_config(path: Path, hf: dict, tokenizer: Tokenizer) -> NemotronHConfig:
    def pick(name: str, *aliases: str, default=None):
        for key in (name, *aliases):
            if key in hf:
                return hf[key]
        if default is None:
            raise KeyError(name)
        return default

    pattern = _nemotron_h_pattern(path, hf)
    unsupported = {
        "residual_in_fp32": hf.get("residual_in_fp32", False),
        "attention_bias": hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
        "sliding_window": hf.get("sliding_window") is not None,
    }
    for flag, on in unsupported.items():
        if on:
            raise ModelLoadError(f"{path}: {flag} is not supported for NemotronH")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if hf.get(key, want) != want:
            raise ModelLoadError(f"{path}: {key} {hf[key]!r} is not supported (only {want!r})")
    try:
        num_heads = hf["num_attention_heads"]
        limit = pick("time_step_limit", "mamba_dt_limit", default=[0.0, math.inf])
        return NemotronHConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            pattern=pattern,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf["intermediate_size"],
            mamba_num_heads=hf["mamba_num_heads"],
            mamba_head_dim=hf["mamba_head_dim"],
            n_groups=pick("n_groups", "mamba_n_groups"),
            ssm_state_size=hf["ssm_state_size"],
            conv_kernel=pick("conv_kernel", "mamba_d_conv"),
            chunk_size=pick("chunk_size", "mamba_chunk_size"),
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id", tokenizer.bos_token_id),
            eos_token_ids=_eos_ids(hf, tokenizer),
            dt_limit=(_json_float(limit[0]), _json_float(limit[1])),
            use_conv_bias=bool(pick("use_conv_bias", "mamba_conv_bias", default=True)),
            mamba_proj_bias=bool(hf.get("use_bias", False)),
            ssm_state_dtype=hf.get("mamba_ssm_cache_dtype", "float32"),
            moe=_nemotron_h_moe(hf, pick) if "E" in pattern else None,
        )
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise ModelLoadError(f"{path}/config.json: bad or missing field ({exc})") from exc


def _nemotron_h_moe(hf: dict, pick) -> MoEConfig:
    """The `E` layers' settings, as transformers 5.23's NemotronHMoE reads them: one shared
    ReLU² expert of moe_shared_expert_intermediate_size (whatever n_shared_experts says);
    moe_shared_expert_overlap only schedules, it changes no result."""
    latent = hf.get("moe_latent_size")
    return MoEConfig(
        num_experts=pick("n_routed_experts", "num_local_experts"),
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        activation="relu2",
        scoring="sigmoid",
        renormalize=bool(hf.get("norm_topk_prob", True)),
        num_groups=hf.get("n_group", 1),
        topk_groups=hf.get("topk_group", 1),
        scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        latent_size=int(latent) if latent is not None else None,
        shared_intermediate_size=hf["moe_shared_expert_intermediate_size"],
    )


def _rope_theta(path: Path, hf: dict) -> float:
    """Plain RoPE's base; any other RoPE type is refused."""
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 nests rope_theta here
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ModelLoadError(f"{path}: RoPE type {rope_type!r} is not supported yet")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _hf_llama_config(path: Path, hf: dict, tokenizer: Tokenizer) -> LlamaConfig:
    rope_theta = _rope_theta(path, hf)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ModelLoadError(f"{path}: {flag}=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported")
    try:
        return LlamaConfig(**_decoder_fields(hf, tokenizer, rope_theta, max_positions=2048))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json: bad or missing field ({exc})") from exc


def _decoder_fields(hf: dict, tokenizer: Tokenizer, rope_theta: float, max_positions: int):
    """The fields a Llama-skeleton config (Llama, Qwen3-MoE) takes from Hugging Face's config
    (KeyError for a missing one)."""
    num_heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", max_positions),
        bos_token_id=hf.get("bos_token_id", tokenizer.bos_token_id),
        eos_token_ids=_eos_ids(hf, tokenizer),
    )


def _hf_qwen3_moe_config(path: Path, hf: dict, tokenizer: Tokenizer) -> Qwen3MoeConfig:
    rope_theta = _rope_theta(path, hf)
    unsupported = {
        "attention_bias": hf.get("attention_bias", False),
        "use_sliding_window": hf.get("use_sliding_window", False),
    }
    for flag, on in unsupported.items():
        if on:
            raise ModelLoadError(f"{path}: {flag}=true is not supported for Qwen3-MoE")
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported")
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not num_experts:
        raise ModelLoadError(
            f"{path}: num_experts {num_experts!r}: a Qwen3-MoE config without experts (a dense "
            "Qwen3) is not supported"
        )
    try:
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=hf["num_experts_per_tok"],
            intermediate_size=hf["moe_intermediate_size"],
            activation="swiglu",
            scoring="softmax",
            renormalize=bool(hf.get("norm_topk_prob", False)),
        )
        return Qwen3MoeConfig(
            **_decoder_fields(hf, tokenizer, rope_theta, max_positions=32768),
            moe=moe,
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}/config.json: bad or missing field ({exc})") from exc


_HF_CONFIGS = {
    "llama": _hf_llama_config,
    "nemotron_h": _hf_nemotron_h_config,
    "qwen3_moe": _hf_qwen3_moe_config,
}


# ---- shared ------------------------------------------------------------------------------------


_MODELS = {
    LlamaConfig: LlamaForCausalLM,
    NemotronHConfig: NemotronHForCausalLM,
    Qwen3MoeConfig: Qwen3MoeForCausalLM,
}


def _build(
    path: Path,
    config,
    pieces,
    dtype,
    device,
    tp: TPGroup = SINGLE,
    experts: ExpertRange | None = None,
):
    """Instantiate without initializing (meta device), allocate this rank's parameters (zeros:
    the vocabulary padding stays zero), then fill them piece by piece, each checkpoint tensor
    read only as far as this rank's slice of it. `experts`: the MoE experts this rank holds."""
    cls = _MODELS[type(config)]
    kwargs = {"tp": tp} if experts is None else {"tp": tp, "expert_range": experts}
    try:
        with torch.device("meta"):
            model = cls(config, **kwargs)
    except TPError as exc:
        raise ModelLoadError(f"{path}: cannot split over {tp.size} ranks: {exc}") from exc
    params = {
        name: torch.zeros(t.shape, dtype=_param_dtype(name, dtype), device=device)
        for name, t in model.state_dict().items()
    }
    expected = {name for param in params for name in checkpoint_names(param)}
    seen, unexpected, misfits = set(), [], []
    for name, shape, read in pieces:
        if name not in expected:
            unexpected.append(name)
            continue
        seen.add(name)
        for p in placements(name, config, tp):  # (several: a Mamba in_proj's segments)
            want = p.checkpoint_shape(tuple(params[p.param].shape))
            if tuple(shape) != want:
                misfits.append(f"{name} has shape {tuple(shape)}, the config wants {want}")
                break
            if p.dim is None or p.length:  # (a rank past the vocabulary's end reads nothing)
                params[p.param][p.rows].copy_(read(p))
    missing = sorted(expected - seen)
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: checkpoint does not match the {cls.__name__} layout "
            f"(missing {missing[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    if misfits:
        raise ModelLoadError(f"{path}: weights do not fit the config: {'; '.join(misfits[:5])}")
    model.load_state_dict(params, strict=True, assign=True)
    return model.requires_grad_(False).eval()


# ---- random weights (a model's real shape without its checkpoint: benchmarks, tests) ------------

RANDOM_PREFIX = "random:"
RANDOM_SEED = 0
RANDOM_STD = 0.02  # of every matrix (embeddings and projections); norm weights are 1
_RANDOM_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3's vocabulary size (so the LM head costs what it really costs) and RoPE base. Its
# checkpoints scale RoPE ("llama3" rope type), which we do not support: these shapes use plain
# RoPE, which costs the same. max_position_embeddings is the real 131072 (the fp32 cos/sin
# cache is then 131072 x head_dim x 4 bytes: 32 MiB for 1B, 64 MiB for 8B).
_LLAMA3 = dict(
    vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072
)
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
}


def random_config(spec: str) -> LlamaConfig:
    """The LlamaConfig of `random:<shape>`; EOS is the tokenizer's <|im_end|> (id 258)."""
    shape = spec.removeprefix(RANDOM_PREFIX)
    if shape not in RANDOM_SHAPES:
        raise ModelLoadError(
            f"{spec}: unknown random shape {shape!r} (known: {', '.join(RANDOM_SHAPES)})"
        )
    eos = 256 + _RANDOM_SPECIALS.index("<|im_end|>")
    return LlamaConfig(**RANDOM_SHAPES[shape], bos_token_id=None, eos_token_ids=(eos,))


def random_state(
    config: LlamaConfig, dtype: torch.dtype, device, seed: int = RANDOM_SEED
) -> dict[str, torch.Tensor]:
    """Seeded random weights in our parameter names (fused qkv_proj / gate_up_proj), made on
    `device` in `dtype`: the same (config, dtype, device type, seed) gives the same tensors, in
    any process. Matrices are normal(0, RANDOM_STD), norm weights 1."""
    return dict(_random_tensors(config, dtype, device, seed))


def _random_tensors(
    config: LlamaConfig, dtype: torch.dtype, device, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """`random_state`'s tensors one at a time (a sharded load keeps one whole tensor alive)."""
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in LlamaForCausalLM(config).state_dict().items()}
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes.items():  # state_dict order: the same on every call
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            yield name, t.fill_(1.0)
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

    model = _build(Path(spec), config, pieces(), dtype, device, tp)
    return model, config, random_tokenizer()
