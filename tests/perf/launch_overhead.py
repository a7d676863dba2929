"""What one Triton launch costs the host (device tool helper; not a test).

Usage: python3 tests/perf/launch_overhead.py. Times, per call over 2,000 calls (host side, the
GPU then synchronized): an empty kernel launched as `kernel[grid](...)` (Triton's JIT path:
binding, argument specialization, cache key, launch); the same kernel's compiled handle
launched directly (the specialization done once); and our `gemv` launcher on a one-row
2,048 x 2,048 product (its checks, its output allocation, the JIT path). eager_host.py put an
eager step of the Gemma 3 1B shape at ~110 us per launch; this says how much is Triton's."""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from taipan.kernels.gemv import gemv

CALLS = 2000


@triton.jit
def _touch(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def per_call_us(fn) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / CALLS * 1e6


def main() -> None:
    x = torch.zeros(128, device="cuda")
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    print(f"kernel[grid](...): {per_call_us(lambda: _touch[(1,)](x, 128, BLOCK=128)):.1f} us")
    try:
        compiled = _touch.warmup(x, 128, BLOCK=128, grid=(1,))
        direct = compiled[(1, 1, 1)]
        try:
            direct(x, 128)
            call = lambda: direct(x, 128)  # noqa: E731
        except TypeError:  # (Triton 3.6's launcher takes the constexprs too)
            call = lambda: direct(x, 128, 128)  # noqa: E731
        print(f"compiled handle: {per_call_us(call):.1f} us")
        x.zero_()
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        print(f"  (three direct launches added {x[0].item():.0f} to each element: 3 is right)")
    except Exception as e:  # (the handle's call differs between Triton releases)
        print(f"compiled handle: failed: {type(e).__name__}: {e}")
    a = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    print(f"gemv (1 x 2048 x 2048): {per_call_us(lambda: gemv(a, w)):.1f} us")
    out = torch.empty(1, 2048, device="cuda", dtype=torch.bfloat16)
    print(f"gemv with out=: {per_call_us(lambda: gemv(a, w, out=out)):.1f} us")
    print(f"torch.empty: {per_call_us(lambda: torch.empty(1, 2048, device='cuda')):.1f} us")
    print(f"F.linear (cuBLAS): {per_call_us(lambda: torch.nn.functional.linear(a, w)):.1f} us")


if __name__ == "__main__":
    main()
