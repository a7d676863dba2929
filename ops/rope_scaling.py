"""RoPE scaling: Hugging Face's static rope types "linear", "llama3" (Llama 3.1 / 3.2 / 3.3) and
"yarn" (Qwen2.5 / Qwen3 long context). `RopeScaling` is the frozen description a model config
carries (None: plain RoPE), `rope_scaling_from_hf` reads it from config.json, and `rope_table`
builds the fp32 cos | sin table kernels/rope.py reads, with that scaling.

Scaling only changes the table, once, on the host at load: the inverse frequencies (as
transformers' modeling_rope_utils computes them) and, for yarn, an attention factor that
multiplies cos and sin. Types whose frequencies depend on the sequence length ("dynamic",
"longrope") and any unknown type are refused with `UnsupportedRope` naming the type. Owns no
model state and touches no weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from taipan.kernels.rope import rope_cos_sin_cache

SUPPORTED = ("default", "linear", "llama3", "yarn")
# Why a known type is refused (its frequencies would change with the sequence's length, so
# one table built at load cannot hold them).
_REFUSED = {
    "dynamic": "its frequencies change with the sequence length (dynamic NTK)",
    "longrope": "its frequencies change past original_max_position_embeddings",
}


class UnsupportedRope(ValueError):
    """A RoPE type we do not implement (the message names it)."""


@dataclass(frozen=True)
class RopeScaling:
    """One static RoPE scaling, every value resolved from the config (hashable, compared field
    by field when a weight update checks the architecture). Each type reads only its own fields:
    linear `factor`; llama3 `factor`, `original_max_position_embeddings`, `low_freq_factor`,
    `high_freq_factor`; yarn `factor`, `original_max_position_embeddings`, `beta_fast`,
    `beta_slow`, `truncate` and `attention_factor` (cos and sin are multiplied by it)."""

    rope_type: str  # "linear" | "llama3" | "yarn"
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool | None = None
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED[1:]:
            raise UnsupportedRope(_unsupported_message(self.rope_type))


def rope_scaling_from_hf(
    params: dict, max_position_embeddings: int, original_max: int | None = None
) -> RopeScaling | None:
    """The scaling of one RoPE parameter dict (`rope_parameters`, or the older `rope_scaling`,
    as transformers reads it) -> None for plain RoPE. `max_position_embeddings`: the config's
    (the default original length, and yarn's factor when the config gives none);
    `original_max`: a top-level `original_max_position_embeddings`, which transformers prefers
    to the dict's. UnsupportedRope for another type; KeyError / ValueError / TypeError for a
    missing or bad field."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind not in SUPPORTED:
        raise UnsupportedRope(_unsupported_message(kind))
    if kind == "linear":
        return RopeScaling("linear", factor=float(params["factor"]))
    original = original_max or params.get("original_max_position_embeddings")
    original = int(original or max_position_embeddings)
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            original_max_position_embeddings=original,
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
        )
    return _yarn(params, max_position_embeddings, original)


def _yarn(params: dict, max_position_embeddings: int, original: int) -> RopeScaling:
    """yarn with transformers' defaults: factor max / original when the config's is null,
    beta_fast 32 and beta_slow 1 (for a missing or zero value), truncate on, and the attention
    factor from `mscale` / `mscale_all_dim` (DeepSeek's form) or 0.1 ln(factor) + 1."""
    factor = params["factor"]
    factor = float(max_position_embeddings / original if factor is None else factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    return RopeScaling(
        "yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _unsupported_message(kind: str) -> str:
    why = _REFUSED.get(kind, "an unknown type")
    return f"RoPE type {kind!r} is not supported: {why} (supported: {', '.join(SUPPORTED)})"


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] fp32 on the host: theta^(-2i / head_dim), scaled as transformers'
    ROPE_INIT_FUNCTIONS[scaling.rope_type] scales them (head_dim: the rotated channels, a
    partial RoPE's rotary dim)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is None:
        return 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        return 1.0 / (theta**exponents) / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(1.0 / (theta**exponents), scaling)
    return _yarn_inverse_frequencies(theta**exponents, head_dim, theta, scaling)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths (past original / low_freq_factor) divided by `factor`, short ones (below
    original / high_freq_factor) kept, the band between interpolated smoothly."""
    old = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inverse_frequencies(
    pos_freqs: torch.Tensor, dim: int, theta: float, s: RopeScaling
) -> torch.Tensor:
    """Dimensions that turn more than beta_fast times over the original context keep their
    frequency (extrapolation), those turning less than beta_slow times are divided by `factor`
    (interpolation), with a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        original = s.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # [dim / 2]: 1 keeps the frequency, 0 divides it by factor
    interpolated, kept = 1.0 / (s.factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - extrapolation) + kept * extrapolation


def rope_table(
    max_positions: int,
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[max_positions, head_dim] fp32, kernels/rope.rope_cos_sin_cache's layout (cos of each
    position's angles, then their sin), the angles from `inverse_frequencies` and both halves
    multiplied by the scaling's attention factor. No scaling: exactly rope_cos_sin_cache."""
    if scaling is None:
        return rope_cos_sin_cache(max_positions, head_dim, theta, device)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)  # [head_dim / 2]
    positions = torch.arange(max_positions, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    if scaling.attention_factor != 1.0:
        table *= scaling.attention_factor
    return table
