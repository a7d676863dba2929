"""One engine rank alone (engine + allocator + gpu actors, wired as runtime/procs.py wires them),
driven through its coordinator socket by a test ROUTER, on a small random Llama.

Checks what must never be silent: a step that raises fails its requests and the rank goes on;
a scheduler that cannot even do that fails every request and ends the rank with FatalError;
controls run off the receive loop (stats and submissions are answered while a control waits
for the device); the engine sends heartbeats; and the messaging contract: a step's outputs
reach the coordinator as one StepOutputs, however many requests it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan.actors.allocator.actor import AllocatorActor
from taipan.actors.base import FatalError
from taipan.actors.channel import make_socket
from taipan.actors.config import InferenceConfig
from taipan.actors.engine.actor import HEARTBEAT_S, EngineActor
from taipan.actors.engine.scheduler import Scheduler
from taipan.actors.gpu.actor import GpuActor
from taipan.messages.common import Heartbeat, Hello
from taipan.messages.gpu import LoadModel, ModelLoaded, StepPlan
from taipan.messages.lifecycle import ControlAck, Pause, Resume, Suspend, Unpause
from taipan.messages.requests import (
    EngineSubmit,
    FinishReason,
    RequestOutput,
    SamplingParams,
    StepOutputs,
)
from taipan.messages.stats import GetStats, Stats
from tests.random_llama import TINY_SHAPE, make_random_llama

pytest.importorskip("transformers")

CONFIG = InferenceConfig(block_size_tokens=16, max_sequence_length=256, buffer_size_gb=0.01)
WAIT_S = 10.0
_names = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_llama(str(tmp_path_factory.mktemp("engine-llama")), TINY_SHAPE)


@dataclasses.dataclass
class Rank:
    coord: object  # the test's ROUTER, where the engine's DEALER connects
    engine: EngineActor
    gpu: GpuActor
    task: asyncio.Task  # the engine actor's run()
    others: list[asyncio.Task]

    async def recv(self, kind: type = object, timeout: float = WAIT_S):
        """The next message of `kind` from the engine (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            env = await asyncio.wait_for(self.coord.recv(), max(left, 0.01))
            if isinstance(env.msg, kind):
                return env.msg

    async def send(self, msg) -> None:
        await self.coord.send(msg, to=b"engine-0")

    async def submit(self, request_id: int, max_tokens: int = 4, stream: bool = False) -> None:
        prompt = np.arange(3, 3 + 8, dtype=np.int32)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        await self.send(EngineSubmit(request_id, prompt, sampling, stream, time.time()))

    async def terminal(self, ids: set[int]) -> dict[int, RequestOutput]:
        done: dict[int, RequestOutput] = {}
        while set(done) != ids:
            batch = await self.recv(StepOutputs)
            for out in batch.decoded():
                if out.finished:
                    done[out.request_id] = out
        return done


@contextlib.asynccontextmanager
async def engine_rank(model_dir):
    ctx = zmq.asyncio.Context()
    n = next(_names)
    back, alloc, gpu = (f"inproc://{kind}-{n}" for kind in ("back", "alloc", "gpu"))
    coord = make_socket(ctx, zmq.ROUTER, back, bind=True, name="engines")
    alloc_side = make_socket(ctx, zmq.PAIR, alloc, bind=True, name="engine")
    gpu_side = make_socket(ctx, zmq.PAIR, gpu, bind=True, name="engine")
    to_alloc = make_socket(ctx, zmq.PAIR, alloc, bind=False, name="allocator")
    to_gpu = make_socket(ctx, zmq.PAIR, gpu, bind=False, name="gpu")
    to_coord = make_socket(
        ctx, zmq.DEALER, back, bind=False, name="coordinator", identity=b"engine-0"
    )
    load = LoadModel(model_dir, "float32", "cpu", CONFIG.block_size_tokens, 64, 0.01, 256, 16, 256)
    engine = EngineActor(0, CONFIG, load, to_coord, to_alloc, to_gpu)
    gpu_actor = GpuActor(0, gpu_side)
    others = [asyncio.create_task(a.run()) for a in (AllocatorActor(alloc_side), gpu_actor)]
    rank = Rank(coord, engine, gpu_actor, asyncio.create_task(engine.run()), others)
    try:
        assert isinstance(await rank.recv(Hello), Hello)
        assert isinstance(await rank.recv(ModelLoaded), ModelLoaded)
        yield rank
    finally:
        engine.stop()
        gpu_actor.stop()
        for task in others:
            task.cancel()
        await asyncio.gather(rank.task, *others, return_exceptions=True)
        for chan in (coord, alloc_side, gpu_side, to_alloc, to_gpu, to_coord):
            chan.close()
        ctx.term()


@pytest.mark.asyncio
async def test_a_step_that_raises_fails_its_requests_and_the_rank_goes_on(model_dir, monkeypatch):
    from taipan.actors.engine import wire

    real = wire.plan_arrays
    calls = []

    def broken_once(batch, *args):
        calls.append(batch.step)
        if len(calls) == 1:
            raise RuntimeError("boom in planning")
        return real(batch, *args)

    monkeypatch.setattr(wire, "plan_arrays", broken_once)
    async with engine_rank(model_dir) as rank:
        await rank.submit(1)
        await rank.submit(2)
        failed = await rank.terminal({1, 2})
        for out in failed.values():
            assert out.finish_reason is FinishReason.ERROR
            assert out.error == "internal error: RuntimeError: boom in planning"
        await rank.submit(3)
        [ok] = (await rank.terminal({3})).values()
        assert ok.finish_reason is FinishReason.LENGTH and ok.num_generated_tokens == 4
        assert not rank.task.done()


@pytest.mark.asyncio
async def test_a_scheduler_that_cannot_fail_a_step_ends_the_rank_loudly(model_dir, monkeypatch):
    def broken(self, batch, result, now, error=""):
        raise RuntimeError("scheduler state is corrupt")

    monkeypatch.setattr(Scheduler, "update", broken)
    async with engine_rank(model_dir) as rank:
        await rank.submit(1)
        [out] = (await rank.terminal({1})).values()
        assert out.finish_reason is FinishReason.ERROR
        assert "step 1 failed and its requests could not be failed" in out.error
        with pytest.raises(ExceptionGroup) as info:
            await asyncio.wait_for(rank.task, WAIT_S)
        [fatal] = info.value.exceptions
        assert isinstance(fatal, FatalError) and "engine-0: step 1 failed" in str(fatal)


@pytest.mark.asyncio
async def test_controls_leave_the_receive_loop_free(model_dir, monkeypatch):
    """While a slow suspend holds the device, stats and submissions are still answered."""
    async with engine_rank(model_dir) as rank:
        worker = rank.gpu.worker
        release = asyncio.Event()
        loop = asyncio.get_running_loop()
        real = worker.control

        def slow_control(msg):
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(WAIT_S)
            return real(msg)

        monkeypatch.setattr(worker, "control", slow_control)
        await rank.send(Pause(""))
        assert (await rank.recv(ControlAck)).state == "PAUSED"
        await rank.send(Suspend("", "persist"))
        await rank.send(GetStats())
        stats = await rank.recv(Stats, timeout=2.0)  # answered while the suspend waits
        assert stats.state == "PAUSED"
        await rank.submit(7)  # queued (paused), not refused, not blocked
        await rank.send(GetStats())
        assert (await rank.recv(Stats, timeout=2.0)).ranks[0].waiting == 1
        release.set()
        assert (await rank.recv(ControlAck)).state == "SUSPENDED"
        await rank.send(Resume(""))
        assert (await rank.recv(ControlAck)).state == "PAUSED"
        await rank.send(Unpause(""))
        [out] = (await rank.terminal({7})).values()
        assert out.finish_reason is FinishReason.LENGTH


@pytest.mark.asyncio
async def test_the_engine_sends_heartbeats(model_dir):
    async with engine_rank(model_dir) as rank:
        start = time.monotonic()
        first = await rank.recv(Heartbeat, timeout=3 * HEARTBEAT_S)
        second = await rank.recv(Heartbeat, timeout=3 * HEARTBEAT_S)
        assert second.time > first.time and time.monotonic() - start < 4 * HEARTBEAT_S


@pytest.mark.asyncio
async def test_each_step_sends_one_message_with_every_output(model_dir):
    """N streaming requests decoding together: every step's N outputs travel in one StepOutputs
    (and the coordinator socket gets nothing else per step but heartbeats and stats)."""
    n, max_tokens = 5, 4
    async with engine_rank(model_dir) as rank:
        plans = []
        real = rank.engine.gpu.send

        async def counting_send(msg, to=None):
            if isinstance(msg, StepPlan):
                plans.append(msg.step)
            await real(msg, to)

        rank.engine.gpu.send = counting_send
        await rank.send(Pause(""))  # queue all five, then let them run together
        assert (await rank.recv(ControlAck)).state == "PAUSED"
        for request_id in range(1, n + 1):
            await rank.submit(request_id, max_tokens=max_tokens, stream=True)
        await rank.send(Unpause(""))
        batches, done = [], set()
        while len(done) < n:
            msg = await rank.recv()
            if isinstance(msg, StepOutputs):
                batches.append(msg)
                done |= {int(r) for r, f in zip(msg.request_ids, msg.finished, strict=True) if f}
            elif not isinstance(msg, Heartbeat | Stats | ControlAck):
                pytest.fail(f"unexpected message from the engine: {msg}")
    # One prefill step for all five (each samples its first token), then decode steps: every
    # step streams one token of each request, all in one message.
    assert len(batches) == len(plans) == max_tokens
    for batch in batches:
        outputs = batch.decoded()
        assert [o.request_id for o in outputs] == list(range(1, n + 1))
        assert all(len(o.new_token_ids) == 1 for o in outputs)
    assert all(batches[-1].finished) and not any(batches[0].finished)
