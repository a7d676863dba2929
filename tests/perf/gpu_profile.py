"""Where a decode step's GPU time goes (device tool helper; not a test).

Usage: python3 tests/perf/gpu_profile.py [MODEL] [BATCH ...] (default random:llama-8b, 1 64).
For each batch: B sequences of 256 cached tokens decode one token; the step runs eagerly under
the torch profiler (the kernels a CUDA graph replays are the same, minus the launch gaps), and
the top kernels by GPU time print with their share, next to the floor (weights + KV bytes at
the copy bandwidth). Then the same step from a CUDA graph, timed with CUDA events.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import LoadModel, StepPlan

CTX = 256
BLOCK = 256


def plan(step: int, batch: int, ctx: int, block_tables: np.ndarray) -> StepPlan:
    q = np.arange(batch + 1, dtype=np.int32)
    pos = np.full(batch, ctx - 1, dtype=np.int32)
    slots = block_tables[:, (ctx - 1) // BLOCK].astype(np.int64) * BLOCK + (ctx - 1) % BLOCK
    zeros32 = np.zeros(batch, dtype=np.int32)
    return StepPlan(
        step=step,
        input_ids=(np.arange(batch) % 1000).astype(np.int32),
        positions=pos,
        slot_mapping=slots,
        query_start_loc=q,
        seq_lens=np.full(batch, ctx, dtype=np.int32),
        block_tables=block_tables,
        sample=np.ones(batch, dtype=np.int8),
        temperature=np.zeros(batch, dtype=np.float32),
        top_k=zeros32,
        top_p=np.ones(batch, dtype=np.float32),
        min_p=np.zeros(batch, dtype=np.float32),
        seeds=np.full(batch, -1, dtype=np.int64),
        gen_index=zeros32,
        logprobs=np.zeros(batch, dtype=np.int8),
        top_n=zeros32,
        prompt_targets=np.full(batch, -1, dtype=np.int32),
    )


def main(model: str, batches: list[int]) -> None:
    from taipan.ops.hardware import copy_bandwidth

    bw = copy_bandwidth("cuda", 1.0)
    for graphs in (False, True):
        w = ModelWorker()
        sizes = ((1, 2, 4, 8, 16, 32, 64, 128, 256), ()) if graphs else ((), ())
        w.load(LoadModel(model, "bfloat16", "cuda", BLOCK, 4096, 40.0, 4096, 256, 2560, *sizes))
        weights = sum(p.numel() * p.element_size() for p in w.model.parameters())
        c = w.config
        for b in batches:
            tables = np.arange(b * 10, dtype=np.int32).reshape(b, 10)
            kv = b * CTX * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
            floor_ms = (weights + kv) / bw * 1e3
            p = plan(1, b, CTX, tables)
            for _ in range(3):
                w.step(p)
            torch.cuda.synchronize()
            if not graphs:
                acts = [torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as prof:
                    w.step(p)
                    torch.cuda.synchronize()
                events = [e for e in prof.key_averages() if e.device_time_total > 0]
                total = sum(e.self_device_time_total for e in events)
                print(f"\n{model} batch {b} eager: kernels {total / 1e3:.2f} ms GPU, "
                      f"floor {floor_ms:.2f} ms ({weights / 1e9:.2f} GB weights + "
                      f"{kv / 1e9:.3f} GB KV at {bw / 1e9:.0f} GB/s)")  # fmt: skip
                events.sort(key=lambda e: -e.self_device_time_total)
                for e in events[:14]:
                    share = e.self_device_time_total / total
                    print(f"  {e.self_device_time_total / 1e3:7.3f} ms {share:5.1%} "
                          f"x{e.count:<4} {e.key[:90]}")  # fmt: skip
            else:
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                times = []
                for _ in range(20):
                    start.record()
                    r = w.step(p)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                print(f"{model} batch {b} graphed step (host + device, events): "
                      f"median {np.median(times):.2f} ms, device part {r.device_seconds * 1e3:.2f}"
                      f" ms, floor {floor_ms:.2f} ms")  # fmt: skip
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "random:llama-8b", [int(x) for x in args[1:]] or [1, 64])
