"""Rotate-half RoPE fused with the KV-cache append: `rope_and_write_kv` rotates q and k by their
tokens' positions and stores rotated k and raw v in their slots; `write_kv` only stores (for
attention without RoPE, NemotronH's); `rope_cos_sin_cache` builds the table `rope_and_write_kv`
reads. `*_ref` are the same contracts in torch.

Contracts (who writes what): q is rotated IN PLACE unless `out=` is given (then q is only read);
k and v are only read; the KV cache is written at the slots of `slot_mapping` and nowhere else
(slot -1 = padding token: its q row is still rotated, its k/v are not stored).

Numerics: HF (`apply_rotary_pos_emb`) casts cos/sin to the activation dtype and rounds after each
multiply and the add; these kernels keep cos/sin and the arithmetic in fp32 and round once. In
fp32 they agree to ~1e-6; in bf16 the kernel is the more accurate one and differs from HF by a
few bf16 ulps (cos/sin alone carry 2^-9 relative error), so compare with ~2e-2 relative
tolerance per element (~1e-2 norm-wise) in bf16, ~2e-3 in fp16.

Positions, padding rows' included, must lie in [0, max_pos) of the table: nothing checks it
(that would sync the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from taipan.kernels.pdl import enter, launch_kwargs
from taipan.kernels.rmsnorm import rms_norm_ref

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rope_cos_sin_cache(
    max_pos: int, head_dim: int, theta: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[max_pos, head_dim] fp32: row p holds cos of p's angles in its first head_dim/2 columns and
    their sin in the last head_dim/2. Angles p * theta^(-2i / head_dim), as HF Llama's rotary
    embedding computes them (no rope scaling)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))  # [head_dim / 2]
    positions = torch.arange(max_pos, device=device)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [max_pos, head_dim / 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@triton.jit
def _head_offsets(
    stride_head,
    NUM: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_NUM: tl.constexpr,
    BLOCK_WIDTH: tl.constexpr,
):
    """Offsets and mask of a [NUM, WIDTH] tile of heads (rows `stride_head` apart)."""
    heads = tl.arange(0, BLOCK_NUM)[:, None]
    cols = tl.arange(0, BLOCK_WIDTH)[None, :]
    return heads * stride_head + cols, (heads < NUM) & (cols < WIDTH)


@triton.jit
def _head_norm(x1, x2, norm_ptr, eps, dtype, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
               GEMMA: tl.constexpr):  # fmt: skip
    """Heads [BLOCK_NUM, BLOCK_HALF] x 2 halves (fp32) RMS-normalized over their HEAD_DIM and
    scaled by the norm's weight, rounded to `dtype` where kernels/rmsnorm.py stores its output
    (Llama's order: the normalized head rounded, times the weight, rounded; GEMMA: times
    (1 + weight) in fp32, rounded once), returned in fp32."""
    cols = tl.arange(0, BLOCK_HALF)
    w1 = tl.load(norm_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(norm_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    rstd = tl.rsqrt(squares / (2 * HALF) + eps)[:, None]
    if GEMMA:
        x1 = (x1 * rstd * (1.0 + w1)).to(dtype).to(tl.float32)
        x2 = (x2 * rstd * (1.0 + w2)).to(dtype).to(tl.float32)
    else:
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return x1, x2


@triton.jit
def _rope_heads(
    src_ptr,
    stride_src_head,
    dst_ptr,
    stride_dst_head,
    active,  # False: neither load nor store (a padding token's k)
    cos,  # [1, BLOCK_HALF] fp32
    sin,
    norm_ptr,  # [HEAD_DIM] the per-head norm's weight (NORM)
    eps,
    NUM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_NUM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
    GEMMA: tl.constexpr,
):
    """One token's NUM heads at `src_ptr`, each RMS-normalized first with NORM, rotated in
    fp32, stored at `dst_ptr` (may be src)."""
    src, mask = _head_offsets(stride_src_head, NUM, HALF, BLOCK_NUM, BLOCK_HALF)
    dst, _ = _head_offsets(stride_dst_head, NUM, HALF, BLOCK_NUM, BLOCK_HALF)
    mask = mask & active
    x1 = tl.load(src_ptr + src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + HALF + src, mask=mask, other=0.0).to(tl.float32)
    dtype = dst_ptr.dtype.element_ty
    if NORM:
        x1, x2 = _head_norm(x1, x2, norm_ptr, eps, src_ptr.dtype.element_ty, HALF, BLOCK_HALF,
                            GEMMA)  # fmt: skip
    tl.store(dst_ptr + dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst_ptr + HALF + dst, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _copy_heads(
    src_ptr,
    stride_src_head,
    dst_ptr,
    stride_dst_head,
    active,
    NUM: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_NUM: tl.constexpr,
    BLOCK_WIDTH: tl.constexpr,
):
    """One token's NUM heads copied from `src_ptr` to `dst_ptr` (cast to dst's dtype)."""
    src, mask = _head_offsets(stride_src_head, NUM, WIDTH, BLOCK_NUM, BLOCK_WIDTH)
    dst, _ = _head_offsets(stride_dst_head, NUM, WIDTH, BLOCK_NUM, BLOCK_WIDTH)
    mask = mask & active
    x = tl.load(src_ptr + src, mask=mask)
    tl.store(dst_ptr + dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_and_write_kv_kernel(
    # pointers
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, KVH, D]
    v_ptr,  # [T, KVH, D]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, D] fp32: cos | sin
    kv_cache_ptr,  # [2, num_blocks, block_size, KVH, D]
    slot_mapping_ptr,  # [T] int64, -1 = padding
    out_ptr,  # [T, H, D], may be q
    q_norm_ptr,  # [D] (NORM)
    k_norm_ptr,  # [D] (NORM)
    # strides
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cos_sin_pos,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    stride_out_token,
    stride_out_head,
    eps,
    # meta-parameters
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,  # q and k heads RMS-normalized first (Qwen3, Gemma 3)
    GEMMA: tl.constexpr,  # that norm Gemma's (1 + w)
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    HALF = HEAD_DIM // 2
    cols = tl.arange(0, BLOCK_HALF)
    cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * stride_cos_sin_pos
    cos = tl.load(cos_sin_row + cols, mask=cols < HALF, other=0.0)[None, :]
    sin = tl.load(cos_sin_row + HALF + cols, mask=cols < HALF, other=0.0)[None, :]
    slot = tl.load(slot_mapping_ptr + token)
    store_kv = slot >= 0  # slot -1: a padding token
    k_dst = kv_cache_ptr + slot * stride_cache_slot
    # q of every row, padding included (its output row is simply unused)
    q_src, q_dst = q_ptr + token * stride_q_token, out_ptr + token * stride_out_token
    _rope_heads(q_src, stride_q_head, q_dst, stride_out_head, True, cos, sin, q_norm_ptr, eps,
                NUM_HEADS, HALF, BLOCK_HEADS, BLOCK_HALF, NORM, GEMMA)  # fmt: skip
    # k (rotated) and v (raw) into the token's slot, unless it is padding
    k_src, v_src = k_ptr + token * stride_k_token, v_ptr + token * stride_v_token
    _rope_heads(k_src, stride_k_head, k_dst, stride_cache_head, store_kv, cos, sin, k_norm_ptr,
                eps, NUM_KV_HEADS, HALF, BLOCK_KV_HEADS, BLOCK_HALF, NORM, GEMMA)  # fmt: skip
    _copy_heads(v_src, stride_v_head, k_dst + stride_cache_kv, stride_cache_head, store_kv,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_KV_HEADS, BLOCK_D)  # fmt: skip


@triton.jit
def _write_kv_kernel(
    # pointers
    k_ptr,  # [T, KVH, D]
    v_ptr,  # [T, KVH, D]
    kv_cache_ptr,  # [2, num_blocks, block_size, KVH, D]
    slot_mapping_ptr,  # [T] int64, -1 = padding
    # strides
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    # meta-parameters
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    store_kv = slot >= 0  # slot -1: a padding token
    k_dst = kv_cache_ptr + slot * stride_cache_slot
    k_src, v_src = k_ptr + token * stride_k_token, v_ptr + token * stride_v_token
    _copy_heads(k_src, stride_k_head, k_dst, stride_cache_head, store_kv,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_KV_HEADS, BLOCK_D)  # fmt: skip
    _copy_heads(v_src, stride_v_head, k_dst + stride_cache_kv, stride_cache_head, store_kv,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_KV_HEADS, BLOCK_D)  # fmt: skip


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    gemma_norm: bool = False,
) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, KVH, D] by `positions` [T] (int32/int64, each < max_pos);
    store rotated k and raw v [T, KVH, D] in one layer's `kv_cache` [2, num_blocks, block_size,
    KVH, D] at `slot_mapping` [T] int64 (-1: store nothing). Returns rotated q: `out` if given,
    else q itself (rotated in place). q, k, v and out may be strided views (e.g. of a fused qkv
    projection) with unit stride in the last dim. No host synchronisation.

    `q_norm_weight`, `k_norm_weight` [D] (both or neither): each head of q and k is
    RMS-normalized first (eps `norm_eps`; `gemma_norm`: Gemma's (1 + w)), rounded as
    kernels/rmsnorm.py rounds its output, then rotated: Qwen3's and Gemma 3's q/k norms, one
    kernel instead of three."""
    _check_kv(k, v, kv_cache, slot_mapping)
    _check_q(q, k, positions, cos_sin_cache, out)
    norm = _check_norms(q, q_norm_weight, k_norm_weight)
    out = q if out is None else out
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return out
    block_heads = triton.next_power_of_2(num_heads)
    block_d = triton.next_power_of_2(head_dim)
    _rope_and_write_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        kv_cache,
        slot_mapping,
        out,
        q_norm_weight if norm else q,
        k_norm_weight if norm else q,
        *q.stride()[:2],
        *k.stride()[:2],
        *v.stride()[:2],
        cos_sin_cache.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        *out.stride()[:2],
        float(norm_eps),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=block_heads,
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_D=block_d,
        NORM=norm,
        GEMMA=bool(gemma_norm),
        num_warps=4 if block_heads * block_d <= 2048 else 8,
        **launch_kwargs(q.device),
    )
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, KVH, D] (already rotated) in one layer's `kv_cache` [2, num_blocks,
    block_size, KVH, D] at `slot_mapping` [T] int64 (-1: store nothing). No host sync."""
    _check_kv(k, v, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        *k.stride()[:2],
        *v.stride()[:2],
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **launch_kwargs(k.device),
    )


def _check_strided(name: str, t: torch.Tensor, shape: tuple, dtypes: tuple, device) -> None:
    if t.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {dtypes}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, k on {device}: use one device")
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dim, got strides {t.stride()}: "
            "pass a .contiguous() copy"
        )


def _check_norms(q, q_norm_weight, k_norm_weight) -> bool:
    """Whether the per-head norms are on (both weights given, each [D] contiguous in q's dtype
    on q's device)."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    if q_norm_weight is None:
        return False
    head_dim = q.shape[-1]
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w.shape != (head_dim,) or w.dtype != q.dtype or w.device != q.device:
            raise ValueError(
                f"{name} must be a [{head_dim}] {q.dtype} tensor on {q.device}, got "
                f"{tuple(w.shape)} {w.dtype} on {w.device}"
            )
        if w.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    return True


def _check_kv(k, v, kv_cache, slot_mapping) -> None:
    if k.dim() != 3:
        raise ValueError(f"k must be [tokens, kv_heads, head_dim], got shape {tuple(k.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_strided("k", k, tuple(k.shape), DTYPES, k.device)
    _check_strided("v", v, tuple(k.shape), (k.dtype,), k.device)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != k.shape[1:]:
        raise ValueError(
            f"kv_cache must be one layer's [2, num_blocks, block_size, {num_kv_heads}, "
            f"{head_dim}], got shape {tuple(kv_cache.shape)}"
        )
    _check_strided("kv_cache", kv_cache, tuple(kv_cache.shape), DTYPES, k.device)
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (slots are addressed as one flat range)")
    _check_strided("slot_mapping", slot_mapping, (num_tokens,), (torch.int64,), k.device)


def _check_q(q, k, positions, cos_sin_cache, out) -> None:
    if q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q must be [tokens, heads, head_dim] with k's tokens and head_dim "
            f"{(k.shape[0], k.shape[2])}, got shape {tuple(q.shape)}"
        )
    head_dim = q.shape[2]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
    _check_strided("q", q, tuple(q.shape), (k.dtype,), k.device)
    if out is not None:
        _check_strided("out", out, tuple(q.shape), (q.dtype,), k.device)
    _check_strided("positions", positions, (q.shape[0],), (torch.int32, torch.int64), k.device)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_pos, {head_dim}] (see rope_cos_sin_cache), got shape "
            f"{tuple(cos_sin_cache.shape)}"
        )
    shape = tuple(cos_sin_cache.shape)
    _check_strided("cos_sin_cache", cos_sin_cache, shape, (torch.float32,), k.device)


def rope_and_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    gemma_norm: bool = False,
) -> torch.Tensor:
    """`rope_and_write_kv` in plain torch (fp32 cos/sin and arithmetic), same contract: the
    per-head norms are kernels/rmsnorm.py's reference over each head."""
    out = q if out is None else out
    if _check_norms(q, q_norm_weight, k_norm_weight):
        d = q.shape[-1]
        q = rms_norm_ref(q.reshape(-1, d), q_norm_weight, norm_eps, gemma=gemma_norm).view(q.shape)
        k = rms_norm_ref(k.reshape(-1, d), k_norm_weight, norm_eps, gemma=gemma_norm).view(k.shape)
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()][:, None, :]  # [T, 1, D] fp32
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    q_rot = _rotate_half_ref(q.float(), cos, sin)
    write_kv_ref(_rotate_half_ref(k.float(), cos, sin), v, kv_cache, slot_mapping)
    return out.copy_(q_rot)


def _rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def write_kv_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`write_kv` in plain torch (boolean indexing: syncs the device; a reference only)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_slots, KVH, D]
    flat[0, slots] = k[keep].to(kv_cache.dtype)
    flat[1, slots] = v[keep].to(kv_cache.dtype)
