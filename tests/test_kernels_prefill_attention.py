"""Paged varlen prefill attention: the Triton kernel against the one attention reference
(kernels/attention_ref.py; fp32, the CPU interpreter without a GPU) for every supported head size,
with and without a sliding window, the reference against dense float64 attention built from the
true keys and values, the launcher's refusals, and on a GPU bf16/fp16 accuracy for every head
size and windows, a CUDA graph replay, plus timing prints."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from taipan.kernels import prefill_attention
from taipan.kernels.attention_ref import SUPPORTED_HEAD_DIMS, paged_attention_ref
from taipan.kernels.prefill_attention import paged_prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Case:
    """One step's inputs; every cache slot no sequence owns (block 0, spare blocks, the tail of
    each last block) is NaN, so a kernel that reads past a sequence poisons its output. With a
    window, so is every block wholly before the window of a sequence's first query (the engine
    frees those, and another request may have reused them)."""

    q: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, KVH, D], what the cache holds
    values: list[torch.Tensor]
    scale: float
    max_query_len: int
    window: int | None = None

    def args(self):
        return (self.q, self.kv_cache, self.block_tables, self.query_start_loc, self.seq_lens)

    def run(self, **kwargs) -> torch.Tensor:
        return paged_prefill_attention(
            *self.args(), self.scale, max_query_len=self.max_query_len,
            sliding_window=self.window, **kwargs,
        )  # fmt: skip

    def ref(self) -> torch.Tensor:
        return paged_attention_ref(*self.args(), self.scale, sliding_window=self.window)


def make_case(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    block_size: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    extra_query_len: int = 0,
    device: str = DEVICE,
    window: int | None = None,
) -> Case:
    """seqs: (cached prefix length, new query length) per sequence."""
    gen = torch.Generator(device=device).manual_seed(seed)
    order = random.Random(seed)
    seq_lens = [prefix + q_len for prefix, q_len in seqs]
    blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_needed) + 3  # block 0 never allocated, 3 spare blocks (gaps)
    free = list(range(1, num_blocks))
    order.shuffle(free)  # out-of-order block ids
    max_blocks = max(blocks_needed) + 1  # at least one padding entry per row
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    slots_view = cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    tables, keys, values = [], [], []
    for (prefix, _), seq_len, needed in zip(seqs, seq_lens, blocks_needed, strict=True):
        table = [free.pop() for _ in range(needed)]
        k, v = torch.randn(2, seq_len, kv_heads, head_dim, generator=gen, device=device)
        pos = torch.arange(seq_len)
        slots = (
            torch.tensor(table, dtype=torch.int64)[pos // block_size] * block_size
            + pos % block_size
        ).to(device)
        slots_view[0, slots], slots_view[1, slots] = k.to(dtype), v.to(dtype)
        first = 0 if window is None else max(0, prefix - window + 1)
        cache[:, table[: first // block_size]] = float("nan")  # freed: wholly before the window
        keys.append(k.to(dtype))
        values.append(v.to(dtype))
        tables.append(table + [0] * (max_blocks - needed))
    q_lens = [q_len for _, q_len in seqs]
    starts = [sum(q_lens[:b]) for b in range(len(seqs) + 1)]
    q = torch.randn(starts[-1], heads, head_dim, generator=gen, device=device) * 2.0
    return Case(
        q=q.to(dtype),
        kv_cache=cache,
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
        scale=head_dim**-0.5,
        max_query_len=max(q_lens) + extra_query_len,
        window=window,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# (seqs as (prefix, q_len), heads, kv_heads, head_dim, block_size, surplus on max_query_len)
CASES = {
    "gqa1-prefix0-boundary-midblock": ([(0, 37), (16, 1), (14, 20)], 2, 2, 64, 16, 0),
    "gqa3-decode-rows": ([(21, 1), (0, 1), (40, 24)], 6, 2, 64, 16, 5),
    "gqa4-empty-row-d128": ([(32, 17), (7, 0), (0, 16)], 4, 1, 128, 16, 20),
    "tile-inside-block32": ([(45, 19), (0, 5)], 2, 1, 64, 32, 0),
}


def random_case(seed: int, window: int | None = None) -> Case:
    rng = random.Random(seed)
    group = rng.choice([1, 3, 4])
    kv_heads = rng.choice([1, 2])
    seqs = []
    for _ in range(rng.randint(1, 3)):
        prefix = rng.choice([0, 16, 32, rng.randint(1, 40)])
        seqs.append((prefix, rng.choice([1, rng.randint(2, 26)])))
    heads = group * kv_heads
    return make_case(seqs, heads, kv_heads, 64, seed=seed, extra_query_len=seed, window=window)


def check_kernel(case: Case) -> None:
    out = case.run()
    ref = case.ref()
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.isfinite(out).all(), "NaN/inf: the kernel read a slot no sequence owns"
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_ref(name):
    seqs, heads, kv_heads, head_dim, block_size, extra = CASES[name]
    check_kernel(
        make_case(seqs, heads, kv_heads, head_dim, block_size=block_size, extra_query_len=extra)
    )


@pytest.mark.parametrize("seed", range(4))
def test_kernel_matches_ref_random(seed):
    check_kernel(random_case(seed))


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_every_head_dim_matches_ref(head_dim, window):
    """Padded sizes (80, 96, 192) load and store only their real columns."""
    check_kernel(make_case([(21, 9), (0, 17)], 4, 2, head_dim, seed=head_dim, window=window))


# (seqs, heads, kv_heads, block_size, window): windows shorter than the chunk and not a multiple
# of the 16-key tile, of 1 (only the query itself), at a block boundary, equal to and past the
# longest context (no effect: checked against no window too); decode rows (q_len 1), an empty
# row and GQA 3 (padded head rows).
WINDOWS = {
    "w13-chunks-after-prefix": ([(40, 25), (5, 30), (0, 1)], 2, 1, 16, 13),
    "w1": ([(20, 18), (0, 5)], 2, 2, 16, 1),
    "w16-block-boundary-gqa3": ([(33, 20), (16, 1)], 6, 2, 16, 16),
    "w40-decode-rows": ([(50, 1), (3, 1), (39, 1)], 4, 1, 16, 40),
    "w45-equals-context": ([(30, 15), (7, 0), (0, 9)], 4, 2, 32, 45),
    "w1000-past-context": ([(30, 15), (0, 9)], 4, 2, 16, 1000),
}


@pytest.mark.parametrize("name", list(WINDOWS))
def test_window_matches_ref(name):
    seqs, heads, kv_heads, block_size, window = WINDOWS[name]
    case = make_case(seqs, heads, kv_heads, 64, block_size=block_size, seed=3, window=window)
    check_kernel(case)
    if window >= max(prefix + q_len for prefix, q_len in seqs):
        case.window, full = None, case.run()
        case.window = window
        assert rel_err(case.run(), full) < 1e-5


@pytest.mark.parametrize("seed", range(3))
def test_window_matches_ref_random(seed):
    check_kernel(random_case(10 + seed, window=random.Random(seed).choice([1, 9, 23])))


@pytest.mark.parametrize("window", [None, 5, 45])
def test_tiles_straddle_blocks(monkeypatch, window):
    """32-key tiles over 16-slot blocks (the GPU's 64 over 16, in small): keys of one tile come
    from two blocks; 32-row M tiles. With a window, the tiles start mid-block at each query
    tile's window and the masked tiles at the window's edge and at the diagonal meet."""
    monkeypatch.setattr(prefill_attention, "_tile_config", lambda *_: (32, 32, 4, 1))
    seqs = [(24, 30), (0, 9), (40, 1), (70, 40)]
    check_kernel(make_case(seqs, 6, 2, 64, seed=5, extra_query_len=3, window=window))


@pytest.mark.parametrize("window", [None, 5, 20])
def test_query_tiles_longer_than_key_tiles(monkeypatch, window):
    """64 queries a program over 16-key tiles (the GPU's 128 over 64, in small): with a window,
    the last rows' windows start right of the first key tiles, which they see nothing of."""
    monkeypatch.setattr(prefill_attention, "_tile_config", lambda *_: (64, 16, 4, 1))
    check_kernel(make_case([(10, 70), (30, 3)], 2, 2, 64, seed=8, window=window))


def test_out_buffer_and_strided_q():
    """q as a view into a fused qkv projection; `out` a persistent (NaN-filled) buffer."""
    case = make_case([(20, 18), (0, 1)], 4, 2, 64, seed=7)
    tokens, heads, head_dim = case.q.shape
    qkv = torch.randn(tokens, heads + 4, head_dim, device=DEVICE)
    qkv[:, :heads] = case.q
    q = qkv[:, :heads]  # stride(0) = (heads + 4) * head_dim
    out = torch.full_like(case.q, float("nan"))
    args = (q, *case.args()[1:])
    got = paged_prefill_attention(*args, case.scale, max_query_len=case.max_query_len, out=out)
    assert got is out
    ref = paged_attention_ref(*case.args(), case.scale)
    assert rel_err(out, ref) < 1e-5


def dense_attention(case: Case) -> torch.Tensor:
    """Causal attention in float64 from the true keys/values, one sequence at a time; with a
    window, query i (position prefix + i) sees only keys after prefix + i - window."""
    out = torch.zeros(case.q.shape, dtype=torch.float64, device=case.q.device)
    group = case.q.shape[1] // case.keys[0].shape[1] if case.keys else 1
    starts = case.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        q = case.q[starts[b] : starts[b + 1]].double()  # [q_len, H, D]
        k = k.double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        q_len, seq_len = q.shape[0], k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        causal = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
        causal = causal.tril(diagonal=seq_len - q_len)  # query i sees keys 0..prefix + i
        if case.window is not None:
            causal &= ~causal.tril(diagonal=seq_len - q_len - case.window)
        scores = scores.masked_fill(~causal, float("-inf"))
        out[starts[b] : starts[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_ref_matches_dense_float64(name):
    seqs, heads, kv_heads, head_dim, block_size, extra = CASES[name]
    case = make_case(seqs, heads, kv_heads, head_dim, block_size=block_size, extra_query_len=extra)
    ref = paged_attention_ref(*case.args(), case.scale)
    assert rel_err(ref, dense_attention(case)) < 1e-5


@pytest.mark.parametrize("name", list(WINDOWS))
def test_windowed_ref_matches_dense_float64(name):
    seqs, heads, kv_heads, block_size, window = WINDOWS[name]
    case = make_case(seqs, heads, kv_heads, 64, block_size=block_size, seed=3, window=window)
    assert rel_err(case.ref(), dense_attention(case)) < 1e-5


def _swap(case: Case, **changes) -> tuple:
    names = ("q", "kv_cache", "block_tables", "query_start_loc", "seq_lens")
    args = dict(zip(names, case.args(), strict=True))
    args.update(changes)
    return tuple(args.values())


REFUSALS = {
    "q-2d": (lambda c: _swap(c, q=c.q[:, 0]), ValueError, "q must be"),
    "cache-4d": (lambda c: _swap(c, kv_cache=c.kv_cache[0]), ValueError, "kv_cache must be"),
    "q-float64": (lambda c: _swap(c, q=c.q.double()), TypeError, "bf16, fp16 or fp32"),
    "cache-dtype": (lambda c: _swap(c, kv_cache=c.kv_cache.half()), TypeError, "must match"),
    "head-dim-48": (
        lambda c: _swap(c, q=c.q[..., :48], kv_cache=c.kv_cache[..., :48].contiguous()),
        ValueError,
        r"head_dim 48 is not supported \(supported: 32, 64, 80, 96, 128, 192, 256\)",
    ),
    "head-dim-mismatch": (lambda c: _swap(c, q=torch.cat([c.q, c.q], -1)), ValueError, "!="),
    "heads-not-multiple": (lambda c: _swap(c, q=c.q[:, :3]), ValueError, "multiple of kv_heads"),
    "block-size-24": (
        lambda c: _swap(c, kv_cache=c.kv_cache[:, :, :24].contiguous()),
        ValueError,
        "power of two",
    ),
    "block-size-8": (
        lambda c: _swap(c, kv_cache=c.kv_cache[:, :, :8].contiguous()),
        ValueError,
        "power of two",
    ),
    "cache-not-contiguous": (
        lambda c: _swap(c, kv_cache=torch.cat([c.kv_cache] * 2, 3)[..., :2, :]),
        ValueError,
        "contiguous",
    ),
    "q-dim-strided": (
        lambda c: _swap(c, q=c.q.transpose(1, 2).contiguous().transpose(1, 2)),
        ValueError,
        "stride 1",
    ),
    "tables-int64": (lambda c: _swap(c, block_tables=c.block_tables.long()), TypeError, "int32"),
    "seq-lens-int64": (lambda c: _swap(c, seq_lens=c.seq_lens.long()), TypeError, "int32"),
    "query-start-short": (
        lambda c: _swap(c, query_start_loc=c.query_start_loc[:-1]),
        ValueError,
        "B \\+ 1",
    ),
    "tables-1d": (lambda c: _swap(c, block_tables=c.block_tables[0]), ValueError, "2 dims"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_launcher_refuses(name):
    # block_size 32 so that slicing the cache to 24 or 8 slots per block stays in range
    case = make_case([(3, 5), (0, 2)], 4, 2, 64, block_size=32, device="cpu")
    mutate, error, match = REFUSALS[name]
    with pytest.raises(error, match=match):
        paged_prefill_attention(*mutate(case), case.scale, max_query_len=case.max_query_len)


def test_launcher_refuses_bad_out_max_query_len_and_window():
    case = make_case([(3, 5)], 2, 2, 64, device="cpu")
    with pytest.raises(ValueError, match="out must be"):
        paged_prefill_attention(*case.args(), case.scale, max_query_len=5, out=case.q[:-1])
    with pytest.raises(ValueError, match="max_query_len"):
        paged_prefill_attention(*case.args(), case.scale, max_query_len=-1)
    for window in (0, 3.0):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
            paged_prefill_attention(
                *case.args(), case.scale, max_query_len=5, sliding_window=window
            )


@pytest.mark.gpu
def test_gpu_low_precision_and_bench():
    """bf16/fp16 against the fp32 reference over random shapes, then one timing (printed)."""
    rng = random.Random(0)
    for dtype in (torch.bfloat16, torch.float16):
        for block_size in (16, 256):
            for group, head_dim in ((1, 128), (4, 64), (8, 128)):
                kv_heads = rng.choice([1, 2, 4])
                seqs = [
                    (rng.choice([0, rng.randint(1, 2048)]), rng.choice([1, rng.randint(1, 2048)]))
                    for _ in range(rng.randint(1, 16))
                ]
                case = make_case(
                    seqs,
                    group * kv_heads,
                    kv_heads,
                    head_dim,
                    block_size=block_size,
                    seed=rng.randint(0, 10**6),
                    dtype=dtype,
                    device="cuda",
                )
                out = paged_prefill_attention(
                    *case.args(), case.scale, max_query_len=case.max_query_len
                )
                ref = paged_attention_ref(
                    case.q.float(), case.kv_cache.float(), *case.args()[2:], case.scale
                )
                assert torch.isfinite(out).all()
                err = rel_err(out, ref)
                assert err < 1e-2, (dtype, block_size, group, head_dim, seqs, err)
    _bench_one_prompt()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_gpu_every_head_dim_and_window_in_bf16(head_dim):
    """Each head size in bf16 against the fp32 reference over random chunks after random
    prefixes, without a window and with windows of 1, under a tile, mid-prompt and past every
    context; blocks before each sequence's first window freed (NaN)."""
    rng = random.Random(head_dim)
    for window in (None, 1, 100, 700, 5000):
        for group in (1, 4):
            seqs = [
                (rng.choice([0, rng.randint(1, 1500)]), rng.choice([1, rng.randint(1, 1500)]))
                for _ in range(rng.randint(1, 6))
            ]
            block_size = rng.choice([16, 256])
            case = make_case(
                seqs, group * 2, 2, head_dim, block_size=block_size, seed=rng.randint(0, 10**6),
                dtype=torch.bfloat16, device="cuda", window=window,
            )  # fmt: skip
            out = case.run()
            ref = paged_attention_ref(
                case.q.float(), case.kv_cache.float(), *case.args()[2:], case.scale,
                sliding_window=window,
            )  # fmt: skip
            assert torch.isfinite(out).all(), (head_dim, window, group, block_size, seqs)
            err = rel_err(out, ref)
            assert err < 1e-2, (head_dim, window, group, block_size, seqs, err)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, window", [(128, None), (256, 300), (80, 33)])
def test_gpu_cuda_graph_replays_new_queries(head_dim, window):
    """Captured once (lengths and window fixed, as the engine captures a step), the graph
    replays over new queries written into the same buffer."""
    seqs = [(500, 1), (0, 200), (1000, 64)]
    case = make_case(seqs, 8, 2, head_dim, dtype=torch.bfloat16, device="cuda", window=window)
    out = torch.empty_like(case.q)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        case.run(out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(out=out)
    case.q.copy_(torch.randn_like(case.q))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(
        case.q.float(), case.kv_cache.float(), *case.args()[2:], case.scale, sliding_window=window
    )
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_bench_wide_heads_and_window():
    """Timings (printed) at Gemma 3 4B's attention shape: 8 heads over 4 kv heads of 256,
    global and with its 1024-token window."""
    for window in (None, 1024):
        _bench_one_prompt(heads=8, kv_heads=4, head_dim=256, window=window)


def _bench_one_prompt(
    tokens: int = 4096,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    window: int | None = None,
):
    import triton.testing

    for block_size in (16, 256):
        case = make_case(
            [(0, tokens)],
            heads,
            kv_heads,
            head_dim,
            block_size=block_size,
            dtype=torch.bfloat16,
            device="cuda",
            window=window,
        )
        out = torch.empty_like(case.q)
        ms = triton.testing.do_bench(lambda case=case, out=out: case.run(out=out))
        # QK^T and PV over the keys each query sees (the causal half without a window)
        seen = sum(min(p + 1, window or tokens) for p in range(tokens))
        flops = 4 * heads * head_dim * seen
        print(
            f"\nprefill {tokens} tok H={heads} KVH={kv_heads} D={head_dim} window={window} bf16 "
            f"block_size={block_size}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s"
        )
    if window is not None:
        return
    q = case.q.transpose(0, 1)[None]  # dense SDPA for scale: [1, H, T, D]
    k = case.keys[0].transpose(0, 1)[None]
    v = case.values[0].transpose(0, 1)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms = triton.testing.do_bench(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))
    print(f"torch SDPA (dense, causal): {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s")
