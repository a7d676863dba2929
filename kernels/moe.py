"""Mixture-of-experts expert computation: `fused_moe` (Triton kernels and their launcher) and
`fused_moe_ref` (the contract in plain torch).

Each token goes to `k` experts (`topk_ids`, global expert ids) with weights `topk_weights`; this
file computes the weighted sum of the chosen experts' MLPs:

    out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])

over the experts this rank holds, `[expert_start, expert_start + E_local)`: a choice of an
expert outside that range contributes nothing, so summing the outputs of every expert-parallel
rank (each with its own range) gives the whole MoE. An expert is
- `swiglu`: w2 @ (silu(gate) * up), with w1 = [gate; up] stacked on rows (Qwen3-MoE, Mixtral);
- `relu2`:  w2 @ relu(w1 @ x)^2 (NemotronH's non-gated experts).

Shapes: x [T, H]; w1 [E_local, N, H] with N = 2 * I (swiglu) or I (relu2); w2 [E_local, H, I];
topk_ids [T, k] int32/int64; topk_weights [T, k] (any float dtype; used in fp32).
Output [T, H] in x's dtype; arithmetic in fp32; each (token, expert) result is weighted, rounded
once to x's dtype and the k of them summed in fp32 (HF's experts round after each projection: a
few ulps apart in bf16, equal in fp32 up to rounding).

The kernels (`fused_moe`), four stages, none of which syncs the host:
1. kernels/moe_align.py groups the T·k (token, choice) pairs by local expert into row blocks of
   BLOCK_M (padding rows -1), within a static bound of blocks.
2. `_up_kernel`, one program per (row block, BLOCK_N columns of I): gathers the block's token
   rows of x, multiplies them by its expert's w1 (both halves for swiglu), applies the
   activation in fp32 and stores it in x's dtype, row by row of the block, into `act`
   [blocks · BLOCK_M, I]. That one rounding of the activation (the operand of the second
   tensor-core product) is the kernel's only departure from the reference: HF rounds there too.
3. `_down_kernel`, one program per (row block, BLOCK_N columns of H): act · w2ᵀ, times each
   pair's routing weight, rounded to x's dtype, into its pair's row of `pair_out` [T·k, H].
4. `_sum_kernel`, one program per (token, column block): the sum in fp32 of the token's local
   pairs (others skipped: their rows were never written), rounded into out.
Blocks of unused tail exit at once; a decode step (T·k pairs) has at most T·k blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from taipan.kernels.activation import silu
from taipan.kernels.moe_align import moe_align
from taipan.kernels.pdl import enter, launch_kwargs

ACTIVATIONS = ("swiglu", "relu2")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WEIGHT_DTYPES = (*DTYPES, torch.float64)  # topk_weights


@triton.jit
def _k_tile(ptrs, k0, ks, K: tl.constexpr, BLOCK_K: tl.constexpr, K_AXIS: tl.constexpr):
    """The tile at `ptrs` of a GEMM operand whose K offsets `k0 + ks` run along axis K_AXIS:
    unmasked when BLOCK_K divides K, else zeros past K."""
    if K % BLOCK_K == 0:
        tile = tl.load(ptrs)
    else:
        k_ok = k0 + ks < K
        if K_AXIS == 0:
            tile = tl.load(ptrs, mask=k_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=k_ok[None, :], other=0.0)
    return tile


@triton.jit
def _up_kernel(
    # pointers
    x_ptr,  # [T, H]
    w1_ptr,  # [E_local, N, H]: gate rows then up rows (swiglu), or the I rows (relu2)
    act_ptr,  # [blocks * BLOCK_M, I] (written)
    sorted_pairs_ptr,  # [blocks * BLOCK_M] int32
    block_expert_ptr,  # [blocks] int32
    # strides (unit stride along H)
    stride_x_t,
    stride_w_e,
    stride_w_n,
    stride_act,
    # meta-parameters
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # past the blocks this routing uses
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows)
    # Padding rows read token 0 (any real row: no mask in the loop) and are never summed.
    token = tl.where(pair >= 0, pair // TOPK, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_x_t + ks[None, :]
    # [BLOCK_K, BLOCK_N] tiles of w1ᵀ; columns past I wrap onto real rows (stores are masked).
    w_ptrs = w1_ptr + expert.to(tl.int64) * stride_w_e + (cols % INTER)[None, :] * stride_w_n
    w_ptrs += ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        xt = _k_tile(x_ptrs, k0, ks, HIDDEN, BLOCK_K, 1)
        w = _k_tile(w_ptrs, k0, ks, HIDDEN, BLOCK_K, 0)
        acc = tl.dot(xt, w, acc=acc, input_precision=DOT_PRECISION)
        if SWIGLU:  # the up half: rows I.. of w1
            w_up = _k_tile(w_ptrs + INTER * stride_w_n, k0, ks, HIDDEN, BLOCK_K, 0)
            acc_up = tl.dot(xt, w_up, acc=acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWIGLU:
        h = silu(acc) * acc_up
    else:
        h = tl.maximum(acc, 0.0)
        h = h * h
    act_ptrs = act_ptr + rows[:, None] * stride_act + cols[None, :]
    tl.store(act_ptrs, h.to(act_ptr.dtype.element_ty), mask=(cols < INTER)[None, :])


@triton.jit
def _down_kernel(
    # pointers
    act_ptr,  # [blocks * BLOCK_M, I]
    w2_ptr,  # [E_local, H, I]
    topk_weights_ptr,  # [T, k]
    pair_out_ptr,  # [T * k, H] (rows of this rank's pairs written)
    sorted_pairs_ptr,  # [blocks * BLOCK_M] int32
    block_expert_ptr,  # [blocks] int32
    # strides (unit stride along I and H)
    stride_act,
    stride_w_e,
    stride_w_h,
    stride_tw_t,
    stride_tw_k,
    stride_pair_out,
    # meta-parameters
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # past the blocks this routing uses
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_act + ks[None, :]
    w_ptrs = w2_ptr + expert.to(tl.int64) * stride_w_e + (cols % HIDDEN)[None, :] * stride_w_h
    w_ptrs += ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        a = _k_tile(a_ptrs, k0, ks, INTER, BLOCK_K, 1)
        w = _k_tile(w_ptrs, k0, ks, INTER, BLOCK_K, 0)
        acc = tl.dot(a, w, acc=acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    row_ok = pair >= 0
    pair = tl.maximum(pair, 0).to(tl.int64)
    weight_ptrs = topk_weights_ptr + (pair // TOPK) * stride_tw_t + (pair % TOPK) * stride_tw_k
    weight = tl.load(weight_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    y = acc * weight[:, None]
    out_ptrs = pair_out_ptr + pair[:, None] * stride_pair_out + cols[None, :]
    tl.store(out_ptrs, y.to(pair_out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < HIDDEN))


@triton.jit
def _sum_kernel(
    # pointers
    pair_out_ptr,  # [T * k, H]
    topk_ids_ptr,  # [T, k]
    out_ptr,  # [T, H] (written)
    # strides
    stride_pair_out,
    stride_ids_t,
    stride_ids_k,
    stride_out_t,
    # scalars
    expert_start,
    # meta-parameters
    NUM_EXPERTS: tl.constexpr,
    HIDDEN: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < HIDDEN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        local = tl.load(topk_ids_ptr + token * stride_ids_t + j * stride_ids_k) - expert_start
        hit = (local >= 0) & (local < NUM_EXPERTS)  # other pairs' rows were never written
        row_ptr = pair_out_ptr + (token * TOPK + j) * stride_pair_out
        acc += tl.load(row_ptr + cols, mask=col_ok & hit, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + token * stride_out_t + cols
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


class _Gemm(NamedTuple):
    block_n: int
    block_k: int  # upper bound: the GEMM takes the largest power of two <= it dividing its K
    num_stages: int


class _Tiles(NamedTuple):
    block_m: int  # rows per block, the alignment's padding unit
    up: _Gemm  # N = I columns (each program reads twice that many rows of w1 for swiglu)
    down: _Gemm  # N = H columns
    num_warps: int


def fused_moe(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str = "swiglu",
    expert_start: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fused_moe_ref`'s contract (module docstring) in Triton; returns out [T, H] in x's dtype
    (`out` if given). Never syncs the host and sizes every grid from shapes alone, so it can be
    captured in a CUDA graph; ids outside the local range are skipped on the device.

    x, w1, w2: fp16/bf16/fp32 of one dtype, unit stride in the last dim (other strides free);
    topk_ids, topk_weights: [T, k], any strides; out: [T, H], unit stride in the last dim, not
    overlapping the inputs. Expert ids are trusted: values are not checked. Scratch from the
    caching allocator (a graph's pool under capture), in x's dtype: the activations,
    moe_align.max_blocks(T·k, E_local, BLOCK_M) · BLOCK_M x I, and the weighted pair results,
    T·k x H.
    """
    _check_kernel_args(x, w1, w2, topk_ids, topk_weights, activation, expert_start, out)
    num_tokens, hidden = x.shape
    num_experts, inter = w1.shape[0], w2.shape[2]
    topk = topk_ids.shape[1]
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or hidden == 0:
        return out
    if topk == 0 or num_experts == 0 or inter == 0:
        return out.zero_()
    num_pairs = num_tokens * topk
    tiles = _tile_config(x, num_pairs, num_experts, activation)
    sorted_pairs, block_expert = moe_align(topk_ids, num_experts, expert_start, tiles.block_m)
    blocks = block_expert.shape[0]
    act = torch.empty(blocks * tiles.block_m, inter, dtype=x.dtype, device=x.device)
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    # fp32 storage (tests, debugging) means fp32 products, not TF32's 10-bit mantissa.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    up, down = tiles.up, tiles.down
    _up_kernel[(blocks, triton.cdiv(inter, up.block_n))](
        x, w1, act, sorted_pairs, block_expert,
        x.stride(0), w1.stride(0), w1.stride(1), act.stride(0),
        HIDDEN=hidden, INTER=inter, TOPK=topk, SWIGLU=activation == "swiglu",
        BLOCK_M=tiles.block_m, BLOCK_N=up.block_n, BLOCK_K=_block_k(hidden, up.block_k),
        DOT_PRECISION=precision, num_warps=tiles.num_warps, num_stages=up.num_stages,
        **launch_kwargs(x.device),
    )  # fmt: skip
    _down_kernel[(blocks, triton.cdiv(hidden, down.block_n))](
        act, w2, topk_weights, pair_out, sorted_pairs, block_expert,
        act.stride(0), w2.stride(0), w2.stride(1),
        topk_weights.stride(0), topk_weights.stride(1), pair_out.stride(0),
        HIDDEN=hidden, INTER=inter, TOPK=topk,
        BLOCK_M=tiles.block_m, BLOCK_N=down.block_n, BLOCK_K=_block_k(inter, down.block_k),
        DOT_PRECISION=precision, num_warps=tiles.num_warps, num_stages=down.num_stages,
        **launch_kwargs(act.device),
    )  # fmt: skip
    block = min(triton.next_power_of_2(hidden), 1024)
    _sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        pair_out, topk_ids, out,
        pair_out.stride(0), topk_ids.stride(0), topk_ids.stride(1), out.stride(0),
        expert_start,
        NUM_EXPERTS=num_experts, HIDDEN=hidden, TOPK=topk, BLOCK=block,
        **launch_kwargs(pair_out.device),
    )  # fmt: skip
    return out


