"""Gated MLP activations on the fused gate/up projection: SwiGLU's `silu_and_mul` and Gemma's
`gelu_tanh_and_mul` (one kernel, a launcher each) and their `*_ref` (the same contracts in
torch); also the @triton.jit `silu` and `gelu_tanh` that every kernel gating with them calls
(moe, causal_conv1d, gated_rmsnorm), so each is written once.

A row of x [T, 2I] holds the gate then the up half, as ops/layers.SwiGLUMLP's `gate_up_proj`
writes them; out [T, I] = silu(gate) * up, computed in fp32 and rounded once (HF rounds silu's
output to the activation dtype before the multiply: up to one ulp apart). Reads x, writes only
out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.pdl import enter, launch_kwargs

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK = 1024


@triton.jit
def silu(x):
    """x * sigmoid(x), for fp32 x (shared by every kernel that gates with silu)."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def gelu_tanh(x):
    """gelu's tanh approximation for fp32 x, tanh(z) = 2 / (1 + exp(-2z)) - 1 (exp -> inf
    gives -1)."""
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (2.0 / (1.0 + tl.exp(-2.0 * z)))


@triton.jit
def _gated_act_and_mul_kernel(
    # pointers
    x_ptr,  # [T, 2I]: gate | up
    out_ptr,  # [T, I]
    # strides
    stride_x_token,
    stride_out_token,
    # meta-parameters
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,  # gelu_tanh (Gemma) instead of silu
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    x_row = x_ptr + token * stride_x_token
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # HF rounds the activation to the storage dtype before the product (gelu_pytorch_tanh).
        act = gelu_tanh(gate).to(out_ptr.dtype.element_ty).to(tl.float32)
    else:
        act = silu(gate)
    tl.store(
        out_ptr + token * stride_out_token + cols,
        (act * up).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def gelu_tanh_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] (gate | up) -> out: [T, I] = gelu_tanh(gate) * up in x's dtype (new if None),
    the activation rounded to x's dtype before the product, as HF's Gemma MLP. As
    `silu_and_mul` otherwise."""
    return _launch(x, out, gelu_tanh=True)


def gelu_tanh_and_mul_ref(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`gelu_tanh_and_mul` in plain torch (HF's order of roundings)."""
    gate, up = x.chunk(2, dim=-1)
    result = torch.nn.functional.gelu(gate, approximate="tanh") * up
    if out is None:
        return result
    out.copy_(result)
    return out


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] (gate | up) -> out: [T, I] = silu(gate) * up in x's dtype (new if None).

    Rows need unit stride in their last dim. Each program covers one token row's tile of up to
    MAX_BLOCK columns: a decode step's single row still spreads over many SMs. No host sync.
    """
    return _launch(x, out, gelu_tanh=False)


def _launch(x: torch.Tensor, out: torch.Tensor | None, *, gelu_tanh: bool) -> torch.Tensor:
    _check_args(x, out)
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, intermediate, dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        block = min(triton.next_power_of_2(intermediate), MAX_BLOCK)
        grid = (num_tokens, triton.cdiv(intermediate, block))
        _gated_act_and_mul_kernel[grid](
            x,
            out,
            x.stride(0),
            out.stride(0),
            INTERMEDIATE=intermediate,
            BLOCK=block,
            GELU_TANH=gelu_tanh,
            **launch_kwargs(x.device),
        )
    return out


def _check_args(x: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[1] == 0 or x.shape[1] % 2:
        raise ValueError(
            f"x must be [tokens, 2 * intermediate] (gate | up), got shape {tuple(x.shape)}"
        )
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(
            f"x must have unit stride in its last dim, got strides {x.stride()}: "
            "pass a .contiguous() copy"
        )
    if out is None:
        return
    shape = (x.shape[0], x.shape[1] // 2)
    if out.shape != shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be {shape} {x.dtype} on {x.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"out must have unit stride in its last dim, got strides {out.stride()}")


def silu_and_mul_ref(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`silu_and_mul` in plain torch (fp32 inside)."""
    gate, up = x.float().chunk(2, dim=-1)
    result = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
