"""ops.attention: the production path (`paged_attention`, slots + fused SDPA) against the one
per-sequence reference (kernels/attention_ref.py `paged_attention_ref`, given the metadata's
tensors), and the reference against dense causal attention over each sequence's true keys and
values.

Every cache starts as NaN and block 0 (the block tables' padding value) is never handed out, so a
read of any slot a sequence did not write, or of a padded table entry, shows up as NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from taipan.kernels.attention_ref import paged_attention_ref
from taipan.kernels.rope import write_kv_ref as write_kv
from taipan.ops.attention import AttentionMetadata, build_attention_metadata, paged_attention

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass
class Case:
    """One step: the cache with each sequence's prefix written, this step's K/V written, the
    metadata (layout attached, as the gpu worker builds it) and the true K/V per sequence."""

    q: torch.Tensor  # [T, heads, D]
    cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, D]
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence [seq_len, kv_heads, D]
    values: list[torch.Tensor]
    query_lens: list[int]


def make_case(
    cached: list[int],
    query_lens: list[int],
    *,
    heads: int = 6,
    kv_heads: int = 2,
    dim: int = 16,
    block_size: int = 4,
    num_blocks: int = 64,
    tables: list[list[int]] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    g = torch.Generator().manual_seed(seed)
    cache = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    seq_lens = [c + n for c, n in zip(cached, query_lens, strict=True)]
    if tables is None:  # shuffled, so each table has gaps and runs backwards; block 0 unused
        pool = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        tables = [[pool.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    keys, values = [], []
    for seq_len in seq_lens:
        keys.append(torch.randn(seq_len, kv_heads, dim, generator=g).to(dtype))
        values.append(torch.randn(seq_len, kv_heads, dim, generator=g).to(dtype))
    for c, k, v, table in zip(cached, keys, values, tables, strict=True):
        for p in range(c):  # the cached prefix: written by earlier steps
            cache[0, table[p // block_size], p % block_size] = k[p]
            cache[1, table[p // block_size], p % block_size] = v[p]
    meta, _ = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    new_k = torch.cat([k[c:] for c, k in zip(cached, keys, strict=True)])
    new_v = torch.cat([v[c:] for c, v in zip(cached, values, strict=True)])
    write_kv(new_k, new_v, cache, meta.slot_mapping)
    q = torch.randn(sum(query_lens), heads, dim, generator=g).to(dtype)
    return Case(q, cache, meta, keys, values, query_lens)


def dense_attention(case: Case, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's queries over its true (unpaged) K/V, in float64."""
    heads = case.q.shape[1]
    outs, start = [], 0
    for k, v, n in zip(case.keys, case.values, case.query_lens, strict=True):
        seq_len = k.shape[0]
        group = heads // k.shape[1]
        q = case.q[start : start + n].double().transpose(0, 1)  # [heads, n, D]
        kk = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [heads, S, D]
        vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
        scores = q @ kk.transpose(1, 2) * scale  # [heads, n, S]
        q_pos = torch.arange(seq_len - n, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        outs.append((scores.softmax(-1) @ vv).transpose(0, 1))  # [n, heads, D]
        start += n
    return torch.cat(outs)


def reference(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float):
    """The one reference over the metadata's tensors (it needs no layout)."""
    return paged_attention_ref(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
    )


def check(case: Case) -> None:
    scale = case.q.shape[-1] ** -0.5
    ref = reference(case.q, case.cache, case.meta, scale)
    got = paged_attention(case.q, case.cache, case.meta, scale)
    assert got.dtype == ref.dtype == case.q.dtype and got.shape == case.q.shape
    assert not ref.isnan().any() and not got.isnan().any()
    tol = TOLERANCE[case.q.dtype]
    expected = dense_attention(case, scale).to(case.q.dtype)
    torch.testing.assert_close(ref, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


CASES = {
    # name: (cached tokens, query tokens) per sequence
    "decode_only": ([5, 0, 13, 8], [1, 1, 1, 1]),
    "prefill_only": ([0, 0, 0], [7, 3, 12]),
    "prefill_after_cached_prefix": ([9, 4], [6, 2]),
    "mixed": ([11, 0, 3, 0, 17, 6], [1, 9, 5, 1, 1, 2]),
    "one_token_prompt_is_a_decode_row": ([0, 10], [1, 4]),
    "idle_sequence_has_no_queries": ([6, 3, 0], [1, 0, 5]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CASES)
def test_production_matches_reference(name, dtype):
    cached, query_lens = CASES[name]
    check(make_case(cached, query_lens, dtype=dtype))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_grouped_query_heads(heads, kv_heads):
    check(make_case([7, 0, 2], [1, 6, 3], heads=heads, kv_heads=kv_heads))


def test_block_tables_with_gaps_and_uneven_widths():
    # Non-contiguous, out-of-order block ids; tables of different widths padded with block 0,
    # which holds NaN: a read past a table's used entries poisons the result.
    tables = [[9, 2, 30], [5], [17, 3, 11, 25, 1]]
    check(make_case([8, 1, 12], [2, 1, 6], tables=tables, block_size=4, num_blocks=32))


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed):
    g = torch.Generator().manual_seed(100 + seed)
    num_seqs = int(torch.randint(1, 8, (1,), generator=g))
    query_lens = [
        1 if torch.rand(1, generator=g) < 0.5 else int(torch.randint(2, 12, (1,), generator=g))
        for _ in range(num_seqs)
    ]
    cached = torch.randint(0, 20, (num_seqs,), generator=g).tolist()
    block_size = [1, 4, 16][seed % 3]
    check(make_case(cached, query_lens, block_size=block_size, num_blocks=256, seed=seed))


def test_production_path_needs_the_layout():
    case = make_case([2], [3])
    bare = AttentionMetadata(
        case.meta.query_start_loc,
        case.meta.seq_lens,
        case.meta.block_tables,
        case.meta.slot_mapping,
    )
    with pytest.raises(ValueError, match="with_layout"):
        paged_attention(case.q, case.cache, bare, 0.25)
    with pytest.raises(ValueError, match="block_size"):
        bare.with_layout([0, 3], [5], 0)
    # The reference needs no layout.
    torch.testing.assert_close(
        reference(case.q, case.cache, bare, 0.25),
        reference(case.q, case.cache, case.meta, 0.25),
    )
