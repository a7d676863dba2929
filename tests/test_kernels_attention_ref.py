"""kernels/attention_ref.py, the one paged-attention reference, on its own: decode rows agree
with the prefill they are the steps of, against dense float64 attention for head dims and block
sizes no kernel takes, empty contexts give zeros, lengths past the table clamp to it, and bad
metadata is refused. (The kernel and ops tests check the kernels and the CPU path against it.)

Every slot no sequence owns is NaN, so a read past a sequence's context shows up."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels.attention_ref import paged_attention_ref


def make_cache(seq_lens, kv_heads, head_dim, block_size, seed=0):
    """A NaN cache with each sequence's keys/values in shuffled blocks (block 0 never used);
    returns cache, block tables [B, max_blocks + 1] int32 and the true (k, v) per sequence."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = 2 + sum(needed)
    pool = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    tables = torch.zeros(len(seq_lens), max(needed, default=0) + 1, dtype=torch.int32)
    true_kv = []
    for b, (n, used) in enumerate(zip(seq_lens, needed, strict=True)):
        tables[b, :used] = torch.tensor([pool.pop() for _ in range(used)], dtype=torch.int32)
        k, v = torch.randn(2, n, kv_heads, head_dim, generator=g)
        for p in range(n):
            cache[:, tables[b, p // block_size], p % block_size] = torch.stack([k[p], v[p]])
        true_kv.append((k, v))
    return cache, tables, true_kv


def run(q, cache, tables, query_lens, seq_lens, scale=0.3):
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return paged_attention_ref(q, cache, tables, starts, lens, scale)


def dense(q, k, v, scale=0.3):
    """Causal attention of the last len(q) positions over k, v [S, KVH, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(k.shape[0] - q.shape[0])
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("head_dim, block_size", [(32, 1), (96, 4), (256, 16)])
def test_matches_dense_attention(head_dim, block_size):
    seq_lens, query_lens = [9, 20, 3], [4, 1, 3]
    cache, tables, true_kv = make_cache(seq_lens, 2, head_dim, block_size)
    q = torch.randn(sum(query_lens), 6, head_dim)
    out = run(q, cache, tables, query_lens, seq_lens)
    start = 0
    for (k, v), n in zip(true_kv, query_lens, strict=True):
        want = dense(q[start : start + n], k, v)
        torch.testing.assert_close(out[start : start + n].double(), want, rtol=1e-5, atol=1e-5)
        start += n


def test_decode_rows_are_the_steps_of_a_prefill():
    """Query i of a 7-token chunk after a 5-token prefix equals one decode row of length 6 + i."""
    cache, tables, _ = make_cache([12], 1, 64, 4, seed=1)
    q = torch.randn(7, 4, 64)
    prefill = run(q, cache, tables, [7], [12])
    decode = run(q, cache, tables.expand(7, -1).contiguous(), [1] * 7, list(range(6, 13)))
    # (fp32: the same sums in another order)
    torch.testing.assert_close(decode, prefill, rtol=1e-5, atol=1e-5)


def test_empty_context_and_unowned_tokens_are_zeros():
    cache, tables, _ = make_cache([5, 3], 2, 16, 4, seed=2)
    q = torch.randn(4, 2, 16)  # rows 0 (idle decode, seq_len 0) and 1..2 (a chunk), token 3 spare
    out = run(q, cache, tables, [1, 2], [0, 3])
    assert (out[0] == 0).all() and (out[3] == 0).all()
    assert torch.isfinite(out).all() and (out[1:3] != 0).any()


def test_lengths_past_the_table_are_clamped_to_it():
    cache, tables, _ = make_cache([8], 1, 16, 4, seed=3)
    tables = tables[:, :2].contiguous()  # exactly the 8 slots written
    q = torch.randn(2, 1, 16)
    torch.testing.assert_close(run(q, cache, tables, [2], [500]), run(q, cache, tables, [2], [8]))


@pytest.mark.parametrize(
    "query_lens, seq_lens, match",
    [([4], [3], "q_len \\(4\\) <= seq_len \\(3"), ([1], [-1], "seq_len \\(-1")],
)
def test_refuses_queries_past_their_context(query_lens, seq_lens, match):
    cache, tables, _ = make_cache([3], 1, 16, 4)
    with pytest.raises(ValueError, match=match):
        run(torch.randn(sum(query_lens), 1, 16), cache, tables, query_lens, seq_lens)


def test_refuses_inconsistent_shapes():
    cache, tables, _ = make_cache([3, 4], 2, 16, 4)
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="query_start_loc \\[B \\+ 1\\]"):
        paged_attention_ref(q, cache, tables, torch.tensor([0, 1]), torch.tensor([3, 4]), 1.0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        run(torch.randn(2, 3, 16), cache, tables, [1, 1], [3, 4])
    with pytest.raises(ValueError, match="head_dim"):
        run(torch.randn(2, 4, 8), cache, tables, [1, 1], [3, 4])
    with pytest.raises(ValueError, match="block_tables must be"):
        run(q, cache, tables[:1], [1, 1], [3, 4])
