"""The paged decode kernel at small batches under CUDA graphs, wide heads against the 128 ones
(device tool helper, not a test): `python3 tests/perf/decode_wide_bench.py`. Prints us per call
for Gemma 3 1B's attention (4 heads over 1 kv head of 256), a 4B-like one (8 over 4 of 256) and
Llama 8B's (32 over 8 of 128), at `_SPLIT_WARPS_WIDE` 4 and 8, context 512 and 2048."""

from __future__ import annotations

import torch

from taipan.kernels import decode_attention as da


def time_us(fn, reps: int = 200) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def case(batch: int, heads: int, kv_heads: int, dim: int, context: int, window=None) -> float:
    block, max_blocks = 16, 2560 // 16
    blocks = batch * max_blocks + 1
    cache = torch.randn(2, blocks, block, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    tables = torch.arange(1, batch * max_blocks + 1, dtype=torch.int32, device="cuda")
    tables = tables.view(batch, max_blocks)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)

    def run():
        da.paged_decode_attention(q, cache, tables, lens, dim**-0.5, sliding_window=window, out=out)

    return time_us(run)


if __name__ == "__main__":
    for warps in (4, 8):
        da._SPLIT_WARPS_WIDE = warps
        for name, (h, kvh, d) in {"gemma3-1b": (4, 1, 256), "4b-like": (8, 4, 256),
                                  "llama-8b": (32, 8, 128)}.items():  # fmt: skip
            for batch in (1, 64):
                for context, window in ((512, None), (2048, None), (2048, 512)):
                    us = case(batch, h, kvh, d, context, window)
                    print(f"warps {warps} {name} B={batch} ctx={context} window={window}: "
                          f"{us:.1f} us")  # fmt: skip
