"""Gated group RMSNorm, the norm at the end of a Mamba2 mixer (NemotronH): `gated_rms_norm`
(kernel + launcher) and `gated_rms_norm_ref` (the same contract in torch).

out = weight * groupnorm(x * silu(gate)), where each row of N channels is cut into N / group
groups and each group is divided by its own root mean square. Numerics are Hugging Face
NemotronH's (NemotronHRMSNormGated): x and gate go to fp32, the gated row is normalized in
fp32 and cast to the input dtype, and only then multiplied by the weight, in that dtype.

Reads x, gate and weight; writes `out` only (which may be x: each program loads its whole group
before it stores anything). One program per (token, group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.activation import silu
from taipan.kernels.pdl import enter, launch_kwargs

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GROUP = 16384  # one program holds a whole group in registers


@triton.jit
def _gated_rms_norm_kernel(
    # pointers
    x_ptr,  # [T, N]
    gate_ptr,  # [T, N]
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    # strides
    stride_x_token,
    stride_gate_token,
    stride_out_token,
    # meta-parameters
    eps: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * GROUP + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < GROUP
    x = tl.load(x_ptr + token * stride_x_token + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + token * stride_gate_token + cols, mask=mask, other=0.0).to(tl.float32)
    h = x * silu(g)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / GROUP + eps)
    # HF order: cast the normalized group to the storage dtype, then multiply by the weight.
    normed = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    result = (normed * weight).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_out_token + cols, result, mask=mask)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x, gate: [T, N] -> out: [T, N] = weight * groupnorm(x * silu(gate)), groups of
    `group_size` channels (N a multiple of it). `out` (new if None) may be `x`. Rows need unit
    stride in their last dim; x, gate, weight and out share one dtype (fp16, bf16 or fp32).
    No host synchronisation."""
    _check_args(x, gate, weight, group_size, out)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_tokens, hidden = x.shape
    if num_tokens > 0:
        block = triton.next_power_of_2(group_size)
        _gated_rms_norm_kernel[(num_tokens, hidden // group_size)](
            x,
            gate,
            weight,
            out,
            x.stride(0),
            gate.stride(0),
            out.stride(0),
            eps=float(eps),
            GROUP=group_size,
            BLOCK=block,
            num_warps=max(1, min(16, block // 256)),
            **launch_kwargs(x.device),
        )
    return out


def _check_args(x, gate, weight, group_size, out) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    hidden = x.shape[1]
    if not 0 < group_size <= MAX_GROUP or hidden % group_size:
        raise ValueError(
            f"group_size must be in 1..{MAX_GROUP} and divide the hidden size {hidden}, "
            f"got {group_size}"
        )
    if weight.shape != (hidden,) or weight.dtype != x.dtype or weight.stride(0) != 1:
        raise ValueError(
            f"weight must be a contiguous [{hidden}] {x.dtype} tensor, got shape "
            f"{tuple(weight.shape)}, {weight.dtype}, stride {weight.stride()}"
        )
    for name, t in {"x": x, "gate": gate, "out": out}.items():
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: use one device")
        if t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(
                f"{name} must match x ({tuple(x.shape)}, {x.dtype}), "
                f"got {tuple(t.shape)}, {t.dtype}"
            )
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have unit stride in its last dim, got strides {t.stride()}: "
                "pass a .contiguous() copy"
            )


def gated_rms_norm_ref(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gated_rms_norm` in plain torch (fp32 inside), the same contract."""
    h = x.float() * torch.nn.functional.silu(gate.float())
    groups = h.view(*h.shape[:-1], -1, group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    normed = groups.view(h.shape).to(x.dtype)
    result = (normed.float() * weight.float()).to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
