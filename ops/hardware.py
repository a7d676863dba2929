"""The measured hardware that the bench's floors come from: the device's name, copy bandwidth,
matmul rate, and what one decode step must read (`model_bytes`, `hardware_limit`).

The runtime's bench (runtime/bench/) imports it inside its workloads' functions, on use: never
`taipan --help`, the CLI's start or a client or coordinator process. Measures, never serves:
nothing on the serving path imports it.
"""

from __future__ import annotations

import time

import torch

from taipan.ops.loader import RANDOM_PREFIX, load_model, random_config
from taipan.ops.models.llama import kv_cache_bytes_per_block
from taipan.ops.moe import MoE
from taipan.ops.random_model import random_model_class

GIB = 1 << 30


def sync(device) -> None:
    """Wait for the device (a no-op off CUDA): a timer read after it covers the queued work."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def gpu_name(device: str) -> str | None:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its name ("bfloat16"), so the workloads need not import torch."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _best_seconds(device: str, fn, reps: int) -> float:
    """The shortest of `reps` timed calls of `fn`, the device synchronised around each."""
    best = float("inf")
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device: str, gib: float, reps: int = 10) -> float:
    """Bytes/s of `dst.copy_(src)` on `gib` GiB buffers (read + write bytes), best of `reps`."""
    n = int(gib * GIB) // 4
    src = torch.randn(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)  # preallocated: time the copy, not page faults
    return 2 * src.numel() * 4 / _best_seconds(device, lambda: dst.copy_(src), reps)


def matmul_rate(
    device: str, dtype: str | torch.dtype, reps: int = 5, n: int | None = None
) -> float:
    """FLOP/s of an n x n matmul in `dtype` (default n = 8192 on CUDA, 1024 elsewhere), best of
    `reps` after a warm-up."""
    n = n or (8192 if device.startswith("cuda") else 1024)
    a = torch.randn(n, n, dtype=as_dtype(dtype), device=device)
    b = torch.randn(n, n, dtype=as_dtype(dtype), device=device)
    a @ b  # warm-up (cuBLAS handle, heuristics)
    return 2 * n**3 / _best_seconds(device, lambda: a @ b, reps)


def model_bytes(model_path: str, dtype: str | torch.dtype) -> dict:
    """What one decode step must read: `weight_bytes` (every parameter, except an untied input
    embedding, of which a step reads only its batch's rows) and `kv_bytes_per_token` (keys and
    values of every layer); `params` counts every parameter, `read_params` those read.

    Mixtures of experts: `expert_bytes` (`expert_params`) is the routed experts' share of
    `weight_bytes` (a step reads only the experts its tokens chose) and `experts` =
    (num_experts, top_k), or None for a dense model; taipan.bench.decode's `step_weight_bytes`
    turns them into one batch's bytes."""
    dtype = as_dtype(dtype)
    if model_path.startswith(RANDOM_PREFIX):
        config = random_config(model_path)
        with torch.device("meta"):
            model = random_model_class(config)(config).to(dtype)
    else:
        model, config, _ = load_model(model_path, dtype=dtype, device="cpu")
    size = torch.empty((), dtype=dtype).element_size()
    read = [
        p for name, p in model.named_parameters() if model.lm_head is None or "embed" not in name
    ]
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "read_params": sum(p.numel() for p in read),
        "weight_bytes": sum(p.numel() for p in read) * size,
        "expert_params": (expert_params := sum(m.w1.numel() + m.w2.numel() for m in moe)),
        "expert_bytes": expert_params * size,
        "experts": (moe[0].config.num_experts, moe[0].config.top_k) if moe else None,
        "kv_bytes_per_token": kv_cache_bytes_per_block(config, 1, dtype),
        # Each attention layer's window (None: its whole context), or None where the family
        # has no per-layer windows: a windowed layer reads at most its window's keys.
        "kv_windows": _layer_windows(config),
    }


def _layer_windows(config) -> list[int | None] | None:
    layer_window = getattr(config, "layer_window", None)
    if layer_window is None:
        return None
    return [layer_window(i) for i in range(config.num_layers)]


def hardware_limit(args, model_path: str, batch: int) -> dict:
    """Measured peak matmul rate and copy bandwidth, and the decode floor they imply."""
    dtype = as_dtype(args.dtype)
    model, _, _ = load_model(model_path, dtype=dtype, device=args.device)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    flops = matmul_rate(args.device, dtype, n=2048)
    bandwidth = copy_bandwidth(args.device, 1 / 16, reps=5)  # 64 MiB buffers
    # One decode step of `batch` sequences: 2*params FLOPs per token, the weights read once.
    step = max(2 * params * batch / flops, weight_bytes / bandwidth)
    out = {
        "hw_matmul_gflop_s": flops / 1e9,
        "hw_copy_gb_s": bandwidth / 1e9,
        "hw_limit_output_tok_s": batch / step,
        "params": params,
    }
    if args.device.startswith("cuda"):
        out["gpu"] = gpu_name(args.device)
    return out
