"""kernels/attention_ref.py, the one paged-attention reference, on its own: decode rows agree
with the prefill they are the steps of, against dense float64 attention (with and without a
sliding window) for head dims and block sizes no kernel takes, empty contexts give zeros,
lengths past the table clamp to it, and bad metadata or windows are refused. (The kernel and ops
tests check the kernels and the CPU path against it.)

Every slot no sequence owns is NaN, and so, with a window, is every block wholly before the
window of a sequence's first query (the engine frees those): a read of either shows up."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels.attention_ref import (
    SUPPORTED_HEAD_DIMS,
    check_sliding_window,
    head_dim_pad,
    paged_attention_ref,
)


def make_cache(seq_lens, kv_heads, head_dim, block_size, seed=0, freed_before=None):
    """A NaN cache with each sequence's keys/values in shuffled blocks (block 0 never used);
    returns cache, block tables [B, max_blocks + 1] int32 and the true (k, v) per sequence.
    freed_before[b]: sequence b's blocks wholly before this position are NaN again (freed)."""
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
        if freed_before is not None:
            cache[:, tables[b, : freed_before[b] // block_size].long()] = float("nan")
        true_kv.append((k, v))
    return cache, tables, true_kv


def run(q, cache, tables, query_lens, seq_lens, scale=0.3, window=None):
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return paged_attention_ref(q, cache, tables, starts, lens, scale, sliding_window=window)


def dense(q, k, v, scale=0.3, window=None, sinks=None):
    """Causal attention of the last len(q) positions over k, v [S, KVH, D], in float64; with a
    window, as Hugging Face's masking_utils builds it: causal AND kv_idx > q_idx - window;
    `sinks` [H]: each head's sink one more logit in each softmax (and no value)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_idx = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    kv_idx = torch.arange(k.shape[0])[None, :]
    seen = kv_idx <= q_idx
    if window is not None:
        seen &= kv_idx > q_idx - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    weights = scores.exp()
    total = weights.sum(-1, keepdim=True) + sinks.double().exp()[:, None, None]
    return torch.einsum("hqk,khd->qhd", weights / total, v)


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


# Windows: 1 (only itself), smaller than every context and not a multiple of the block size,
# between the contexts, and as long as the longest context (no effect).
@pytest.mark.parametrize("window", [1, 3, 7, 20])
@pytest.mark.parametrize("head_dim, block_size", [(16, 4), (80, 2)])
def test_windows_match_dense_attention(window, head_dim, block_size):
    seq_lens, query_lens = [9, 20, 3, 13], [4, 1, 3, 13]
    first = [max(0, n - q - window + 1) for n, q in zip(seq_lens, query_lens, strict=True)]
    cache, tables, true_kv = make_cache(seq_lens, 2, head_dim, block_size, 4, freed_before=first)
    q = torch.randn(sum(query_lens), 4, head_dim)
    out = run(q, cache, tables, query_lens, seq_lens, window=window)
    assert torch.isfinite(out).all(), "read a freed block before the window"
    start = 0
    for (k, v), n in zip(true_kv, query_lens, strict=True):
        want = dense(q[start : start + n], k, v, window=window)
        torch.testing.assert_close(out[start : start + n].double(), want, rtol=1e-5, atol=1e-5)
        start += n
    if window >= max(seq_lens):
        torch.testing.assert_close(out, run(q, cache, tables, query_lens, seq_lens))


def test_window_of_one_returns_each_query_its_own_value():
    cache, tables, true_kv = make_cache([10], 1, 16, 4, seed=5, freed_before=[7])  # block 0
    out = run(torch.randn(3, 2, 16), cache, tables, [3], [10], window=1)
    torch.testing.assert_close(out, true_kv[0][1][7:].repeat_interleave(2, 1))


@pytest.mark.parametrize("window", [0, -2, 2.0, True, "8"])
def test_refuses_bad_windows(window):
    cache, tables, _ = make_cache([3], 1, 16, 4)
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        run(torch.randn(1, 1, 16), cache, tables, [1], [3], window=window)
    check_sliding_window(None)
    check_sliding_window(4096)


def test_kernel_head_dims_pad_to_a_power_of_two():
    assert [head_dim_pad(d) for d in SUPPORTED_HEAD_DIMS] == [32, 64, 128, 128, 128, 256, 256]
    with pytest.raises(ValueError, match=r"head_dim 72 is not supported \(supported: 32, 64, 80"):
        head_dim_pad(72)


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
