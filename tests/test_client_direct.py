"""The direct client (actors/client/direct.py) alone, over real zmq sockets: the public
AsyncClient with `direct=` binds the endpoint, and a scripted engine (tests/test_coordinator_actor)
connects to it as a real engine rank does. Checked: the ModelInfo it builds from ModelLoaded,
requests and streams under the client's own ids, bad submissions refused without reaching the
engine, a malformed StepOutputs entry failing its request (and aborting it on the engine),
stats passed through, lifecycle refused naming the mode, stop_engine, a load failure, and an
engine that goes silent or disconnects failing everything within seconds (and the HTTP app's
/health and /metrics turning 503 then)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import httpx
import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan.actors.channel import make_socket
from taipan.client import AsyncClient, DirectEndpoint, RuntimeUnreachable
from taipan.messages.common import ErrorReply, Hello
from taipan.messages.lifecycle import Stop
from taipan.messages.requests import FinishReason, SamplingParams, StepOutputs
from taipan.server import build_app
from tests.test_coordinator_actor import WAIT_S, ScriptedEngine, finished_output

ENDPOINT = DirectEndpoint("test-model", 64, prefix_caching=False)
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


@contextlib.asynccontextmanager
async def direct(tmp_path, *, timeout: float = 1.0, hello: bool = True):
    """(client, engine): a connected direct client and the scripted engine rank behind it."""
    address = f"ipc://{tmp_path}/engine.sock"
    ctx = zmq.asyncio.Context()
    client = AsyncClient(address, direct=ENDPOINT, timeout=timeout, connect_timeout=WAIT_S)
    chan = make_socket(ctx, zmq.DEALER, address, bind=False, name="coord", identity=b"engine-0")
    engine = ScriptedEngine(chan, heartbeat_s=0.2)
    tasks = [asyncio.ensure_future(engine.run()), asyncio.ensure_future(engine.heartbeats())]
    try:
        if hello:
            await asyncio.gather(client.connect(), engine.hello())
        yield client, engine
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        chan.close()
        ctx.term()


@pytest.mark.asyncio
async def test_requests_streams_and_stats_go_straight_to_the_engine(tmp_path):
    async with direct(tmp_path) as (client, engine):
        info = client.info
        assert (info.model, info.max_sequence_length, info.num_ranks) == ("test-model", 64, 1)
        assert (info.block_size, info.kv_cache_tokens, info.weight_version) == (16, 256, 0)
        [a, b] = await client.generate([[1, 2, 3], "hi"], GREEDY)
        assert a.token_ids == b.token_ids == [5, 6] and a.finish_reason == FinishReason.LENGTH
        assert [s.request_id for s in engine.submits] == [1, 2]  # the client's own ids
        assert engine.submits[1].prompt_token_ids.tolist() == client.tokenizer.encode("hi")
        deltas = [d async for d in client.stream([1, 2, 3], GREEDY)]
        assert [d.token_ids for d in deltas] == [[5], [6]] and deltas[-1].finished
        assert engine.submits[-1].stream
        stats = await client.stats()
        assert stats.ranks[0].rank == 0


@pytest.mark.asyncio
async def test_bad_submissions_never_reach_the_engine(tmp_path):
    async with direct(tmp_path) as (client, engine):
        [empty, bad] = await asyncio.gather(
            client.generate([[]], GREEDY, raise_on_error=False),
            client.generate([[1]], SamplingParams(max_tokens=0), raise_on_error=False),
        )
        assert "the prompt is empty" in empty[0].error
        assert "max_tokens must be >= 1" in bad[0].error
        assert engine.submits == []


@pytest.mark.asyncio
async def test_a_malformed_output_fails_its_request_and_aborts_it(tmp_path):
    async with direct(tmp_path) as (client, engine):
        engine.hold_submits = True
        job = asyncio.ensure_future(client.generate([[1, 2]], GREEDY, raise_on_error=False))
        await engine.until(lambda: engine.submits)
        sub = engine.submits[0]
        other = finished_output(dataclasses.replace(sub, request_id=99))
        # Filed under this request's id, but carrying another request's output.
        ids, finished = np.array([sub.request_id], np.int64), np.array([True])
        wrong = StepOutputs(ids, finished, StepOutputs.of([other]).outputs)
        await engine.send(wrong)
        [out] = await asyncio.wait_for(job, WAIT_S)
        assert out.finish_reason == FinishReason.ERROR
        assert "engine rank 0 sent a malformed output" in out.error
        await engine.until(lambda: engine.aborts == [sub.request_id])


@pytest.mark.asyncio
async def test_lifecycle_is_refused_and_stop_engine_stops_it(tmp_path):
    async with direct(tmp_path) as (client, engine):
        for call in (client.pause, client.unpause, client.resume, client.stop):
            with pytest.raises(RuntimeError, match="in direct mode .* no coordinator owns"):
                await call()
        with pytest.raises(RuntimeError, match="direct mode"):
            await client.suspend("offload")
        assert engine.controls == []
        assert await client.stop_engine(timeout=WAIT_S)
        assert isinstance(engine.controls[-1], Stop)


@pytest.mark.asyncio
async def test_a_silent_engine_fails_everything_within_its_timeout(tmp_path):
    async with direct(tmp_path, timeout=0.5) as (client, engine):
        engine.hold_submits = True
        job = asyncio.ensure_future(client.generate([[1, 2]], GREEDY, raise_on_error=False))
        await engine.until(lambda: engine.submits)
        engine.silent = True  # no more heartbeats: a hung process
        [out] = await asyncio.wait_for(job, WAIT_S)
        assert "engine rank 0 died: sent nothing for" in out.error
        with pytest.raises(RuntimeUnreachable, match="engine rank 0 died"):
            await client.stats()
        [late] = await client.generate([[1]], GREEDY, raise_on_error=False)
        assert "engine rank 0 died" in late.error


@pytest.mark.asyncio
async def test_a_closed_engine_connection_fails_its_requests(tmp_path):
    async with direct(tmp_path) as (client, engine):
        engine.hold_submits = True
        job = asyncio.ensure_future(client.generate([[1, 2]], GREEDY, raise_on_error=False))
        await engine.until(lambda: engine.submits)
        engine.chan.close()  # as a dying process's socket closes
        [out] = await asyncio.wait_for(job, WAIT_S)
        assert out.error == "engine rank 0 died: its connection closed"


@pytest.mark.asyncio
async def test_a_load_failure_fails_connect(tmp_path):
    async with direct(tmp_path, hello=False) as (client, engine):
        connect = asyncio.ensure_future(client.connect())
        await engine.send(Hello("engine", 0))
        await engine.send(ErrorReply("load_failed", "no such checkpoint", None))
        with pytest.raises(RuntimeError, match="model load failed: no such checkpoint"):
            await asyncio.wait_for(connect, WAIT_S)


@pytest.mark.asyncio
async def test_health_and_metrics_turn_503_when_the_runtime_is_gone(tmp_path):
    async with direct(tmp_path) as (client, engine):
        app = build_app(client, served_model_name="M")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            assert (await http.get("/health")).status_code == 200
            ok = await http.get("/metrics")
            assert ok.status_code == 200 and "taipan_requests_running" in ok.text
            engine.chan.close()
            await asyncio.sleep(0.2)  # the disconnect is noticed
            health, gone = await http.get("/health"), await http.get("/metrics")
            assert health.status_code == gone.status_code == 503
            assert "engine rank 0 died" in gone.text
