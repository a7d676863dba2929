"""The one-token (decode) state update of a Mamba2 mixer's SSM: `selective_state_update` (Triton
kernel + launcher) and `selective_state_update_ref`, in plain torch (fp32 inside). The
recurrence is kernels/ssd_scan.py's, one token at a time:
    state = exp(dt'·A) · state + dt' · x ⊗ B;   y = state · C + D · x
with dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max).

Contract (the Triton kernel and its launcher keep it):
- x: [Bt, H, P] (row b is sequence b's one token); dt: [Bt, H]; A: [H] fp32; B, C: [Bt, G, N];
  D, dt_bias: [H]. Inputs may be strided views.
- ssm_states: [num_slots, H, P, N] fp32; row b reads slot init_slots[b] (-1: zeros) and writes
  out_slots[b] (-1: not written; a row with both -1 is padding: its y comes from a zero state).
  All reads happen before the writes, so the two may be the same slot.
- Returns y: [Bt, H, P] in x's dtype.

The Triton kernel (`selective_state_update`): one program per (row, head, block of P) loads its
[BLOCK_P, N] state tile (fp32), advances it one token, stores y and the tile. It owns the tile
from read to write, so a row's init and out slot may be one slot; but programs of different rows
are not ordered, so no row may read a slot that another row writes in the same call.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from taipan.kernels.pdl import enter, launch_kwargs
from taipan.kernels.ssd_scan import _check_ssm_args, _discretize, _nonempty, discretize_dt

DECODE_TILE = 2048  # state elements (BLOCK_P * BLOCK_N) per program


@triton.jit
def _selective_state_update_kernel(
    # pointers
    x_ptr,  # [R, H, P]
    dt_ptr,  # [R, H]
    A_ptr,  # [H] fp32
    B_ptr,  # [R, G, N]
    C_ptr,  # [R, G, N]
    D_ptr,  # [H]
    dt_bias_ptr,  # [H]
    states_ptr,  # [num_slots, H, P, N] fp32
    init_slots_ptr,  # [R]
    out_slots_ptr,  # [R]
    y_ptr,  # [R, H, P]
    # strides (every last dim has unit stride)
    stride_x_r,
    stride_x_h,
    stride_dt_r,
    stride_b_r,
    stride_b_g,
    stride_c_r,
    stride_c_g,
    stride_y_r,
    stride_y_h,
    stride_s_slot,
    stride_s_h,
    stride_s_p,
    # scalars
    P,
    N,
    dt_min,
    dt_max,
    # meta-parameters
    HEADS_PER_GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    """One program: row program_id(0), head program_id(1), head_dim rows
    [program_id(2) * BLOCK_P, +BLOCK_P) of its state with all N columns: it loads that tile,
    advances it one token and stores it, so its own reads precede its writes."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    init = tl.load(init_slots_ptr + row).to(tl.int64)
    dest = tl.load(out_slots_ptr + row).to(tl.int64)
    group = head // HEADS_PER_GROUP
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < P
    n_ok = n < N
    tile_ok = p_ok[:, None] & n_ok[None, :]
    state_off = head * stride_s_h + p[:, None] * stride_s_p + n[None, :]
    state = tl.load(
        states_ptr + tl.maximum(init, 0) * stride_s_slot + state_off,
        mask=tile_ok & (init >= 0),
        other=0.0,
    )  # [BLOCK_P, BLOCK_N]; slot -1: zeros

    x = tl.load(x_ptr + row * stride_x_r + head * stride_x_h + p, mask=p_ok, other=0.0)
    x = x.to(tl.float32)
    b = tl.load(B_ptr + row * stride_b_r + group * stride_b_g + n, mask=n_ok, other=0.0)
    c = tl.load(C_ptr + row * stride_c_r + group * stride_c_g + n, mask=n_ok, other=0.0)
    dt = tl.load(dt_ptr + row * stride_dt_r + head).to(tl.float32)
    bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    a = tl.load(A_ptr + head).to(tl.float32)
    d = tl.load(D_ptr + head).to(tl.float32)
    dtp = _discretize(dt + bias, dt_min, dt_max)

    state = state * tl.exp(dtp * a) + (dtp * x)[:, None] * b.to(tl.float32)[None, :]
    y = tl.sum(state * c.to(tl.float32)[None, :], axis=1) + d * x
    tl.store(
        y_ptr + row * stride_y_r + head * stride_y_h + p,
        y.to(y_ptr.dtype.element_ty),
        mask=p_ok,
    )
    tl.store(
        states_ptr + tl.maximum(dest, 0) * stride_s_slot + state_off,
        state,
        mask=tile_ok & (dest >= 0),
    )


