"""The step's rules without I/O (actors/engine/flow.py's StepFlow), driven by hand the way the
live engine (actors/engine/step.py) and the replay checker (actors/engine/check.py) drive it:
which replies a step waits for, the order they are applied in and which problem names a failed
step, steps that only free blocks, and the steps at the gpu answered in order (dummies too)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from taipan.actors.engine import flow as flow_module
from taipan.actors.engine.flow import DummyStep, EngineError, StepFlow
from taipan.actors.engine.request import Status
from taipan.actors.engine.scheduler import Scheduler
from taipan.messages.allocator import BlockOpsReply
from taipan.messages.gpu import StepResult
from taipan.messages.mamba_cache import MambaOpsReply
from tests.test_scheduler import make_plan, make_request


def started(num_requests: int = 1, mamba_slots: int = 0) -> tuple[StepFlow, Scheduler]:
    plan = dataclasses.replace(make_plan(), mamba_slots=mamba_slots)
    sched = Scheduler(plan, False)
    for rid in range(1, num_requests + 1):
        sched.add(make_request(rid, 6, max_tokens=2), 0.0)
    return StepFlow(sched), sched


def served(batch, first_block: int = 0, num_free: int = 60) -> BlockOpsReply:
    n = sum(c.new_blocks for c in batch.chunks)
    ids = np.arange(first_block, first_block + n, dtype=np.int32)
    return BlockOpsReply(batch.step, True, ids, num_free, None)


def result(batch, token: int = 7) -> StepResult:
    return StepResult(batch.step, np.full(len(batch.chunks), token, np.int32), None, 0.0)


def dispatch(flow: StepFlow, sched: Scheduler, now: float = 1.0, first_block: int = 0):
    """Plan a step, give it its blocks and send it: the batch, now at the gpu."""
    batch = sched.schedule(now)
    flow.begin(batch)
    flow.reply_in("allocator", served(batch, first_block))
    assert flow.settle() is None
    flow.sent(batch)
    return batch


def test_a_served_step_goes_to_the_gpu_and_its_result_applies():
    flow, sched = started()
    batch = sched.schedule(1.0)
    ops, mops = flow.begin(batch)
    assert ops is not None and mops is None
    assert flow.due == {"allocator"} and flow.waits_for("allocator")
    assert not flow.waits_for("mamba_cache")
    reply = served(batch)
    flow.reply_in("allocator", reply)
    assert not flow.due and flow.block_reply is reply
    assert flow.settle() is None
    assert flow.dispatching is batch  # until its StepPlan is sent
    assert batch.chunks[0].request.blocks == [0, 1] and sched.num_free_blocks == 60
    flow.sent(batch)
    assert flow.dispatching is None and list(flow.at_gpu) == [batch]
    assert flow.on_result(result(batch), 2.0) == []  # no stream: nothing to report yet
    assert not flow.at_gpu and batch.chunks[0].request.generated == [7]


def test_a_refused_allocation_fails_the_step_but_its_counts_are_the_truth():
    flow, sched = started(2)
    batch = sched.schedule(1.0)
    flow.begin(batch)
    refused = BlockOpsReply(batch.step, False, np.zeros(0, np.int32), 3, "out of blocks")
    flow.reply_in("allocator", refused)
    failure = flow.settle()
    assert isinstance(failure, EngineError)
    assert str(failure) == "allocator refused a planned step: out of blocks"
    assert sched.num_free_blocks == 3 and flow.block_reply is refused
    ended = flow.fail(batch, str(failure), 2.0)
    assert [(r.request_id, r.finish_reason, r.error) for r in ended] == [
        (1, "error", str(failure)),
        (2, "error", str(failure)),
    ]
    assert flow.dispatching is None and not flow.at_gpu


def test_an_error_instead_of_the_reply_fails_the_step_with_it():
    flow, sched = started()
    batch = sched.schedule(1.0)
    flow.begin(batch)
    error = EngineError("allocator: boom")
    flow.reply_in("allocator", error)
    assert flow.block_reply is None  # no hash events to relay
    assert flow.settle() is error
    assert flow.fail(batch, str(error), 2.0)[0].error == "allocator: boom"


def test_an_allocator_reply_with_the_wrong_count_is_a_failure_not_a_crash():
    flow, sched = started()
    batch = sched.schedule(1.0)
    flow.begin(batch)
    flow.reply_in("allocator", BlockOpsReply(1, True, np.arange(5, dtype=np.int32), 59, None))
    failure = flow.settle()
    assert isinstance(failure, ValueError) and "expected 2" in str(failure)


def test_a_step_that_only_frees_blocks_is_done_when_settled():
    flow, sched = started()
    batch = dispatch(flow, sched)
    flow.on_result(result(batch), 2.0)
    second = dispatch(flow, sched, 3.0, first_block=2)
    flow.on_result(result(second), 4.0)  # max_tokens 2: request 1 ends
    frees = sched.schedule(5.0)
    assert frees.is_step and not frees.chunks and frees.free_ids == [1]
    ops, _ = flow.begin(frees)
    assert ops is not None
    flow.reply_in("allocator", BlockOpsReply(frees.step, True, np.zeros(0, np.int32), 64, None))
    assert flow.settle() is None
    assert flow.dispatching is None and not flow.at_gpu


def test_results_answer_the_steps_at_the_gpu_in_order():
    flow, sched = started(2)
    first = dispatch(flow, sched)
    sched.add(make_request(3, 6, max_tokens=2), 1.5)
    second = dispatch(flow, sched, 2.0, first_block=4)  # overlap: planned before first's result
    assert list(flow.at_gpu) == [first, second]
    with pytest.raises(EngineError, match=f"gpu answered step {second.step}, expected 1"):
        flow.on_result(result(second), 3.0)
    assert list(flow.at_gpu) == [first, second]  # still at the gpu, until failed
    ended = flow.fail(first, "gpu answered step 2, expected 1", 3.0)
    assert sorted(r.request_id for r in ended) == [1, 2]
    assert list(flow.at_gpu) == [second]
    flow.on_result(result(second), 4.0)
    assert not flow.at_gpu


def test_a_failed_forward_ends_the_step_s_requests():
    flow, sched = started()
    batch = dispatch(flow, sched)
    failed = dataclasses.replace(result(batch), error="device lost")
    with pytest.raises(EngineError, match="forward failed: device lost"):
        flow.on_result(failed, 2.0)
    [req] = flow.fail(batch, "forward failed: device lost", 2.0)
    assert req.status is Status.FINISHED and req.finish_reason == "error"
    assert not flow.at_gpu


def test_a_dummy_step_is_answered_in_its_turn_and_changes_no_request():
    flow, sched = started()
    batch = dispatch(flow, sched)
    flow.sent_dummy(sched.step)
    assert list(flow.at_gpu) == [batch, DummyStep(1)]
    flow.on_result(result(batch), 2.0)
    assert flow.on_result(StepResult(1, np.zeros(0, np.int32), None, 0.0), 3.0) == []
    assert not flow.at_gpu
    flow.sent_dummy(sched.step)
    with pytest.raises(EngineError, match="the gpu answered step 9"):
        flow.on_result(StepResult(9, np.zeros(0, np.int32), None, 0.0), 4.0)
    assert not flow.at_gpu  # a failed dummy is gone (the engine ends: nothing follows it)


# --- hybrids: two replies per step ------------------------------------------------------------


def mamba_served(batch) -> MambaOpsReply:
    live = np.arange(len(batch.mamba_live), dtype=np.int32)
    return MambaOpsReply(batch.step, True, None, live, num_live_free=4 - len(live))


def test_both_replies_are_in_before_either_applies_and_the_allocator_is_named_first():
    flow, sched = started(mamba_slots=4)
    batch = sched.schedule(1.0)
    ops, mops = flow.begin(batch)
    assert ops is not None and mops is not None
    assert flow.due == {"allocator", "mamba_cache"}
    # Read in the engine's order (the allocator's first), applied only once both are in.
    flow.reply_in("allocator", BlockOpsReply(1, False, np.zeros(0, np.int32), 5, "full"))
    assert flow.waits_for("mamba_cache") and sched.num_free_blocks == 64
    flow.reply_in("mamba_cache", EngineError("mamba_cache: boom"))
    failure = flow.settle()
    assert str(failure) == "allocator refused a planned step: full"
    assert sched.num_free_blocks == 5 and sched.mamba.live_free == 4  # both applied


def test_the_mamba_reply_is_applied_before_the_allocator_s(monkeypatch):
    flow, sched = started(mamba_slots=4)
    order = []
    served_mamba = sched.mamba.served
    monkeypatch.setattr(
        sched.mamba, "served", lambda b, r: (order.append("mamba_cache"), served_mamba(b, r))
    )
    apply = flow_module.apply_block_reply
    monkeypatch.setattr(
        flow_module, "apply_block_reply", lambda *a: (order.append("allocator"), apply(*a))
    )
    batch = sched.schedule(1.0)
    flow.begin(batch)
    flow.reply_in("allocator", served(batch))
    flow.reply_in("mamba_cache", mamba_served(batch))
    assert flow.settle() is None
    assert order == ["mamba_cache", "allocator"]
    assert batch.chunks[0].request.mamba_slot == 0 and sched.mamba.live_free == 3


def test_a_mamba_refusal_fails_the_step_and_an_error_gives_the_operations_back():
    flow, sched = started(mamba_slots=4)
    batch = sched.schedule(1.0)
    flow.begin(batch)
    flow.reply_in("allocator", served(batch))
    flow.reply_in("mamba_cache", MambaOpsReply(1, False, "no slot", num_live_free=4))
    failure = flow.settle()
    assert str(failure) == "mamba_cache refused a planned step: no slot"
    assert sched.mamba.live_free == 4
    flow.fail(batch, str(failure), 2.0)

    flow, sched = started(mamba_slots=4)
    batch = sched.schedule(1.0)
    flow.begin(batch)
    assert sched.mamba.live_free == 3  # the admission took one
    flow.reply_in("allocator", served(batch))
    flow.reply_in("mamba_cache", EngineError("mamba_cache: gone"))
    assert str(flow.settle()) == "mamba_cache: gone"
    assert sched.mamba.live_free == 4 and batch.mamba_live == []  # unserved: taken back
