"""A tensor-parallel rank's row-parallel GEMV (o_proj, down_proj at one to four rows) with the
all-reduce, the residual add and the RMSNorm after it in the same launch:
`gemv_all_reduce_rms_norm` (kernel + launcher) and `gemv_all_reduce_rms_norm_ref`.

Under TP a decoder layer's o_proj and down_proj each leave a partial sum per rank, which
kernels/all_reduce_norm.py sums, adds to the residual and normalizes in a launch of its own
after the product. Here the product's programs push their columns of the partial rows straight
into every rank's buffer (their own included), each from its own source slot, so the sum reads
only local memory; the last program of the launch to finish (a counter of finished programs)
raises this rank's flag at every peer, waits for every peer's, sums the rows in rank order in
fp32, adds the residual and normalizes, as the all-reduce kernel does after kernels/gemv.py's
product. One launch and its gap fewer per sum: two per layer.

Protocol (as kernels/all_reduce.py's, over buffers, flags and counters of its own):
- `state` holds this rank's call count (the epoch: every rank's e-th call is the same sum) and
  the programs of the current call that have finished. Every program reads the count first;
  only the last program to finish, which has acquired every other program's increment (and so
  every read before it), stores the new count and resets the finished count, so calls of any
  grid may follow each other;
- the data goes to half epoch % 2 of each destination buffer [2, WORLD, rows_cap, row_stride],
  at the source rank's slot; a program's stores are ordered before its increment of the
  finished count (an acq_rel atomic at system scope), and the last program's flag (release,
  system scope) after it has acquired them all;
- a rank writes half e % 2 of a peer's buffer again only in call e + 2, which starts after its
  call e + 1 saw that peer's flag e + 1, which the peer raised after its call e had read that
  half: no closing barrier is needed.
Numerics: the partial rows rounded to the storage dtype (as F.linear stores them), summed in rank
order in fp32, rounded (as the all-reduce stores the sum), added to the residual in fp32 and
stored, then kernels/rmsnorm.py's norm of the stored row: every rank gets the same rows.

No host synchronisation: CUDA-graph safe. A peer that never comes leaves the wait spinning (as an
NCCL call would), unless `max_spins` bounds it (then `status` is set to 1 and the rows are
summed with whatever arrived).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.all_reduce import MAX_WORLD, UNBOUNDED, check_group
from taipan.kernels.gemv import MAX_ROWS, _products, gemv_ref
from taipan.kernels.pdl import enter, launch_kwargs
from taipan.kernels.rmsnorm import rms_norm_ref

BLOCK_N = 4  # output columns a program


@triton.jit
def _gemv_all_reduce_rms_norm_kernel(
    # pointers
    x_ptr,  # [M, K] this rank's input (its shard of the columns)
    w_ptr,  # [N, K] this rank's columns of the row-parallel matrix
    residual_ptr,  # [M, N], overwritten with sum + residual
    weight_ptr,  # [N] RMSNorm weight
    out_ptr,  # [M, N] rmsnorm(sum + residual) * weight
    state_ptr,  # [2] int64: this rank's call count, the current call's finished programs
    status_ptr,  # [1] int32, set to 1 when a wait gave up
    bufs,  # WORLD buffers [2, WORLD, rows_cap, ROW_STRIDE] (by destination rank)
    flags,  # WORLD flag arrays [MAX_WORLD] int64 (by destination rank, slot = source)
    # sizes
    M,
    N,
    K,
    rows_cap,
    max_spins,
    # strides
    stride_x,
    stride_w,
    stride_residual,
    stride_out,
    # meta-parameters
    eps: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_ROW: tl.constexpr,  # N rounded up to a power of two (the last program's rows)
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = tl.load(state_ptr) + 1  # (stored by the last program of the call before)
    half = (epoch % 2) * WORLD * rows_cap * ROW_STRIDE
    slot = RANK * rows_cap * ROW_STRIDE  # this rank's source slot in every buffer
    dtype = out_ptr.dtype.element_ty
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc, _ = _products(
        x_ptr, stride_x, M, w_rows, w_rows, col_mask, weight_ptr, K, eps,
        False, False, False, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    part = acc.to(dtype)  # this rank's partial rows, as F.linear would store them
    rows = tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & col_mask[None, :]
    at = half + slot + rows[:, None] * ROW_STRIDE + cols[None, :]
    for q in tl.static_range(WORLD):
        tl.store(bufs[q] + at, part, mask=mask)
    tl.debug_barrier()  # the program's stores are issued before its increment
    finished = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="sys")
    if finished == programs - 1:  # the last program of this call on this rank
        tl.store(state_ptr, epoch)  # (every program has read the count: the next call's)
        tl.store(state_ptr + 1, 0)
        for q in tl.static_range(WORLD):
            if q != RANK:
                tl.atomic_xchg(flags[q] + RANK, epoch, sem="release", scope="sys")
        for q in tl.static_range(WORLD):
            if q != RANK:
                seen = tl.atomic_add(flags[RANK] + q, 0, sem="acquire", scope="sys")
                spins = 0
                while (seen < epoch) & (spins < max_spins):
                    seen = tl.atomic_add(flags[RANK] + q, 0, sem="acquire", scope="sys")
                    spins += 1
                if seen < epoch:
                    tl.store(status_ptr, 1)
        tl.debug_barrier()  # every thread reads only after the peers' flags were seen
        wide = tl.arange(0, BLOCK_ROW)
        wide_mask = wide < N
        weight = tl.load(weight_ptr + wide, mask=wide_mask, other=0.0).to(tl.float32)
        own = bufs[RANK] + half
        for row in range(0, M):
            total = tl.zeros([BLOCK_ROW], dtype=tl.float32)
            for q in tl.static_range(WORLD):
                src = own + q * rows_cap * ROW_STRIDE + row * ROW_STRIDE + wide
                total += tl.load(src, mask=wide_mask, other=0.0, cache_modifier=".cg").to(
                    tl.float32
                )
            reduced = total.to(dtype).to(tl.float32)  # the sum as the all-reduce stores it
            residual_row = residual_ptr + row * stride_residual + wide
            summed = reduced + tl.load(residual_row, mask=wide_mask, other=0.0).to(tl.float32)
            stored = summed.to(residual_ptr.dtype.element_ty)
            tl.store(residual_row, stored, mask=wide_mask)
            h = stored.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
            normed = (h * rstd).to(dtype).to(tl.float32)
            result = (normed * weight).to(dtype)
            tl.store(out_ptr + row * stride_out + wide, result, mask=wide_mask)


def gemv_all_reduce_rms_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,
    bufs: tuple[torch.Tensor, ...],
    flags: tuple[torch.Tensor, ...],
    rank: int,
    status: torch.Tensor,
    max_spins: int = UNBOUNDED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- (the sum over the group of x @ w.T) + residual; returns
    (rmsnorm(residual) * weight, residual). Every rank makes this call with the same shapes, in
    the same order as every other call on these buffers.

    x: [M, K] (M <= MAX_ROWS), w: [N, K] (this rank's columns), residual: [M, N], weight: [N];
    one dtype, rows of unit stride. bufs[q]: rank q's buffer of that dtype, [2, WORLD,
    rows_cap, row_stride] contiguous (M <= rows_cap, N <= row_stride); flags[q]: rank q's
    [MAX_WORLD] int64; state: [2] int64 zeros at first, this rank's and used by no other
    kernel; status: [1] int32."""
    _check_args(x, w, residual, weight, state, bufs, flags, rank, status)
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out, residual
    _, world, rows_cap, row_stride = bufs[0].shape
    _gemv_all_reduce_rms_norm_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, w, residual, weight, out, state, status, tuple(bufs), tuple(flags),
        m, n, k, rows_cap, max_spins,
        x.stride(0), w.stride(0), residual.stride(0), out.stride(0),
        eps=float(eps), ROW_STRIDE=row_stride, RANK=rank, WORLD=world,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=BLOCK_N,
        BLOCK_K=min(1024, triton.next_power_of_2(k)), BLOCK_ROW=triton.next_power_of_2(n),
        num_warps=4, **launch_kwargs(x.device),
    )  # fmt: skip
    return out, residual


