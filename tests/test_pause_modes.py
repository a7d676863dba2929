"""Pause modes and the cache flush in the pure cores (issue 26 items 2 and 6): the scheduler's
admission switch and drain test (mode wait), its flush step against the real allocator service,
the lifecycle table's flush_cache, and the coordinator's all-or-none pause round (the first
error ends it; the ranks that paused are unpaused); and, in an expert-parallel group of real
engine actors (tests/ep_harness.py), a submission that lands while an idle group's round runs
wakes the next round (the stress test of tests/test_e2e_pause_parallel.py hung on it). End to
end: tests/test_e2e_pause_modes.py and tests/test_e2e_pause_parallel.py.
"""

from __future__ import annotations

import asyncio

import pytest
import structlog

from taipan.actors.config import InferenceConfig
from taipan.actors.coordinator.control import LifecycleControl
from taipan.actors.coordinator.fsm import LifecycleFSM, State
from taipan.actors.engine import wire
from taipan.actors.engine.request import Status
from taipan.actors.engine.scheduler import Scheduler
from taipan.messages.common import ErrorReply
from taipan.messages.lifecycle import (
    ControlAck,
    ControlCommand,
    FlushCache,
    LifecycleState,
    Pause,
    PauseMode,
    next_state,
)
from tests.ep_harness import ep_group
from tests.test_scheduler import make_plan
from tests.test_scheduler_prefix import SYSTEM, PrefixHarness, request, run_all

TOKEN = "test-control-token-0123456789"
LOG = structlog.get_logger()


def steps_until_idle(h: PrefixHarness, limit: int = 500) -> None:
    for _ in range(limit):
        if not h.step():
            return
    raise AssertionError("no end")


# --- the scheduler: admission off, drained ---------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_admission_off_drains_what_started_and_keeps_the_rest_queued(overlap):
    h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False, overlap)
    sched = h.sched
    h.add(request(1, [5, 6, 7], max_tokens=6))
    h.add(request(2, [8, 9], max_tokens=4))
    h.step()  # both start
    sched.admitting = False  # a pause in mode wait arrives
    h.add(request(3, [10, 11, 12], max_tokens=2))
    assert not sched.drained() and sched.pending() == 2
    steps_until_idle(h)
    assert sorted(h.ended) == [1, 2] and sched.drained()
    assert [r.request_id for r in sched.waiting] == [3] and sched.pending() == 0
    assert sched.requests[3].status is Status.WAITING and sched.requests[3].admissions == 0
    sched.admitting = True  # unpause
    run_all(h)
    assert sorted(h.ended) == [1, 2, 3]


def test_an_evicted_request_comes_back_while_admission_is_off():
    # 6 blocks of 4 tokens: two requests growing to 16 tokens cannot both keep theirs.
    plan = make_plan(num_blocks=6, block_size=4, max_tokens=64)
    h = PrefixHarness(plan, False)
    sched = h.sched
    h.add(request(1, list(range(20, 28)), max_tokens=8))
    h.add(request(2, list(range(40, 48)), max_tokens=8))
    h.step()
    sched.admitting = False
    h.add(request(3, [1, 2, 3], max_tokens=2))
    steps_until_idle(h)
    assert sched.num_evicted_total > 0  # one was evicted, and came back to finish
    assert sorted(h.ended) == [1, 2] and all(len(h.ended[r].generated) == 8 for r in (1, 2))
    assert sched.drained() and [r.request_id for r in sched.waiting] == [3]


# --- the scheduler: the flush step ---------------------------------------------------------


def _flush(h: PrefixHarness):
    batch = h.sched.flush_cache()
    assert batch is not None and batch.drop_cache and not batch.chunks
    ops = wire.block_ops(batch)
    reply = h.allocate(batch, ops)
    h.apply_blocks(batch, reply)
    h.check_blocks(batch)
    return batch, reply


def test_flush_drops_every_cached_block_and_the_next_request_hits_nothing():
    h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False)
    h.add(request(1, SYSTEM + [500], max_tokens=2))
    run_all(h)
    assert len(h.sched.prefix.block_of) == 3 and h.alloc.pool.num_available == 64
    _, reply = _flush(h)
    assert len(reply.evicted_hashes) == 3 and reply.num_hashed == 0
    assert h.sched.prefix.block_of == {} and h.sched.num_free_blocks == 64
    h.add(request(2, SYSTEM + [600], max_tokens=2))
    run_all(h)
    assert h.ended[2].num_cached_tokens == 0


def test_a_request_holding_shared_blocks_keeps_them_through_a_flush():
    h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False)
    h.add(request(1, SYSTEM + [500], max_tokens=1))
    run_all(h)
    h.add(request(2, SYSTEM + [600, 601], max_tokens=6))
    h.step()
    h.step()
    held = list(h.sched.requests[2].blocks)
    assert h.sched.requests[2].num_cached_tokens == 12 and len(held) >= 3
    _flush(h)  # (between steps: nothing in flight without overlap)
    assert h.alloc.pool.blocks_of(2) == held  # still its own, no longer shared
    run_all(h)  # the harness checks every step reads its own tokens
    assert len(h.ended[2].generated) == 6


def test_flush_without_prefix_caching_or_with_a_step_in_flight():
    assert Scheduler(make_plan(), False).flush_cache() is None
    h = PrefixHarness(make_plan(block_size=4, max_tokens=64), False, overlap=True)
    h.add(request(1, [5, 6, 7, 8, 9], max_tokens=6))
    h.step()  # its step is at the "gpu", its result not applied
    with pytest.raises(RuntimeError, match="step in flight"):
        h.sched.flush_cache()


