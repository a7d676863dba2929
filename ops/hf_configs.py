"""Hugging Face config.json -> our model config, one function per family (Llama, Qwen2, Qwen3,
Mistral, Gemma 3, NemotronH with or without MoE layers, Qwen3-MoE, Qwen3-Next, Qwen3.5; of a
multimodal Qwen3.5 or Gemma 3 checkpoint, its text model's `text_config`): which
architecture a directory holds, which fields each family reads, with which defaults, which layers
have a sliding window, and which settings we refuse (each a ModelLoadError naming the setting).

Every failure is a `ModelLoadError` naming the path and the field. Reads no weights and no
tokenizer files (the caller passes the tokenizer, whose BOS/EOS ids fill in what config.json
leaves out).
"""

from __future__ import annotations

import math
from pathlib import Path

from taipan.ops.checkpoint import ModelLoadError
from taipan.ops.models.gemma3 import Gemma3Config
from taipan.ops.models.llama import LlamaConfig
from taipan.ops.models.mistral import MistralConfig
from taipan.ops.models.nemotron_h import NemotronHConfig
from taipan.ops.models.qwen2 import Qwen2Config
from taipan.ops.models.qwen3 import Qwen3Config
from taipan.ops.models.qwen3_5 import Qwen3_5Config
from taipan.ops.models.qwen3_moe import Qwen3MoeConfig
from taipan.ops.models.qwen3_next import FULL, LINEAR, Qwen3NextConfig
from taipan.ops.moe import MoEConfig
from taipan.ops.rope_scaling import UnsupportedRope, rope_scaling_from_hf
from taipan.ops.tokenizer import Tokenizer

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
    "NemotronHForCausalLM": "nemotron_h",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5",
}
# Multimodal checkpoints whose text model we serve -> (its family, the outer config's
# tie_word_embeddings default: transformers ties by the outer config, not text_config).
_MULTIMODAL = {
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", False),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", False),
    "Gemma3ForConditionalGeneration": ("gemma3", True),
}
_MULTIMODAL_TYPES = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
}
# Fields of the outer config a text_config falls back to (older Gemma 3 configs keep the token
# ids outside).
_OUTER_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def multimodal_architecture(hf: dict) -> str | None:
    """The multimodal architecture config.json names (its text model is what we serve), or
    None for a text model."""
    for arch in hf.get("architectures") or []:
        if arch in _MULTIMODAL:
            return arch
    if hf.get("architectures"):
        return None
    return _MULTIMODAL_TYPES.get(hf.get("model_type"))


def text_model_config(path: Path, hf: dict) -> dict:
    """The config.json of the model we serve: a multimodal checkpoint's `text_config`, with the
    outer config's tie_word_embeddings (transformers ties by it) and token ids it lacks, and
    the text model's architecture; a text model's config.json as it is."""
    arch = multimodal_architecture(hf)
    if arch is None:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(
            f"{path}/config.json: {arch} without a text_config (the text model's config)"
        )
    family, tied = _MULTIMODAL[arch]
    outer = {k: hf[k] for k in _OUTER_FIELDS if k in hf and k not in text}
    text_arch = arch.replace("ForConditionalGeneration", "ForCausalLM")
    return dict(
        text,
        **outer,
        architectures=[text_arch],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", tied)),
    )


def hf_family(path: Path, hf: dict) -> str:
    """The model family of a Hugging Face config: "llama", "qwen2", "qwen3", "mistral",
    "gemma3", "nemotron_h", "qwen3_moe", "qwen3_next" or "qwen3_5" (the launcher's torch-free
    runtime/models.has_mamba_layers tells a hybrid the same way); a multimodal checkpoint's
    (`multimodal_architecture`) is its text model's."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    multimodal = multimodal_architecture(hf)
    if multimodal is not None:
        return _MULTIMODAL[multimodal][0]
    text_types = {"gemma3_text": "gemma3", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5"}
    model_type = text_types.get(hf.get("model_type"), hf.get("model_type"))
    if model_type in _ARCHITECTURES.values():
        return model_type
    raise ModelLoadError(
        f"{path}: architecture {archs or hf.get('model_type')!r} is not supported "
        f"(supported: {', '.join(_ARCHITECTURES)}, and the text model of "
        f"{', '.join(_MULTIMODAL)})"
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
    _refuse_nemotron_h_options(path, hf)
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


def _refuse_nemotron_h_options(path: Path, hf: dict) -> None:
    """NemotronH options our layers do not implement: a clear error, never silently ignored."""
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


def _rope(path: Path, hf: dict, max_positions: int) -> dict:
    """`rope_theta` and `rope_scaling` (ops/rope_scaling.py; None: plain) as transformers reads
    them: the older `rope_scaling` dict if set, else `rope_parameters`, the base from it or a
    top-level `rope_theta`. `max_positions`: the family's default max_position_embeddings. A
    RoPE type we do not implement is refused, naming it."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    max_len = hf.get("max_position_embeddings") or max_positions
    try:
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = rope_scaling_from_hf(params, max_len, hf.get("original_max_position_embeddings"))
    except UnsupportedRope as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}/config.json: bad or missing RoPE field ({exc})") from exc
    return dict(rope_theta=theta, rope_scaling=scaling)


