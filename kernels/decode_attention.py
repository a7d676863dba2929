"""Paged-attention decode: one query token per sequence over its paged KV cache, with grouped
K/V heads (GQA), an optional sliding window, and the context split across programs (split-K,
"flash decoding"). Head sizes: attention_ref.SUPPORTED_HEAD_DIMS (32 to 256; 80, 96 and 192 are
tiled as the next power of two with the surplus columns masked).

Owns two kernels and their launcher: `_decode_split_kernel` (each program: one sequence, one kv
head, one chunk of the context -> partial max, sum and unnormalised V sum, fp32) and
`_decode_merge_kernel` (log-sum-exp merge of the chunks -> the output). Its reference is
kernels/attention_ref.py's `paged_attention_ref` with one query per sequence. Reads the cache,
block tables and lengths only; never writes the cache and never decides anything about
allocation.

Layout (kernels/__init__.py): `kv_cache` is one layer's `[2, num_blocks, block_size, KVH, D]`;
token p of sequence b lives in block `block_tables[b, p // block_size]` at offset
`p % block_size`. `seq_lens[b]` counts the current token, whose K/V is already written.

Sliding window W: the query (position seq_len - 1) sees the last W keys only. The chunks start
at the window's first key, so no program is spent on the keys before it and none of them is
ever loaded: the engine may free those blocks and hand them to another request.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from taipan.kernels.attention_ref import (
    SUPPORTED_HEAD_DIMS,
    check_sinks,
    check_sliding_window,
    head_dim_pad,
)
from taipan.kernels.pdl import enter, launch_kwargs

__all__ = ["SUPPORTED_HEAD_DIMS", "default_num_splits", "paged_decode_attention"]
# Default split-K: one chunk per this many context tokens (of the static maximum), at most
# _MAX_SPLITS chunks. Small batches need the extra programs to fill the GPU; large batches pay
# only the partials (fp32, one D-row per query head and chunk, written once and read once):
# group/128 of a chunk's bf16 K/V bytes, 3% at GQA group 4. Chunks need not be whole cache
# blocks (each token finds its own block): with 256-token blocks, whole-block chunks left one
# program looping over a short context while the others sat empty (8B shape, batch 1).
_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 64
# Enough programs per SM to hide memory latency; SM count when no CUDA device says (an H100/H200).
_PROGRAMS_PER_SM = 2
_DEFAULT_SMS = 132
_SMS: dict[int, int] = {}
# Context tokens per inner-loop tile; a tile may span several cache blocks (each token finds its
# own block), so small blocks do not mean small tiles. Heads wider than 128 take half as many:
# compiled for sm_90 in bf16, [64, 256] K and V tiles spilled ~470 bytes of registers a thread,
# [32, 256] ones none (25 KB of shared memory).
_MAX_TILE_TOKENS = 64
_MAX_TILE_TOKENS_WIDE = 32
# Warps of a split program for the wide heads (head_dim past 128). 4, as for the others: 8 was
# slower on an H100 under CUDA graphs (Gemma 3 1B's 4 over 1 heads of 256, batch 1: 18.0 against
# 15.3 us; batch 64: 47.6 against 38.3 us; tests/perf/decode_wide_bench.py).
_SPLIT_WARPS_WIDE = 4


@triton.jit
def _decode_split_kernel(
    # pointers
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [num_blocks, block_size, KVH, D] (kv_cache[0])
    v_cache_ptr,  # [num_blocks, block_size, KVH, D] (kv_cache[1])
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    part_max_ptr,  # [B, H, num_splits] fp32
    part_sum_ptr,  # [B, H, num_splits] fp32
    part_acc_ptr,  # [B, H, num_splits, D] fp32
    # strides
    stride_q_b,
    stride_q_h,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_bt_b,
    stride_bt_blk,
    stride_sl_b,
    stride_pm_b,
    stride_pm_h,
    stride_pm_s,
    stride_pa_b,
    stride_pa_h,
    stride_pa_s,
    # scalars
    scale,
    max_context,  # max_blocks * block_size: lengths are clamped to it (never read past the table)
    window,  # keys the query sees (the sliding window; max_context when there is none)
    split_tokens,  # context tokens per split, a multiple of BLOCK_N
    # meta-parameters
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16 (tl.dot rows)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (tl.arange's need)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # context tokens per tile
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 storage (no tf32 rounding), else "tf32"
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    pid_b = tl.program_id(0)
    pid_kvh = tl.program_id(1)
    pid_s = tl.program_id(2)

    seq_len = tl.minimum(tl.load(seq_lens_ptr + pid_b * stride_sl_b), max_context)
    # Chunks tile the window, not the whole context: keys before it are neither spent on nor
    # loaded (their blocks may be freed and reused, garbage or NaN).
    chunk_start = tl.maximum(seq_len - window, 0) + pid_s * split_tokens
    chunk_end = tl.minimum(chunk_start + split_tokens, seq_len)

    # GQA: the GROUP query heads of this kv head are the rows of one [GROUP_PAD, D] tile, so
    # every K/V tile is loaded once and serves all of them through tl.dot. Rows past GROUP are
    # zero padding (tl.dot needs >= 16 rows); a broadcast multiply-sum would avoid the padding
    # but needs a [GROUP, BLOCK_N, D] intermediate, which spills registers on a GPU. Decode is
    # bound by K/V bytes, so the padded rows cost nothing measurable.
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = pid_kvh * GROUP + rows
    # Padded head columns load as 0 (q and k alike, so q.k is exact) and are never stored.
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_ptrs = q_ptr + pid_b * stride_q_b + heads[:, None] * stride_q_h + dims[None, :]
    q_mask = _narrow_to_head_dim(row_ok, dims, HEAD_DIM, HEAD_DIM_PAD)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # [GROUP_PAD, D_PAD]

    # Online softmax over this chunk: running max m, running sum l, unnormalised acc (fp32).
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    head_off = pid_kvh * stride_c_head
    bt_row = block_tables_ptr + pid_b * stride_bt_b
    # A chunk past seq_len runs no iteration: it never touches the table or the cache.
    for tile_start in range(chunk_start, chunk_end, BLOCK_N):
        pos = tile_start + offs_n  # [BLOCK_N] token positions
        tok_ok = pos < chunk_end  # never a slot past seq_len (unwritten: garbage, maybe NaN)
        block_ids = tl.load(bt_row + (pos // BLOCK_SIZE) * stride_bt_blk, mask=tok_ok, other=0)
        # int64: block_id * stride overflows int32 on caches past 2^31 elements.
        slot_off = block_ids.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE) * stride_c_tok
        kv_off = slot_off[:, None] + head_off + dims[None, :]  # [BLOCK_N, D_PAD]
        kv_mask = _narrow_to_head_dim(tok_ok, dims, HEAD_DIM, HEAD_DIM_PAD)
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        # Every tile holds >= 1 valid token, so m_new is finite and no exp sees -inf - -inf.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    # Empty chunks store the neutral partial (m = -inf, l = 0, acc = 0) for the merge.
    pm_off = pid_b * stride_pm_b + heads * stride_pm_h + pid_s * stride_pm_s
    tl.store(part_max_ptr + pm_off, m, mask=row_ok)
    tl.store(part_sum_ptr + pm_off, l, mask=row_ok)
    pa_off = pid_b * stride_pa_b + heads[:, None] * stride_pa_h + pid_s * stride_pa_s
    tl.store(part_acc_ptr + pa_off + dims[None, :], acc, mask=q_mask)


@triton.jit
def _decode_merge_kernel(
    # pointers
    part_max_ptr,  # [B, H, num_splits] fp32
    part_sum_ptr,  # [B, H, num_splits] fp32
    part_acc_ptr,  # [B, H, num_splits, D] fp32
    sinks_ptr,  # [H] fp32 sink logits (SINKS)
    out_ptr,  # [B, H, D]
    # strides
    stride_pm_b,
    stride_pm_h,
    stride_pm_s,
    stride_pa_b,
    stride_pa_h,
    stride_pa_s,
    stride_o_b,
    stride_o_h,
    # scalars
    num_splits,
    # meta-parameters
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two >= 2
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SINKS: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc_mask = _narrow_to_head_dim(split_ok, dims, HEAD_DIM, HEAD_DIM_PAD)

    pm_off = pid_b * stride_pm_b + pid_h * stride_pm_h + splits * stride_pm_s
    m = tl.load(part_max_ptr + pm_off, mask=split_ok, other=float("-inf"))  # [SPLITS_PAD]
    l = tl.load(part_sum_ptr + pm_off, mask=split_ok, other=0.0)  # noqa: E741
    pa_off = pid_b * stride_pa_b + pid_h * stride_pa_h + splits[:, None] * stride_pa_s
    acc = tl.load(part_acc_ptr + pa_off + dims[None, :], mask=acc_mask, other=0.0)

    # Log-sum-exp merge: rescale each chunk to the global max. A row with seq_len 0 has every
    # max at -inf; measuring from 0 instead gives weights exp(-inf) = 0 and so a zero output,
    # never -inf - -inf = NaN.
    m_all = tl.max(m, axis=0)
    if SINKS:  # the head's sink logit: one more term of the denominator, none of the sum
        sink = tl.load(sinks_ptr + pid_h)
        m_all = tl.maximum(m_all, sink)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_all)  # [SPLITS_PAD]; 0 for empty chunks
    total = tl.sum(w * l, axis=0)
    if SINKS:
        total += tl.where(tl.sum(l, axis=0) > 0.0, tl.exp(sink - m_all), 0.0)
    o = tl.sum(w[:, None] * acc, axis=0)  # [D]
    o = o / tl.where(total > 0.0, total, 1.0)
    o_ptrs = out_ptr + pid_b * stride_o_b + pid_h * stride_o_h + dims
    if HEAD_DIM == HEAD_DIM_PAD:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty))
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _narrow_to_head_dim(rows_ok, dims, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """The [rows, HEAD_DIM_PAD] mask of a tile: `rows_ok` rows, and only the real head_dim
    columns where it is padded. Unpadded sizes keep a row-only mask, which keeps whole-row
    vector loads (a column compare can defeat Triton's vectorisation)."""
    mask = rows_ok[:, None]
    if HEAD_DIM != HEAD_DIM_PAD:
        mask = mask & (dims < HEAD_DIM)[None, :]
    return mask


def default_num_splits(
    max_context_tokens: int, programs: int = 1, num_sms: int = _DEFAULT_SMS
) -> int:
    """Chunks for a context of at most `max_context_tokens` when `programs` (sequences x kv
    heads) share the device: one per `_TOKENS_PER_SPLIT` of the context, 1 to `_MAX_SPLITS`, but
    no more than it takes to give every SM _PROGRAMS_PER_SM programs: a large batch fills the
    GPU without splits, and then the partials' round trip through memory only costs (8B shape,
    batch 64: the merge took 4% of the step with 10 splits). Static bounds only, never the data,
    so a CUDA graph captured once stays valid."""
    by_length = max(1, min(_MAX_SPLITS, triton.cdiv(max_context_tokens, _TOKENS_PER_SPLIT)))
    by_occupancy = max(1, triton.cdiv(_PROGRAMS_PER_SM * num_sms, max(1, programs)))
    return min(by_length, by_occupancy)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one query token over its first `seq_lens[b]` cached tokens,
    or over the last `sliding_window` of them; with `sinks` ([H] fp32 sink logits,
    kernels/attention_ref.py), each head's sink joins the softmax's denominator (in the merge).

    q: [B, H, D]; kv_cache: [2, num_blocks, block_size, KVH, D] (contiguous, q's dtype, D in
    SUPPORTED_HEAD_DIMS); block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (0 = inactive
    row -> zeros; lengths past max_blocks * block_size are clamped to it); sliding_window: None or
    W >= 1 keys (a host int). Grid and buffers depend only on shapes, the window and `num_splits`
    (chunks of the keys a query can see, min(W, max_blocks * block_size); default:
    `default_num_splits` of that and B * KVH), never on the lengths' values, and nothing syncs
    the host: safe to capture in a CUDA graph.
    Returns out: [B, H, D] in q's dtype (written into `out` when given).
    """
    batch, num_heads, head_dim, block_size, num_kv_heads = _check_inputs(
        q, kv_cache, block_tables, seq_lens
    )
    check_sliding_window(sliding_window)
    check_sinks(sinks, q)
    dim_pad = head_dim_pad(head_dim)
    max_blocks = block_tables.shape[1]
    out = _check_out(out, q)
    # The most keys one query sees: the chunks split this span, which starts at each row's
    # window (or at 0), so a window of W costs the same programs as a W-token context.
    span = max(max_blocks * block_size, 1)
    if sliding_window is not None:
        span = min(span, sliding_window)
    if num_splits is None:
        programs = batch * num_kv_heads
        num_splits = default_num_splits(span, programs, _num_sms(q.device))
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    # Whole tiles per chunk (rounded down, so a short context spreads over more programs);
    # recount so no chunk lies wholly past the span.
    per_split = triton.cdiv(span, num_splits)
    max_tile = _MAX_TILE_TOKENS if dim_pad <= 128 else _MAX_TILE_TOKENS_WIDE
    tile = min(max_tile, max(16, triton.next_power_of_2(per_split)))
    split_tokens = max(tile, per_split // tile * tile)
    num_splits = triton.cdiv(span, split_tokens)
    if batch == 0:
        return out

    group = num_heads // num_kv_heads
    part_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(
        batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_max, part_sum, part_acc,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1), seq_lens.stride(0),
        part_max.stride(0), part_max.stride(1), part_max.stride(2),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        float(scale), max_blocks * block_size, span, split_tokens,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=tile,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if dim_pad <= 128 else _SPLIT_WARPS_WIDE,
        **launch_kwargs(q.device),
    )  # fmt: skip
    splits_pad = max(2, triton.next_power_of_2(num_splits))  # >= 2: no 1-wide tiles
    _decode_merge_kernel[(batch, num_heads)](
        part_max, part_sum, part_acc, sinks if sinks is not None else part_max, out,
        part_max.stride(0), part_max.stride(1), part_max.stride(2),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        out.stride(0), out.stride(1),
        num_splits,
        SPLITS_PAD=splits_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=dim_pad,
        SINKS=sinks is not None,
        # The [SPLITS_PAD, D_PAD] fp32 partials sit in registers: wide ones get more threads.
        num_warps=4 if splits_pad * dim_pad <= 8192 else 8,
        **launch_kwargs(q.device),
    )  # fmt: skip
    return out


def _check_inputs(q, kv_cache, block_tables, seq_lens) -> tuple[int, int, int, int, int]:
    """The layout the kernels assume, with errors that name the offending argument; returns
    (B, H, D, block_size, KVH)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be one layer's [2, num_blocks, block_size, KVH, D], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must equal q's dtype {q.dtype}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if cache_dim != head_dim:
        raise ValueError(f"kv_cache head_dim {cache_dim} != q head_dim {head_dim}")
    head_dim_pad(head_dim)  # raises for a head size the kernels do not serve
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of KVH ({num_kv_heads})")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks], got {block_tables.shape}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [B={batch}], got {tuple(seq_lens.shape)}")
    if q.stride(2) != 1:
        raise ValueError(f"q must be contiguous in its last dim, got strides {q.stride()}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous, got strides {kv_cache.stride()}")
    devices = {t.device for t in (q, kv_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"inputs on {q.device} need TRITON_INTERPRET=1 (or use kernels/attention_ref.py)"
        )
    return batch, num_heads, head_dim, block_size, num_kv_heads


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}), "
            f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    if out.stride(2) != 1:
        raise ValueError(f"out must be contiguous in its last dim, got strides {out.stride()}")
    return out
