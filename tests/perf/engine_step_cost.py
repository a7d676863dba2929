"""The engine's host work per decode step at batch B, without a device (helper; not a test).

Usage: python tests/perf/engine_step_cost.py [BATCH] [STEPS] [--profile] [--grammar] [--overlap]
(default 64 200). B requests of 256-token prompts are admitted and prefilled, then the timed
steps decode one token each, as the engine's step loop runs them with overlap off (with
`--overlap`, on: each step planned before the result of the one before is applied): plan
(`Scheduler.schedule`), the allocator's reply applied, the StepPlan built
(`wire.step_plan`), the result applied (`Scheduler.update`) and the step's outputs built and
encoded (`outputs.step_outputs`, streamed requests). The fake device samples token 7 for
every row; no request ends while timed. Prints the median microseconds of each part per
step; `--profile` adds cProfile's busiest functions over the timed steps; `--grammar` gives
every request the structured bench's json_schema (the engine's side of structured outputs:
384 against 380 us a step at batch 64 on the 2-core box). At batch 64 the engine's main thread
sets the step's pace on a GPU (tests/perf/NOTES.md, "Where the host goes at batch 64"): what
this measures is that thread's share.
"""

from __future__ import annotations

import cProfile
import dataclasses
import pstats
import statistics
import sys
import time

import numpy as np

from taipan.actors.config import RuntimePlan
from taipan.actors.engine import wire
from taipan.actors.engine.flow import apply_block_reply
from taipan.actors.engine.outputs import step_outputs
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.scheduler import Scheduler
from taipan.messages.allocator import BlockOpsReply
from taipan.messages.codec import encode
from taipan.messages.gpu import StepResult
from taipan.messages.requests import SamplingParams

PROMPT, BLOCK = 256, 16


class Pool:
    """The allocator's reply: the lowest free blocks, frees by request id."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.held: dict[int, list[int]] = {}

    def reply(self, batch) -> BlockOpsReply:
        for rid in batch.free_ids:
            self.free.extend(self.held.pop(rid, []))
        out = []
        for c in batch.chunks:
            if c.new_blocks:
                taken, self.free = self.free[: c.new_blocks], self.free[c.new_blocks :]
                self.held.setdefault(c.request.request_id, []).extend(taken)
                out += taken
        return BlockOpsReply(batch.step, True, np.asarray(out, np.int32), len(self.free), None)


def run(
    batch: int, steps: int, profile: bool, grammar: bool = False, overlap: bool = False
) -> None:
    blocks = batch * (PROMPT + steps + 64) // BLOCK + 8
    plan = RuntimePlan(
        num_blocks=blocks,
        block_size=BLOCK,
        max_requests=batch,
        max_tokens=max(batch * PROMPT, 2048),
        max_sequence_length=PROMPT + steps + 64,
        eos_token_ids=(),
    )
    sched, pool = Scheduler(plan, True), Pool(blocks)
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    if grammar:  # (every request under the structured bench's schema)
        from taipan.bench.structured import array_schema
        from taipan.messages.requests import StructuredOutput

        structured = StructuredOutput("json_schema", array_schema(steps))
        params = dataclasses.replace(params, ignore_eos=False, structured=structured)
    gen = np.random.default_rng(0)
    for rid in range(batch):
        prompt = gen.integers(10, 1000, PROMPT).astype(np.int32)
        sched.add(EngineRequest(rid, prompt, params, True, 0.0, seed=rid), 0.0)
    parts: dict[str, list[float]] = {
        k: [] for k in ("schedule", "blocks", "step_plan", "update", "outputs")
    }
    prof = cProfile.Profile() if profile else None
    in_flight = (None, None)
    for n in range(steps + 2):
        timed = n >= 2  # (the prompts' step and the first decode step are not)
        if timed and prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        planned = sched.schedule(float(n))
        t1 = time.perf_counter()
        if wire.block_ops(planned) is not None:
            apply_block_reply(sched, planned, pool.reply(planned))
        t2 = time.perf_counter()
        step_plan = wire.step_plan(sched, planned)
        t3 = time.perf_counter()
        rows = len(step_plan.seq_lens)
        result = StepResult(planned.step, np.full(rows, 7, np.int32), None, 0.001)
        if overlap:  # (the step before's result, applied once this one is planned)
            (planned, result), in_flight = in_flight, (planned, result)
        done = sched.update(planned, result, float(n)) if planned is not None else []
        t4 = time.perf_counter()
        encode(step_outputs(done))
        t5 = time.perf_counter()
        if prof is not None:
            prof.disable()
        if timed:
            assert rows == batch, f"step {n} has {rows} rows"
            for key, (a, b) in zip(
                parts, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)), strict=True
            ):
                parts[key].append((b - a) * 1e6)
    total = sum(statistics.median(v) for v in parts.values())
    cells = ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in parts.items())
    print(f"batch {batch}, {steps} decode steps: {total:.0f} us a step ({cells})")
    if prof is not None:
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    run(
        int(args[0]) if args else 64,
        int(args[1]) if len(args) > 1 else 200,
        "--profile" in sys.argv,
        "--grammar" in sys.argv,
        "--overlap" in sys.argv,
    )