# The dense Llama-skeleton families: our config class, transformers' default
# max_position_embeddings, and the settings we refuse when true (Qwen2's q/k/v biases are always
# on, no flag; a Qwen3 attention_bias would add an o_proj bias, which no released Qwen3 has).
_DENSE = {
    "llama": (LlamaConfig, 2048, ("attention_bias", "mlp_bias")),
    "qwen2": (Qwen2Config, 32768, ()),
    "qwen3": (Qwen3Config, 32768, ("attention_bias",)),
    "mistral": (MistralConfig, 4096 * 32, ()),
}


def _hf_dense_config(path: Path, hf: dict, tokenizer: Tokenizer, family: str) -> LlamaConfig:
    cls, max_positions, refused = _DENSE[family]
    rope = _rope(path, hf, max_positions)
    for flag in refused:
        if hf.get(flag):
            raise ModelLoadError(f"{path}: {flag}=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported")
    try:
        fields = _decoder_fields(hf, tokenizer, rope, max_positions)
        return cls(**fields, **_sliding_window(hf, family))
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}/config.json: bad or missing field ({exc})") from exc


def _sliding_window(hf: dict, family: str) -> dict:
    """`sliding_window` and `sliding_layers` (None: every layer) as transformers reads the
    config: Mistral's window holds for every layer; Qwen2/3's only with `use_sliding_window`,
    for the layers `layer_types` marks, or else those from `max_window_layers` on; Llama has
    none."""
    window = hf.get("sliding_window")
    if family == "llama" or window is None:
        return dict(sliding_window=None)
    if family == "mistral":
        return dict(sliding_window=int(window))
    if not hf.get("use_sliding_window"):
        return dict(sliding_window=None)
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        layers = tuple(range(first, hf["num_hidden_layers"]))
    else:
        layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    if not layers:
        return dict(sliding_window=None)
    return dict(sliding_window=int(window), sliding_layers=layers)


def _decoder_fields(hf: dict, tokenizer: Tokenizer, rope: dict, max_positions: int):
    """The fields a Llama-skeleton config (the `_DENSE` families, Qwen3-MoE) takes from Hugging
    Face's config (KeyError for a missing one); `rope`: `_rope`'s."""
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
        **rope,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", max_positions),
        bos_token_id=hf.get("bos_token_id", tokenizer.bos_token_id),
        eos_token_ids=_eos_ids(hf, tokenizer),
    )


def _hf_qwen3_moe_config(path: Path, hf: dict, tokenizer: Tokenizer) -> Qwen3MoeConfig:
    rope = _rope(path, hf, max_positions=32768)
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
            **_decoder_fields(hf, tokenizer, rope, max_positions=32768),
            moe=moe,
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}/config.json: bad or missing field ({exc})") from exc


# Gemma 3's layer types -> whether the layer is local (sliding window, local RoPE).
_GEMMA3_LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def _hf_gemma3_config(path: Path, hf: dict, tokenizer: Tokenizer) -> Gemma3Config:
    """Gemma3TextConfig's fields with its defaults; settings our layers do not implement
    (logit soft-capping, bidirectional attention, biases, another activation, a RoPE other
    than default or linear) are refused."""
    refused = {
        "attn_logit_softcapping": hf.get("attn_logit_softcapping") is not None,
        "final_logit_softcapping": hf.get("final_logit_softcapping") is not None,
        "use_bidirectional_attention": bool(hf.get("use_bidirectional_attention")),
        "attention_bias": bool(hf.get("attention_bias")),
    }
    for flag, on in refused.items():
        if on:
            raise ModelLoadError(f"{path}: {flag}={hf[flag]!r} is not supported for Gemma 3")
    activation = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{path}: hidden_activation {activation!r} is not supported")
    try:
        num_layers = hf.get("num_hidden_layers", 26)
        local = _gemma3_local_layers(path, hf, num_layers)
        rope = _gemma3_rope(path, hf)
        num_heads = hf.get("num_attention_heads", 8)
        return Gemma3Config(
            vocab_size=hf.get("vocab_size", 262_208),
            hidden_size=hf.get("hidden_size", 2304),
            intermediate_size=hf.get("intermediate_size", 9216),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads", 4),
            head_dim=hf.get("head_dim", 256),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            max_position_embeddings=hf.get("max_position_embeddings", 131_072),
            bos_token_id=hf.get("bos_token_id", 2),
            eos_token_ids=_eos_ids(hf | {"eos_token_id": hf.get("eos_token_id", 1)}, tokenizer),
            sliding_window=hf.get("sliding_window", 4096),
            sliding_layers=local,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            **rope,
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}/config.json: bad or missing field ({exc})") from exc