def _check_args(x, w, residual, weight, state, bufs, flags, rank, status) -> None:
    world = check_group(bufs, flags, rank)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x [M, K] and w [N, K] do not fit: {tuple(x.shape)}, {tuple(w.shape)}")
    m, n = x.shape[0], w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows, got {m}")
    for name, t in {"w": w, "residual": residual, "weight": weight}.items():
        if t.dtype != x.dtype or t.device != x.device or t.stride(-1) != 1:
            raise ValueError(f"{name} must be {x.dtype} on {x.device} with unit last stride")
    if x.stride(-1) != 1:
        raise ValueError("x needs rows of unit stride")
    if residual.shape != (m, n) or weight.shape != (n,):
        raise ValueError(
            f"residual must be [{m}, {n}] and weight [{n}], got {tuple(residual.shape)} and "
            f"{tuple(weight.shape)}"
        )
    shapes = {tuple(b.shape) for b in bufs}
    if len(shapes) != 1 or any(b.dtype != x.dtype or not b.is_contiguous() for b in bufs):
        raise ValueError(f"every buffer must be contiguous, of x's dtype {x.dtype}, one shape")
    shape = shapes.pop()
    if len(shape) != 4 or shape[:2] != (2, world) or shape[2] < m or shape[3] < n:
        raise ValueError(f"buffers of shape {shape} do not hold 2 x {world} slots of {m} x {n}")
    if any(f.dtype != torch.int64 or tuple(f.shape) != (MAX_WORLD,) for f in flags):
        raise ValueError(f"every flag array must be int64 [{MAX_WORLD}]")
    if state.dtype != torch.int64 or tuple(state.shape) != (2,):
        raise ValueError("state must be int64 [2]")
    if status.dtype != torch.int32 or status.numel() != 1:
        raise ValueError("status must be one int32")


def gemv_all_reduce_rms_norm_ref(
    xs: list[torch.Tensor],
    ws: list[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What every rank's call returns, given every rank's x and w: each partial product rounded
    to the storage dtype, summed in rank order in fp32 and rounded, then kernels/rmsnorm.py's
    fused add and norm (residual updated in place)."""
    parts = [gemv_ref(x, w).float() for x, w in zip(xs, ws, strict=True)]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return rms_norm_ref(total.to(residual.dtype), weight, eps, residual=residual)
