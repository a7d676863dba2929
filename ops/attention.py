"""Paged attention over a flat, unpadded batch: the metadata, the KV write and the torch reference.

Owns `AttentionMetadata` (what one step's attention needs to know about its B sequences), the
KV-cache layout, `write_kv` (this step's keys and values into their slots) and
`paged_attention_ref` (each query token against its own sequence's cached keys, causally).
The Triton kernels in kernels/ implement the same contracts; this file is their reference and
the CPU path. Must not decide anything about scheduling: block tables and slots come from the
allocator through the GPU actor, and are only read here.

KV cache: one tensor per model, `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values). Token `p` of a sequence lives in block `block_table[p // block_size]`
at offset `p % block_size`, i.e. in slot `block_id * block_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's view of its B sequences; built by the GPU actor, read-only for the model.

    The step's T query tokens are laid out sequence after sequence: sequence b owns tokens
    `query_start_loc[b] : query_start_loc[b + 1]`, which are the last tokens of its context, so its
    first query token sits at position `seq_lens[b] - query_len[b]` (after its cached prefix).
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor  # [B] int32, context length of each sequence including this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset of each new token

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def to(self, device: torch.device | str) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_tables=self.block_tables.to(device),
            slot_mapping=self.slot_mapping.to(device),
        )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values in their slots (in place).

    k, v: [T, kv_heads, head_dim]; layer_cache: [2, num_blocks, block_size, kv_heads, head_dim].
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    assert layer_cache.shape[0] == 2 and layer_cache.shape[-2:] == (num_kv_heads, head_dim)
    assert slot_mapping.shape == (k.shape[0],), (slot_mapping.shape, k.shape)
    k_slots = layer_cache[0].view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, ...]
    v_slots = layer_cache[1].view(-1, num_kv_heads, head_dim)
    k_slots.index_copy_(0, slot_mapping, k.to(layer_cache.dtype))
    v_slots.index_copy_(0, slot_mapping, v.to(layer_cache.dtype))


def gather_kv(
    layer_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `seq_len` keys and values, in position order.

    block_table: [max_blocks] int32. Returns k, v: [seq_len, kv_heads, head_dim].
    """
    block_size = layer_cache.shape[2]
    num_blocks_used = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks_used].long()
    k = layer_cache[0, blocks].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, head_dim]
    v = layer_cache[1, blocks].flatten(0, 1)[:seq_len]
    return k, v


def paged_attention_ref(
    q: torch.Tensor, layer_cache: torch.Tensor, attn: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal GQA attention of each query token over its sequence's paged KV (this step's keys
    must already be written). Plain torch, fp32 inside; one loop iteration per sequence.

    q: [T, heads, head_dim] -> out: [T, heads, head_dim] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = layer_cache.shape[-2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    # One host sync for the whole step: the loop bounds are Python ints.
    starts = attn.query_start_loc.tolist()
    seq_lens = attn.seq_lens.tolist()
    for b, seq_len in enumerate(seq_lens):
        start, end = starts[b], starts[b + 1]
        query_len = end - start
        if query_len == 0:
            continue
        k, v = gather_kv(layer_cache, attn.block_tables[b], seq_len)  # [S, kv_heads, D]
        # qg: [kv_heads, group, query_len, D]; each kv head serves `group` query heads
        qg = q[start:end].float().view(query_len, num_kv_heads, group, head_dim)
        qg = qg.permute(1, 2, 0, 3)
        kt = k.float().permute(1, 2, 0).unsqueeze(1)  # [kv_heads, 1, D, S]
        vv = v.float().permute(1, 0, 2).unsqueeze(1)  # [kv_heads, 1, S, D]
        scores = torch.matmul(qg, kt) * scale  # [kv_heads, group, query_len, S]
        # Query i sits at position seq_len - query_len + i and sees keys 0..that position.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]  # [query_len, S], True = hidden
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, vv)  # [kv_heads, group, query_len, D]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim).to(q.dtype)
    return out


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions [T] for sequences given as plain lists (tests and simple callers;
    the GPU actor fills persistent buffers instead).

    Sequence b's new tokens are positions `seq_lens[b] - query_lens[b] .. seq_lens[b] - 1`.
    """
    assert len(query_lens) == len(seq_lens) == len(block_tables)
    positions, slots = [], []
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        assert 0 <= query_len <= seq_len <= len(table) * block_size, (query_len, seq_len, table)
        for pos in range(seq_len - query_len, seq_len):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max((len(t) for t in block_tables), default=0)
    padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
    cumulative = [0]
    for query_len in query_lens:
        cumulative.append(cumulative[-1] + query_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(cumulative, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(-1, max_blocks),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)
