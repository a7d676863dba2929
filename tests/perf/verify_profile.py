"""Where a speculative verify step's time goes, next to a plain decode step's (device tool
helper; not a test).

Usage: python3 tests/perf/verify_profile.py [MODEL] [K] [BATCH ...] (default smollm2, 4, 1 8).
The worker loads as a speculative config loads it (decode and mixed CUDA graphs, every token's
hidden state kept in the mixed ones). For each batch: B sequences of 256 cached tokens decode
one token (the decode graph), then verify K drafts each (K + 1 query tokens, a mixed graph,
greedy), each timed with CUDA events over 30 steps (host + device, as the gpu actor's launch
and collect), with the step's device part; then one verify step under the torch profiler (CPU
and CUDA): the host calls and the kernels that take its time.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch

from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import LoadModel
from taipan.models import resolve
from tests.perf.gpu_profile import BLOCK, CTX, plan

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def verify_plan(step: int, batch: int, k: int, tables: np.ndarray):
    """B sequences whose last K + 1 tokens (one known, K drafts) end at position CTX - 1."""
    q = k + 1
    base = plan(step, batch, CTX, tables)
    pos = np.concatenate([np.arange(CTX - q, CTX) for _ in range(batch)]).astype(np.int32)
    blocks = tables[np.repeat(np.arange(batch), q), pos // BLOCK].astype(np.int64)
    return dataclasses.replace(
        base,
        input_ids=(np.arange(batch * q) % 1000).astype(np.int32),
        positions=pos,
        slot_mapping=blocks * BLOCK + pos % BLOCK,
        query_start_loc=np.arange(0, batch * q + 1, q, dtype=np.int32),
        prompt_targets=np.full(batch * q, -1, dtype=np.int32),
        num_drafts=np.full(batch, k, dtype=np.int32),
    )


def timed(w: ModelWorker, p, n: int = 30) -> tuple[float, float, bool]:
    """(median ms per step, host + device; median device ms; graphed)."""
    for _ in range(3):
        w.step(p)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    walls, devs, graphed = [], [], False
    for _ in range(n):
        start.record()
        r = w.step(p)
        end.record()
        end.synchronize()
        assert r.error is None, r.error
        walls.append(start.elapsed_time(end))
        devs.append(r.device_seconds * 1e3)
        graphed = r.graphed
    return float(np.median(walls)), float(np.median(devs)), graphed


def profile(w: ModelWorker, p) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            w.step(p)
        torch.cuda.synchronize()
    avg = prof.key_averages()
    cpu = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:16]
    print("  host (self CPU per verify step):")
    for e in cpu:
        print(f"    {e.self_cpu_time_total / 5e3:7.3f} ms x{e.count // 5:<4} {e.key[:80]}")
    gpu = sorted((e for e in avg if e.self_device_time_total > 0),
                 key=lambda e: -e.self_device_time_total)[:12]  # fmt: skip
    total = sum(e.self_device_time_total for e in avg) / 5e3
    print(f"  kernels ({total:.3f} ms GPU per verify step):")
    for e in gpu:
        print(f"    {e.self_device_time_total / 5e3:7.3f} ms x{e.count // 5:<4} {e.key[:80]}")


def main(model: str, k: int, batches: list[int]) -> None:
    w = ModelWorker()
    w.load(
        LoadModel(
            resolve(model)[1],
            "bfloat16",
            "cuda",
            BLOCK,
            4096,
            8.0,
            4096,
            256,
            2560,
            SIZES,
            SIZES,
            speculative=True,
        )  # fmt: skip
    )
    for b in batches:
        tables = np.arange(b * 10, dtype=np.int32).reshape(b, 10)
        dec = timed(w, plan(1, b, CTX, tables))
        ver = timed(w, verify_plan(2, b, k, tables))
        print(f"{model} batch {b}: decode step {dec[0]:.3f} ms (device {dec[1]:.3f}, graphed "
              f"{dec[2]}); verify k={k} step {ver[0]:.3f} ms (device {ver[1]:.3f}, graphed "
              f"{ver[2]}): {ver[0] / dec[0]:.2f}x")  # fmt: skip
        profile(w, verify_plan(3, b, k, tables))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        args[0] if args else "smollm2",
        int(args[1]) if len(args) > 1 else 4,
        [int(x) for x in args[2:]] or [1, 8],
    )
