"""The batched attention paths (decode rows, padded prefill rows) equal the per-sequence loop,
and never read slots a sequence did not write (those hold NaN here)."""

from __future__ import annotations

import pytest
import torch

from taipan.ops.attention import AttentionMetadata, paged_attention_ref, write_kv


@pytest.mark.parametrize("seed", range(6))
def test_batched_equals_loop(seed):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, bs, num_blocks = 6, 2, 16, 4, 64
    num_seqs = int(torch.randint(1, 7, (1,), generator=g))
    cache = torch.full((2, num_blocks, bs, kv_heads, dim), float("nan"))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    query_lens, seq_lens, tables, slots = [], [], [], []
    for _ in range(num_seqs):
        q_len = int(torch.randint(1, 9, (1,), generator=g))
        if torch.rand(1, generator=g) < 0.5:
            q_len = 1  # a decode row
        cached = int(torch.randint(0, 12, (1,), generator=g))
        total = cached + q_len
        blocks = [perm.pop() for _ in range(-(-total // bs))]
        # the cached prefix: written earlier
        for p in range(cached):
            cache[:, blocks[p // bs], p % bs] = torch.randn(2, kv_heads, dim, generator=g)
        slots += [blocks[p // bs] * bs + p % bs for p in range(cached, total)]
        query_lens.append(q_len)
        seq_lens.append(total)
        tables.append(blocks)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    tokens = starts[-1]
    q = torch.randn(tokens, heads, dim, generator=g)
    k = torch.randn(tokens, kv_heads, dim, generator=g)
    v = torch.randn(tokens, kv_heads, dim, generator=g)
    write_kv(k, v, cache, torch.tensor(slots))

    def meta():
        return AttentionMetadata(
            torch.tensor(starts, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            block_tables,
            torch.tensor(slots),
        )

    loop = paged_attention_ref(q, cache, meta(), dim**-0.5)
    batched = paged_attention_ref(q, cache, meta().with_layout(starts, seq_lens), dim**-0.5)
    by_slots = paged_attention_ref(q, cache, meta().with_layout(starts, seq_lens, bs), dim**-0.5)
    assert not torch.isnan(loop).any() and not torch.isnan(batched).any()
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_slots, loop, rtol=1e-5, atol=1e-5)
