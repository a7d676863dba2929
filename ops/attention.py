"""Paged attention over a flat, unpadded batch: the metadata and the one dispatch point.

Owns `AttentionMetadata` (what one step's attention needs to know about its B sequences), the
KV-cache layout and `paged_attention`, what the model runs: on CUDA the Triton kernels (the
decode rows, a prefix of the step, through kernels/decode_attention.py; the longer chunks through
kernels/prefill_attention.py); elsewhere decode rows and prefill rows each as one padded batch
through fused SDPA. Tests check both paths against the one reference, kernels/attention_ref.py's
`paged_attention_ref`, given the metadata's tensors. Must not decide anything about scheduling:
block tables and slots come from the allocator through the GPU actor, and are only read here.

KV cache: one tensor per rank, `[num_kv_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]` (attention layers only, this rank's kv heads; index 0 = keys, 1 = values; built by
ops/models/llama.allocate_kv_cache). Token `p` of a sequence lives in block
`block_table[p // block_size]` at offset `p % block_size`, i.e. in slot
`block_id * block_size + offset`. The cache is not zeroed: a slot a sequence did not write holds
garbage, so no path may read one.

Sliding windows are per layer (`paged_attention(..., sliding_window=W)`; Gemma 3 interleaves
windowed and global layers): one step's metadata serves them all. The kernels take W as an
argument; the CPU path builds each window's key slots and mask once per step, on first use.
With W, no path reads a key before the window of its sequence's first query this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from taipan.kernels.attention_ref import check_sinks, check_sliding_window
from taipan.kernels.decode_attention import paged_decode_attention
from taipan.kernels.prefill_attention import paged_prefill_attention


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
    # From the host copies, once per step (`with_layout`), so no layer syncs the device: the
    # first `num_decodes` sequences have one query token each (the scheduler puts such rows
    # first; any later one-token row goes with the others), none more than `max_query_len`.
    num_decodes: int = 0
    max_query_len: int = 0
    # CPU only: the decode rows and the prefill rows, each one padded batch for SDPA.
    batches: tuple[RowBatch, ...] | None = None
    # Per-layer-group KV (ops/models/llama.WindowedKV): the windowed layers' view, the same
    # sequences over their own pool's block tables and slots; None: every layer reads these.
    local: AttentionMetadata | None = None

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata a layer with this sliding window reads (None: a global layer)."""
        return self.local if window and self.local is not None else self

    def with_local(
        self, block_tables: torch.Tensor, slot_mapping: torch.Tensor, host_layout=None
    ) -> AttentionMetadata:
        """Attach the windowed layers' view (their block tables and slots; `host_layout`: the
        (query_start, seq_lens, block_size) `with_layout` took, for the CPU's batches); returns
        self."""
        local = AttentionMetadata(
            self.query_start_loc, self.seq_lens, block_tables, slot_mapping,
            self.num_decodes, self.max_query_len,
        )  # fmt: skip
        self.local = local if host_layout is None else local.with_layout(*host_layout)
        return self

    def with_layout(
        self, query_start: np.ndarray | list[int], seq_lens: np.ndarray | list[int], block_size: int
    ) -> AttentionMetadata:
        """Attach the layout `paged_attention` needs, from host copies of `query_start_loc` and
        `seq_lens` the caller already has; returns self."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        query_start, seq_lens = np.asarray(query_start), np.asarray(seq_lens)
        query_lens = np.diff(query_start)
        longer = np.flatnonzero(query_lens != 1)  # the leading one-token rows are decode rows
        self.num_decodes = int(longer[0]) if len(longer) else len(query_lens)
        self.max_query_len = int(query_lens.max(initial=0))
        if self.query_start_loc.is_cuda:
            return self  # the kernels need nothing more
        query_start, seq_lens = query_start.tolist(), seq_lens.tolist()
        query_lens = query_lens.tolist()
        # Decode rows and prefill rows are padded apart: one long prompt must not pad every
        # decode row's single query to its length.
        decode = [b for b, n in enumerate(query_lens) if n == 1]
        prefill = [b for b, n in enumerate(query_lens) if n > 1]
        self.batches = tuple(
            RowBatch.build(rows, query_start, seq_lens, self.block_tables, block_size)
            for rows in (decode, prefill)
            if rows
        )
        return self


@dataclass
class RowBatch:
    """Some of a step's sequences padded into one batch: R rows of up to Qmax queries each.

    Which keys a row's queries see depends on the layer's sliding window (Gemma 3 interleaves
    windowed and global layers), so the key side is built per window on first use and kept for
    the step's other layers (`keys`); everything else is built once per step."""

    tokens: torch.Tensor  # [R, Qmax] int64 token index of each query (0 where padded)
    # Each query's position; padded queries repeat their row's last one, which sees keys in
    # every window, so no row of the mask is all False (no NaN).
    positions: torch.Tensor  # [R, Qmax] int64
    # Where the real (unpadded) queries' outputs go: flat index in [R * Qmax] -> token index.
    # Index tensors, not a boolean mask, so scattering them back never syncs the device.
    valid_index: torch.Tensor  # [N] int64 into the flattened [R * Qmax] queries
    valid_tokens: torch.Tensor  # [N] int64 their token indices
    tables: torch.Tensor  # [R, max_blocks] int64, each row's block table
    lens: torch.Tensor  # [R, 1] int64 context lengths
    block_size: int
    # Host copies, so sizing a window's keys never syncs the device.
    host_first: list[int]  # [R] position of each row's first query
    host_lens: list[int]  # [R] context lengths
    _keys: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def build(
        cls,
        rows: list[int],
        query_start: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
    ) -> RowBatch:
        qmax = max(query_start[b + 1] - query_start[b] for b in rows)
        tokens = torch.zeros(len(rows), qmax, dtype=torch.int64)
        positions = torch.zeros(len(rows), qmax, dtype=torch.int64)
        valid_index: list[int] = []
        for i, b in enumerate(rows):
            n = query_start[b + 1] - query_start[b]
            tokens[i, :n] = torch.arange(query_start[b], query_start[b + 1])
            positions[i, :n] = torch.arange(seq_lens[b] - n, seq_lens[b])
            positions[i, n:] = seq_lens[b] - 1
            valid_index += range(i * qmax, i * qmax + n)
        valid_tokens = tokens.view(-1)[valid_index]
        device = block_tables.device
        seqs = torch.tensor(rows, dtype=torch.int64, device=device)
        host_lens = [seq_lens[b] for b in rows]
        return cls(
            tokens=tokens.to(device),
            positions=positions.to(device),
            valid_index=torch.tensor(valid_index, dtype=torch.int64, device=device),
            valid_tokens=valid_tokens.to(device),
            tables=block_tables[seqs].long(),
            lens=torch.tensor(host_lens, dtype=torch.int64, device=device)[:, None],
            block_size=block_size,
            host_first=[seq_lens[b] - (query_start[b + 1] - query_start[b]) for b in rows],
            host_lens=host_lens,
        )

    def keys(self, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [R, S] int64, mask [R, 1, Qmax, S] bool, True = the query sees the key) for
        one window. Key j of row r is position `first_r + j`, where first_r starts the window
        of the row's first query (0 without a window): no slot before it is read (its block
        may be freed and reused), and S is the longest such span, not the longest context.
        Positions past a row's end read its last token (written this step, so finite; the
        mask hides it)."""
        if sliding_window not in self._keys:
            self._keys[sliding_window] = self._build_keys(sliding_window)
        return self._keys[sliding_window]

    def _build_keys(self, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        window = sliding_window
        first = [0 if window is None else max(0, p - window + 1) for p in self.host_first]
        span = max(n - f for n, f in zip(self.host_lens, first, strict=True))
        device = self.tables.device
        start = torch.tensor(first, dtype=torch.int64, device=device)[:, None]  # [R, 1]
        pos = start + torch.arange(span, device=device)[None, :]  # [R, S]
        clamped = torch.minimum(pos, self.lens - 1)
        blocks = torch.gather(self.tables, 1, clamped // self.block_size)
        slots = blocks * self.block_size + clamped % self.block_size
        q_pos = self.positions[:, :, None]  # [R, Qmax, 1]
        mask = pos[:, None, :] <= q_pos  # [R, Qmax, S]
        if window is not None:
            mask &= pos[:, None, :] > q_pos - window
        return slots, mask[:, None]


def paged_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of each query token over its sequence's paged KV (this step's keys
    must already be written). Needs the layout (`AttentionMetadata.with_layout`).

    q: [T, heads, head_dim] (a strided view is fine) -> out: [T, heads, head_dim] in q's dtype.
    sliding_window: None (global), or W >= 1, this layer's window: the query at position p sees
    keys p - W < k <= p (Hugging Face's sliding-window mask). With W, no path reads a key
    before the window of its sequence's first query this step, so the engine may free blocks
    wholly before it. On CUDA, head_dim must be one of kernels/attention_ref.SUPPORTED_HEAD_DIMS
    (32, 64, 80, 96, 128, 192, 256); the CPU path takes any. sinks: None, or [heads] fp32
    learned sink logits (gpt-oss's; kernels/attention_ref.py says what they do).
    """
    check_sliding_window(sliding_window)
    check_sinks(sinks, q)
    if q.is_cuda:
        return _attend_kernels(q, layer_cache, attn, scale, sliding_window, sinks)
    if attn.batches is None:
        raise ValueError(
            "paged_attention needs the step's layout: build the metadata with "
            "AttentionMetadata(...).with_layout(query_start, seq_lens, block_size)"
        )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for rows in attn.batches:
        _attend_rows(q, out, layer_cache, rows, scale, sliding_window, sinks)
    return out


