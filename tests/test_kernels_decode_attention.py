"""The paged decode-attention kernel against the one attention reference
(kernels/attention_ref.py, one query per sequence), and the reference against a dense float64
attention over the keys and values the test wrote: every supported head size, with and without a
sliding window. On CPU the kernels run in the Triton interpreter in fp32 (it computes bf16
wrongly); the `gpu` tests cover bf16/fp16, every head size and a window, and a CUDA graph.

Every slot no sequence wrote is NaN, and so, with a window, is every block wholly before it (the
engine frees those): a kernel that reads one returns NaN."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from taipan.kernels.attention_ref import SUPPORTED_HEAD_DIMS, paged_attention_ref
from taipan.kernels.decode_attention import paged_decode_attention


@dataclass
class Case:
    q: torch.Tensor  # [B, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D], NaN wherever not written
    block_tables: torch.Tensor  # [B, max_blocks] int32, padding 0 (block 0 is never allocated)
    seq_lens: torch.Tensor  # [B] int32
    true_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per sequence k, v: [S, KVH, D] fp32
    scale: float
    window: int | None = None  # the sliding window the cache was freed for

    def args(self):
        return self.q, self.kv_cache, self.block_tables, self.seq_lens, self.scale

    def run(self, **kwargs) -> torch.Tensor:
        return paged_decode_attention(*self.args(), sliding_window=self.window, **kwargs)

    def ref(self) -> torch.Tensor:
        """The reference's answer: decode is one query per sequence."""
        starts = torch.arange(self.q.shape[0] + 1, dtype=torch.int32, device=self.q.device)
        return paged_attention_ref(
            self.q, self.kv_cache, self.block_tables, starts, self.seq_lens, self.scale,
            sliding_window=self.window,
        )  # fmt: skip


