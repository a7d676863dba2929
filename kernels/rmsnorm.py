"""RMSNorm over token rows, optionally fused with the residual add that precedes it in a Llama
decoder layer: `rms_norm` (kernel + launcher) and `rms_norm_ref` (the same contract in torch).

Numerics are HF Llama's (LlamaRMSNorm; ops/layers.RMSNorm dispatches here): the row is
normalized in fp32, cast to the input dtype, and only then multiplied by the weight, in that
dtype.

In-place contract: with `residual`, the sum `x + residual` (added in fp32, stored in x's dtype)
is written back INTO `residual`, as vLLM's fused_add_rms_norm does, so the residual stream lives
in one persistent buffer; the norm of that stored sum goes to `out`. Gemma's sandwich norms:
`pre_weight` normalizes x before the add, and `add_rms_norm_` adds a normalized x into the
residual with no norm after. `x` is only read, except
that `out=x` is allowed (each program loads its whole row before it stores anything). Touches no
other memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.pdl import enter, launch_kwargs

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 32768  # one program holds a whole row in registers


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N], overwritten with x + residual (only if HAS_RESIDUAL)
    weight_ptr,  # [N]
    pre_weight_ptr,  # [N] (PRE_NORM)
    out_ptr,  # [T, N] (FINAL_NORM)
    # strides
    stride_x_token,
    stride_residual_token,
    stride_out_token,
    # meta-parameters
    eps: tl.constexpr,
    N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,  # Gemma's norm: x / rms(x) * (1 + weight), all in fp32, rounded once
    PRE_NORM: tl.constexpr,  # x normalized (pre_weight) before the add: Gemma's post-norms
    FINAL_NORM: tl.constexpr,  # False: only the residual is written (no `out`)
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + token * stride_x_token + cols, mask=mask, other=0.0).to(tl.float32)
    if PRE_NORM:  # as a launch of its own would store it, rounded to the storage dtype
        x = _normalized(x, pre_weight_ptr, cols, mask, eps, N, GEMMA, out_ptr.dtype.element_ty)
        x = x.to(tl.float32)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + token * stride_residual_token + cols
        summed = x + tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)
        stored = summed.to(residual_ptr.dtype.element_ty)
        tl.store(residual_row, stored, mask=mask)
        # Normalize the sum as stored, as HF normalizes its (rounded) residual stream.
        x = stored.to(tl.float32)
    if FINAL_NORM:
        result = _normalized(x, weight_ptr, cols, mask, eps, N, GEMMA, out_ptr.dtype.element_ty)
        tl.store(out_ptr + token * stride_out_token + cols, result, mask=mask)


@triton.jit
def _normalized(x, weight_ptr, cols, mask, eps, N: tl.constexpr, GEMMA: tl.constexpr, dtype):
    """The row x (fp32) normalized and weighted, in `dtype`."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        # HF's Gemma3RMSNorm: the normalized row stays fp32 and meets (1 + weight) in fp32.
        result = (x * rstd * (1.0 + weight)).to(dtype)
    else:
        # HF order: cast the normalized row to the storage dtype, then multiply by the weight.
        # A product of two 16-bit floats is exact in fp32: one rounding equals torch's multiply.
        normed = (x * rstd).to(dtype).to(tl.float32)
        result = (normed * weight).to(dtype)
    return result


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    gemma: bool = False,
    pre_weight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, N] -> out: [T, N] = rmsnorm(x) * weight; with `residual` [T, N], returns
    `(out, residual)` after `residual <- x + residual` in place and `out = rmsnorm(residual)`.
    `gemma`: Gemma's norm, rmsnorm(x) * (1 + weight) in fp32 and rounded once.
    `pre_weight` [N] (with `residual`): x is first normalized with it (the same kind of norm,
    rounded as its own launch would store it), then added: Gemma 3's post-attention norm, the
    add and the pre-feedforward norm in one launch.

    `out` (new if None) may be `x`, never `residual`. Rows need unit stride in their last dim;
    x, weight, residual and out share one dtype (fp16, bf16 or fp32). No host synchronisation.
    """
    _check_args(x, weight, residual, out)
    if pre_weight is not None:
        if residual is None:
            raise ValueError("pre_weight needs residual (the norm before the add)")
        _check_args(x, pre_weight, residual, out)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, weight, pre_weight, residual, out, eps, gemma)
    return out if residual is None else (out, residual)


def add_rms_norm_(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, gemma: bool = False
) -> torch.Tensor:
    """`residual <- rmsnorm(x) * weight + residual` in place (the norm rounded as `rms_norm`
    stores it, the add in fp32 rounded once, as torch adds); returns residual. Gemma 3's
    post-feedforward norm and the add after it in one launch."""
    _check_args(x, weight, residual, None)
    _launch(x, None, weight, residual, x, eps, gemma)
    return residual


def _launch(x, weight, pre_weight, residual, out, eps, gemma) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if has_residual else x,
        weight if weight is not None else x,
        pre_weight if pre_weight is not None else x,
        out,
        x.stride(0),
        residual.stride(0) if has_residual else 0,
        out.stride(0),
        eps=float(eps),
        N=hidden,
        HAS_RESIDUAL=has_residual,
        GEMMA=bool(gemma),
        PRE_NORM=pre_weight is not None,
        FINAL_NORM=weight is not None,
        BLOCK=block,
        num_warps=max(1, min(16, block // 256)),
        **launch_kwargs(x.device),
    )


def _check_args(x, weight, residual, out) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    hidden = x.shape[1]
    if not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be in 1..{MAX_HIDDEN}, got {hidden}")
    if weight.shape != (hidden,) or weight.dtype != x.dtype or weight.stride(0) != 1:
        raise ValueError(
            f"weight must be a contiguous [{hidden}] {x.dtype} tensor, got shape "
            f"{tuple(weight.shape)}, {weight.dtype}, stride {weight.stride()}"
        )
    named = {"x": x, "weight": weight, "residual": residual, "out": out}
    for name, t in named.items():
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: use one device")
        if name in ("residual", "out") and (t.shape != x.shape or t.dtype != x.dtype):
            raise ValueError(
                f"{name} must match x ({tuple(x.shape)}, {x.dtype}), "
                f"got {tuple(t.shape)}, {t.dtype}"
            )
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have unit stride in its last dim, got strides {t.stride()}: "
                "pass a .contiguous() copy"
            )
    if residual is not None and out is not None and out.data_ptr() == residual.data_ptr():
        raise ValueError("out must not be residual: residual receives x + residual in place")


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    gemma: bool = False,
    pre_weight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` in plain torch (fp32 inside), with the same in-place contract."""
    if pre_weight is not None:
        if residual is None:
            raise ValueError("pre_weight needs residual (the norm before the add)")
        x = rms_norm_ref(x, pre_weight, eps, gemma=gemma)
    if residual is not None:
        residual.copy_((x.float() + residual.float()).to(residual.dtype))
        x = residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:  # (HF's Gemma3RMSNorm: fp32 throughout, one rounding)
        result = (normed * (1.0 + weight.float())).to(x.dtype)
    else:
        result = (normed.to(x.dtype).float() * weight.float()).to(x.dtype)
    if out is None:
        out = result
    else:
        out.copy_(result)
    return out if residual is None else (out, residual)


def add_rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, gemma: bool = False
) -> torch.Tensor:
    """`add_rms_norm_` in plain torch, same contract."""
    normed = rms_norm_ref(x, weight, eps, gemma=gemma)
    return residual.copy_((normed.float() + residual.float()).to(residual.dtype))
