"""The engine actor of a hybrid rank in one process (real actors over inproc sockets): a step
whose mamba_cache hop fails ends its requests with errors, hands back every block and slot
the other hop gave them, and the rank goes on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan.actors.allocator.actor import AllocatorActor
from taipan.actors.channel import make_socket
from taipan.actors.config import InferenceConfig
from taipan.actors.engine.actor import EngineActor
from taipan.actors.gpu.actor import GpuActor
from taipan.actors.mamba_cache.actor import MambaCacheActor
from taipan.messages.common import ErrorReply, Hello
from taipan.messages.gpu import LoadModel, ModelLoaded
from taipan.messages.mamba_cache import MambaOps
from taipan.messages.requests import EngineSubmit, FinishReason, SamplingParams, StepOutputs
from taipan.messages.stats import GetStats, Stats
from tests.random_nemotron_h import make_random_nemotron_h

pytest.importorskip("transformers")
CONFIG = InferenceConfig(
    block_size_tokens=16,
    max_sequence_length=256,
    buffer_size_gb=0.01,
    enable_prefix_caching=True,
    prefix_caching_mamba_gb=0.001,
)
WAIT_S = 20.0
_names = itertools.count()


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_random_nemotron_h(str(tmp_path_factory.mktemp("nh")), pattern="M-*-M-")


@contextlib.asynccontextmanager
async def hybrid_rank(path: str):
    ctx = zmq.asyncio.Context()
    n = next(_names)
    back, alloc, gpu, mamba = (f"inproc://{k}-h{n}" for k in ("back", "alloc", "gpu", "mamba"))
    coord = make_socket(ctx, zmq.ROUTER, back, bind=True, name="engines")
    sides = [make_socket(ctx, zmq.PAIR, a, bind=True, name="engine") for a in (alloc, gpu, mamba)]
    to = [
        make_socket(ctx, zmq.PAIR, a, bind=False, name=name)
        for a, name in ((alloc, "allocator"), (gpu, "gpu"), (mamba, "mamba_cache"))
    ]
    to_coord = make_socket(
        ctx, zmq.DEALER, back, bind=False, name="coordinator", identity=b"engine-0"
    )
    load = LoadModel(path, "float32", "cpu", 16, 64, 0.01, 256, 8, 256, mamba_snapshot_gb=0.001)
    engine = EngineActor(0, CONFIG, load, to_coord, to[0], to[1], to[2])
    actors = [AllocatorActor(sides[0]), GpuActor(0, sides[1]), MambaCacheActor(sides[2])]
    tasks = [asyncio.create_task(a.run()) for a in (engine, *actors)]

    async def recv(kind):
        deadline = time.monotonic() + WAIT_S
        while True:
            env = await asyncio.wait_for(coord.recv(), max(deadline - time.monotonic(), 0.01))
            if isinstance(env.msg, kind):
                return env.msg

    try:
        assert isinstance(await recv(Hello), Hello)
        assert isinstance(await recv(ModelLoaded), ModelLoaded)
        yield coord, recv, actors[2], tasks[0]
    finally:
        for a in (engine, *actors):
            a.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        for chan in (coord, *sides, *to, to_coord):
            chan.close()
        ctx.term()


async def _generate(coord, recv, ids: list[int]) -> dict[int, object]:
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for rid in ids:
        prompt = np.arange(3, 3 + 20 + rid, dtype=np.int32)
        msg = EngineSubmit(rid, prompt, sampling, False, time.time())
        await coord.send(msg, to=b"engine-0")
    done = {}
    while set(done) != set(ids):
        for out in (await recv(StepOutputs)).decoded():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.asyncio
async def test_a_failed_mamba_hop_fails_the_step_and_frees_what_the_allocator_gave(hybrid_dir):
    async with hybrid_rank(hybrid_dir) as (coord, recv, mamba_actor, engine_task):
        real = mamba_actor.service.handle
        calls = []

        def error_once(msg):
            if isinstance(msg, MambaOps):
                calls.append(msg.step)
                if len(calls) == 1:
                    return ErrorReply("bad_request", "injected", None)
            return real(msg)

        mamba_actor.service.handle = error_once
        [out] = (await _generate(coord, recv, [1])).values()
        assert out.finish_reason is FinishReason.ERROR and "injected" in out.error
        ok = await _generate(coord, recv, [3])
        assert ok[3].finish_reason is FinishReason.LENGTH and ok[3].num_generated_tokens == 3
        assert not engine_task.done()
        await coord.send(GetStats(), to=b"engine-0")
        [stats] = (await recv(Stats)).ranks
        # Every block and live slot came back (cached prefix blocks count as free: evictable).
        assert stats.blocks_free == stats.num_blocks and stats.mamba_live_free == 8
