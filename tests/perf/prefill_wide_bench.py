"""The paged prefill kernel at head_dim 256 under several tile choices (device tool helper, not
a test): `python3 tests/perf/prefill_wide_bench.py`. One 4096-token sequence (8 heads over 4,
and Gemma 3 1B's 4 over 1), bf16, 16-slot blocks; each config's output is compared with the
launcher's own choice, and torch SDPA (dense, causal) is timed beside them."""

from __future__ import annotations

import torch

from taipan.kernels import prefill_attention as pa

CONFIGS = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (32, 32, 8, 2),
    (64, 32, 8, 2),
    (64, 64, 8, 2),
    (128, 32, 8, 2),
    (64, 32, 4, 2),
    (128, 64, 8, 2),
    (64, 32, 8, 3),
]


def ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def problem(tokens: int, heads: int, kv_heads: int, dim: int, block: int = 16):
    g = torch.Generator(device="cuda").manual_seed(0)
    nblocks = tokens // block
    cache = torch.randn(2, nblocks + 1, block, kv_heads, dim, generator=g, device="cuda")
    cache = cache.bfloat16()
    q = torch.randn(tokens, heads, dim, generator=g, device="cuda").bfloat16()
    tables = torch.arange(1, nblocks + 1, dtype=torch.int32, device="cuda")[None]
    starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    return q, cache, tables, starts, lens


def triton_pad(n: int) -> int:
    return 1 << (n - 1).bit_length()


def bench_shape(heads: int, kv_heads: int, dim: int = 256, tokens: int = 4096) -> None:
    original = pa._tile_config
    q, cache, tables, starts, lens = problem(tokens, heads, kv_heads, dim)
    scale = dim**-0.5

    def run():
        return pa.paged_prefill_attention(
            q, cache, tables, starts, lens, scale, max_query_len=tokens
        )

    want = run()
    flops = 4 * tokens * tokens / 2 * heads * dim
    chosen = original(q, triton_pad(heads // kv_heads), tokens, dim)
    print(f"H={heads} KVH={kv_heads} D={dim} T={tokens}: the launcher's choice {chosen}")
    for cfg in CONFIGS:
        pa._tile_config = lambda *_, cfg=cfg: cfg
        try:
            t = ms(run)
            err = (run().float() - want.float()).abs().max().item()
            print(f"  {cfg}: {t:.3f} ms, {flops / t / 1e9:.0f} TFLOP/s, max diff {err:.2e}")
        except Exception as e:  # (a config that does not fit: out of resources)
            print(f"  {cfg}: failed: {type(e).__name__}: {str(e)[:80]}")
        finally:
            pa._tile_config = original
    k = cache[0, 1:].reshape(tokens, kv_heads, dim).transpose(0, 1)
    v = cache[1, 1:].reshape(tokens, kv_heads, dim).transpose(0, 1)
    k = k.repeat_interleave(heads // kv_heads, 0)[None]
    v = v.repeat_interleave(heads // kv_heads, 0)[None]
    qq = q.transpose(0, 1)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t = ms(lambda: sdpa(qq, k, v, is_causal=True, scale=scale))
    print(f"  torch SDPA: {t:.3f} ms, {flops / t / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    bench_shape(8, 4)
    bench_shape(4, 1)
