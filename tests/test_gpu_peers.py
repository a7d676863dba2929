"""The leader gpu actor's side of the tensor-parallel peer protocol (actors/gpu/peers.py), alone
through its sockets: a real GpuActor at tensor-parallel size 2 with no model loaded (so nothing
joins a torch.distributed group), and a fake follower made of a SUB and a DEALER socket.

- nothing is published before the follower said hello and subscribed: a follower whose SUB
  connects late (the slow joiner) still gets the first message;
- a step is published and answered by the leader alone;
- a control answers the engine once the follower has; the same failure on both is the rank's
  reply; peers that disagree (or a follower that never answers) end the actor with FatalError;
- an answer with a stale index is ignored;
- a follower that never says hello fails the load within the bounded wait;
- a follower whose connection closes ends the rank (PeerGoneError, naming it); a stopping
  leader says goodbye to its followers, and their connections closing then end nothing;
- a follower gets its leader's goodbye before the connection's end, and leaves cleanly; a
  leader that goes without one ends it (PeerGoneError), as does one that never sends a load.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan.actors.base import FatalError
from taipan.actors.channel import make_socket
from taipan.actors.gpu import peers
from taipan.actors.gpu.actor import GpuActor
from taipan.actors.gpu.follower import FollowerActor
from taipan.actors.gpu.peers import Followers, PeerGoneError, TPSetup, follower_identity
from taipan.messages.common import ErrorReply
from taipan.messages.gpu import (
    GpuControl,
    GpuControlReply,
    LoadModel,
    PeerBye,
    PeerHello,
    PeerOutcome,
    StepPlan,
    StepResult,
)

NO_MODEL = "no model is loaded"


class Rig:
    """The leader (served over an inproc PAIR, as the engine talks to it) and a fake follower."""

    def __init__(self, tmp_path):
        self.ctx = zmq.asyncio.Context()
        plans, reports = f"ipc://{tmp_path}/plans.sock", f"ipc://{tmp_path}/reports.sock"
        self.plans_address = plans
        served = make_socket(self.ctx, zmq.PAIR, "inproc://gpu", bind=True, name="engine")
        self.engine = make_socket(self.ctx, zmq.PAIR, "inproc://gpu", bind=False, name="gpu")
        followers = Followers(
            make_socket(self.ctx, zmq.XPUB, plans, bind=True, name="followers"),
            make_socket(
                self.ctx, zmq.ROUTER, reports, bind=True, name="followers", watch_peers=True
            ),
            size=2,
            rank=0,
        )
        self.actor = GpuActor(0, served, tp=TPSetup(0, 2, "file:///unused"), followers=followers)
        self.channels = [served, self.engine, followers.plans, followers.reports]
        self.push = make_socket(
            self.ctx, zmq.DEALER, reports, bind=False, name="reports",
            identity=follower_identity(1), watch_peers=True,
        )  # fmt: skip
        self.sub = None
        self.channels.append(self.push)

    def subscribe(self) -> None:
        self.sub = make_socket(self.ctx, zmq.SUB, self.plans_address, bind=False, name="plans")
        self.channels.append(self.sub)

    async def say_hello(self) -> None:
        await self.push.send(PeerHello(1, 12345))

    async def published(self):
        return (await asyncio.wait_for(self.sub.recv(), 10)).msg

    async def reply(self):
        return (await asyncio.wait_for(self.engine.recv(), 10)).msg

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.ctx.term()


@contextlib.asynccontextmanager
async def running(tmp_path):
    rig = Rig(tmp_path)
    task = asyncio.create_task(rig.actor.run())
    try:
        yield rig, task
    finally:
        rig.actor.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 10)
        rig.actor.executor.shutdown()
        rig.close()


def empty_plan(step: int) -> StepPlan:
    i32, f32 = np.zeros(1, np.int32), np.ones(1, np.float32)
    return StepPlan(
        step, i32, i32, np.zeros(1, np.int64), np.array([0, 1], np.int32), np.ones(1, np.int32),
        np.zeros((1, 1), np.int32), np.ones(1, np.int8), f32, i32, f32, np.zeros(1, np.float32),
        np.zeros(1, np.int64), i32, np.zeros(1, np.int8), i32, np.full(1, -1, np.int32),
    )  # fmt: skip


@pytest.mark.asyncio
async def test_a_slow_joiner_gets_the_first_message_and_a_shared_failure_is_the_reply(tmp_path):
    async with running(tmp_path) as (rig, task):
        await rig.say_hello()
        await rig.engine.send(GpuControl("resume", None, None, None))
        await asyncio.sleep(0.3)  # the leader holds the control: no subscriber yet
        rig.subscribe()
        assert await rig.published() == GpuControl("resume", None, None, None)
        await rig.push.send(PeerOutcome(1, 7, "resume", None))  # a stale index: ignored
        await rig.push.send(PeerOutcome(1, 1, "resume", NO_MODEL))
        reply = await rig.reply()
        assert isinstance(reply, GpuControlReply) and reply.error == NO_MODEL
        # A step goes to the follower; only the leader answers it.
        await rig.engine.send(empty_plan(1))
        assert (await rig.published()).step == 1
        result = await rig.reply()
        assert isinstance(result, StepResult) and result.error == NO_MODEL
        assert not task.done()


@pytest.mark.asyncio
async def test_peers_that_disagree_on_a_control_end_the_rank(tmp_path):
    async with running(tmp_path) as (rig, task):
        rig.subscribe()
        await rig.say_hello()
        await rig.engine.send(GpuControl("suspend", "persist", None, None))
        assert (await rig.published()).command == "suspend"
        await rig.push.send(PeerOutcome(1, 1, "suspend", None))  # applied there, not here
        reply = await rig.reply()
        assert "peers disagree" in reply.error and NO_MODEL in reply.error
        with pytest.raises(ExceptionGroup) as group:
            await asyncio.wait_for(task, 10)
        [fatal] = group.value.exceptions
        assert isinstance(fatal, FatalError)
        assert "the tensor-parallel peers disagree on suspend" in str(fatal)


@pytest.mark.asyncio
async def test_a_follower_that_does_not_answer_ends_the_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "PEER_ANSWER_TIMEOUT_S", 0.5)
    async with running(tmp_path) as (rig, task):
        rig.subscribe()
        await rig.say_hello()
        await rig.engine.send(GpuControl("resume", None, None, None))
        assert (await rig.published()).command == "resume"
        reply = await rig.reply()
        assert "followers [1] did not answer resume within 0.5 s" in reply.error
        with pytest.raises(ExceptionGroup) as group:
            await asyncio.wait_for(task, 10)
        assert isinstance(group.value.exceptions[0], FatalError)


@pytest.mark.asyncio
async def test_a_follower_that_never_comes_fails_the_load(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "FOLLOWER_START_TIMEOUT_S", 0.5)
    async with running(tmp_path) as (rig, task):
        load = LoadModel("random:tiny", "float32", "cpu", 16, 8, 0.1, 64, 4, 256)
        await rig.engine.send(load)
        reply = await rig.reply()
        assert isinstance(reply, ErrorReply) and reply.code == "load_failed"
        assert "followers [1] never said hello within 0.5 s" in reply.text
        assert not task.done()  # the rank reports it; the engine decides


async def _ended_with(task, error: type) -> Exception:
    with pytest.raises(ExceptionGroup) as group:
        await asyncio.wait_for(task, 10)
    [fatal] = group.value.exceptions
    assert type(fatal) is error, fatal
    return fatal


@pytest.mark.asyncio
async def test_a_follower_whose_connection_closes_ends_the_rank(tmp_path):
    async with running(tmp_path) as (rig, task):
        rig.subscribe()
        await rig.say_hello()
        await asyncio.sleep(0.2)  # the hello is in: the leader knows the follower
        rig.push.close()  # as the kernel does for a killed process
        fatal = await _ended_with(task, PeerGoneError)
        assert "tensor-parallel follower 1 (pid 12345) is gone" in str(fatal)


@pytest.mark.asyncio
async def test_a_stopping_leader_says_goodbye_first(tmp_path):
    async with running(tmp_path) as (rig, task):
        rig.subscribe()
        await rig.say_hello()
        await asyncio.sleep(0.2)
        rig.actor.stop()
        env = await asyncio.wait_for(rig.push.recv(), 10)
        assert env.msg == PeerBye("the engine rank stops")
        await asyncio.wait_for(task, 10)  # a clean end
        rig.push.close()  # nothing to end any more


class FollowerRig:
    """A real FollowerActor (no model loaded) and a fake leader: an XPUB and a ROUTER."""

    def __init__(self, tmp_path, leader_timeout: float = 60.0):
        self.ctx = zmq.asyncio.Context()
        plans, reports = f"ipc://{tmp_path}/plans.sock", f"ipc://{tmp_path}/reports.sock"
        self.xpub = make_socket(self.ctx, zmq.XPUB, plans, bind=True, name="followers")
        self.router = make_socket(self.ctx, zmq.ROUTER, reports, bind=True, name="followers")
        sub = make_socket(self.ctx, zmq.SUB, plans, bind=False, name="plans")
        dealer = make_socket(
            self.ctx, zmq.DEALER, reports, bind=False, name="reports",
            identity=follower_identity(1), watch_peers=True,
        )  # fmt: skip
        self.actor = FollowerActor(
            0, sub, dealer, TPSetup(1, 2, "file:///unused"), "cpu", "random:tiny",
            leader_timeout=leader_timeout,
        )  # fmt: skip
        self.channels = [self.xpub, self.router, sub, dealer]

    async def hello(self):
        env = await asyncio.wait_for(self.router.recv(), 10)
        assert isinstance(env.msg, PeerHello) and env.sender == follower_identity(1)
        return env

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.ctx.term()


@pytest.mark.asyncio
@pytest.mark.parametrize("bye", [True, False])
async def test_a_follower_leaves_on_its_leaders_goodbye_or_ends_without_one(tmp_path, bye):
    rig = FollowerRig(tmp_path)
    task = asyncio.create_task(rig.actor.run())
    try:
        env = await rig.hello()
        if bye:
            await rig.router.send(PeerBye("the engine rank stops"), to=env.sender)
        rig.router.close(linger_ms=1000)  # the leader's process ends
        if bye:
            await asyncio.wait_for(task, 10)  # a clean end
        else:
            fatal = await _ended_with(task, PeerGoneError)
            assert "the connection to the leader closed without a goodbye" in str(fatal)
    finally:
        rig.actor.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 10)
        rig.actor.executor.shutdown()
        rig.close()


@pytest.mark.asyncio
async def test_a_follower_whose_leader_never_sends_a_load_gives_up(tmp_path):
    rig = FollowerRig(tmp_path, leader_timeout=0.5)
    task = asyncio.create_task(rig.actor.run())
    try:
        await rig.hello()
        fatal = await _ended_with(task, PeerGoneError)
        assert "the leader sent no LoadModel within 0.5 s" in str(fatal)
    finally:
        rig.actor.executor.shutdown()
        rig.close()