def selective_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one-token update of the module contract, in Triton. Never syncs the device: the grid
    is (R, H, cdiv(P, BLOCK_P)) for R rows (CUDA-graph safe).

    x: [R, H, P]; dt: [R, H]; B, C: [R, G, N] (G divides H, N <= 256): fp16/bf16/fp32, strided
    views allowed with unit stride in the last dim. A: [H] fp32; D, dt_bias: [H] (any float).
    init_slots, out_slots: [R] int32 or int64 on x's device; ssm_states: [num_slots, H, P, N]
    fp32 contiguous. Returns y [R, H, P] in x's dtype (`out` if given; it may be x).

    A padding row (both slots -1) writes no slot; its y is computed from a zero state, as the
    reference does. Slot values are trusted, not checked (in [-1, num_slots)). A row's own init
    and out slot may be the same; a slot that one row writes must not be another row's init slot
    in the same call (programs of different rows are not ordered).
    """
    rows = _check_ssm_args(x, dt, A, B, C, D, dt_bias, ssm_states, init_slots, out_slots, out)
    if rows != x.shape[0]:
        raise ValueError(
            f"init_slots and out_slots need one entry per row of x ({x.shape[0]}), got {rows}"
        )
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_heads, head_dim = x.shape[1], x.shape[2]
    groups, state_size = B.shape[1], B.shape[2]
    if rows == 0 or num_heads == 0 or head_dim == 0:
        return out
    block_n = triton.next_power_of_2(state_size)
    block_p = min(triton.next_power_of_2(head_dim), max(1, DECODE_TILE // block_n))
    grid = (rows, num_heads, triton.cdiv(head_dim, block_p))
    _selective_state_update_kernel[grid](
        x, dt, A, B, C, D, dt_bias, _nonempty(ssm_states), init_slots, out_slots, out,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
        C.stride(0), C.stride(1), out.stride(0), out.stride(1),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        head_dim, state_size, float(dt_min), float(dt_max),
        HEADS_PER_GROUP=num_heads // groups, BLOCK_P=block_p, BLOCK_N=block_n,
        num_warps=4,
        **launch_kwargs(x.device),
    )  # fmt: skip
    return out


def selective_state_update_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    init_slots: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
) -> torch.Tensor:
    rows, num_heads = x.shape[0], x.shape[1]
    rep = num_heads // B.shape[1]
    init = init_slots.long()
    state = ssm_states[init.clamp(min=0)].float()  # [Bt, H, P, N]
    state = torch.where((init >= 0)[:, None, None, None], state, torch.zeros_like(state))
    step = discretize_dt(dt, dt_bias, dt_min, dt_max)  # [Bt, H]
    decay = torch.exp(step * A.float())  # [Bt, H]
    Bh = B.float().repeat_interleave(rep, dim=1)  # [Bt, H, N]
    Ch = C.float().repeat_interleave(rep, dim=1)
    xs = x.float()
    state = state * decay[:, :, None, None] + (step[:, :, None] * xs)[..., None] * Bh[:, :, None]
    y = torch.einsum("bhpn,bhn->bhp", state, Ch) + D.float()[None, :, None] * xs
    dest = out_slots.long()
    keep = dest >= 0
    if rows and bool(keep.any()):
        ssm_states[dest[keep]] = state[keep].to(ssm_states.dtype)
    return y.to(x.dtype)
