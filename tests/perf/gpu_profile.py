"""Profile one prefill and a few decode steps of the gpu worker on CUDA (device tool helper).

Usage: python3 tests/perf/gpu_profile.py MODEL_DIR [dtype]. Prints step times and the top ops
by CUDA and CPU time. Not a test; a tool to see where a step's time goes.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from taipan.actors.config import RuntimePlan
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.scheduler import Scheduler
from taipan.actors.gpu.worker import ModelWorker
from taipan.bench import mixed_prompts
from taipan.messages.gpu import LoadModel, StepPlan
from taipan.messages.requests import SamplingParams
from taipan.ops.tokenizer import Tokenizer


def main(model_dir: str, dtype: str = "bfloat16") -> None:
    w = ModelWorker()
    w.load(LoadModel(model_dir, dtype, "cuda", 16, 4096, 4.0, 16384, 128, 2560))
    tok = Tokenizer.from_hf_dir(model_dir)
    prompts = [np.asarray(tok.encode(p), np.int32) for p in mixed_prompts(32)]
    plan = RuntimePlan(4096, 16, 128, 16384, 2560, ())
    s = Scheduler(plan, False)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        s.add(EngineRequest(i, p, sp, False, 0.0, 1), 0.0)
    used = 0

    def step(profile=False):
        nonlocal used
        b = s.schedule(0.0)
        n = sum(c.new_blocks for c in b.chunks)
        s.assign_blocks(b, np.arange(used, used + n), 4096 - used - n)
        used += n
        planned = StepPlan(step=b.step, **s.plan_arrays(b))
        torch.cuda.synchronize()
        t = time.perf_counter()
        if profile:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                r = w.step(planned)
                torch.cuda.synchronize()
        else:
            r = w.step(planned)
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        s.update(b, r, 0.0)
        print(f"step {b.step}: {b.num_tokens} tokens, {dt * 1000:.1f} ms", flush=True)
        if profile:
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=12), flush=True)

    step(profile=True)  # prefill
    for _ in range(5):
        step()
    step(profile=True)  # decode


if __name__ == "__main__":
    main(*sys.argv[1:])
