"""The one-shot all-reduce of kernels/all_reduce.py fused with the residual add and RMSNorm that
follow it in a tensor-parallel decoder layer: `one_shot_all_reduce_rms_norm` (kernel +
launcher) and `all_reduce_rms_norm_ref`.

A row-parallel projection (o_proj, down_proj) leaves each rank a partial sum of the hidden state;
the next step is `residual <- sum + residual; out <- rmsnorm(residual) * weight`. Done apart, that
is two launches per sum (a 32-layer model has 64 sums per step) and a round trip of the sum through
memory; here it is one.

The protocol is kernels/all_reduce.py's (epochs per program from device counters, the data in
half epoch % 2 of each rank's buffer, flags raised with release and awaited with acquire, system
scope, every rank summing in rank order in fp32), over buffers, flags and counters of its own
(the two kernels never share them). It works by rows: row r of x always goes to program
r % MAX_PROGRAMS (the grid is min(rows, MAX_PROGRAMS)) and to the buffer's row slot r, of fixed
`row_stride` elements whatever the row length, so the calls that touch a slot alternate its
halves and no closing barrier is needed, for the same reason as there.

Numerics equal the two kernels run one after the other: the sum is rounded to x's dtype, added to
the residual in fp32 and stored in the residual's dtype, and that stored row is normalized as
kernels/rmsnorm.py does (HF Llama's order). Every rank gets bitwise the same rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.all_reduce import (
    DTYPES,
    MAX_PROGRAMS,
    MAX_WORLD,
    UNBOUNDED,
    all_reduce_ref,
    check_group,
)
from taipan.kernels.pdl import enter, launch_kwargs
from taipan.kernels.rmsnorm import rms_norm_ref


@triton.jit
def _all_reduce_rms_norm_kernel(
    # pointers
    x_ptr,  # [T, N] this rank's partial sum
    residual_ptr,  # [T, N], overwritten with sum + residual
    weight_ptr,  # [N]
    out_ptr,  # [T, N] rmsnorm(sum + residual) * weight (may be x)
    counters_ptr,  # [MAX_PROGRAMS] int64, this rank's call count per program
    status_ptr,  # [1] int32, set to 1 when a wait gave up
    bufs,  # WORLD data buffers [2, rows_cap, ROW_STRIDE], in rank order
    flags,  # WORLD flag arrays [MAX_PROGRAMS, MAX_WORLD] int64, in rank order
    # sizes
    num_rows,
    rows_cap,
    max_spins,
    # strides
    stride_x_row,
    stride_residual_row,
    stride_out_row,
    # meta-parameters
    eps: tl.constexpr,
    N: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    FLAG_STRIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = tl.load(counters_ptr + pid) + 1
    tl.debug_barrier()  # every thread has read the count before it changes
    tl.store(counters_ptr + pid, epoch)
    half = (epoch % 2) * rows_cap * ROW_STRIDE
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    own = bufs[RANK] + half
    for row in range(pid, num_rows, programs):
        part = tl.load(x_ptr + row * stride_x_row + cols, mask=mask)
        tl.store(own + row * ROW_STRIDE + cols, part, mask=mask)
    tl.debug_barrier()  # the whole share is written before the flags go up
    for q in tl.static_range(WORLD):
        if q != RANK:
            slot = flags[q] + pid * FLAG_STRIDE + RANK
            tl.atomic_xchg(slot, epoch, sem="release", scope="sys")
    for q in tl.static_range(WORLD):
        if q != RANK:
            slot = flags[RANK] + pid * FLAG_STRIDE + q
            seen = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
            spins = 0
            while (seen < epoch) & (spins < max_spins):
                seen = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
                spins += 1
            if seen < epoch:
                tl.store(status_ptr, 1)
    tl.debug_barrier()  # every thread reads only after the peers' flags were seen
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, num_rows, programs):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            peer_row = bufs[q] + half + row * ROW_STRIDE + cols
            acc += tl.load(peer_row, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        # The sum as the plain all-reduce would store it, then kernels/rmsnorm.py's steps.
        reduced = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        residual_row = residual_ptr + row * stride_residual_row + cols
        summed = reduced + tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)
        stored = summed.to(residual_ptr.dtype.element_ty)
        tl.store(residual_row, stored, mask=mask)
        h = stored.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        normed = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        result = (normed * weight).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_out_row + cols, result, mask=mask)


def programs_for_rows(num_rows: int) -> int:
    """The grid of a launch over num_rows rows: one program per row, at most MAX_PROGRAMS."""
    return max(1, min(MAX_PROGRAMS, num_rows))


def one_shot_all_reduce_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    counters: torch.Tensor,
    bufs: tuple[torch.Tensor, ...],
    flags: tuple[torch.Tensor, ...],
    rank: int,
    status: torch.Tensor,
    max_spins: int = UNBOUNDED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- (the sum of every rank's x) + residual, out <- rmsnorm(residual) * weight;
    returns (out, residual). Every rank makes this call with the same shapes, in the same order
    as every other collective on these buffers.

    x, residual, out: [T, N], one dtype (fp16, bf16 or fp32), rows of unit stride; `out` may be
    x, never residual; weight: [N] contiguous, that dtype. bufs[q]: rank q's buffer in that
    dtype, [2, rows_cap, row_stride] contiguous with N <= row_stride and T <= rows_cap; flags
    and counters as for `one_shot_all_reduce` (but only ever used by this kernel). `max_spins`
    and `status` as there. No host synchronisation: CUDA-graph safe."""
    _check_args(x, residual, weight, out, counters, bufs, flags, rank, status)
    num_rows, hidden = x.shape
    if num_rows == 0:
        return out, residual
    _, rows_cap, row_stride = bufs[0].shape
    block = triton.next_power_of_2(hidden)
    _all_reduce_rms_norm_kernel[(programs_for_rows(num_rows),)](
        x, residual, weight, out, counters, status, tuple(bufs), tuple(flags),
        num_rows, rows_cap, max_spins, x.stride(0), residual.stride(0), out.stride(0),
        eps=float(eps), N=hidden, ROW_STRIDE=row_stride, RANK=rank, WORLD=len(bufs),
        FLAG_STRIDE=MAX_WORLD, BLOCK=block, num_warps=max(1, min(8, block // 512)),
        **launch_kwargs(x.device),
    )  # fmt: skip
    return out, residual


def _check_args(x, residual, weight, out, counters, bufs, flags, rank, status) -> None:
    check_group(bufs, flags, rank)
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be [rows, N] of {DTYPES}, got {tuple(x.shape)} {x.dtype}")
    for name, t in {"residual": residual, "out": out}.items():
        if t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(
                f"{name} must match x ({tuple(x.shape)}, {x.dtype}), got "
                f"{tuple(t.shape)}, {t.dtype}"
            )
    if any(t.stride(-1) != 1 for t in (x, residual, out)):
        raise ValueError("x, residual and out need rows of unit stride")
    if out.data_ptr() == residual.data_ptr():
        raise ValueError("out must not be residual: residual receives the sum in place")
    rows, hidden = x.shape
    if weight.shape != (hidden,) or weight.dtype != x.dtype or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{hidden}] {x.dtype} tensor")
    shapes = {tuple(b.shape) for b in bufs}
    if len(shapes) != 1 or any(b.dtype != x.dtype or not b.is_contiguous() for b in bufs):
        raise ValueError(f"every buffer must be contiguous, of x's dtype {x.dtype}, one shape")
    shape = shapes.pop()
    if len(shape) != 3 or shape[0] != 2 or shape[2] < hidden or shape[1] < rows:
        raise ValueError(
            f"buffers of shape {shape} do not hold 2 halves of {rows} rows of {hidden}"
        )
    flag_shape = (MAX_PROGRAMS, MAX_WORLD)
    if any(f.dtype != torch.int64 or tuple(f.shape) != flag_shape for f in flags):
        raise ValueError(f"every flag array must be int64 {flag_shape}")
    if counters.dtype != torch.int64 or tuple(counters.shape) != (MAX_PROGRAMS,):
        raise ValueError(f"counters must be int64 [{MAX_PROGRAMS}]")
    if status.dtype != torch.int32 or status.numel() != 1:
        raise ValueError("status must be one int32")


def all_reduce_rms_norm_ref(
    xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What every rank's `one_shot_all_reduce_rms_norm` returns, given every rank's x and the
    (shared) residual: the fp32 rank-order sum cast to x's dtype, then kernels/rmsnorm.py's
    fused add and norm. residual is updated in place, as there."""
    return rms_norm_ref(all_reduce_ref(xs), weight, eps, residual=residual)
