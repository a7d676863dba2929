"""The engine's host time per decode step, without the actors or a model (device tool helper and
CPU check; not a test): `python3 tests/perf/host_step_bench.py [BATCH ...]` (default 64 256).

B requests of 128 prompt tokens decode for 600 steps through the scheduler as the engine's step
drives it (schedule, the allocator's reply applied, the StepPlan's arrays, a result applied);
prints the median and p90 per step over the last 500, and the median of what a step's outputs
cost besides when every request streams (each its RequestOutput, in one StepOutputs, encoded).
Run it with an older tree first on the path (`PYTHONPATH=<staged old tree>`) to compare two
versions on one machine.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from taipan.actors.config import RuntimePlan
from taipan.actors.engine import wire
from taipan.actors.engine.outputs import output_of
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.scheduler import Scheduler
from taipan.messages.allocator import BlockOpsReply
from taipan.messages.codec import encode
from taipan.messages.gpu import StepResult
from taipan.messages.requests import SamplingParams, StepOutputs

try:
    from taipan.actors.engine.outputs import step_outputs
except ImportError:  # an older tree on the path (before step_outputs)

    def step_outputs(requests):
        return StepOutputs.of([output_of(r) for r in requests])


try:
    from taipan.actors.engine.flow import apply_block_reply
except ImportError:  # an older tree on the path (before actors/engine/flow.py)

    def apply_block_reply(sched, batch, reply):
        sched.assign_blocks(batch, reply)


BLOCKS = 8192


def host_step_us(batch: int, steps: int = 600) -> tuple[float, float, float]:
    limits = dict(max_requests=256, max_tokens=8192, max_sequence_length=4096)
    plan = RuntimePlan(BLOCKS, 16, **limits, eos_token_ids=(), max_paused_blocks=None)
    sched = Scheduler(plan, enable_chunked_prefill=True)
    greedy = SamplingParams(max_tokens=3000, temperature=0.0)
    for rid in range(batch):
        prompt = ((np.arange(128) * 31 + rid) % 1000 + 100).astype(np.int32)
        sched.add(EngineRequest(rid, prompt, greedy, True, arrival_time=0.0, seed=rid), 0.0)
    taken, times, emits = 0, [], []
    for step in range(steps):
        now = float(step + 1)
        start = time.perf_counter()
        batch_ = sched.schedule(now)
        n = sum(c.new_blocks for c in batch_.chunks)
        ids = np.arange(taken, taken + n, dtype=np.int32)
        taken += n
        reply = BlockOpsReply(batch_.step, True, ids, BLOCKS - taken, None)
        apply_block_reply(sched, batch_, reply)
        if batch_.chunks:
            wire.step_plan(sched, batch_)
        rows = np.full(len(batch_.chunks), 7, np.int32)
        out = sched.update(batch_, StepResult(batch_.step, rows, None, 0.0), now)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        if out:
            encode(step_outputs(out))
        emits.append(time.perf_counter() - start)
    tail = sorted(times[100:])
    emit = sorted(emits[100:])[len(emits[100:]) // 2]
    return tail[len(tail) // 2] * 1e6, tail[int(len(tail) * 0.9)] * 1e6, emit * 1e6


if __name__ == "__main__":
    for b in [int(a) for a in sys.argv[1:]] or [64, 256]:
        median, p90, emit = host_step_us(b)
        print(f"batch {b}: median {median:.0f} us per step, p90 {p90:.0f} us; streamed outputs "
              f"{emit:.0f} us more")  # fmt: skip