def make_case(
    seed: int,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    spare_columns: int = 1,
    window: int | None = None,
) -> Case:
    """Random q and K/V scattered through shuffled blocks with gaps (ids from a pool twice the
    need, block 0 excluded); every slot no sequence wrote, block 0 included, is NaN, and with a
    window so is each block wholly before it (freed: the allocator may have reused it)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + 2 * sum(needed) + 1
    pool = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).tolist()
    max_blocks = max(needed) + spare_columns
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    slots = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    true_kv = []
    for b, (n, used) in enumerate(zip(seq_lens, needed, strict=True)):
        tables[b, :used] = torch.tensor(pool[:used], dtype=torch.int32)
        blocks, pool = tables[b, :used].to(device, torch.int64), pool[used:]
        k, v = torch.randn(2, n, num_kv_heads, head_dim, generator=gen, device=device)
        pos = torch.arange(n, device=device)
        slot = blocks[pos // block_size] * block_size + pos % block_size
        slots[0, slot], slots[1, slot] = k.to(dtype), v.to(dtype)
        true_kv.append((k, v))
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    case = Case(
        q=q,
        kv_cache=cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        true_kv=true_kv,
        scale=head_dim**-0.5,
    )
    free_before_window(case, seq_lens, window)
    return case


def free_before_window(case: Case, seq_lens: list[int], window: int | None) -> None:
    """Set the case's window and NaN every block wholly before it, as if the engine had freed
    it and another request had reused it."""
    case.window = window
    if window is None:
        return
    block_size = case.kv_cache.shape[2]
    for b, n in enumerate(seq_lens):
        freed = case.block_tables[b, : max(0, n - window) // block_size]
        case.kv_cache[:, freed.long()] = float("nan")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# (seed, seq_lens, H, KVH, D, block_size): ragged lengths with 1, exact block boundaries (16,
# 32, 64, 96), an inactive row (0), GQA groups 1, 3, 4, 8.
CASES = [
    (0, [1, 16, 37, 100], 2, 2, 64, 16),
    (1, [0, 32, 75], 6, 2, 64, 16),
    (2, [17, 64], 4, 1, 128, 16),
    (3, [96, 33], 8, 1, 64, 32),
]


@pytest.mark.parametrize("num_splits", [None, 1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}")
def test_kernel_matches_ref(case, num_splits):
    seed, seq_lens, heads, kv_heads, head_dim, block_size = case
    c = make_case(seed, seq_lens, heads, kv_heads, head_dim, block_size)
    out = paged_decode_attention(*c.args(), num_splits=num_splits)
    ref = c.ref()
    assert torch.isfinite(out).all(), "the kernel read a slot past some seq_len (NaN)"
    assert torch.isfinite(ref).all()
    assert rel_err(out, ref) < 1e-5
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert (out[b] == 0).all()


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_every_head_dim_matches_ref(head_dim):
    """Padded sizes (80, 96, 192) load and store only their real columns (a stray column would
    read the next head's keys, or a NaN slot, and write into the next head's output)."""
    c = make_case(20 + head_dim, [1, 37], 4, 2, head_dim)
    out = c.run(num_splits=2)
    assert torch.isfinite(out).all() and rel_err(out, c.ref()) < 1e-5


# (window, seq_lens, block_size): windows shorter than every context and not a multiple of the
# block size (whole blocks before them freed), a window of 1 (the query's own token), windows
# at and past the longest context (no effect), a window at a block boundary; inactive rows.
WINDOWS = [
    (5, [1, 16, 37, 100], 16),
    (1, [0, 21, 64], 16),
    (37, [37, 2, 40], 16),
    (50, [33, 7], 32),
    (32, [0, 75, 96], 16),
]


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("window, seq_lens, block_size", WINDOWS, ids=lambda w: str(w))
def test_window_matches_ref(window, seq_lens, block_size, num_splits):
    c = make_case(window, seq_lens, 4, 2, 64, block_size, window=window)
    out = c.run(num_splits=num_splits)
    ref = c.ref()
    assert torch.isfinite(out).all(), "the kernel read a key before the window (freed: NaN)"
    assert rel_err(out, ref) < 1e-5
    if window >= max(seq_lens):
        assert rel_err(out, paged_decode_attention(*c.args())) < 1e-5


@pytest.mark.parametrize("head_dim", [80, 256])
def test_window_with_padded_and_wide_heads(head_dim):
    c = make_case(head_dim, [50, 19], 6, 2, head_dim, window=21)
    out = c.run()
    assert torch.isfinite(out).all() and rel_err(out, c.ref()) < 1e-5


def test_window_splits_cover_only_the_window(monkeypatch):
    """A window of 40 over a 512-slot table: the chunks split 40 keys, not 512 (asked for 64
    chunks, it launches 3 of 16 keys), and they start at the window, not at position 0."""
    from taipan.kernels import decode_attention

    grids = []
    split = decode_attention._decode_split_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return split[grid]

    monkeypatch.setattr(decode_attention, "_decode_split_kernel", Spy())
    c = make_case(8, [300, 45], 2, 1, 64, spare_columns=13, window=40)
    assert c.block_tables.shape[1] * 16 == 512
    out = c.run(num_splits=64)
    assert grids == [(2, 1, 3)]
    assert torch.isfinite(out).all() and rel_err(out, c.ref()) < 1e-5


def test_lengths_past_the_table_are_clamped_to_it():
    """A length past max_blocks * block_size reads the whole table and no further, in the kernel
    as in the reference."""
    c = make_case(7, [32, 5], 4, 2, 64, spare_columns=0)  # row 0 fills its 2-block table
    c.seq_lens[0] = 1000
    out = paged_decode_attention(*c.args(), num_splits=2)
    assert torch.isfinite(out).all()
    assert rel_err(out, c.ref()) < 1e-5
    c.seq_lens[0] = 32
    assert rel_err(out, c.ref()) < 1e-5


def test_splits_agree_and_out_buffer_is_used():
    c = make_case(4, [100, 5, 48], 8, 2, 64, spare_columns=2)
    outs = [paged_decode_attention(*c.args(), num_splits=n) for n in (1, 2, 3)]
    assert rel_err(outs[1], outs[0]) < 1e-5 and rel_err(outs[2], outs[0]) < 1e-5
    buf = torch.full_like(c.q, float("nan"))
    assert paged_decode_attention(*c.args(), num_splits=2, out=buf) is buf
    assert rel_err(buf, outs[0]) < 1e-5


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}")
def test_ref_matches_dense_float64(case):
    seed, seq_lens, heads, kv_heads, head_dim, block_size = case
    c = make_case(seed, seq_lens, heads, kv_heads, head_dim, block_size)
    ref = c.ref()
    group = heads // kv_heads
    for b, (k, v) in enumerate(c.true_kv):
        if seq_lens[b] == 0:
            assert (ref[b] == 0).all()
            continue
        k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))  # [S, H, D]
        scores = torch.einsum("hd,shd->hs", c.q[b].double(), k) * c.scale
        dense = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), v)
        assert rel_err(ref[b], dense) < 1e-5


def _bad_seq_lens(c):
    return c.q, c.kv_cache, c.block_tables, c.seq_lens.long(), c.scale


def _strided_cache(c):
    wide = torch.cat([c.kv_cache, c.kv_cache], dim=-1)  # [..., 2D]
    return c.q, wide[..., : c.q.shape[-1]], c.block_tables, c.seq_lens, c.scale


def _uneven_gqa(c):  # 6 query heads over 4 kv heads
    q = torch.randn(c.q.shape[0], 6, c.q.shape[2])
    cache = torch.zeros(*c.kv_cache.shape[:3], 4, c.kv_cache.shape[4])
    return q, cache, c.block_tables, c.seq_lens, c.scale


def _head_dim_72(c):
    q = torch.randn(*c.q.shape[:2], 72)
    cache = torch.zeros(*c.kv_cache.shape[:4], 72)
    return q, cache, c.block_tables, c.seq_lens, c.scale


def _mixed_dtypes(c):
    return c.q.double(), c.kv_cache, c.block_tables, c.seq_lens, c.scale


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (_bad_seq_lens, TypeError, "seq_lens must be int32"),
        (_strided_cache, ValueError, "kv_cache must be contiguous"),
        (_uneven_gqa, ValueError, r"num_heads \(6\) must be a multiple of KVH \(4\)"),
        (_head_dim_72, ValueError, r"head_dim 72 is not supported \(supported: 32, 64, 80, 96"),
        (_mixed_dtypes, TypeError, "q must be float16, bfloat16 or float32"),
    ],
    ids=["seq_lens_int64", "strided_cache", "heads_not_multiple", "head_dim_72", "q_float64"],
)
def test_launcher_refuses(bad, error, match):
    c = make_case(5, [20, 3], 4, 2, 64)
    with pytest.raises(error, match=match):
        paged_decode_attention(*bad(c))


@pytest.mark.parametrize("window", [0, -1, 2.5])
def test_launcher_refuses_bad_windows(window):
    c = make_case(5, [20, 3], 4, 2, 64)
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        paged_decode_attention(*c.args(), sliding_window=window)


def test_launcher_never_syncs_the_host(monkeypatch):
    """CUDA-graph safety: grid and buffers come from shapes only, never from lengths' values."""
    c = make_case(6, [40, 7], 4, 2, 64)
    ref = c.ref()

    def host_sync(*args, **kwargs):
        raise AssertionError("paged_decode_attention read a device value on the host")

    monkeypatch.setattr(torch.Tensor, "item", host_sync)
    monkeypatch.setattr(torch.Tensor, "tolist", host_sync)
    out = paged_decode_attention(*c.args(), num_splits=2)
    monkeypatch.undo()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, window", [(128, None), (256, 1000), (80, 100), (96, 1)])
