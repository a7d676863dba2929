"""One or more modes of `taipan bench --workload structured` alone, for a profiler (device tool
helper, not a test): `python3 tests/perf/structured_modes.py MODE[,MODE] [ROUNDS]` (default
10 rounds), MODE one of unconstrained, json_schema, unconstrained_whole, json_schema_whole.
SmolLM2 on CUDA in bf16, 64 requests x 128 tokens, as the bench; prints each round's seconds,
engine steps and wall ms per step. Run under `py-spy record --gil` to see which functions hold
the engine process's GIL per step in one mode and not in the other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from taipan.bench.command import add_arguments
from taipan.bench.common import mixed_prompts
from taipan.bench.structured import _timed_rounds, array_schema
from taipan.flags import add_runtime_arguments
from taipan.launcher import runtime_from_args
from taipan.messages.requests import SamplingParams, StructuredOutput


def main(names: list[str], rounds: int) -> None:
    p = argparse.ArgumentParser()
    add_runtime_arguments(p)
    add_arguments(p)
    device = os.environ.get("DEVICE", "cuda")  # (cpu: a smoke run, 4 x 8 in fp32)
    dtype = "bfloat16" if device == "cuda" else "float32"
    args = p.parse_args(["--model", "smollm2", "--device", device, "--dtype", dtype])
    args.record = os.environ.get("RECORD")  # (a directory: tests/perf/step_timeline.py reads it)
    n, m = (64, 128) if device == "cuda" else (4, 8)
    prompts = [f"List notes about this text as JSON. {q}" for q in mixed_prompts(n)]
    free = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
    schema = StructuredOutput("json_schema", array_schema(m))
    constrained = SamplingParams(max_tokens=m, temperature=0.0, structured=schema)
    all_modes = {
        "unconstrained": (free, True),
        "json_schema": (constrained, True),
        "unconstrained_whole": (free, False),
        "json_schema_whole": (constrained, False),
    }
    modes = {k: all_modes[k] for k in names}
    with runtime_from_args(args) as rt:
        for r in range(rounds):
            best = asyncio.run(_timed_rounds(rt.address, prompts, modes, 1))
            for mode, (seconds, _, _, steps, _, void) in best.items():
                print(f"round {r} {mode}: {seconds:.4f} s, {steps} steps, "
                      f"{1e3 * seconds / steps:.3f} ms a step, {void} void rows")  # fmt: skip


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0].split(","), int(a[1]) if len(a) > 1 else 10)
