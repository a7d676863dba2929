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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


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
    # Host-side layout, filled once per step by `with_layout` so that no layer syncs the device:
    # Python copies of the loop bounds, and the decode rows (one query token each) that run as
    # one batched computation instead of a loop.
    host_query_start: list[int] | None = None
    host_seq_lens: list[int] | None = None
    decode_seqs: torch.Tensor | None = None  # [Bd] int64 sequence indices with query_len 1
    decode_tokens: torch.Tensor | None = None  # [Bd] int64 their token indices
    decode_max_len: int = 0  # longest context among the decode rows
    # With the block size known: each decode row's slots for positions [0, decode_max_len),
    # positions past its end clamped to its last token (written, so finite), and the additive
    # mask that hides them. The same for every layer, so built once per step.
    decode_slots: torch.Tensor | None = None  # [Bd, S] int64
    decode_bias: torch.Tensor | None = None  # [Bd, 1, 1, S] float32, 0 or -inf
    prefill: PrefillLayout | None = None  # the other sequences, padded into one batch

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

    def with_layout(
        self, query_start: list[int], seq_lens: list[int], block_size: int = 0
    ) -> AttentionMetadata:
        """Attach the host layout (from the host copies the caller already has): decode rows
        and prefill rows each become one batched computation, the same for every layer.
        `block_size` (0 = unknown) lets the decode rows' slots be computed once here."""
        self.host_query_start, self.host_seq_lens = list(query_start), list(seq_lens)
        device = self.seq_lens.device
        lens = [query_start[b + 1] - query_start[b] for b in range(len(seq_lens))]
        decode = [b for b, n in enumerate(lens) if n == 1]
        if decode:
            self.decode_seqs = torch.tensor(decode, dtype=torch.int64, device=device)
            tokens = [query_start[b] for b in decode]
            self.decode_tokens = torch.tensor(tokens, dtype=torch.int64, device=device)
            self.decode_max_len = max(seq_lens[b] for b in decode)
            if block_size > 0:
                self._decode_slots(block_size)
        rows = [b for b, n in enumerate(lens) if n > 1]
        if rows:
            self.prefill = PrefillLayout.build(rows, query_start, seq_lens, device)
            if block_size > 0:
                self.prefill.attach_slots(self.block_tables, self.seq_lens, block_size)
        return self

    def _decode_slots(self, block_size: int) -> None:
        lens = self.seq_lens[self.decode_seqs].long()[:, None]  # [Bd, 1]
        pos = torch.arange(self.decode_max_len, device=lens.device)[None, :]  # [1, S]
        clamped = torch.minimum(pos, lens - 1)
        tables = self.block_tables[self.decode_seqs].long()
        blocks = torch.gather(tables, 1, clamped // block_size)
        self.decode_slots = blocks * block_size + clamped % block_size
        bias = torch.zeros(clamped.shape, device=lens.device).masked_fill(pos >= lens, -math.inf)
        self.decode_bias = bias[:, None, None, :]  # [Bd, 1, 1, S]


@dataclass
class PrefillLayout:
    """Sequences with several query tokens, padded to the longest: [Bp, Qmax] index tables."""

    seqs: torch.Tensor  # [Bp] int64 sequence indices
    tokens: torch.Tensor  # [Bp, Qmax] int64 token index of each query (0 where padded)
    valid: torch.Tensor  # [Bp, Qmax] bool, False where padded
    positions: torch.Tensor  # [Bp, Qmax] int64 position of each query in its sequence
    max_len: int  # longest context among these rows
    # With the block size known (attach_slots): each row's slots for key positions [0, max_len),
    # clamped to its last token (written this step, so finite), and the causal mask over them.
    slots: torch.Tensor | None = None  # [Bp, S] int64
    mask: torch.Tensor | None = None  # [Bp, 1, Qmax, S] bool, True = the query sees the key

    @classmethod
    def build(cls, rows: list[int], query_start: list[int], seq_lens: list[int], device):
        qmax = max(query_start[b + 1] - query_start[b] for b in rows)
        tokens = torch.zeros(len(rows), qmax, dtype=torch.int64)
        valid = torch.zeros(len(rows), qmax, dtype=torch.bool)
        positions = torch.zeros(len(rows), qmax, dtype=torch.int64)
        for i, b in enumerate(rows):
            n = query_start[b + 1] - query_start[b]
            tokens[i, :n] = torch.arange(query_start[b], query_start[b + 1])
            valid[i, :n] = True
            positions[i, :n] = torch.arange(seq_lens[b] - n, seq_lens[b])
        seqs = torch.tensor(rows, dtype=torch.int64)
        max_len = max(seq_lens[b] for b in rows)
        return cls(*(x.to(device) for x in (seqs, tokens, valid, positions)), max_len)

    def attach_slots(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> None:
        lens = seq_lens[self.seqs].long()[:, None]  # [Bp, 1]
        pos = torch.arange(self.max_len, device=lens.device)[None, :]  # [1, S]
        clamped = torch.minimum(pos, lens - 1)
        blocks = torch.gather(block_tables[self.seqs].long(), 1, clamped // block_size)
        self.slots = blocks * block_size + clamped % block_size
        # Padded query rows have position 0: they see key 0, so no row is all -inf (no NaN).
        self.mask = (pos[:, None, :] <= self.positions[:, :, None])[:, None]


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
    must already be written). Plain torch, fp32 inside: decode rows batched when the host
    layout is attached (`with_layout`), one loop iteration per other sequence.

    q: [T, heads, head_dim] -> out: [T, heads, head_dim] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = layer_cache.shape[-2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = attn.host_query_start
    seq_lens = attn.host_seq_lens
    if starts is None:  # no host layout attached: one device sync for the loop bounds
        starts, seq_lens = attn.query_start_loc.tolist(), attn.seq_lens.tolist()
    if attn.host_query_start is not None:  # batched: no per-sequence loop
        if attn.decode_slots is not None:
            out[attn.decode_tokens] = _decode_attention_by_slots(
                q[attn.decode_tokens], layer_cache, attn.decode_slots, attn.decode_bias, scale
            )
        elif attn.decode_seqs is not None:
            out[attn.decode_tokens] = paged_decode_attention_ref(
                q[attn.decode_tokens],
                layer_cache,
                attn.block_tables[attn.decode_seqs],
                attn.seq_lens[attn.decode_seqs],
                scale,
                attn.decode_max_len,
            )
        if attn.prefill is not None and attn.prefill.slots is not None:
            _prefill_attention_by_slots(q, out, layer_cache, attn.prefill, scale)
        elif attn.prefill is not None:
            _batched_prefill_attention(q, out, layer_cache, attn, scale)
        return out
    for b, seq_len in enumerate(seq_lens):
        start, end = starts[b], starts[b + 1]
        query_len = end - start
        if query_len == 0 or (query_len == 1 and attn.decode_seqs is not None):
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


def _gather_padded(
    layer_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, max_len) of each row, through its block table:
    [rows, max_len, kv_heads, D] (0 = every position the table covers). Gathers slots, not
    whole blocks, so large blocks cost only what is used."""
    _, num_blocks, block_size, num_kv_heads, head_dim = layer_cache.shape
    if max_len <= 0:
        max_len = block_tables.shape[1] * block_size
    pos = torch.arange(max_len, device=block_tables.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    k = layer_cache[0].view(num_blocks * block_size, num_kv_heads, head_dim)[slots]
    v = layer_cache[1].view(num_blocks * block_size, num_kv_heads, head_dim)[slots]
    return k, v


def _batched_prefill_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    layer_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> None:
    """Causal attention of the prefill rows as one padded batch; writes their rows of `out`."""
    lay = attn.prefill
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = layer_cache.shape[-2]
    bp, qmax = lay.tokens.shape
    k, v = _gather_padded(layer_cache, attn.block_tables[lay.seqs], lay.max_len)
    k, v = k.float(), v.float()  # [Bp, S, kv_heads, D], S = the longest context
    key_pos = torch.arange(k.shape[1], device=q.device)
    seen = key_pos[None, None, :] <= lay.positions[:, :, None]  # [Bp, Qmax, S] causal
    qg = q[lay.tokens].float().view(bp, qmax, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bqkgd,bskd->bkgqs", qg, k) * scale  # [Bp, kv, group, Qmax, S]
    scores = scores.masked_fill(~seen[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # padded query rows are NaN; never read back
    # Keys past the longest query position were never written here (garbage may be NaN).
    used = key_pos[None, :] <= lay.positions.max(dim=1).values[:, None]  # [Bp, S]
    v = torch.where(used[:, :, None, None], v, 0.0)
    o = torch.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(bp, qmax, num_heads, head_dim)
    out[lay.tokens[lay.valid]] = o[lay.valid].to(out.dtype)


def _gather_slots(layer_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Keys and values at `slots` [R, S]: each [R, kv_heads, S, D] (index_select: on CPU about
    twice as fast as advanced indexing)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = layer_cache.shape
    flat = layer_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    index = slots.reshape(-1)
    shape = (*slots.shape, num_kv_heads, head_dim)
    k = flat[0].index_select(0, index).view(shape).transpose(1, 2)
    v = flat[1].index_select(0, index).view(shape).transpose(1, 2)
    return k, v


def _sdpa(q, k, v, mask, scale: float) -> torch.Tensor:
    """Fused attention with grouped K/V. q: [B, heads, Q, D]; k, v: [B, kv_heads, S, D]; mask
    [B, 1, Q, S] (bool, True = seen, or additive float) -> [B, heads, Q, D]."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    # On CUDA, SDPA with a mask may pick cuDNN, which builds a new graph for every new shape:
    # 10-25 ms of host time per call, and a decode step's context length changes every step.
    # The memory-efficient kernel has no such cost; it wants K/V with every head.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _prefill_attention_by_slots(
    q: torch.Tensor, out: torch.Tensor, layer_cache: torch.Tensor, lay: PrefillLayout, scale: float
) -> None:
    """The prefill rows as one padded batch through fused SDPA (grouped K/V, see `_sdpa`);
    writes their rows of `out`. Every gathered slot was written, so no NaN can leak in."""
    bp, qmax = lay.tokens.shape
    k, v = _gather_slots(layer_cache, lay.slots)  # [Bp, kv_heads, S, D]
    qp = q[lay.tokens].transpose(1, 2)  # [Bp, heads, Qmax, D]
    o = _sdpa(qp, k.to(q.dtype), v.to(q.dtype), lay.mask, scale)
    o = o.transpose(1, 2)  # [Bp, Qmax, heads, D]
    out[lay.tokens[lay.valid]] = o[lay.valid].to(out.dtype)


def _decode_attention_by_slots(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    slots: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_decode_attention_ref with the per-step work hoisted out (slots, mask): two gathers
    and one fused SDPA per layer. q: [Bd, heads, D] -> [Bd, heads, D]."""
    k, v = _gather_slots(layer_cache, slots)  # [Bd, kv_heads, S, D]
    o = _sdpa(q[:, :, None], k.to(q.dtype), v.to(q.dtype), bias.to(q.dtype), scale)
    return o[:, :, 0]


def paged_decode_attention_ref(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_len: int = 0,
) -> torch.Tensor:
    """Batched attention of Bd sequences that each have one query token (decode), padded to the
    longest context in the batch (`max_len`, 0 = the whole block table) and masked. fp32 inside.

    q: [Bd, heads, D]; block_tables: [Bd, max_blocks]; seq_lens: [Bd] -> [Bd, heads, D].
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = layer_cache.shape[-2]
    k, v = _gather_padded(layer_cache, block_tables, max_len)  # [Bd, S, kv_heads, D]
    positions = torch.arange(k.shape[1], device=q.device)
    valid = positions[None, :] < seq_lens[:, None].long()  # [Bd, S]
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k.float()) * scale  # [Bd, kv, group, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Slots past a sequence's end were never written (the cache is not zeroed): a zero weight
    # times garbage can still be NaN, so clear them.
    v = torch.where(valid[:, :, None, None], v.float(), 0.0)
    out = torch.einsum("bkgs,bskd->bkgd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


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
