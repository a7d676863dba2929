"""The coordinator actor's parts alone, without sockets: `relay_outputs` (relay.py, which the
replay check drives too), `LifecycleControl` (control.py) and `StatsBook` (stats.py). The actor
around them is tested through its sockets in tests/test_coordinator_actor.py."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import structlog

from taipan.actors.coordinator.control import LifecycleControl
from taipan.actors.coordinator.core import CoordinatorCore, Route
from taipan.actors.coordinator.fsm import LifecycleFSM, State
from taipan.actors.coordinator.relay import relay_outputs
from taipan.actors.coordinator.stats import StatsBook
from taipan.messages.codec import decode
from taipan.messages.common import ErrorReply
from taipan.messages.lifecycle import ControlAck, Pause, Unpause, UpdateWeights
from taipan.messages.requests import RequestOutput, StepOutputs
from taipan.messages.stats import RankStats, Stats

TOKEN = "token"
LOG = structlog.get_logger()


def output(request_id: int, finished: bool) -> RequestOutput:
    reason = "length" if finished else None
    return RequestOutput(request_id, np.array([5], np.int32), finished, reason, None, 3, 1)


def core_with_requests(*clients: bytes) -> tuple[CoordinatorCore, list[int]]:
    """A core with one rank and one request per client (client request id 10 + its place)."""
    core = CoordinatorCore()
    core.add_rank(0)
    return core, [core.admit(c, 10 + i)[0] for i, c in enumerate(clients)]


# --- relay_outputs --------------------------------------------------------------------------------


def test_batch_clients_get_one_step_outputs_and_others_one_output_each():
    core, (a, b, c) = core_with_requests(b"batch", b"single", b"batch")
    msg = StepOutputs.of([output(a, False), output(b, True), output(c, True)])
    relay = relay_outputs(msg, core, {b"batch"})
    assert relay.lost == [] and relay.why == ""
    [(client, frame)] = relay.singles
    single = decode([frame])
    assert client == b"single" and (single.request_id, single.finished) == (11, True)
    [(client, batch)] = relay.batches
    assert client == b"batch" and batch.request_ids.tolist() == [10, 12]
    assert batch.finished.tolist() == [False, True]
    assert batch.outputs == (msg.outputs[0], msg.outputs[2])  # frames untouched
    assert set(core.routes) == {a}  # the finished ones forgot their routes


def test_outputs_of_forgotten_routes_are_dropped():
    core, (a,) = core_with_requests(b"x")
    core.route_of(a, True)
    relay = relay_outputs(StepOutputs.of([output(a, True), output(99, False)]), core, set())
    assert (relay.singles, relay.batches, relay.lost) == ([], [], [])


def test_a_bad_entry_is_lost_alone_and_a_bad_message_loses_every_entry():
    core, (a, b) = core_with_requests(b"x", b"y")
    forged = output(b + 50, True)  # filed under b, carrying another request's output
    msg = StepOutputs(
        np.array([a, b]), np.array([True, True]), StepOutputs.of([output(a, True), forged]).outputs
    )
    relay = relay_outputs(msg, core, set())
    assert [c for c, _ in relay.singles] == [b"x"]
    assert relay.lost == [(b, Route(b"y", 11, 0))] and "filed under request" in relay.why
    assert core.routes == {}
    core, (a, b) = core_with_requests(b"x", b"y")
    short = dataclasses.replace(
        StepOutputs.of([output(a, True), output(b, False)]), finished=np.array([True])
    )
    relay = relay_outputs(short, core, {b"x"})
    assert relay.singles == relay.batches == [] and [g for g, _ in relay.lost] == [a, b]
    assert "differ" in relay.why and core.routes == {}


# --- LifecycleControl -----------------------------------------------------------------------------


def test_refusals_name_the_token_the_fields_the_fsm_and_a_busy_round():
    control = LifecycleControl(LifecycleFSM(), TOKEN)
    assert control.refusal("pause", Pause("wrong"), True)[0] == "not_authorized"
    both = UpdateWeights(TOKEN, None, None)
    assert control.refusal("update_weights", both, True)[1] == (
        "update_weights needs exactly one of path and state"
    )
    code, text = control.refusal("unpause", Unpause(TOKEN), True)
    assert code == "illegal_transition" and text.startswith("unpause is illegal while RUNNING")
    assert control.refusal("pause", Pause(TOKEN), True) is None
    control.open("pause", b"client", [b"e0"])
    code, text = control.refusal("pause", Pause(TOKEN), True)
    assert code == "busy" and "pause is still waiting for the engines" in text
    with pytest.raises(ValueError, match="non-empty control token"):
        LifecycleControl(LifecycleFSM(), "")


def test_weight_transfer_controls_with_unusable_fields_are_bad_requests():
    from taipan.messages.lifecycle import (
        InitWeightTransfer,
        UpdateWeightsFromDistributed,
        WeightSpec,
        WeightTransferGroup,
    )

    control = LifecycleControl(LifecycleFSM(State.PAUSED), TOKEN)
    cases = [
        (WeightTransferGroup("h", 0, 3, 1, ""), "is not a port"),
        (WeightTransferGroup("h", 29500, 1, 1, ""), "below world_size"),
        (WeightTransferGroup("h", 29500, 3, 0, ""), "must be >= 1"),
        (WeightTransferGroup("h", 29500, 3, 1, "mpi"), "not nccl or gloo"),
    ]
    for group, text in cases:
        code, why = control.refusal("init_weight_transfer", InitWeightTransfer(TOKEN, group), True)
        assert code == "bad_request" and text in why, why
    good = InitWeightTransfer(TOKEN, WeightTransferGroup("h", 29500, 3, 1, ""))
    assert control.refusal("init_weight_transfer", good, True) is None
    empty = UpdateWeightsFromDistributed(TOKEN, [[]], None, False)
    assert "non-empty bucket" in control.refusal("update_weights", empty, True)[1]
    one = UpdateWeightsFromDistributed(TOKEN, [[WeightSpec("w", "float32", [2])]], 3, False)
    assert control.refusal("update_weights", one, True) is None
    assert "no engine" in control.refusal("update_weights", one, False)[1]


@pytest.mark.asyncio
async def test_a_round_moves_the_fsm_only_when_every_engine_acknowledged():
    fsm = LifecycleFSM()
    control = LifecycleControl(fsm, TOKEN)
    round_ = control.open("pause", b"client", [b"e0", b"e1"])
    assert not control.answer(b"e0", "engine 0", "unpause")  # another command's answer
    assert control.answer(b"e0", "engine 0", "pause", weight_version=2)
    assert not control.answer(b"e0", "engine 0", "pause")  # a duplicate
    assert control.answer(b"e1", "engine 1", None, error="its connection closed")  # a death
    reply = await control.close(round_, lambda i: i.decode(), LOG)
    assert isinstance(reply, ErrorReply) and reply.code == "control_failed"
    assert reply.text == ("pause failed; the state stays RUNNING: engine 1: its connection closed")
    assert fsm.state is State.RUNNING and control.round is None and control.weight_version == 0
    round_ = control.open("pause", b"client", [b"e0"])
    control.answer(b"e0", "engine 0", "pause", weight_version=2)
    assert await control.close(round_, lambda i: i.decode(), LOG) == ControlAck(
        "pause", "PAUSED", 2
    )
    assert fsm.state is State.PAUSED and control.weight_version == 2


@pytest.mark.asyncio
async def test_a_round_times_out_naming_the_engines_that_did_not_answer():
    control = LifecycleControl(LifecycleFSM(State.PAUSED), TOKEN, stop_timeout=0.05)
    round_ = control.open("stop", b"client", [b"e1", b"e0"])
    assert control.stopping
    reply = await control.close(round_, lambda i: f"engine {i.decode()}", LOG)
    assert reply.text == (
        "stop failed; the state stays PAUSED: engine e0, engine e1 did not answer stop within "
        "0.05 s (the coordinator exits anyway)"
    )
    assert not control.stopping


# --- StatsBook ------------------------------------------------------------------------------------


def rank(r: int, step: int) -> RankStats:
    return RankStats(r, "RUNNING", step, 1, 2, 0, 16, 10, 6, 0, 0, 4, 0)


@pytest.mark.asyncio
async def test_stats_keep_each_ranks_own_latest_report_and_share_a_query():
    book = StatsBook(timeout=0.05)
    assert book.ask(b"a") and not book.ask(b"b")  # b shares a's query
    book.query([b"e0", b"e1"])
    book.report(b"e0", 0, Stats("RUNNING", (rank(0, 3), rank(1, 9))))  # rank 1 is not e0's
    assert await book.wait() == {b"e1"}  # e1 is late
    book.client_gone(b"b")
    waiters, stats = book.answer(State.RUNNING)
    assert waiters == [b"a"] and stats == Stats("RUNNING", (rank(0, 3),))
    assert book.ask(b"a")  # the next query goes out again


@pytest.mark.asyncio
async def test_a_dead_rank_shows_its_totals_and_ends_the_wait_for_it():
    book = StatsBook(timeout=60.0)
    book.report(b"e0", 0, Stats("RUNNING", (rank(0, 3),)))
    book.ask(b"a")
    book.query([b"e0"])
    book.rank_died(0, b"e0", "its connection closed", State.RUNNING, 0)
    await asyncio.wait_for(book.wait(), 1.0)
    book.rank_died(1, b"e1", "x" * 600, State.PAUSED, 5)  # never reported
    _, stats = book.answer(State.RUNNING)
    dead, never = stats.ranks
    assert (dead.step, dead.running, dead.blocks_free, dead.alive) == (3, 0, 0, False)
    assert dead.dead_reason == "its connection closed"
    assert (never.state, never.weight_version, len(never.dead_reason)) == ("PAUSED", 5, 500)
    assert book.ranks[0] is dead
