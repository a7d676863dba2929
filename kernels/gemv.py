"""Matrix-vector products for a few token rows (decode at small batch), fused with what sits
around a projection in a Llama decoder layer: `gemv` (kernel + launcher) and `gemv_ref` (the
same contract in torch).

At batch 1 a decode step is a chain of ~10 kernels per layer, each reading little; the fixed
cost of a kernel in a graph (its launch, ramp and tail, a few microseconds) adds up to a fifth
of the step. One program here computes BLOCK_N outputs of every row, and takes on:
- `norm_weight`: the RMSNorm before the projection: each program sums the squares of the rows
  as it reads them (a row is a few KB, from L2) and scales its sums by 1/rms at the end, so the
  norm kernel and its output buffer go. The normalized row is never rounded to the storage
  dtype (HF rounds it twice, after the 1/rms and after the weight): in bf16 the products
  differ from the unfused path's by that rounding; in fp32 only by the order of the sums.
  `gemma_norm`: Gemma's (1 + w) norm (fp32 throughout in HF too);
- `gated`: w holds the gate rows then the up rows (SwiGLUMLP's gate_up_proj); the program
  computes both halves of its columns and writes silu(gate) * up, or gelu_tanh(gate) * up
  (Gemma; kernels/activation.py's numerics), so the activation kernel goes;
- `residual`: the product is added into `residual` in place (rounded to the storage dtype first,
  as F.linear's output would be, then added in fp32 and rounded once, as kernels/rmsnorm.py adds
  its residual), so the add leaves the next norm's kernel;
- `bias` (Qwen2's qkv), added in fp32 before the rounding.

Writes only `out` (or `residual`); reads x, w and the vectors. Each output element is owned by
one program, so `residual` may be read and written by the same launch. No host
synchronisation: CUDA-graph safe.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from taipan.kernels.activation import gelu_tanh, silu
from taipan.kernels.pdl import enter, launch_kwargs
from taipan.kernels.rope import rope_and_write_kv_ref

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = ("silu", "gelu_tanh")
MAX_ROWS = 4  # beyond this a GEMM (cuBLAS) reads the weights as few times and computes better


@triton.jit
def _products(
    x_ptr, stride_x, M, w_rows, w2_rows, col_mask, norm_ptr, K, eps,
    NORM: tl.constexpr, GEMMA_NORM: tl.constexpr, TWO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M, BLOCK_N] sums of the rows of x (normalized with NORM) times the weight rows at
    `w_rows` [BLOCK_N, 1] (and, with TWO, at `w2_rows`: the second sums, else zeros), fp32.
    Products accumulate elementwise and are summed over K once, after the loop: the loop is
    loads and multiply-adds only, no reduction across threads per tile; the weights' tiles are
    read once for every row."""
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_rows = x_ptr + rows[:, None] * stride_x
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    two3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)  # NORM: the rows' squares
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x_mask = row_mask[:, None] & k_mask[None, :]
        xs = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
        if NORM:  # x * weight now, times the row's 1/rms once the sums are done
            sq += xs * xs
            nw = tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            if GEMMA_NORM:
                nw += 1.0
            xs *= nw[None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
        acc3 += xs[:, None, :] * w[None, :, :]
        if TWO:
            w2 = tl.load(w2_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
            two3 += xs[:, None, :] * w2[None, :, :]
    acc = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]
    acc2 = tl.sum(two3, axis=2)
    if NORM:
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]  # [BLOCK_M, 1]
        acc *= rstd
        acc2 *= rstd
    return acc, acc2


