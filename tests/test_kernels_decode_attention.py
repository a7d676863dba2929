"""The paged decode-attention kernel against the one attention reference
(kernels/attention_ref.py, one query per sequence), and the reference against a dense float64
attention over the keys and values the test wrote. On CPU the kernels run in the Triton
interpreter in fp32 (it computes bf16 wrongly); the `gpu` test covers bf16/fp16."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from taipan.kernels.attention_ref import paged_attention_ref
from taipan.kernels.decode_attention import paged_decode_attention


@dataclass
class Case:
    q: torch.Tensor  # [B, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D], NaN wherever not written
    block_tables: torch.Tensor  # [B, max_blocks] int32, padding 0 (block 0 is never allocated)
    seq_lens: torch.Tensor  # [B] int32
    true_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per sequence k, v: [S, KVH, D] fp32
    scale: float

    def args(self):
        return self.q, self.kv_cache, self.block_tables, self.seq_lens, self.scale

    def ref(self) -> torch.Tensor:
        """The reference's answer: decode is one query per sequence."""
        starts = torch.arange(self.q.shape[0] + 1, dtype=torch.int32, device=self.q.device)
        return paged_attention_ref(
            self.q, self.kv_cache, self.block_tables, starts, self.seq_lens, self.scale
        )


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
) -> Case:
    """Random q and K/V scattered through shuffled blocks with gaps (ids from a pool twice the
    need, block 0 excluded); every slot no sequence wrote, block 0 included, is NaN."""
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
    return Case(
        q=q,
        kv_cache=cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        true_kv=true_kv,
        scale=head_dim**-0.5,
    )


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


def _head_dim_96(c):
    q = torch.randn(*c.q.shape[:2], 96)
    cache = torch.zeros(*c.kv_cache.shape[:4], 96)
    return q, cache, c.block_tables, c.seq_lens, c.scale


def _mixed_dtypes(c):
    return c.q.double(), c.kv_cache, c.block_tables, c.seq_lens, c.scale


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (_bad_seq_lens, TypeError, "seq_lens must be int32"),
        (_strided_cache, ValueError, "kv_cache must be contiguous"),
        (_uneven_gqa, ValueError, r"num_heads \(6\) must be a multiple of KVH \(4\)"),
        (_head_dim_96, ValueError, "head_dim 96 is not supported"),
        (_mixed_dtypes, TypeError, "q must be float16, bfloat16 or float32"),
    ],
    ids=["seq_lens_int64", "strided_cache", "heads_not_multiple", "head_dim_96", "q_float64"],
)
def test_launcher_refuses(bad, error, match):
    c = make_case(5, [20, 3], 4, 2, 64)
    with pytest.raises(error, match=match):
        paged_decode_attention(*bad(c))


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
def test_gpu_cuda_graph_replays_new_lengths():
    """Captured once, the graph serves other lengths and queries written into the same buffers."""
    c = make_case(10, [300, 1, 4000, 17], 16, 4, 128, 16, torch.bfloat16, "cuda")
    out = torch.empty_like(c.q)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        paged_decode_attention(*c.args(), out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*c.args(), out=out)
    c.seq_lens.copy_(torch.tensor([2, 0, 1500, 16], dtype=torch.int32))  # still written slots
    c.q.copy_(torch.randn_like(c.q))
    graph.replay()
    torch.cuda.synchronize()
    ref = c.ref()
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2


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


def test_default_splits_follow_the_context_until_the_batch_fills_the_gpu():
    from taipan.kernels.decode_attention import default_num_splits

    assert default_num_splits(2560, programs=8, num_sms=132) == 33  # batch 1, 8 kv heads
    assert default_num_splits(2560, programs=512, num_sms=132) == 1  # batch 64: no splits
    assert default_num_splits(2560, programs=64, num_sms=132) == 5  # 2 programs per SM
    assert default_num_splits(512, programs=8, num_sms=132) == 8  # 64 tokens per chunk
    assert default_num_splits(100_000, programs=1, num_sms=132) == 64  # capped
    assert default_num_splits(16, programs=1) == 1
