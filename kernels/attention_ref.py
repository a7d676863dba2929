"""The one reference of paged causal attention: varlen GQA attention over the paged KV cache, in
plain torch, fp32 inside. The decode kernel (kernels/decode_attention.py: one query per
sequence), the prefill kernel (kernels/prefill_attention.py) and ops/attention.py's CPU path are
all checked against it; it also owns what the three share: the sliding-window rule
(`check_sliding_window`) and the head sizes the two kernels serve (`SUPPORTED_HEAD_DIMS`).

Contract. Sequence b owns query tokens `query_start_loc[b] : query_start_loc[b + 1]`, the last
`q_len` tokens of its context of `seq_lens[b]` tokens (clamped to its block table's capacity,
max_blocks * block_size, as the decode kernel clamps): query i sits at position
`p = context - q_len + i` and sees keys 0..p, or with a sliding window W only keys k with
`p - W < k <= p` (at most W keys, itself included: Hugging Face's `sliding_window_overlay`). A
sequence with an empty context (an idle decode row, seq_len 0) gives zeros, as do tokens no
sequence owns. Only slots its queries can see are read: none past the context (unwritten) and,
with a window, none before the first query's window (the engine may free and reuse those
blocks), so garbage there (maybe NaN) never reaches the output. Any head_dim, block_size and
GQA group; the kernels' own limits are their launchers' to check.

Attention sinks (gpt-oss's learned ones): `sinks` [H] fp32, one logit per query head in the
softmax's units (after the scale). Each query's softmax runs over its visible keys and the
head's sink, and the sink's share is dropped: out = sum_k p_k v_k with
p_k = exp(s_k) / (exp(sink) + sum_j exp(s_j)), so the weights sum to less than one.

Which keys a query sees is decided in `_visible` alone. Syncs the device (reads the metadata on
the host): for tests and debugging, never a hot path. Reads the cache only.
"""

from __future__ import annotations

import torch

# The head sizes the two Triton kernels serve (this reference takes any): the common ones of
# open models, e.g. 64 and 128 (Llama, Qwen), 80 (Phi-2), 96 (Phi-3), 256 (Gemma 3). A size that
# is not a power of two is tiled as the next one, its surplus columns masked (`head_dim_pad`).
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)


def head_dim_pad(head_dim: int) -> int:
    """The power of two the kernels tile `head_dim` with (its surplus columns masked); raises a
    ValueError naming the supported sizes for any other head_dim."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        supported = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
        raise ValueError(f"head_dim {head_dim} is not supported (supported: {supported})")
    return 1 << (head_dim - 1).bit_length()


def check_sliding_window(sliding_window: int | None) -> None:
    """None (global attention) or a window of >= 1 keys, as a host int (it never syncs)."""
    ok = isinstance(sliding_window, int) and not isinstance(sliding_window, bool)
    if sliding_window is not None and not (ok and sliding_window >= 1):
        raise ValueError(
            f"sliding_window must be None or an int >= 1 (keys seen, the query's own included), "
            f"got {sliding_window!r}"
        )


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence's queries over its paged KV, one sequence at a time.

    q: [T, H, D]; kv_cache: one layer's [2, num_blocks, block_size, KVH, D]; block_tables:
    [B, max_blocks]; query_start_loc: [B + 1]; seq_lens: [B], context lengths including this
    step's tokens (already written); sliding_window: None, or W >= 1 keys per query; sinks:
    None, or [H] fp32 sink logits (see the module docstring). Returns [T, H, D] in q's dtype.
    """
    _check_inputs(q, kv_cache, block_tables, query_start_loc, seq_lens)
    check_sliding_window(sliding_window)
    check_sinks(sinks, q)
    capacity = block_tables.shape[1] * kv_cache.shape[2]
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        q_len, context = end - start, min(seq_len, capacity)
        if q_len < 0 or seq_len < 0 or q_len > context > 0:
            raise ValueError(
                f"sequence {b}: need 0 <= q_len ({q_len}) <= seq_len ({seq_len}, clamped to the "
                f"block table's {capacity} slots), or seq_len 0"
            )
        if q_len == 0 or context == 0:
            continue
        # The first query's window start: no query sees a key before it, so none is read.
        first = 0 if sliding_window is None else max(0, context - q_len - sliding_window + 1)
        k, v = gather_kv(kv_cache, block_tables[b], context, first)  # [context - first, KVH, D]
        visible = _visible(q_len, context, first, sliding_window, q.device)
        out[start:end] = _attend(q[start:end], k, v, visible, scale, sinks).to(q.dtype)
    return out


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values at positions `first .. seq_len - 1`, in position order
    (its blocks wholly outside them are never touched). block_table: [max_blocks].
    Returns k, v: [seq_len - first, KVH, D]."""
    block_size = kv_cache.shape[2]
    first_block = first // block_size
    blocks = block_table[first_block : -(-seq_len // block_size)].long()
    skip, count = first - first_block * block_size, seq_len - first
    k = kv_cache[0, blocks].flatten(0, 1)[skip : skip + count]
    v = kv_cache[1, blocks].flatten(0, 1)[skip : skip + count]
    return k, v


def _visible(
    q_len: int, context: int, first: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[q_len, context - first] bool, True where the query (one of the last q_len positions)
    sees the key (positions first .. context - 1)."""
    q_pos = torch.arange(context - q_len, context, device=device)[:, None]
    k_pos = torch.arange(first, context, device=device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """None, or one fp32 sink logit per query head of q [T, H, D], on q's device."""
    if sinks is None:
        return
    if sinks.shape != (q.shape[1],) or sinks.dtype != torch.float32 or sinks.device != q.device:
        raise ValueError(
            f"sinks must be fp32 [{q.shape[1]}] (one logit per query head) on {q.device}, got "
            f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
        )


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [Q, H, D]; k, v: [S, KVH, D], each kv head serving H / KVH query heads; visible:
    [Q, S] (every row sees its own key, so no row is all -inf); sinks: None or [H] -> [Q, H, D]
    fp32."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))  # [S, H, D]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more column per head, its probability dropped after
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _check_inputs(q, kv_cache, block_tables, query_start_loc, seq_lens) -> None:
    """The shapes the contract needs, with errors that name the argument (no kernel limits)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be one layer's [2, num_blocks, block_size, kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    if kv_cache.shape[4] != q.shape[2]:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[4]} != q's head_dim {q.shape[2]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"heads ({num_heads}) must be a multiple of kv_heads ({num_kv_heads})")
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"need seq_lens [B] and query_start_loc [B + 1], got {tuple(seq_lens.shape)} and "
            f"{tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [B={num_seqs}, max_blocks], got {block_tables.shape}"
        )
