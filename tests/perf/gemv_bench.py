"""How close a decode step's matrix products come to the copy bandwidth (device tool helper; not
a test): `python3 tests/perf/gemv_bench.py [ROWS ...]` (default 1 16 64).

For the projections of the 1B and 8B Llama shapes, whole and as one rank's half under TP=2,
times `F.linear` (what ops/layers runs: cuBLAS) and a plain Triton GEMV (one program per
BLOCK_N outputs, optionally split over K) from CUDA graphs of 50 calls, against the bytes of the
weight and a measured device-to-device copy rate. Prints one JSON line per shape and row count.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tests.perf.cuda_graphs import graph_us

SHAPES = {  # name: (in_features K, out_features N)
    "1b.qkv": (2048, 3072),
    "1b.o": (2048, 2048),
    "1b.gate_up": (2048, 16384),
    "1b.down": (8192, 2048),
    "8b/2.qkv": (4096, 3072),
    "8b/2.o": (2048, 4096),
    "8b/2.gate_up": (4096, 14336),
    "8b/2.down": (7168, 4096),
    "8b.qkv": (4096, 6144),
    "8b.down": (14336, 4096),
}
CALLS = 50


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, K, N, stride_w,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    # x: [K], w: [N, K] (nn.Linear's layout), out: [N] fp32 (zeroed when SPLIT_K > 1)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :])
        x = tl.load(x_ptr + rk)
        acc += tl.sum(w.to(tl.float32) * x[None, :].to(tl.float32), axis=1)
    if SPLIT_K == 1:
        tl.store(out_ptr + rn, acc)
    else:
        tl.atomic_add(out_ptr + rn, acc, sem="relaxed")


def _graph_us(fn) -> float:
    return graph_us(fn, CALLS, reps=30)


def copy_gb_s() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _graph_us(lambda: dst.copy_(src))
    return 2 * src.numel() / us / 1e3  # read + write


def _rotating(call, ws):
    """A function of no arguments that calls `call(w)` with the next of `ws` each time."""
    turn = iter(range(1 << 62))
    return lambda: call(ws[next(turn) % len(ws)])


def _triton_gemv(x, out, k, n, block_n, block_k, split):
    grid = (n // block_n, split)

    def call(w):
        if split > 1:
            out.zero_()
        _gemv_kernel[grid](x, w, out, k, n, k, block_n, block_k, split, num_warps=4)

    return call


def main(rows_list: list[int]) -> None:
    copy = copy_gb_s()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_gb_s": round(copy)}))
    for name, (k, n) in SHAPES.items():
        # Weights in turn, 256 MB of them, so that the L2 cache (50 MB) holds none when read.
        copies = max(4, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(copies)]
        floor_us = n * k * 2 / copy / 1e3
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda").bfloat16()
            cublas = _graph_us(_rotating(lambda w, x=x: F.linear(x, w), ws))
            row = {"shape": name, "K": k, "N": n, "rows": rows}
            row |= {"floor_us": round(floor_us, 2), "cublas_us": round(cublas, 2)}
            row["cublas_vs_floor"] = round(cublas / floor_us, 3)
            if rows == 1:
                for block_n, block_k, split in ((16, 512, 1), (32, 256, 1), (16, 256, 4)):
                    if n % block_n or k % (block_k * split):
                        continue
                    out = torch.zeros(n, device="cuda")
                    call = _triton_gemv(x, out, k, n, block_n, block_k, split)
                    call(ws[0])
                    ref = F.linear(x.float(), ws[0].float())[0]
                    torch.testing.assert_close(out, ref, atol=0.5, rtol=0.05)
                    us = _graph_us(_rotating(call, ws))
                    row[f"triton_{block_n}x{block_k}s{split}_us"] = round(us, 2)
            print(json.dumps(row))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 16, 64])
