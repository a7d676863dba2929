"""A weight update across data-parallel ranks is all or none: the coordinator alone over real
zmq sockets, two engine peers that each test answers by hand (stage, commit, refuse).

With two engines an update that stages goes out with `hold`; each engine stages it and
acknowledges; only when both did does WeightsDecision(commit) go to both. When one refuses, the
one that staged gets WeightsDecision(discard) and the client's error names the rank that
failed. (tests/test_e2e_dp.py runs the same rounds through real engines.)
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan.actors.channel import Channel, make_socket
from taipan.actors.coordinator.actor import CoordinatorActor
from taipan.actors.coordinator.control import holds
from taipan.messages.common import ErrorReply, Hello
from taipan.messages.lifecycle import (
    ControlAck,
    Pause,
    UpdateWeights,
    UpdateWeightsFromDistributed,
    WeightsDecision,
)
from taipan.messages.requests import GetModelInfo, ModelInfo
from tests.test_coordinator_actor import TOKEN, _loaded, assert_error, assert_silent, receive

STATE = {"model.norm.weight": np.ones(4, np.float32)}


@contextlib.asynccontextmanager
async def two_ranks(tmp_path):
    """A coordinator of two ranks, both loaded, PAUSED; yields (client, [engine0, engine1])."""
    ctx = zmq.asyncio.Context()
    front_address, back_address = f"ipc://{tmp_path}/c", f"ipc://{tmp_path}/e"
    front = make_socket(ctx, zmq.ROUTER, front_address, bind=True, name="clients", watch_peers=True)
    back = make_socket(ctx, zmq.ROUTER, back_address, bind=True, name="engines", watch_peers=True)

    def dealer(address: str, identity: bytes) -> Channel:
        return make_socket(ctx, zmq.DEALER, address, bind=False, name="c", identity=identity)

    engines = [dealer(back_address, f"engine-{i}".encode()) for i in range(2)]
    client = dealer(front_address, b"tester")
    actor = CoordinatorActor(front, back, 2, "test-model", 512, control_token=TOKEN)
    try:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(actor.run())
            for rank, chan in enumerate(engines):
                await chan.send(Hello("engine", rank))
                await chan.send(_loaded())
            await client.send(GetModelInfo())
            assert isinstance(await receive(client), ModelInfo)
            await client.send(Pause(TOKEN))
            for chan in engines:
                assert isinstance(await receive(chan), Pause)
                await chan.send(ControlAck("pause", "PAUSED", 0))
            assert await receive(client) == ControlAck("pause", "PAUSED", 0)
            yield client, engines
            actor.stop()
            await run
    finally:
        for chan in (front, back, client, *engines):
            chan.close()
        ctx.term()


@pytest.mark.asyncio
async def test_every_rank_stages_then_both_commit(tmp_path):
    async with two_ranks(tmp_path) as (client, engines):
        await client.send(UpdateWeights(TOKEN, None, STATE, 7, hold=False))
        for chan in engines:
            staged = await receive(chan)
            assert isinstance(staged, UpdateWeights) and staged.hold and staged.token == ""
            await chan.send(ControlAck("update_weights", "PAUSED", 0))  # staged, version as was
        for chan in engines:
            assert await receive(chan) == WeightsDecision("", True)
        await assert_silent(client, 0.1)  # no answer before every rank committed
        for chan in engines:
            await chan.send(ControlAck("update_weights", "PAUSED", 7))
        assert await receive(client) == ControlAck("update_weights", "PAUSED", 7)


@pytest.mark.asyncio
async def test_a_rank_that_fails_staging_makes_the_other_drop_its_weights(tmp_path):
    async with two_ranks(tmp_path) as (client, engines):
        await client.send(UpdateWeights(TOKEN, "/some/checkpoint", None, None))
        for chan in engines:
            assert (await receive(chan)).hold
        await engines[0].send(ControlAck("update_weights", "PAUSED", 0))
        await engines[1].send(ErrorReply("control_failed", "engine-1: no such file", None))
        assert await receive(engines[0]) == WeightsDecision("", False)
        await assert_silent(engines[1], 0.1)  # it staged nothing: no decision for it
        await engines[0].send(ControlAck("update_weights", "PAUSED", 0))
        reply = await receive(client)
        assert_error(reply, "control_failed", "stays PAUSED", "engine 1", "no such file")
        assert "dropped them: the old ones stay" in reply.text
        # The next update starts from a clean slate: both stage and commit it.
        await client.send(UpdateWeights(TOKEN, None, STATE, 3))
        for chan in engines:
            assert (await receive(chan)).hold
            await chan.send(ControlAck("update_weights", "PAUSED", 0))
        for chan in engines:
            assert await receive(chan) == WeightsDecision("", True)
            await chan.send(ControlAck("update_weights", "PAUSED", 3))
        assert await receive(client) == ControlAck("update_weights", "PAUSED", 3)


def test_only_updates_that_stage_hold_and_only_over_several_engines():
    in_place = UpdateWeightsFromDistributed(TOKEN, [[]], None, stage=False)
    staged = UpdateWeightsFromDistributed(TOKEN, [[]], None, stage=True)
    path = UpdateWeights(TOKEN, "/ckpt", None)
    assert holds(path, 2) and holds(staged, 3)
    assert not holds(path, 1) and not holds(staged, 1)
    assert not holds(in_place, 2)  # received into the live weights: nothing to take back
