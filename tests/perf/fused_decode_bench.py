"""The fused few-row decode path (kernels/gemv.py) on a GPU (device tool helper; not a test).

`python3 tests/perf/fused_decode_bench.py kernels [PREFIX ...]`: per projection shape (1B, 8B,
Gemma 3 1B and 12B, Qwen2.5-7B, SmolLM2; those starting with a PREFIX) and
rows 1 and 4, microseconds per call from CUDA graphs of 50 calls with the weights in rotation
(so the L2 holds none): cuBLAS (`F.linear`), gemv with the launcher's blocks, and the best of
a sweep of (BLOCK_N, BLOCK_K, num_warps), next to the weight's bytes at the copy rate.
`python3 tests/perf/fused_decode_bench.py model [SHAPE ...]` (default llama-1b llama-8b): the
whole decode step of a random-weight model (256 cached tokens a row) from a CUDA graph, the
layers fused and unfused, against the floor (weights and KV once at the copy rate). One JSON
line per figure. `... profile [SHAPE ...]`: the kernels of one batch-1 step, largest first.
`... blocks [SHAPE ...]`: the graphed batch-1 step under each GEMV block policy (BLOCK_POLICIES;
rows 1 and 4, or those of $BLOCK_ROWS, e.g. "1"; all the policies, or those named in
$BLOCK_POLICIES, e.g. "wide8,few+k8").
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

from taipan.kernels import gemv as G
from taipan.kernels.activation import silu_and_mul
from taipan.ops.attention import build_attention_metadata
from taipan.ops.hardware import copy_bandwidth
from taipan.ops.models import llama
from tests.perf.cuda_graphs import graph_us

SHAPES = {  # name: (K, N, gated)
    "1b.qkv": (2048, 3072, False),
    "1b.o": (2048, 2048, False),
    "1b.gate_up": (2048, 8192, True),
    "1b.down": (8192, 2048, False),
    "8b.qkv": (4096, 6144, False),
    "8b.o": (4096, 4096, False),
    "8b.gate_up": (4096, 14336, True),
    "8b.down": (14336, 4096, False),
    "gemma3-1b.qkv": (1152, 1536, False),
    "gemma3-1b.o": (1024, 1152, False),
    "gemma3-1b.gate_up": (1152, 6912, True),
    "gemma3-1b.down": (6912, 1152, False),
    "12b.qkv": (3840, 8192, False),  # (Gemma 3 12B: 16 + 2 x 8 heads of 256)
    "12b.o": (4096, 3840, False),
    "12b.gate_up": (3840, 15360, True),
    "12b.down": (15360, 3840, False),
    "12b.lm_head": (3840, 262208, False),
    "q7b.qkv": (3584, 4608, False),  # (Qwen2.5-7B)
    "q7b.o": (3584, 3584, False),
    "q7b.gate_up": (3584, 18944, True),
    "q7b.down": (18944, 3584, False),
    "8b.lm_head": (4096, 128256, False),
    "smollm2.qkv": (576, 960, False),
    "smollm2.o": (576, 576, False),
    "smollm2.gate_up": (576, 1536, True),
    "smollm2.down": (1536, 576, False),
}
CALLS = 50
ROTATE_BYTES = 256 << 20


def _us(fn, calls: int = CALLS) -> float:
    return graph_us(fn, calls)


def _rotating(weights):
    turn = itertools.count()
    return lambda: weights[next(turn) % len(weights)]


def _launch(x, w, out, n, gated, blocks):
    block_n, block_k, warps = blocks
    m, k = x.shape
    G._gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, w, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        eps=1e-5, NORM=False, GEMMA_NORM=False, GATED=gated, GELU=False, RESIDUAL=False,
        HAS_BIAS=False,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        PDL=False,
    )  # fmt: skip


def kernels(bw: float, prefixes=()) -> None:
    best_of = {}  # rows 4 runs the blocks rows 1 found best
    shapes = {n: s for n, s in SHAPES.items() if not prefixes or n.startswith(tuple(prefixes))}
    for (name, (k, n, gated)), m in itertools.product(shapes.items(), (1, 4)):
        print(json.dumps(_kernel_row(name, k, n, gated, m, bw, best_of)), flush=True)


def _kernel_row(name, k, n, gated, m, bw, best_of) -> dict:
    dt = torch.bfloat16
    rows = 2 * n if gated else n
    count = max(2, ROTATE_BYTES // (rows * k * 2))
    ws = [torch.randn(rows, k, device="cuda", dtype=dt) / k**0.5 for _ in range(count)]
    x = torch.randn(m, k, device="cuda", dtype=dt)
    out = torch.empty(m, n, device="cuda", dtype=dt)
    nxt = _rotating(ws)
    row = dict(part="kernels", shape=name, rows=m, k=k, n=n, gated=gated)
    row["floor_us"] = rows * k * 2 / bw * 1e6
    if gated:
        row["cublas_us"] = _us(lambda: silu_and_mul(F.linear(x, nxt())))
    else:
        row["cublas_us"] = _us(lambda: F.linear(x, nxt()))
    row["gemv_us"] = _us(lambda: G.gemv(x, nxt(), gated=gated, out=out))
    row["default_blocks"] = G._blocks(n, k, gated)
    best = None
    sweep = itertools.product((2, 4, 8), (128, 256, 512, 1024), (2, 4, 8))
    for blocks in sweep if m == 1 else [best_of[name]]:
        run = functools.partial(_launch, x, out=out, n=n, gated=gated, blocks=blocks)
        us = _us(lambda run=run: run(nxt()))
        if best is None or us < best[0]:
            best = (us, *blocks)
    row["best_us"], row["best_blocks"] = best[0], best[1:]
    best_of[name] = best[1:]
    return row


def _step(model, rows: int, ctx: int = 256, block: int = 256):
    """A decode step of `rows` sequences with `ctx - 1` cached tokens each (garbage KV: timing
    only), its inputs built once; returns a function of no arguments that runs it."""
    blocks_per = triton.cdiv(ctx, block)
    cache = llama.allocate_kv_cache(model.config, rows * blocks_per, block, torch.bfloat16, "cuda")
    cache.normal_()
    tables = [list(range(r * blocks_per, (r + 1) * blocks_per)) for r in range(rows)]
    meta, positions = build_attention_metadata([1] * rows, [ctx] * rows, tables, block, "cuda")
    ids = torch.arange(rows, device="cuda")
    return lambda: model.compute_logits(model(ids, positions, meta, cache)[-rows:])


def model_steps(shape: str, bw: float) -> None:
    from taipan.ops.random_model import load_random_model

    model, config, _ = load_random_model(f"random:{shape}", dtype=torch.bfloat16, device="cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not config.tie_word_embeddings:
        weights -= model.embed_tokens.weight.numel() * 2  # a step reads its rows only
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    with torch.no_grad():
        for rows in (1, 2, 4):
            row = dict(part="model", shape=shape, rows=rows)
            row["floor_ms"] = (weights + rows * 256 * kv_per_token) / bw * 1e3
            for fused in (True, False, True, False):
                llama.FUSED_DECODE_ROWS = G.MAX_ROWS if fused else 0
                ms = _us(_step(model, rows), calls=20) / 1e3
                key = "fused_ms" if fused else "unfused_ms"
                row[key] = min(ms, row.get(key, ms))
            row["fused_vs_floor"] = row["fused_ms"] / row["floor_ms"]
            row["unfused_vs_floor"] = row["unfused_ms"] / row["floor_ms"]
            print(json.dumps(row), flush=True)
    del model
    torch.cuda.empty_cache()


_BIG = 1 << 24  # weight elements: the 1B shape's gate_up and larger


def _policy(gated_blocks, other_blocks=None, gated_min=_BIG):
    def blocks(n, k, gated):
        if gated and n * k >= gated_min:
            return gated_blocks
        return other_blocks if not gated and other_blocks and n * k >= _BIG else None

    return blocks


def _few(n, k, gated):  # a large plain product of under 4 programs of 4 outputs an SM
    return not gated and n * k >= _BIG and n // 4 < 4 * 132


def _narrow_k(n, k, gated):
    return (8, 1024, 4) if not gated and n * k >= _BIG and k < 8192 else None


def _wide(n, k, gated):
    return (8, 1024, 4) if not gated and n * k >= _BIG and n >= 2 * k else None


BLOCK_POLICIES = {  # name: (n, k, gated) -> (BLOCK_N, BLOCK_K, num_warps) or None (the default)
    "default": lambda n, k, gated: None,
    "g4_512_2": _policy((4, 512, 2)),
    "g4_512_2_all": _policy((4, 512, 2), gated_min=1 << 18),
    "g4_256_2": _policy((4, 256, 2)),
    "g8_512_2": _policy((8, 512, 2)),
    "g4_512_2+n4_512_2": _policy((4, 512, 2), (4, 512, 2)),
    "g4_512_2+n4_1024_2": _policy((4, 512, 2), (4, 1024, 2)),
    # (twenty-second session: fewer outputs a program, more warps, longer rows, one warp)
    "g2_512_2": _policy((2, 512, 2)),
    "g2_1024_2": _policy((2, 1024, 2)),
    "g4_512_4": _policy((4, 512, 4)),
    "g4_1024_4": _policy((4, 1024, 4)),
    "g4_512_1": _policy((4, 512, 1)),
    "n2_1024_2": _policy((4, 512, 2), (2, 1024, 2)),
    "n4_2048_4": _policy((4, 512, 2), (4, 2048, 4)),
    "n4_1024_1": _policy((4, 512, 2), (4, 1024, 1)),
    "n8_1024_4": _policy((4, 512, 2), (8, 1024, 4)),
    # (rules by the programs per SM (132 SMs): a plain product of few programs reads longer rows
    # with more warps; a wide one, N >= 2K, eight outputs a program)
    "few_4_2048_4": lambda n, k, g: (4, 2048, 4) if _few(n, k, g) else None,
    "few+k8": lambda n, k, g: (4, 2048, 4) if _few(n, k, g) else _narrow_k(n, k, g),
    "few+wide8": lambda n, k, g: (4, 2048, 4) if _few(n, k, g) else _wide(n, k, g),
    "wide8": _wide,
}


def block_policies(shape: str, bw: float) -> None:
    """The whole batch-1 step (graphed, fused) under each of BLOCK_POLICIES, in one process:
    which GEMV blocks pay where the kernels overlap (PDL) as they do in a real step."""
    from taipan.ops.random_model import load_random_model

    model, config, _ = load_random_model(f"random:{shape}", dtype=torch.bfloat16, device="cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not config.tie_word_embeddings:
        weights -= model.embed_tokens.weight.numel() * 2
    default = G._blocks
    only = os.environ.get("BLOCK_POLICIES", "").split(",")  # (names; default: all)
    chosen = {
        n: p for n, p in BLOCK_POLICIES.items() if n in only or n == "default" or only == [""]
    }
    for rows in [int(r) for r in os.environ.get("BLOCK_ROWS", "1,4").split(",")]:
        row = dict(part="blocks", shape=shape, rows=rows, floor_ms=weights / bw * 1e3)
        with torch.no_grad():
            for _ in range(2):  # (two rounds: the best of each policy)
                for name, policy in chosen.items():
                    G._blocks = lambda n, k, g, *a, p=policy: p(n, k, g) or default(n, k, g, *a)
                    ms = _us(_step(model, rows), calls=20) / 1e3
                    row[name] = round(min(ms, row.get(name, ms)), 4)
        G._blocks = default
        print(json.dumps(row), flush=True)
    del model
    torch.cuda.empty_cache()


def profile(shape: str) -> None:
    """The kernels of one fused batch-1 step (eager, under the torch profiler): count and device
    microseconds per kernel name, the 40 largest, and the total."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from taipan.ops.random_model import load_random_model

    model, _, _ = load_random_model(f"random:{shape}", dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        step = _step(model, 1)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows)
    print(json.dumps({"part": "profile", "shape": shape, "kernels": sum(e.count for e in rows),
                      "device_us": total}))  # fmt: skip
    for e in rows[:40]:
        print(f"{e.count:5d} {e.device_time_total:9.1f} us  {e.key[:110]}")
    del model
    torch.cuda.empty_cache()


if __name__ == "__main__":
    part, *rest = sys.argv[1:] or ["kernels"]
    bandwidth = copy_bandwidth("cuda", 1.0)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_gb_s": bandwidth / 1e9}))
    if part == "kernels":
        kernels(bandwidth, rest)
    elif part == "profile":
        for s in rest or ["llama-1b"]:
            profile(s)
    elif part == "blocks":
        for s in rest or ["llama-1b", "llama-8b"]:
            block_policies(s, bandwidth)
    else:
        for s in rest or ["llama-1b", "llama-8b"]:
            model_steps(s, bandwidth)