def _tile_config(x, num_pairs: int, num_experts: int, activation: str) -> _Tiles:
    """Tiles for this launch, from shapes only. BLOCK_M follows the rows an expert gets on
    average: decode-sized steps (a few rows per expert) stream weights through 16-row tiles;
    prefill reuses each weight tile across 64 rows. Picked from a sweep on an H100 (bf16,
    Qwen3-30B-A3B and NemotronH sizes, under CUDA graphs); the neighbours of each choice were
    within a few percent."""
    if not x.is_cuda:  # the CPU interpreter: small tiles, few programs
        return _Tiles(16, _Gemm(32, 32, 1), _Gemm(32, 32, 1), 4)
    rows = num_pairs / num_experts
    if x.element_size() == 4:  # fp32 storage (tests, debugging): IEEE products, smaller tiles
        return _Tiles(16 if rows <= 16 else 32, _Gemm(32, 32, 2), _Gemm(64, 32, 2), 4)
    up_n = 64 if activation == "swiglu" else 128  # swiglu's two accumulators: half the columns
    if rows <= 16:
        return _Tiles(16, _Gemm(up_n // 2, 128, 4), _Gemm(64, 128, 3), 4)
    if rows <= 32:
        return _Tiles(32, _Gemm(up_n, 128, 4), _Gemm(128, 64, 3), 4)
    return _Tiles(64, _Gemm(up_n, 128, 4), _Gemm(128, 64, 3), 4)


def _block_k(k: int, cap: int) -> int:
    """The largest power of two <= cap (and >= 16) that divides k, else cap (masked tail)."""
    block = cap
    while block > 16 and k % block:
        block //= 2
    return block if k % block == 0 else cap


def _check_kernel_args(x, w1, w2, topk_ids, topk_weights, activation, expert_start, out) -> None:
    """`_check_args` plus what the kernels need: dtypes, unit strides, one device, out."""
    _check_args(x, w1, w2, topk_ids, topk_weights, activation)
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if w1.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"w1 and w2 must be {x.dtype} like x, got {w1.dtype} and {w2.dtype}")
    if topk_weights.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"topk_weights must be a float tensor, got {topk_weights.dtype}")
    for name, t in (("x", x), ("w1", w1), ("w2", w2)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(
                f"{name} must have unit stride in its last dim, got strides {t.stride()}: "
                "pass a .contiguous() copy"
            )
    if isinstance(expert_start, bool) or not isinstance(expert_start, int) or expert_start < 0:
        raise ValueError(f"expert_start must be a host int >= 0, got {expert_start!r}")
    if topk_ids.numel() >= 2**31:
        raise ValueError(f"T * k = {topk_ids.numel()} pairs must be < 2**31")
    if out is not None:
        if out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
            raise ValueError(
                f"out must be {tuple(x.shape)} {x.dtype} with unit stride in its last dim, got "
                f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
            )
    for name, t in (("w1", w1), ("w2", w2), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                    ("out", out)):  # fmt: skip
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def _check_args(x, w1, w2, topk_ids, topk_weights, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"x must be [T, H], w1 [E, N, H], w2 [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w1.shape)}, {tuple(w2.shape)}"
        )
    experts, n, hidden = w1.shape
    inter = w2.shape[2]
    want_n = 2 * inter if activation == "swiglu" else inter
    if hidden != x.shape[1] or w2.shape[:2] != (experts, hidden) or n != want_n:
        raise ValueError(
            f"{activation} experts: w1 must be [E, {want_n}, {x.shape[1]}] and w2 "
            f"[E, {x.shape[1]}, I]; got {tuple(w1.shape)} and {tuple(w2.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2:
        raise ValueError(
            f"topk_ids and topk_weights must both be [T, k], got {tuple(topk_ids.shape)} and "
            f"{tuple(topk_weights.shape)}"
        )
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows for {x.shape[0]} tokens")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")


def fused_moe_ref(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str = "swiglu",
    expert_start: int = 0,
) -> torch.Tensor:
    """The MoE output of the experts [expert_start, expert_start + E_local) (module docstring).
    Loops over the experts that received a token (a host sync per step: the CPU path)."""
    _check_args(x, w1, w2, topk_ids, topk_weights, activation)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_start  # [T, k]: local expert index, or out of range
    hit = (local >= 0) & (local < w1.shape[0])
    for e in torch.unique(local[hit]).tolist():
        token, choice = torch.nonzero(local == e, as_tuple=True)
        h = x[token].float() @ w1[e].float().t()  # [n, N]
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.relu(h).square()
        y = (h @ w2[e].float().t()) * topk_weights[token, choice, None].float()  # [n, H]
        out.index_add_(0, token, y.to(x.dtype).float())  # rounded once, as a kernel stores it
    return out.to(x.dtype)
