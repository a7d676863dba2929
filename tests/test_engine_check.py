"""The engine replay checker (actors/engine/check.py) on message sequences made the way the live
engine makes them (tests/test_scheduler.py's harness stands in for the allocator and the gpu):
it re-plans every step without divergence, including aborts in flight, pauses, evictions and
steps that only free blocks; it names the first step a changed message would alter; and it
holds the engine's StepOutputs to their contract (whole entries, one terminal output each)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from taipan.actors.config import InferenceConfig
from taipan.actors.engine import wire
from taipan.actors.engine.check import EngineReplay
from taipan.actors.engine.flow import apply_block_reply
from taipan.messages.allocator import AllocatorReady, BlockOpsReply
from taipan.messages.codec import encode
from taipan.messages.gpu import ModelLoaded, StepResult
from taipan.messages.requests import AbortRequest, EngineSubmit, StepOutputs
from tests.test_scheduler import Harness, make_request

CONFIG = InferenceConfig(
    block_size_tokens=2, max_tokens=16, max_requests=4, max_sequence_length=64, buffer_size_gb=1
)
LOADED = ModelLoaded("m", 6, 2, 2000, 64, "{}", (), 1)


class RecordingHarness(Harness):
    """Writes the engine's side of every exchange as (direction, channel, msg, time)."""

    def __init__(self, overlap: bool = False):
        plan = wire.runtime_plan(CONFIG, LOADED, AllocatorReady(6, 6))
        super().__init__(plan, chunked=False, overlap=overlap)
        self.sched = wire.new_scheduler(CONFIG, plan)
        self.records = [("in", "gpu", LOADED, 0.0), ("in", "allocator", AllocatorReady(6, 6), 0.0)]

    def record(self, direction: str, channel: str, msg) -> None:
        self.records.append((direction, channel, msg, self.now))

    def submit(self, req):
        msg = EngineSubmit(req.request_id, req.prompt, req.sampling, False, req.arrival_time)
        self.record("in", "coordinator", msg)
        new, _ = wire.submission(self.sched, LOADED.vocab_size, msg)
        self.sched.add(new, self.now)
        self.added[new.request_id] = new

    def abort(self, rid: int) -> None:
        self.record("in", "coordinator", AbortRequest(rid))
        super().abort(rid)

    def sent(self, outputs) -> None:
        self.record("out", "coordinator", StepOutputs.of(outputs))


def replay(records) -> tuple[str | None, int]:
    checker = EngineReplay(CONFIG)
    for direction, channel, msg, time in records:
        if direction == "in":
            what = checker.inbound(channel, msg, time)
        else:
            what = checker.outbound(msg, tuple(encode(msg)))
        if what is not None:
            return what, checker.steps_checked
    return None, checker.steps_checked


def workload(overlap: bool = False) -> RecordingHarness:
    """6 blocks of 2 tokens for 3 requests: pauses and an eviction; one abort in flight."""
    h = RecordingHarness(overlap)
    for rid in (1, 2, 3):
        h.submit(make_request(rid, 2, max_tokens=6, return_log_probs=True))
    h.step()
    h.step(in_flight=lambda: h.abort(3))
    h.run()
    assert h.sched.num_paused_total > 0
    return h


@pytest.mark.parametrize("overlap", [False, True])
def test_replay_of_a_faithful_log_has_no_divergence(overlap):
    h = workload(overlap)
    what, steps = replay(h.records)
    assert what is None and steps == sum(1 for r in h.records if type(r[2]).__name__ == "StepPlan")
    assert any(r[2].__class__.__name__ == "BlockOps" and not len(r[2].alloc_ids) for r in h.records)


@pytest.mark.parametrize(
    "overlap, shows",
    [
        (False, ["StepPlan differs"]),  # the next plan carries the token
        # The next plan takes the token on the device: the change shows in the outputs.
        (True, ["the engine sent", "replay generates"]),
    ],
)
def test_an_altered_sampled_token_diverges(overlap, shows):
    records = workload(overlap).records
    i = next(i for i, r in enumerate(records) if isinstance(r[2], StepResult))
    d, ch, msg, t = records[i]
    tokens = msg.token_ids.copy()
    tokens[tokens >= 0] += 1
    records[i] = (d, ch, dataclasses.replace(msg, token_ids=tokens), t)
    what, _ = replay(records)
    assert what is not None and all(s in what for s in shows), what


def test_an_abort_moved_out_of_flight_diverges():
    records = workload().records
    i = next(i for i, r in enumerate(records) if isinstance(r[2], AbortRequest))
    # the abort arrived while step 2 was in flight; put it before that step's first message
    j = min(k for k in range(i) if records[k][0] == "out" and records[k][2].step == 2)
    records.insert(j, records.pop(i))
    what, _ = replay(records)
    assert what is not None and "BlockOps differs" in what


def test_a_plan_with_no_scheduler_is_reported():
    plan = wire.step_plan(*_one_step())
    assert "before it could have a scheduler" in EngineReplay(CONFIG).outbound(plan, ())


def _one_step():
    h = RecordingHarness()
    h.submit(make_request(1, 2, max_tokens=2))
    batch = h.sched.schedule(1.0)
    ids, free = h.pool.apply([], [(1, batch.chunks[0].new_blocks)])
    apply_block_reply(
        h.sched, batch, BlockOpsReply(batch.step, True, np.asarray(ids, np.int32), free, None)
    )
    return h.sched, batch


def _outputs(records) -> list[int]:
    return [i for i, r in enumerate(records) if isinstance(r[2], StepOutputs)]


def test_outputs_that_break_their_contract_are_reported():
    records = workload().records
    assert len(_outputs(records)) >= 3
    last = _outputs(records)[-1]
    d, ch, msg, t = records[last]
    assert msg.finished.any()
    # A terminal output sent twice.
    twice = [*records, records[last]]
    rid = int(msg.request_ids[msg.finished][0])
    assert replay(twice)[0] == f"request {rid} got a second terminal output"
    # An entry filed under another request, and arrays that disagree.
    swapped = dataclasses.replace(msg, request_ids=msg.request_ids + 100)
    records[last] = (d, ch, swapped, t)
    assert "is filed as request" in replay(records)[0]
    records[last] = (d, ch, dataclasses.replace(msg, finished=msg.finished[:0]), t)
    assert "differ" in replay(records)[0]
