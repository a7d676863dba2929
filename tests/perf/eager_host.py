"""Where an eager step's host time goes (device tool helper; not a test).

Usage: python3 tests/perf/eager_host.py [MODEL] [TOKENS ...] (default random:gemma3-1b, 1 512
2048). For each size: one sequence computes TOKENS new tokens (1: a decode row over 255 cached
ones; more: a prefill chunk from position 0) with no CUDA graphs; the step's wall time and the
device's part (StepResult.device_seconds), then cProfile's top functions by own time over five
steps. The bench's eager rows (~23 ms a step on the Gemma 3 1B shape, H200) are host-bound:
this says where."""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import numpy as np
import torch

from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import LoadModel, StepPlan
from tests.test_ops_logprobs import Seq, make_plan

BLOCK = 256
DEVICE = os.environ.get("DEVICE", "cuda")  # (cpu: a dry run of the script)


def plan(step: int, tokens: int) -> StepPlan:
    """One sequence: a decode row over 255 cached tokens (tokens == 1) or a prompt chunk from
    position 0 (tests/test_ops_logprobs.py builds the plan as the engine would)."""
    start = 255 if tokens == 1 else 0
    ids = (np.arange(tokens) % 1000).tolist()
    return make_plan(step, [Seq(ids, start, list(range(16)))], block_size=BLOCK)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main(model: str, sizes: list[int]) -> None:
    w = ModelWorker()
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    w.load(LoadModel(model, dtype, DEVICE, BLOCK, 64, 8.0, 4096, 16, 4096, (), ()))
    for tokens in sizes:
        p = plan(1, tokens)
        for _ in range(3):
            w.step(p)
        sync()
        walls, device = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            r = w.step(p)
            sync()
            walls.append(time.perf_counter() - t0)
            device.append(r.device_seconds)
        print(f"\n{model} {tokens} tokens eager: wall {np.median(walls) * 1e3:.2f} ms, "
              f"device part {np.median(device) * 1e3:.2f} ms")  # fmt: skip
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            w.step(p)
        sync()
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(22)
        stats.sort_stats("cumulative").print_stats("taipan", 40)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "random:gemma3-1b", [int(x) for x in args[1:]] or [1, 512, 2048])
