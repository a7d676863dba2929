"""Where a structured-output step's time goes, beside a plain one (device tool helper; not a test).

Usage: python3 tests/perf/grammar_step_profile.py [DEVICE] [BATCH] [STEPS] (default cuda 64 40).
The gpu worker alone on SmolLM2 (bf16 and decode CUDA graphs on CUDA, fp32 on the CPU): B
sequences of 256 cached tokens decode, each step a plain one or one where every row follows the
`taipan bench --workload structured` schema (greedy rows, checked as TAIPAN_GRAMMAR_MASKS says).
Per kind, two ways of running the steps: `serial` (launch then collect, one thread) and `overlap`
(as the gpu actor does: each step launched on this thread while the last one is collected on
another, at most two launched). Prints the median wall time per step and the median device span
(StepResult.device_seconds: CUDA events from the step's upload to its last copy), then the
torch profiler's busiest host calls and kernels over a few serial grammar steps. The structured
rows of the twenty-fourth session found a grammar step's device span twice a plain one's while
the grammar's own host work for 64 rows is a fraction of a millisecond (tests/perf/NOTES.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import statistics
import sys
import time

import numpy as np
import torch

from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import GrammarStart, LoadModel
from taipan.messages.requests import StructuredOutput
from taipan.models import resolve
from tests.perf.gpu_profile import BLOCK, CTX, plan

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 128}},
    "required": ["notes"],
}


def serial(w: ModelWorker, plans) -> tuple[float, float]:
    walls, spans = [], []
    for p in plans:
        start = time.perf_counter()
        r = w.step(p)
        walls.append(time.perf_counter() - start)
        spans.append(r.device_seconds)
        assert r.error is None, r.error
    return statistics.median(walls), statistics.median(spans)


def overlap(w: ModelWorker, plans) -> tuple[float, float]:
    """Launch on this thread, collect on another, two launched at most (the gpu actor's way)."""
    done, pending = [], []
    with concurrent.futures.ThreadPoolExecutor(1) as collector:
        start = time.perf_counter()
        for p in plans:
            if len(pending) == 2:
                done.append(pending.pop(0).result())
            pending.append(collector.submit(w.collect, w.launch(p)))
        done += [f.result() for f in pending]
        wall = (time.perf_counter() - start) / len(plans)
    assert all(r.error is None for r in done), [r.error for r in done if r.error]
    return wall, statistics.median(r.device_seconds for r in done)


def main(device: str, batch: int, steps: int) -> None:
    w = ModelWorker()
    cuda = device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    graphs = (1, 2, 4, 8, 16, 32, 64, 128, 256) if cuda else ()
    w.load(LoadModel(resolve("smollm2")[1], dtype, device, BLOCK, 4096, 8.0, 4096, 256, 2560,
                     graphs, ()))  # fmt: skip
    tables = np.arange(batch * 10, dtype=np.int32).reshape(batch, 10)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    counter = iter(range(1, 1 << 30))
    request_ids = iter(range(1 << 30))

    def plans(grammar: bool, n: int) -> list:
        out = [plan(next(counter), batch, CTX, tables) for _ in range(n)]
        if not grammar:
            return out
        ids = np.array([next(request_ids) for _ in range(batch)], dtype=np.int64)
        new = [GrammarStart(int(r), spec) for r in ids]
        return [
            dataclasses.replace(p, grammar_rows=ids, grammar_new=new if i == 0 else [],
                                grammar_drop=ids if i == n - 1 else np.zeros(0, np.int64))
            for i, p in enumerate(out)
        ]  # fmt: skip

    serial(w, plans(False, 3) + plans(True, 3))  # (graphs, kernels and grammars warm)
    for mode in (serial, overlap):
        for grammar in (False, True, False, True):
            wall, span = mode(w, plans(grammar, steps))
            kind = "json_schema" if grammar else "plain"
            print(f"{mode.__name__:8s} {kind:11s} batch {batch}: {wall * 1e3:.3f} ms a step, "
                  f"device span {span * 1e3:.3f} ms")  # fmt: skip
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    profiled = plans(True, 6)
    serial(w, profiled[:2])
    with torch.profiler.profile(activities=acts) as prof:
        serial(w, profiled[2:5])
    serial(w, profiled[5:])
    events = prof.key_averages()
    print("\nhost calls over 3 serial json_schema steps (self CPU time):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]:
        print(f"  {e.self_cpu_time_total / 1e3:8.3f} ms x{e.count:<5} {e.key[:80]}")
    if cuda:
        kernels = [e for e in events if e.self_device_time_total > 0]
        total = sum(e.self_device_time_total for e in kernels)
        print(f"kernels over those steps: {total / 1e3:.3f} ms")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]:
            print(f"  {e.self_device_time_total / 1e3:8.3f} ms x{e.count:<5} {e.key[:80]}")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0] if a else "cuda", int(a[1]) if len(a) > 1 else 64, int(a[2]) if len(a) > 2 else 40)