def test_gpu_cuda_graph_replays_new_lengths(head_dim, window):
    """Captured once, the graph serves other lengths and queries written into the same buffers;
    with a window, the blocks before the replayed lengths' windows are freed (NaN)."""
    c = make_case(10, [300, 1, 4000, 17], 16, 4, head_dim, 16, torch.bfloat16, "cuda")
    out = torch.empty_like(c.q)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        paged_decode_attention(*c.args(), sliding_window=window, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*c.args(), sliding_window=window, out=out)
    replayed = [2, 0, 1500, 16]  # still written slots
    c.seq_lens.copy_(torch.tensor(replayed, dtype=torch.int32))
    free_before_window(c, replayed, window)
    c.q.copy_(torch.randn_like(c.q))
    graph.replay()
    torch.cuda.synchronize()
    ref = c.ref()
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_gpu_every_head_dim_and_window_in_bf16(head_dim):
    """Each head size in bf16 with GQA 4 against the reference, without a window and with
    windows of 1, under a block, mid-context and past every context; blocks before the window
    freed (NaN)."""
    seq_lens = [300, 1, 4000, 17, 1000]
    for window in (None, 1, 13, 1000, 5000):
        c = make_case(head_dim, seq_lens, 8, 2, head_dim, 16, torch.bfloat16, "cuda", window=window)
        ref = c.ref().float()
        for num_splits in (None, 1, 7):
            out = c.run(num_splits=num_splits).float()
            assert torch.isfinite(out).all(), (head_dim, window, num_splits)
            err = rel_err(out, ref)
            assert err < 1e-2, (head_dim, window, num_splits, err)


