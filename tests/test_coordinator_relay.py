"""How the coordinator relays outputs to a client that said Hello("client") (what the client
actor does; actors/coordinator/relay.py): one StepOutputs per engine step
with that client's entries under its own ids and the engine's frames unread, while a client that
said nothing keeps getting one renumbered RequestOutput per output. The client actor checks
each entry: a bad one fails its request alone and aborts it in the engine. The replay checker
mirrors which entries the coordinator read. Over real zmq sockets, with the scripted engine of
tests/test_coordinator_actor.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zmq

from taipan.actors.channel import make_socket
from taipan.actors.client.actor import ClientActor
from taipan.actors.coordinator.check import CLIENTS, ENGINES
from taipan.messages.codec import encode_frame
from taipan.messages.common import ErrorReply, Heartbeat, Hello
from taipan.messages.requests import RequestOutput, SamplingParams, StepOutputs
from tests.test_coordinator_actor import (
    WAIT_S,
    assert_silent,
    finished_output,
    held_requests,
    outputs_for,
    receive,
    running,
)
from tests.test_coordinator_check import E0, ROUND_ROBIN, Log, check


@pytest.fixture
def addresses(tmp_path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/front.sock", f"ipc://{tmp_path}/back.sock"


@pytest.mark.asyncio
async def test_a_client_that_said_hello_gets_one_step_outputs_per_step(addresses):
    async with running(addresses) as h:
        batched = h.connect(identity=b"batched")
        await batched.send(Hello("client", -1))
        plain = h.client
        mine, theirs = await held_requests(h, [batched, plain], stream=True)
        first, last = outputs_for(mine)
        their_first, _ = outputs_for(theirs)
        # One step: a delta of each, then my request's end; then a step of theirs alone.
        step = StepOutputs.of([first, their_first, last])
        await h.engine.send(step)
        got = await receive(batched)
        assert isinstance(got, StepOutputs) and got.request_ids.tolist() == [1, 1]
        assert got.finished.tolist() == [False, True]
        assert got.outputs == (step.outputs[0], step.outputs[2])  # the engine's bytes, unread
        delta = await receive(plain)  # renumbered, one message per output
        assert isinstance(delta, RequestOutput) and delta.request_id == 1 and not delta.finished
        await assert_silent(batched, 0.2)
        assert list(h.actor.core.routes) == [theirs.request_id]  # mine ended: forgotten
        await h.engine.send(StepOutputs.of([finished_output(theirs)]))
        done = await receive(plain)
        assert done.request_id == 1 and done.finished and done.new_token_ids.tolist() == [5, 6]
        await assert_silent(batched, 0.2)


@pytest.mark.asyncio
async def test_any_other_hello_from_a_client_is_refused(addresses):
    async with running(addresses) as h:
        refusal = await h.ask(Hello("engine", 0))
        assert isinstance(refusal, ErrorReply) and refusal.code == "unexpected_message"
        assert h.actor.links.engines == {0: b"engine-0"} and h.actor.batch_clients == set()


@pytest.mark.asyncio
async def test_the_client_actor_fails_a_bad_entry_alone_and_aborts_it(addresses):
    async with running(addresses) as h:
        h.engine.hold_submits = True
        client = ClientActor(make_socket(h.ctx, zmq.DEALER, addresses[0], bind=False, name="c"))
        h.channels.append(client.channel)
        task = asyncio.create_task(client.run())
        try:
            await client.model_info()  # after the client's Hello (the same connection)
            queues = []
            for _ in range(3):
                prompt = np.array([1, 2, 3], np.int32)
                queues.append((await client.submit(prompt, SamplingParams(), True))[1])
            await h.engine.until(lambda: len(h.engine.submits) == 3)
            a, b, c = (finished_output(s) for s in h.engine.submits)
            frames = (
                encode_frame(Heartbeat(1.0)),  # not a RequestOutput
                encode_frame(b),
                encode_frame(RequestOutput(c.request_id, c.new_token_ids, False, None, None, 3, 2)),
            )
            ids = np.array([a.request_id, b.request_id, c.request_id], np.int64)
            # c's frame is no end though its entry says so; a's is no output at all.
            await h.engine.send(StepOutputs(ids, np.array([False, True, True]), frames))
            outs = [await asyncio.wait_for(q.get(), WAIT_S) for q in queues]
            assert [o.request_id for o in outs] == [1, 2, 3]
            assert [o.finish_reason for o in outs] == ["error", "length", "error"]
            assert "malformed output" in outs[0].error and "Heartbeat" in outs[0].error
            assert outs[1].new_token_ids.tolist() == [5, 6] and outs[1].ttft == 0.125
            # a's route was open: its abort reaches the engine; c's ended with its entry.
            await h.engine.until(lambda: h.engine.aborts == [a.request_id])
            assert client.queues == {}
        finally:
            client.stop()
            await task


def test_replay_reads_only_the_entries_the_coordinator_read():
    """An entry for a client that said Hello is routed by the arrays alone, also in replay: a
    bad frame does not end its route there (the client ends it, with an abort)."""
    for hello in (False, True):
        log = Log(ranks=(E0,))
        if hello:
            log.arrive(CLIENTS, b"client-a", Hello("client", -1))
        sub, arrived = log.submit(1, [1, 2, 3], hashed=False)
        log.route(sub, arrived, 1, E0)
        bad = StepOutputs(np.array([1], np.int64), np.array([False]), (b"\xc1",))
        log.arrive(ENGINES, E0, bad)
        what, replay = check(log.records, ROUND_ROBIN)
        assert what is None
        assert list(replay.core.routes) == ([1] if hello else [])
