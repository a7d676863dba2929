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

import torch
import triton
import triton.language as tl

from taipan.kernels.activation import gelu_tanh, silu

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = ("silu", "gelu_tanh")
MAX_ROWS = 4  # beyond this a GEMM (cuBLAS) reads the weights as few times and computes better


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
):
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's outputs
    col_mask = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_rows = x_ptr + rows[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    # Products accumulate elementwise and are summed over K once, after the loop: the loop is
    # loads and multiply-adds only, no reduction across threads per tile.
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    up3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)  # GATED: the up half
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
        # The weights' tile is read once for every row.
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
        acc3 += xs[:, None, :] * w[None, :, :]
        if GATED:
            up = tl.load(w_rows + N * stride_w + ks[None, :], mask=w_mask, other=0.0)
            up3 += xs[:, None, :] * up.to(tl.float32)[None, :, :]
    acc = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]
    acc_up = tl.sum(up3, axis=2)
    if NORM:
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]  # [BLOCK_M, 1]
        acc *= rstd
        acc_up *= rstd
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


def _blocks(n: int, k: int, gated: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): many programs, each loading a few KB of weights per
    iteration. A tiny matrix needs no such spread (and the CPU interpreter pays per program)."""
    if n * k < 1 << 18:
        return 16, min(512, triton.next_power_of_2(k)), 4
    # Four outputs a program, rows of up to 1,024, four warps: the whole decode step of the 1B
    # and 8B shapes was fastest so on an H100 (tests/perf/fused_decode_bench.py model), though
    # the per-kernel sweep (`kernels`) preferred two outputs and two warps, which made the
    # step slower (1.27 against 1.22 ms at 1B, 6.28 against 5.82 at 8B).
    return 4, min(1024, triton.next_power_of_2(k)), 4


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
    block_n, block_k, warps = _blocks(n, k, gated)
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
