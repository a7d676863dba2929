"""ops.attention: the production path (`paged_attention`, slots + fused SDPA) against the one
per-sequence reference (kernels/attention_ref.py `paged_attention_ref`, given the metadata's
tensors), and the reference against dense causal attention over each sequence's true keys and
values, with and without per-layer sliding windows; on a GPU, the kernels' path with windows and
every head size, eagerly and replayed from a CUDA graph.

Every cache starts as NaN and block 0 (the block tables' padding value) is never handed out, so a
read of any slot a sequence did not write, or of a padded table entry, shows up as NaN. With a
window, every block wholly before the window of a sequence's first query is NaN again (freed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from taipan.kernels.attention_ref import SUPPORTED_HEAD_DIMS, paged_attention_ref
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
    window: int | None = None,
    device: str = "cpu",
) -> Case:
    """`window`: free (NaN) each sequence's blocks wholly before its first query's window."""
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
    for c, table in zip(cached, tables, strict=True):
        first = 0 if window is None else max(0, c - window + 1)
        cache[:, table[: first // block_size]] = float("nan")
    q = torch.randn(sum(query_lens), heads, dim, generator=g).to(dtype)
    if device != "cpu":
        meta, _ = build_attention_metadata(query_lens, seq_lens, tables, block_size, device)
        cache, q = cache.to(device), q.to(device)
    return Case(q, cache, meta, keys, values, query_lens)


def dense_attention(case: Case, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries over its true (unpaged) K/V, in float64; with
    a window, the query at p sees only keys after p - window (Hugging Face's overlay)."""
    heads = case.q.shape[1]
    outs, start = [], 0
    for k, v, n in zip(case.keys, case.values, case.query_lens, strict=True):
        seq_len = k.shape[0]
        group = heads // k.shape[1]
        q = case.q[start : start + n].cpu().double().transpose(0, 1)  # [heads, n, D]
        kk = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [heads, S, D]
        vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
        scores = q @ kk.transpose(1, 2) * scale  # [heads, n, S]
        q_pos = torch.arange(seq_len - n, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append((scores.softmax(-1) @ vv).transpose(0, 1))  # [n, heads, D]
        start += n
    return torch.cat(outs)


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
):
    """The one reference over the metadata's tensors (it needs no layout)."""
    return paged_attention_ref(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window
    )


def check(case: Case, window: int | None = None) -> None:
    scale = case.q.shape[-1] ** -0.5
    ref = reference(case.q, case.cache, case.meta, scale, window)
    got = paged_attention(case.q, case.cache, case.meta, scale, sliding_window=window)
    assert got.dtype == ref.dtype == case.q.dtype and got.shape == case.q.shape
    assert not ref.isnan().any() and not got.isnan().any()
    tol = TOLERANCE[case.q.dtype]
    expected = dense_attention(case, scale, window).to(case.q.dtype)
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


# Windows of 1, shorter than most contexts (not a multiple of the 4-slot blocks), and longer
# than every context (no effect).
@pytest.mark.parametrize("window", [1, 6, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["decode_only", "prefill_after_cached_prefix", "mixed"])
def test_windows_match_reference(name, dtype, window):
    cached, query_lens = CASES[name]
    check(make_case(cached, query_lens, dtype=dtype, window=window), window)


def test_one_step_serves_interleaved_windowed_and_global_layers():
    """Gemma 3 interleaves windowed and global layers over one step's metadata: each window's
    keys are built once, on first use, then reused; a window reads only its own span."""
    case = make_case([11, 0, 3, 17], [1, 9, 5, 1], window=5)
    global_cache = make_case([11, 0, 3, 17], [1, 9, 5, 1]).cache  # same keys, nothing freed
    for window in (5, None, 5, 3, None):
        # each layer has its own cache; the windowed ones lost their blocks before window 5
        check(replace(case, cache=case.cache if window else global_cache), window)
    for rows in case.meta.batches:
        assert set(rows._keys) == {5, None, 3}
        slots, mask = rows.keys(5)
        assert rows.keys(5)[0] is slots  # cached for the step's later layers
        assert slots.shape[1] <= 5 + rows.tokens.shape[1] - 1  # the window's span only
        assert mask.shape == (*rows.tokens.shape[:1], 1, rows.tokens.shape[1], slots.shape[1])


def test_refuses_bad_windows():
    case = make_case([2], [3])
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        paged_attention(case.q, case.cache, case.meta, 0.25, sliding_window=0)


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


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_gpu_kernels_path_with_windows_and_cuda_graph(head_dim):
    """On CUDA, decode rows and chunks through the kernels in bf16, per window (blocks before it
    freed), against the reference; then one windowed step captured in a CUDA graph and replayed
    with new queries, as the engine replays decode steps."""
    cached, query_lens = [70, 0, 300, 33, 5], [1, 1, 40, 90, 200]
    for window in (None, 1, 17, 64, 4096):
        case = make_case(
            cached, query_lens, heads=8, kv_heads=2, dim=head_dim, block_size=16,
            num_blocks=64, dtype=torch.bfloat16, window=window, device="cuda", seed=head_dim,
        )  # fmt: skip
        scale = head_dim**-0.5
        got = paged_attention(case.q, case.cache, case.meta, scale, sliding_window=window)
        ref = reference(case.q.float(), case.cache.float(), case.meta, scale, window)
        assert torch.isfinite(got).all(), (head_dim, window)
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)

    case = make_case(
        [70, 300, 33], [1, 1, 1], heads=8, kv_heads=2, dim=head_dim, block_size=16,
        num_blocks=64, dtype=torch.bfloat16, window=50, device="cuda", seed=1,
    )  # fmt: skip
    out = torch.empty_like(case.q)

    def step():
        out.copy_(paged_attention(case.q, case.cache, case.meta, scale, sliding_window=50))

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    case.q.copy_(torch.randn_like(case.q))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(case.q.float(), case.cache.float(), case.meta, scale, 50)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
