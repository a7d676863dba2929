"""Varlen causal prefill attention over the paged KV cache, flash-attention style: each
sequence's new query tokens attend its cached prefix and their own causal part, optionally
within a sliding window. Head sizes: attention_ref.SUPPORTED_HEAD_DIMS (32 to 256; 80, 96 and
192 are tiled as the next power of two with the surplus columns masked).

Owns `paged_prefill_attention` (kernel + launcher); its reference is kernels/attention_ref.py's
`paged_attention_ref`. Only reads the cache: this step's keys and values must already be in
their slots (the KV-append kernel runs first). Block tables come from the allocator; nothing
here decides or changes them.

Tiling. One program owns BLOCK_Q consecutive queries of one sequence and all GROUP query heads
that share one KV head: its M tile is BLOCK_Q x GROUP_PAD rows (GROUP rounded up to a power of
two, surplus head rows masked), so K/V are read once per group, never repeated per head, and a
decode row (q_len 1) still fills GROUP of its rows. The key loop walks BLOCK_N-key tiles and
finds each key's slot through the block table (one small, cached int32 load per key): a tile may
straddle blocks, so BLOCK_N is free of block_size (64-key tiles over 16-slot blocks) and each key
row is still one contiguous head_dim load. The keys every row of the tile sees need no mask;
only the tiles at the diagonal and, with a window, at the window's left edge are masked.

Sliding window W: query p sees keys p - W < k <= p. The key loop starts at the window of the
program's first query (each row masks its own), so keys before it are never loaded: the engine
may free those blocks and hand them to another request (garbage, maybe NaN).

Sinks (kernels/attention_ref.py): each row's running max and sum take its head's sink logit
once, after the key loop, so the loop is unchanged.
"""

from __future__ import annotations

import math

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