def _gemma3_local_layers(path: Path, hf: dict, num_layers: int) -> tuple[int, ...]:
    """The local layers: those `layer_types` marks "sliding_attention", or else every layer but
    each `sliding_window_pattern`-th (default 6: five local, then one global)."""
    types = hf.get("layer_types")
    if types is None:
        period = int(hf.get("sliding_window_pattern", 6))
        return tuple(i for i in range(num_layers) if (i + 1) % period)
    unknown = sorted({t for t in types if t not in _GEMMA3_LAYER_TYPES})
    if unknown or len(types) != num_layers:
        raise ModelLoadError(
            f"{path}/config.json: layer_types must name each of the {num_layers} layers "
            f"{' or '.join(_GEMMA3_LAYER_TYPES)} (got {len(types)}, unknown {unknown})"
        )
    return tuple(i for i, kind in enumerate(types) if _GEMMA3_LAYER_TYPES[kind])


def _gemma3_rope(path: Path, hf: dict) -> dict:
    """The two RoPEs as transformers' Gemma3TextConfig reads them: `rope_parameters` per layer
    type, or the older `rope_theta` (+ `rope_scaling`, the global layers') and
    `rope_local_base_freq`. Only default and linear RoPE; linear only for the global layers."""
    default = {"rope_type": "default"}  # (so a legacy "type" of rope_scaling does not count)
    params = hf.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or default)
    full.update(hf.get("rope_scaling") or {})
    local = dict(params.get("sliding_attention") or default)
    out = dict(
        rope_theta=float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
        rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))),
    )
    for name, p in (("global", full), ("local", local)):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind == "linear" and name == "global":
            out["rope_scaling_factor"] = float(p["factor"])
        elif kind != "default":
            raise ModelLoadError(
                f"{path}: RoPE type {kind!r} of the {name} layers is not supported for Gemma 3 "
                "(only 'default', and 'linear' for the global layers)"
            )
    return out


def _hf_qwen3_5_config(path: Path, hf: dict, tokenizer: Tokenizer) -> Qwen3_5Config:
    """Qwen3.5 (dense, or MoE when num_experts > 0): Qwen3-Next's fields, but every layer of a
    MoE model is sparse and its top-k weights always renormalised (transformers' Qwen3.5 has
    no decoder_sparse_step, mlp_only_layers or norm_topk_prob); its text "mrope" is plain
    partial RoPE for text (ops/models/qwen3_5.py)."""
    hf = dict(hf, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if hf.get("num_experts"):
        hf.setdefault("intermediate_size", 0)  # (no dense layer in a Qwen3.5 MoE)
    return _hf_qwen3_next_config(path, hf, tokenizer, Qwen3_5Config)


def _hf_qwen3_next_config(
    path: Path, hf: dict, tokenizer: Tokenizer, cls: type = Qwen3NextConfig
) -> Qwen3NextConfig:
    """Qwen3NextConfig's fields (or `cls`'s, a subclass) with transformers' defaults:
    `layer_types`, or else every `full_attention_interval`-th layer attention; MoE layers when
    num_experts > 0. Attention biases, another activation or an unsupported RoPE type (`_rope`)
    are refused."""
    rope_fields = _rope(path, hf, max_positions=32768)
    if hf.get("attention_bias"):
        raise ModelLoadError(f"{path}: attention_bias=true is not supported for Qwen3-Next")
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported")
    rope = hf.get("rope_parameters") or {}
    try:
        num_layers = hf["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None:
            interval = int(hf.get("full_attention_interval", 4))
            types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
        if len(types) != num_layers:
            raise ValueError(f"layer_types names {len(types)} layers, not {num_layers}")
        num_experts = hf.get("num_experts", 0)
        moe = None
        if num_experts:
            moe = MoEConfig(
                num_experts=num_experts,
                top_k=hf["num_experts_per_tok"],
                intermediate_size=hf["moe_intermediate_size"],
                activation="swiglu",
                scoring="softmax",
                renormalize=bool(hf.get("norm_topk_prob", True)),
            )
        shared = hf.get("shared_expert_intermediate_size", 0) if moe else 0
        fields = _decoder_fields(hf, tokenizer, rope_fields, max_positions=32768)
        del fields["num_layers"]
        return cls(
            **fields | {"head_dim": hf.get("head_dim", 256)},
            layer_types=tuple(types),
            linear_num_key_heads=hf.get("linear_num_key_heads", 16),
            linear_num_value_heads=hf.get("linear_num_value_heads", 32),
            linear_key_head_dim=hf.get("linear_key_head_dim", 128),
            linear_value_head_dim=hf.get("linear_value_head_dim", 128),
            linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
            ),
            moe=moe,
            shared_expert_intermediate_size=shared,
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}/config.json: bad or missing field ({exc})") from exc


_HF_CONFIGS = {
    "gemma3": _hf_gemma3_config,
    "nemotron_h": _hf_nemotron_h_config,
    "qwen3_moe": _hf_qwen3_moe_config,
    "qwen3_next": _hf_qwen3_next_config,
    "qwen3_5": _hf_qwen3_5_config,
}


def hf_config(path: Path, hf: dict, family: str, tokenizer: Tokenizer):
    """Our config of `family` (`hf_family`) from the parsed config.json `hf`."""
    if family in _DENSE:
        return _hf_dense_config(path, hf, tokenizer, family)
    return _HF_CONFIGS[family](path, hf, tokenizer)