@triton.jit
def _gemv_kernel(
    # pointers
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (GATED: [2N, K], gate rows then up rows)
    bias_ptr,  # [N] (HAS_BIAS)
    norm_ptr,  # [K] RMSNorm weight (NORM)
    out_ptr,  # [M, N]; RESIDUAL: the residual stream, updated in place
    # sizes
    M,
    N,
    K,
    # strides
    stride_x,
    stride_w,
    stride_out,
    # meta-parameters
    eps: tl.constexpr,
    NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,  # Gemma's norm: x / rms(x) * (1 + weight)
    GATED: tl.constexpr,
    GELU: tl.constexpr,  # GATED with gelu_tanh (Gemma) instead of silu
    RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's outputs
    col_mask = cols < N
    rows = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc, acc_up = _products(
        x_ptr, stride_x, M, w_rows, w_rows + N * stride_w, col_mask, norm_ptr, K, eps,
        NORM, GEMMA_NORM, GATED, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    result = acc.to(dtype)
    if GATED:  # the activation of the rounded gate times the rounded up, rounded once
        gate = result.to(tl.float32)
        if GELU:  # (HF rounds gelu's output before the product: kernels/activation.py)
            act = gelu_tanh(gate).to(dtype).to(tl.float32)
        else:
            act = silu(gate)
        result = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
    out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    out_mask = (rows[:, None] < M) & col_mask[None, :]
    if RESIDUAL:
        stream = tl.load(out, mask=out_mask, other=0.0).to(tl.float32)
        result = (stream + result.to(tl.float32)).to(dtype)
    tl.store(out, result, mask=out_mask)


def _blocks(n: int, k: int, gated: bool, sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): many programs, each loading a few KB of weights per
    iteration, on a GPU of `sms` multiprocessors. A tiny matrix needs no such spread (and the
    CPU interpreter pays per program)."""
    if n * k < 1 << 18:
        return 16, min(512, triton.next_power_of_2(k)), 4
    # Four outputs a program. Chosen by the whole graphed batch-1 step, where PDL overlaps the
    # kernels (tests/perf/fused_decode_bench.py blocks, H200): a gated product (two weight rows
    # an output) in rows of 512 with two warps, a large plain one in rows of 1,024 with two
    # warps, the rest with four: Qwen2.5-7B 4.45 -> 4.21 ms, Gemma 3 12B 7.63 -> 7.40, Gemma
    # 3 1B 1.39 -> 1.33, Llama 1B 0.98 -> 0.94, Llama 8B 4.53 -> 4.47. A per-kernel sweep
    # (`kernels`) picks other blocks that make the step slower: it cannot see the overlap.
    # A large plain product of under four such programs an SM (Llama 1B's down, N = 2,048)
    # reads rows of 2,048 with four warps, for more bytes in flight: 1B 0.942 -> 0.900 ms; a
    # wide one (N >= 2K: Gemma 3 12B's qkv) eight outputs a program with four warps: 12B 7.394
    # -> 7.303; Llama 8B, Qwen2.5-7B and Gemma 3 1B unchanged (`blocks`, the twenty-second
    # session's rules, H200).
    if gated:
        return 4, min(512, triton.next_power_of_2(k)), 2
    if n * k >= 1 << 24 and n // 4 < 4 * sms:
        return 4, min(2048, triton.next_power_of_2(k)), 4
    if n * k >= 1 << 24 and n >= 2 * k:
        return 8, min(1024, triton.next_power_of_2(k)), 4
    return 4, min(1024, triton.next_power_of_2(k)), 2 if n * k >= 1 << 24 else 4


def _sm_count(device: torch.device) -> int:
    """The GPU's multiprocessors (132 on an H100 or H200; the CPU interpreter: 132 too)."""
    if device.type != "cuda":
        return 132
    return _sm_count_cuda(device.index if device.index is not None else 0)


@functools.cache
def _sm_count_cuda(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gemma_norm: bool = False,
    gated: bool = False,
    activation: str = "silu",
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS) -> [M, N] = f(x) @ w.T: w [N, K] (`gated`: [2N, K], gate then
    up rows, and the result is silu(x @ gate.T) * (x @ up.T)). `norm_weight` [K]: x is
    RMS-normalized first (eps `eps`; `gemma_norm`: Gemma's x / rms(x) * (1 + weight)).
    `activation`: the gate's, "silu" (SwiGLU) or "gelu_tanh" (Gemma). `bias` [N] (not with
    `gated`). `residual` [M, N]: the
    result is added into it in place and it is returned (no `out`). All of one dtype and
    device; rows with unit stride in the last dim."""
    n = w.shape[0] // 2 if gated else w.shape[0]
    _check_args(x, w, bias, norm_weight, gated, residual, out, n)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    m, k = x.shape
    if residual is not None:
        out = residual
    elif out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k, warps = _blocks(n, k, gated, _sm_count(x.device))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        bias if bias is not None else w,
        norm_weight if norm_weight is not None else w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        eps=float(eps),
        NORM=norm_weight is not None,
        GEMMA_NORM=bool(gemma_norm),
        GATED=bool(gated),
        GELU=activation == "gelu_tanh",
        RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        **launch_kwargs(x.device),
    )
    return out


def _check_args(x, w, bias, norm_weight, gated, residual, out, n) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(
            f"x must be [rows, K] and w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {m}: use a GEMM")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if w.shape[1] != k or (gated and w.shape[0] % 2):
        rows = "2N" if gated else "N"
        raise ValueError(f"w must be [{rows}, {k}] for x {tuple(x.shape)}, got {tuple(w.shape)}")
    if gated and bias is not None:
        raise ValueError("a gated gemv takes no bias")
    if out is not None and residual is not None:
        raise ValueError("pass out or residual, not both: residual receives the result")
    shapes = {"bias": (n,), "norm_weight": (k,), "residual": (m, n), "out": (m, n)}
    named = {"x": x, "w": w, "bias": bias, "norm_weight": norm_weight, "residual": residual}
    for name, t in {**named, "out": out}.items():
        if t is None:
            continue
        if name in shapes and tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name} must be {shapes[name]}, got {tuple(t.shape)}")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(
                f"{name} must be {x.dtype} on {x.device} like x, got {t.dtype} on {t.device}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got {t.stride()}")


def gemv_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gemma_norm: bool = False,
    gated: bool = False,
    activation: str = "silu",
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gemv` in plain torch: the unfused ops in HF's order of roundings (the kernel skips the
    normalized row's two: equal in fp32 up to the order of the sums)."""
    dtype = x.dtype
    if norm_weight is not None:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        if gemma_norm:  # (fp32 throughout, one rounding: Gemma3RMSNorm)
            x = (normed * (1.0 + norm_weight.float())).to(dtype)
        else:
            x = (normed.to(dtype).float() * norm_weight.float()).to(dtype)
    y = (x.float() @ w.float().T + (0.0 if bias is None else bias.float())).to(dtype)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        if activation == "gelu_tanh":
            act = torch.nn.functional.gelu(gate.float(), approximate="tanh").to(dtype).float()
        else:
            act = torch.nn.functional.silu(gate.float())
        y = (act * up.float()).to(dtype)
    if residual is not None:
        return residual.copy_((residual.float() + y.float()).to(dtype))
    if out is None:
        return y
    return out.copy_(y)


@triton.jit
def _qkv_rope_kernel(
    # pointers
    x_ptr,  # [M, K]
    w_ptr,  # [(H + 2 KVH) * D, K]: q heads, then k heads, then v heads
    bias_ptr,  # [(H + 2 KVH) * D] (HAS_BIAS)
    norm_ptr,  # [K] RMSNorm weight (NORM)
    positions_ptr,  # [M]
    cos_sin_ptr,  # [max_pos, D] fp32: cos | sin
    kv_cache_ptr,  # [2, num_blocks, block_size, KVH, D]
    slot_mapping_ptr,  # [M] int64, -1 = padding
    q_ptr,  # [M, H * D] out: rotated q
    # sizes
    M,
    K,
    # strides
    stride_x,
    stride_w,
    stride_cos_sin,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    stride_q,
    # meta-parameters
    eps: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,  # rotation pairs (i, i + HEAD_DIM / 2) a program; divides HALF
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    HALF = HEAD_DIM // 2
    dtype = q_ptr.dtype.element_ty
    first = tl.program_id(0) * BLOCK_P  # this program's first pair: all in one head
    head = first // HALF
    dims = first % HALF + tl.arange(0, BLOCK_P)  # [BLOCK_P] in the head's first half
    cols = head * HEAD_DIM + dims  # the pairs' first rows; the second ones HALF further
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    all_cols = cols < (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    a, b = _products(
        x_ptr, stride_x, M, w_rows, w_rows + HALF * stride_w, all_cols, norm_ptr, K, eps,
        NORM, False, True, BLOCK_M, BLOCK_P, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        a += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        b += tl.load(bias_ptr + HALF + cols).to(tl.float32)[None, :]
    # The projection's output as F.linear would store it, then rotated in fp32 and rounded
    # once (kernels/rope.py's numerics).
    a = a.to(dtype).to(tl.float32)
    b = b.to(dtype).to(tl.float32)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    mask = row_mask[:, None] & (dims < HALF)[None, :]
    if head < NUM_HEADS + NUM_KV_HEADS:  # q or k: rotated by each row's position
        pos = tl.load(positions_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        table = cos_sin_ptr + pos[:, None] * stride_cos_sin + dims[None, :]
        cos = tl.load(table, mask=mask, other=0.0)
        sin = tl.load(table + HALF, mask=mask, other=0.0)
        a, b = a * cos - b * sin, b * cos + a * sin
    if head < NUM_HEADS:
        q = q_ptr + rows[:, None] * stride_q + cols[None, :]
        tl.store(q, a.to(dtype), mask=mask)
        tl.store(q + HALF, b.to(dtype), mask=mask)
    else:  # k (rotated) or v (raw) into each row's slot, unless it is padding
        slot = tl.load(slot_mapping_ptr + rows, mask=row_mask, other=-1)
        kv = (head - NUM_HEADS) // NUM_KV_HEADS  # 0: k, 1: v
        kv_head = (head - NUM_HEADS) % NUM_KV_HEADS
        dst = (
            kv_cache_ptr
            + kv * stride_cache_kv
            + slot[:, None] * stride_cache_slot
            + kv_head * stride_cache_head
            + dims[None, :]
        )
        keep = mask & (slot >= 0)[:, None]
        tl.store(dst, a.to(dtype), mask=keep)
        tl.store(dst + HALF, b.to(dtype), mask=keep)


def gemv_qkv_rope(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The fused q/k/v projection of x [M, K] (M <= MAX_ROWS; `norm_weight`, `bias`, `eps` as
    `gemv`'s) with kernels/rope.py's `rope_and_write_kv` in its epilogue: q and k rotated by
    `positions` [M] through `cos_sin_cache` [max_pos, D], k and v stored in one layer's
    `kv_cache` [2, num_blocks, block_size, KVH, D] at `slot_mapping` [M] int64 (-1: not
    stored). Returns the rotated q [M, H, D] (new). No host synchronisation."""
    head_dim = kv_cache.shape[-1]
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if w.shape[0] != rows or kv_cache.shape[-2] != num_kv_heads or head_dim % 4:
        raise ValueError(
            f"w {tuple(w.shape)} and kv_cache {tuple(kv_cache.shape)} must hold {num_heads} q "
            f"and {num_kv_heads} kv heads of one head_dim (a multiple of 4)"
        )
    _check_args(x, w, bias, norm_weight, False, None, None, rows)
    m, k = x.shape
    if positions.shape != (m,) or slot_mapping.shape != (m,):
        raise ValueError(f"positions and slot_mapping must be [{m}]")
    if slot_mapping.dtype != torch.int64 or cos_sin_cache.dtype != torch.float32:
        raise ValueError("slot_mapping must be int64 and cos_sin_cache fp32")
    if not kv_cache.is_contiguous() or kv_cache.dtype != x.dtype:
        raise ValueError(f"kv_cache must be a contiguous {x.dtype} tensor")
    q = torch.empty((m, num_heads * head_dim), dtype=x.dtype, device=x.device)
    if m:
        _, block_k, warps = _blocks(rows, k, False, _sm_count(x.device))
        block_p = 2  # two pairs: four weight rows a program, as `gemv` reads them
        _qkv_rope_kernel[(rows // 2 // block_p,)](
            x, w, bias if bias is not None else w, norm_weight if norm_weight is not None else w,
            positions, cos_sin_cache, kv_cache, slot_mapping, q, m, k,
            x.stride(0), w.stride(0), cos_sin_cache.stride(0), kv_cache.stride(0),
            kv_cache.stride(2), kv_cache.stride(3), q.stride(0),
            eps=float(eps), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            NORM=norm_weight is not None, HAS_BIAS=bias is not None,
            BLOCK_M=triton.next_power_of_2(m), BLOCK_P=block_p, BLOCK_K=block_k, num_warps=warps,
            **launch_kwargs(x.device),
        )  # fmt: skip
    return q.view(m, num_heads, head_dim)


def gemv_qkv_rope_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """`gemv_qkv_rope` in plain torch: `gemv_ref`, then `rope_and_write_kv_ref`."""
    head_dim = kv_cache.shape[-1]
    qkv = gemv_ref(x, w, bias=bias, norm_weight=norm_weight, eps=eps)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    m = x.shape[0]
    q = q.reshape(m, num_heads, head_dim)
    k, v = k.reshape(m, num_kv_heads, head_dim), v.reshape(m, num_kv_heads, head_dim)
    return rope_and_write_kv_ref(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping)