@pytest.mark.gpu
def test_gpu_half_precision_and_bandwidth():
    import random

    import triton

    rng = random.Random(0)
    for i in range(12):
        batch = rng.choice([1, 5, 64])
        seq_lens = [rng.randint(1, 4096) for _ in range(batch)]
        kv_heads, group = rng.choice([1, 2, 8]), rng.choice([1, 4, 8])
        dtype = rng.choice([torch.bfloat16, torch.float16])
        block_size, head_dim = rng.choice([16, 256]), rng.choice([64, 128])
        c = make_case(i, seq_lens, kv_heads * group, kv_heads, head_dim, block_size, dtype, "cuda")
        ref = c.ref().float()
        for num_splits in (None, 1):
            out = paged_decode_attention(*c.args(), num_splits=num_splits).float()
            assert torch.isfinite(out).all()
            err = rel_err(out, ref)
            assert err < 1e-2, (i, batch, kv_heads, group, head_dim, block_size, num_splits, err)

    for batch in (1, 64):
        c = make_case(9, [2048] * batch, 32, 8, 128, 16, torch.bfloat16, "cuda", spare_columns=0)
        out = torch.empty_like(c.q)
        ms = triton.testing.do_bench(
            lambda c=c, out=out: paged_decode_attention(*c.args(), out=out)
        )
        floor_us = batch * 2048 * 8 * 128 * 2 * 2 / 3e12 * 1e6  # K + V bytes at 3 TB/s
        us = ms * 1e3
        print(f"\ndecode B={batch} ctx=2048 H=32 KVH=8 D=128 bf16: {us:.1f} us, ", end="")
        print(f"K/V bytes floor {floor_us:.1f} us ({floor_us / us:.0%} of 3 TB/s)")
    # Gemma 3 4B's attention shape (8 heads over 4 kv heads of 256), global and 1024-windowed.
    for batch in (1, 64):
        for window in (None, 1024):
            c = make_case(9, [4096] * batch, 8, 4, 256, 16, torch.bfloat16, "cuda", window=window)
            out = torch.empty_like(c.q)
            ms = triton.testing.do_bench(lambda c=c, out=out: c.run(out=out))
            keys = min(4096, window or 4096)
            floor_us = batch * keys * 4 * 256 * 2 * 2 / 3e12 * 1e6
            us = ms * 1e3
            print(
                f"decode B={batch} ctx=4096 window={window} H=8 KVH=4 D=256 bf16: {us:.1f} us, "
                f"K/V bytes floor {floor_us:.1f} us ({floor_us / us:.0%} of 3 TB/s)"
            )


def test_default_splits_follow_the_context_until_the_batch_fills_the_gpu():
    from taipan.kernels.decode_attention import default_num_splits

    assert default_num_splits(2560, programs=8, num_sms=132) == 33  # batch 1, 8 kv heads
    assert default_num_splits(2560, programs=512, num_sms=132) == 1  # batch 64: no splits
    assert default_num_splits(2560, programs=64, num_sms=132) == 5  # 2 programs per SM
    assert default_num_splits(512, programs=8, num_sms=132) == 8  # 64 tokens per chunk
    assert default_num_splits(100_000, programs=1, num_sms=132) == 64  # capped
    assert default_num_splits(16, programs=1) == 1