def _attend_kernels(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The decode rows (a prefix of the step, one token each) through the split-K decode
    kernel, every other row through the varlen prefill kernel, into one output."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    d = attn.num_decodes
    if d:
        paged_decode_attention(
            q[:d],
            layer_cache,
            attn.block_tables[:d],
            attn.seq_lens[:d],
            scale,
            sliding_window=sliding_window,
            sinks=sinks,
            out=out[:d],
        )
    if d < attn.seq_lens.shape[0]:
        # Its query starts are absolute token indices into q, so the rows need no shifting.
        paged_prefill_attention(
            q,
            layer_cache,
            attn.block_tables[d:],
            attn.query_start_loc[d:],
            attn.seq_lens[d:],
            scale,
            max_query_len=attn.max_query_len,
            sliding_window=sliding_window,
            sinks=sinks,
            out=out,
        )
    return out


def _attend_rows(
    q: torch.Tensor,
    out: torch.Tensor,
    layer_cache: torch.Tensor,
    rows: RowBatch,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> None:
    """One padded batch of rows through fused SDPA; writes their tokens' rows of `out`."""
    num_rows, qmax = rows.tokens.shape
    slots, mask = rows.keys(sliding_window)
    k, v = _gather_slots(layer_cache, slots)  # [R, kv_heads, S, D]
    if sinks is not None:
        k, v, mask = _with_sink_key(k, v, mask, sinks)
        mask = mask.to(q.dtype)  # (SDPA takes a float mask in the query's dtype)
    qr = q[rows.tokens].transpose(1, 2)  # [R, heads, Qmax, D]
    o = _sdpa(qr, k.to(q.dtype), v.to(q.dtype), mask, scale)  # [R, heads, Qmax, D]
    o = o.transpose(1, 2).reshape(num_rows * qmax, *q.shape[1:])  # [R * Qmax, heads, D]
    out[rows.valid_tokens] = o[rows.valid_index].to(out.dtype)


def _with_sink_key(k, v, mask, sinks: torch.Tensor):
    """Sinks for SDPA: one more key of zeros (score 0, value 0) whose additive mask is the
    head's sink logit, so it joins the softmax's denominator and adds nothing to the output.
    k, v: [R, kv_heads, S, D]; mask [R, 1, Q, S] bool -> k, v [R, kv_heads, S + 1, D] and a
    float mask [R, heads, Q, S + 1]."""
    zero = k.new_zeros((*k.shape[:2], 1, k.shape[-1]))
    bias = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
    bias = bias.expand(-1, sinks.shape[0], -1, -1)  # [R, heads, Q, S]
    sink = sinks.float()[None, :, None, None].expand(*bias.shape[:3], 1)
    return torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2), torch.cat([bias, sink], -1)


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
    """Fused attention with grouped K/V (the CPU path). q: [B, heads, Q, D]; k, v: [B, kv_heads,
    S, D]; mask [B, 1, Q, S] (bool, True = seen) -> [B, heads, Q, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata (layout attached) and positions [T] for sequences given as plain lists (tests
    and simple callers; the GPU actor fills persistent buffers instead).

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
    ).with_layout(cumulative, seq_lens, block_size)
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)
