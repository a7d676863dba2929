"""The fused MoE kernel against its floors on CUDA (device tool helper; not a test).

Usage: python3 tests/perf/moe_kernel_bench.py (no arguments; under a minute on an H100).
For Qwen3-30B-A3B's MoE layer (H=2048, I=768, E=128, k=8, swiglu) and a NemotronH-style relu2
layer (H=2688, I=1856, E=128, k=6), bf16, T in {1, 64, 1024}, random softmax top-k routing:
median times (`triton.testing.do_bench`) of `fused_moe` replayed from a CUDA graph (as the
engine runs it) and eagerly (small T pays five kernel launches from Python there), of
`fused_moe_ref` (a loop over the experts hit, a host sync) and of a dense-equivalent bf16
bound (the same FLOPs as two cuBLAS matmuls over all T·k rows through one expert's weights),
next to the floors of this GPU: the weights of the experts actually hit read once at the
measured copy bandwidth, and the FLOPs at the measured bf16 matmul rate.
"""

from __future__ import annotations

import torch
import triton
import triton.testing

from taipan.kernels.moe import fused_moe, fused_moe_ref
from tests.perf.cuda_graphs import graph_of

LAYERS = {  # hidden, intermediate per expert, experts, k, activation
    "qwen3-30b-a3b": (2048, 768, 128, 8, "swiglu"),
    "nemotron-h": (2688, 1856, 128, 6, "relu2"),
}
TOKENS = (1, 64, 1024)
DTYPE = torch.bfloat16


def measured_floors() -> tuple[float, float]:
    """(bytes/s, bf16 FLOP/s) of this GPU: a 1 GiB copy (bytes read + written), an 8192^3
    matmul."""
    src = torch.empty(2**29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    copy_s = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    mm_s = triton.testing.do_bench(lambda: a @ a, return_mode="median") / 1e3
    return 2 * src.nbytes / copy_s, 2 * 8192**3 / mm_s


def problem(tokens, hidden, inter, experts, k, activation, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = 2 * inter if activation == "swiglu" else inter
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(DTYPE)
    w1 = (torch.randn(experts, n, hidden, generator=g, device="cuda") / hidden**0.5).to(DTYPE)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device="cuda") / inter**0.5).to(DTYPE)
    logits = torch.randn(tokens, experts, generator=g, device="cuda")
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return x, w1, w2, ids, weights / weights.sum(-1, keepdim=True)


def dense_bound(x, w1, w2, k, activation):
    """The same FLOPs as the MoE through one expert's weights: cuBLAS on T·k rows."""
    rows = x.repeat_interleave(k, dim=0)
    w1_0, w2_0 = w1[0], w2[0]

    def run():
        h = rows @ w1_0.t()
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.relu(h).square()
        return h @ w2_0.t()

    return run


def graph_replay(fn):
    """fn captured once in a CUDA graph (compiled and warmed up outside the capture)."""
    return graph_of(fn).replay


def bench_row(name, layer, tokens, bandwidth, flops) -> tuple:
    hidden, inter, experts, k, activation = layer
    x, w1, w2, ids, weights = problem(tokens, hidden, inter, experts, k, activation)
    out = torch.empty_like(x)
    n = w1.shape[1]
    hit = torch.unique(ids).numel()
    mem_floor = (hit * (n * hidden + hidden * inter) * x.element_size() + 2 * x.nbytes) / bandwidth
    flop_floor = 2 * tokens * k * (n * hidden + hidden * inter) / flops

    def fused():
        fused_moe(x, w1, w2, ids, weights, activation=activation, out=out)

    runs = (
        graph_replay(fused),
        fused,
        lambda: fused_moe_ref(x, w1, w2, ids, weights, activation=activation),
        dense_bound(x, w1, w2, k, activation),
    )
    us = [triton.testing.do_bench(run, return_mode="median") * 1e3 for run in runs]
    floor = max(mem_floor, flop_floor) * 1e6
    return (name, tokens, hit, *(f"{t:.1f}" for t in us), f"{mem_floor * 1e6:.1f}",
            f"{flop_floor * 1e6:.1f}", f"{floor / us[0]:.0%}")  # fmt: skip


def main() -> None:
    bandwidth, flops = measured_floors()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, "
          f"bf16 matmul {flops / 1e12:.0f} TFLOP/s; times in us (median)")  # fmt: skip
    header = ("layer", "T", "experts hit", "fused graph", "fused eager", "ref", "dense bf16",
              "memory floor", "compute floor", "floor/graph")  # fmt: skip
    print(" | ".join(f"{h:>13}" for h in header))
    for name, layer in LAYERS.items():
        for tokens in TOKENS:
            row = bench_row(name, layer, tokens, bandwidth, flops)
            print(" | ".join(f"{v!s:>13}" for v in row), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