def test_flush_cache_is_legal_only_while_paused_or_suspended():
    command = ControlCommand.FLUSH_CACHE
    assert next_state(LifecycleState.PAUSED, command) is LifecycleState.PAUSED
    assert next_state(LifecycleState.SUSPENDED, command) is LifecycleState.SUSPENDED
    assert next_state(LifecycleState.RUNNING, command) is None
    control = LifecycleControl(LifecycleFSM(), TOKEN)
    code, text = control.refusal(command, FlushCache(TOKEN), True)
    assert code == "illegal_transition" and "while RUNNING" in text and "pause first" in text
    paused = LifecycleControl(LifecycleFSM(State.PAUSED), TOKEN)
    assert paused.refusal(command, FlushCache(TOKEN), True) is None


# --- the coordinator: all or none ------------------------------------------------------------


def test_a_pause_timeout_must_be_a_positive_number_of_seconds():
    control = LifecycleControl(LifecycleFSM(), TOKEN)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        code, text = control.refusal("pause", Pause(TOKEN, PauseMode.WAIT, False, bad), True)
        assert code == "bad_request" and "positive number of seconds" in text
    assert control.refusal("pause", Pause(TOKEN, PauseMode.WAIT, True, 2.5), True) is None


@pytest.mark.asyncio
async def test_a_pause_ends_at_its_first_error_and_is_undone_on_the_others():
    fsm = LifecycleFSM()
    control = LifecycleControl(fsm, TOKEN)
    name = {b"e0": "engine 0", b"e1": "engine 1", b"e2": "engine 2"}.get
    round_ = control.open("pause", b"client", [b"e0", b"e1", b"e2"])
    control.answer(b"e0", "engine 0", "pause")  # paused
    control.answer(b"e1", "engine 1", None, error="died")  # e2 is still draining
    reply = await asyncio.wait_for(control.close(round_, name, LOG), 1)
    assert isinstance(reply, ErrorReply) and "engine 1: died" in reply.text
    assert fsm.state is State.RUNNING
    undo = control.undo_round(round_, [b"e0", b"e2"])  # (e1 is gone)
    assert undo.command == "unpause" and undo.asked == {b"e0", b"e2"}
    assert control.refusal("pause", Pause(TOKEN), True)[0] == "busy"  # until it is answered
    control.answer(b"e0", "engine 0", "unpause")
    control.answer(b"e2", "engine 2", "unpause")
    final = await asyncio.wait_for(control.close_undo(undo, name, reply, LOG), 1)
    assert final.text.startswith(reply.text) and final.text.endswith("runs again")
    assert fsm.state is State.RUNNING and control.round is None


@pytest.mark.asyncio
async def test_a_pause_past_its_timeout_names_the_late_ranks_and_an_undo_that_fails_says_so():
    control = LifecycleControl(LifecycleFSM(), TOKEN, control_timeout=60)
    name = {b"e0": "engine 0", b"e1": "engine 1"}.get
    round_ = control.open("pause", b"client", [b"e0", b"e1"], timeout=0.05, note=" (wait)")
    control.answer(b"e0", "engine 0", "pause")
    reply = await asyncio.wait_for(control.close(round_, name, LOG), 5)  # not 60 s
    assert reply.text.endswith("engine 1 did not answer pause within 0.05 s (wait)")
    assert control.undo_round(round_, []) is None  # nobody left to undo
    undo = control.undo_round(round_, [b"e0", b"e1"])
    assert undo.asked == {b"e0", b"e1"}  # the late one may have paused since
    control.answer(b"e0", "engine 0", "unpause", error="illegal")
    control.answer(b"e1", "engine 1", "unpause")
    final = await control.close_undo(undo, name, reply, LOG)
    assert "undoing it failed too: engine 0: illegal" in final.text
    # A successful round still moves the FSM as before.
    round_ = control.open("pause", b"client", [b"e0"])
    control.answer(b"e0", "engine 0", "pause")
    assert await control.close(round_, name, LOG) == ControlAck("pause", "PAUSED", 0)


# --- an expert-parallel group: no lost wake-up -----------------------------------------------


@pytest.mark.asyncio
async def test_a_submission_during_an_idle_groups_round_wakes_the_next_round():
    """Rank 0's round agrees that the group is idle while a submission reaches it (after its
    vote counted nothing): the submission must start the next round, not wait forever."""
    config = InferenceConfig(block_size_tokens=16, max_sequence_length=256, buffer_size_gb=0.01)
    async with ep_group(config) as g:
        engine = g.engines[0]
        vote, injected = engine.ep.vote, []

        async def vote_then_submit(work: int, pausing: bool):
            agreement = await vote(work, pausing)
            if agreement.max_work == 0 and not injected:
                injected.append(work)
                await g.submit(0, 9, max_tokens=3)
                while 9 not in engine.scheduler.requests:  # handled before the action
                    await asyncio.sleep(0.001)
            return agreement

        engine.ep.vote = vote_then_submit
        await g.submit(1, 5, max_tokens=3)  # rounds again; the last agrees on idle
        outs = await g.terminal({5, 9}, timeout=10)
        assert injected == [0] and [str(o.finish_reason) for o in outs.values()] == ["length"] * 2