__all__ = ["SUPPORTED_HEAD_DIMS", "paged_prefill_attention"]
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 256
# No window: one wider than any context (an int32 kernel argument; positions stay far below).
_NO_WINDOW = 1 << 30


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    start_n,
    key_end,
    # pointers
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    # strides
    stride_cb,
    stride_cs,
    stride_ch,
    # scalars
    kv_head,
    qk_scale,
    window,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile [start_n, start_n + BLOCK_N) into the online softmax (base 2). MASKED: keys
    at or past `key_end` are not loaded, and each row sees only its causal window."""
    key_pos = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM_PAD)
    if MASKED:
        # Past key_end the block table is padding and slots were never written (NaN, say):
        # neither is read, so no 0 * NaN reaches a row.
        key_ok = key_pos < key_end
        block = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        block = tl.load(block_table_ptr + key_pos // BLOCK_SIZE)
    slot_off = block.to(tl.int64) * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs
    kv_off = slot_off[:, None] + kv_head * stride_ch + dims[None, :]
    # Padded head columns load as 0 in q and k alike (q.k stays exact) and are never stored.
    if MASKED:
        kv_mask = key_ok[:, None]
        if HEAD_DIM != HEAD_DIM_PAD:
            kv_mask = kv_mask & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    elif HEAD_DIM != HEAD_DIM_PAD:
        k = tl.load(k_cache_ptr + kv_off, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off)
        v = tl.load(v_cache_ptr + kv_off)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        # Causal (keys past key_end lie right of every row's position), and windowed.
        seen = key_pos[None, :] <= q_pos[:, None]
        if WINDOWED:
            seen = seen & (key_pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(seen, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if WINDOWED and MASKED:
        # A row whose window starts right of this tile sees nothing yet: measure from 0, not
        # -inf, so its weights are exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN. (Without
        # a window the first tile holds key 0, which every row sees.)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _prefill_attention_kernel(
    # pointers
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,  # [H] fp32 sink logits (SINKS)
    # strides
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    # scalars
    qk_scale,  # scale * log2(e): the softmax runs in base 2
    window,  # keys each query sees (the sliding window), read only if WINDOWED
    # meta-parameters
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (tl.arange's need)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD rows: row r = query r // GROUP_PAD, head r % ..
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    enter(PDL)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # Last query tiles first: they have the most keys, so the longest programs start earliest.
    first_q = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_Q
    if first_q >= q_len:  # the grid is sized by max_query_len, a static bound
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP_PAD  # query index within the sequence
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    io_mask = row_ok[:, None]
    if HEAD_DIM != HEAD_DIM_PAD:
        io_mask = io_mask & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)
    # Rows past q_len stand in for the tile's last query (never stored): they see its keys, so
    # no row is all -inf, and none outside the keys the real rows see.
    q_pos = prefix_len + tl.minimum(q_idx, last_q)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The tile's queries sit at positions lo..hi; they see keys from `start` (the first query's
    # window; 0 without one) to `end`. Keys in [hi - window + 1, lo] are seen by every row:
    # the tiles wholly inside need no mask. Tiles step by BLOCK_N from `start`: masked ones
    # while left of that range, unmasked ones while inside it, masked ones to the end.
    lo = prefix_len + first_q
    hi = prefix_len + last_q
    end = hi + 1
    if WINDOWED:
        start = tl.maximum(lo - window + 1, 0)
        seen_by_all = tl.maximum(hi - window + 1, 0)
        left = start + tl.cdiv(seen_by_all - start, BLOCK_N) * BLOCK_N
        for start_n in range(start, left, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start_n, end,
                k_cache_ptr, v_cache_ptr, block_table_ptr,
                stride_cb, stride_cs, stride_ch,
                kv_head, qk_scale, window,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION,
            )  # fmt: skip
    else:
        left = 0
    diagonal = left + tl.maximum(lo + 1 - left, 0) // BLOCK_N * BLOCK_N
    for start_n in range(left, diagonal, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, end,
            k_cache_ptr, v_cache_ptr, block_table_ptr,
            stride_cb, stride_cs, stride_ch,
            kv_head, qk_scale, window,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, False, WINDOWED, DOT_PRECISION,
        )  # fmt: skip
    for start_n in range(diagonal, end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, end,
            k_cache_ptr, v_cache_ptr, block_table_ptr,
            stride_cb, stride_cs, stride_ch,
            kv_head, qk_scale, window,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, True, WINDOWED, DOT_PRECISION,
        )  # fmt: skip

    if SINKS:  # the head's sink logit joins the denominator only (base 2, as qk_scale's)
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
        m_sink = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_sink)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_sink)
    o = acc / l_i[:, None]
    o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of each new query token over its sequence's paged KV (cached prefix
    + this step's tokens, already written). Never syncs the device: CUDA-graph safe.

    q: [T, H, D] (sequence after sequence, D in SUPPORTED_HEAD_DIMS); kv_cache: one layer's
    [2, num_blocks, block_size, KVH, D]; block_tables: [B, max_blocks] int32; query_start_loc:
    [B + 1] int32; seq_lens: [B] int32, context lengths including this step. Query i of sequence
    b sits at position `p = seq_lens[b] - q_len_b + i`. max_query_len: a host bound on every
    q_len_b (queries past it are silently not computed). sliding_window: None, or W >= 1 (a host
    int): query p sees keys p - W < k <= p only, and no key before its sequence's first query's
    window is read. sinks: None, or [H] fp32 sink logits (kernels/attention_ref.py). Returns
    out: [T, H, D] in q's dtype (`out` if given).
    """
    _check_inputs(q, kv_cache, block_tables, query_start_loc, seq_lens, max_query_len, out)
    check_sliding_window(sliding_window)
    check_sinks(sinks, q)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    dim_pad = head_dim_pad(head_dim)
    group = q.shape[1] // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m, block_n, num_warps, num_stages = _tile_config(q, group_pad, max_query_len, dim_pad)
    block_q = max(1, block_m // group_pad)
    if q.shape[0] == 0 or max_query_len == 0 or num_seqs == 0:
        return out
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _prefill_attention_kernel[grid](
        q, kv_cache[0], kv_cache[1], out, block_tables, query_start_loc, seq_lens,
        sinks if sinks is not None else seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        scale * math.log2(math.e),
        _NO_WINDOW if sliding_window is None else min(sliding_window, _NO_WINDOW),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_q * group_pad, BLOCK_N=block_n,
        WINDOWED=sliding_window is not None,
        SINKS=sinks is not None,
        # fp32 storage (tests, debugging) means fp32 products, not TF32's 10-bit mantissa.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
        **launch_kwargs(q.device),
    )  # fmt: skip
    return out


def _tile_config(
    q: torch.Tensor, group_pad: int, max_query_len: int, dim_pad: int
) -> tuple[int, ...]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) for this launch."""
    if not q.is_cuda:  # the CPU interpreter: the smallest tiles tl.dot allows run fastest
        return 16, 16, 4, 1
    half = q.element_size() == 2  # fp32 tiles take twice the shared memory
    if dim_pad <= 128:
        block_m, block_n, num_stages = (128, 64, 3) if half else (64, 32, 2)
    else:
        # 256-wide heads (192 padded, 256): q, K/V and the fp32 accumulator tiles all double.
        # 128 x 64 tiles over 8 warps spill registers on sm_90 yet run fastest on an H100
        # (tests/perf/prefill_wide_bench.py, 4096 tokens, bf16: 0.256 ms against 0.734 for the
        # spill-free 32 x 32, 8 over 4 heads; 0.154 against 0.347, Gemma 3 1B's 4 over 1; SDPA
        # 0.172 and 0.100). fp32 (tests, debugging) keeps the small tiles.
        block_m, block_n, num_stages = (128, 64, 2) if half else (32, 32, 1)
    # Short queries (decode rows, small chunks) would leave most of a 128-row tile empty.
    block_m = min(block_m, max(16, triton.next_power_of_2(max(1, max_query_len) * group_pad)))
    num_warps = 8 if block_m >= 128 or dim_pad > 128 else 4
    return block_m, block_n, num_warps, num_stages


def _check_inputs(q, kv_cache, block_tables, query_start_loc, seq_lens, max_query_len, out):
    """Raise ValueError / TypeError with what to fix; reads shapes only (no device sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be one layer's [2, num_blocks, block_size, kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must match q's {q.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    head_dim_pad(head_dim)  # raises for a head size the kernels do not serve
    if cache_head_dim != head_dim:
        raise ValueError(f"kv_cache head_dim {cache_head_dim} != q's head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"heads ({num_heads}) must be a multiple of kv_heads ({num_kv_heads})")
    if not (MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE) or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
            f"got {block_size}"
        )
    if q.stride(2) != 1:
        raise ValueError("q's head_dim must be contiguous (stride 1)")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    _check_metadata(block_tables, query_start_loc, seq_lens, q.device)
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a host int >= 0, got {max_query_len!r}")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
            raise ValueError(
                f"out must be {tuple(q.shape)} {q.dtype} with a contiguous head_dim, got "
                f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
            )
    for name, t in (("kv_cache", kv_cache), ("out", out)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def _check_metadata(block_tables, query_start_loc, seq_lens, device) -> None:
    """The step's metadata: int32, on q's device, consistent batch size."""
    for name, t, ndim in (
        ("block_tables", block_tables, 2),
        ("query_start_loc", query_start_loc, 1),
        ("seq_lens", seq_lens, 1),
    ):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc needs B + 1 = {num_seqs + 1} entries, got {query_start_loc.shape[0]}"
        )
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
