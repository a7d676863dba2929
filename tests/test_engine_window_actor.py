"""One engine rank with a sliding window, driven through its sockets (issue 27 item 3): the real
engine and allocator actors, and a fake gpu actor that reports `ModelLoaded.sliding_window` and
keeps a shadow KV cache: every slot remembers which sequence (its seed) wrote which position,
and each query at p must find its own keys p - W < k <= p where the block table says. A block
given back too early, and written by another request, fails the step there.

Requests longer than the whole KV pool complete with the tokens the fake gpu samples, the pool
is whole again at the end, and `taipan replay --check` re-plans the recorded engine and
allocator logs without a divergence (with and without overlapping steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan import replay
from taipan.actors.allocator.actor import AllocatorActor
from taipan.actors.base import Service, ServiceActor
from taipan.actors.channel import make_socket
from taipan.actors.config import InferenceConfig
from taipan.actors.engine.actor import EngineActor
from taipan.actors.record import Recorder, read_log
from taipan.messages.allocator import BlockOps
from taipan.messages.codec import decode
from taipan.messages.gpu import LoadModel, ModelLoaded, StepPlan, StepResult
from taipan.messages.requests import EngineSubmit, SamplingParams, StepOutputs
from taipan.messages.stats import GetStats, Stats

NUM_BLOCKS, BLOCK_SIZE, WINDOW, VOCAB = 6, 4, 7, 500  # 24 tokens of KV; a window of 7 keys
WAIT_S = 10.0


def fake_token(seed: int, position: int) -> int:
    """The token the fake gpu samples for the sequence seeded `seed` at `position`."""
    return (seed * 7 + position * 13) % VOCAB


class FakeGpu(Service):
    """The gpu actor's side of messages/gpu.py: a ModelLoaded with the window, and a StepResult
    per StepPlan from the shadow KV cache (an error result when a query would read a key its
    sequence did not write there)."""

    def __init__(self):
        self.name = "gpu"
        self.handlers = {LoadModel: self._load, StepPlan: self._step}
        self.kv = np.full((NUM_BLOCKS * BLOCK_SIZE, 2), -1, dtype=np.int64)  # (seed, position)
        self.sampled = np.zeros(0, dtype=np.int32)

    def _load(self, msg: LoadModel) -> ModelLoaded:
        return ModelLoaded(
            msg.model, NUM_BLOCKS, BLOCK_SIZE, VOCAB, 4096, "{}", (), 1, sliding_window=WINDOW
        )

    def _step(self, plan: StepPlan) -> StepResult:
        n = len(plan.seq_lens)
        rows = np.repeat(np.arange(n), np.diff(plan.query_start_loc))
        write = plan.slot_mapping >= 0
        self.kv[plan.slot_mapping[write]] = np.stack(
            [plan.seeds[rows][write], plan.positions[write]], axis=1
        )
        for i in range(n):
            start = int(plan.positions[plan.query_start_loc[i]])
            pos = np.arange(max(0, start - WINDOW + 1), int(plan.seq_lens[i]))
            table = plan.block_tables[i].astype(np.int64)
            slots = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            want = np.stack([np.full(len(pos), plan.seeds[i]), pos], axis=1)
            if not np.array_equal(self.kv[slots], want):
                return StepResult(plan.step, np.zeros(0, np.int32), f"row {i} reads a stale key", 0)
        tokens = np.asarray(
            [fake_token(int(s), int(p)) for s, p in zip(plan.seeds, plan.seq_lens, strict=True)],
            dtype=np.int32,
        )
        tokens = np.where(plan.sample == 1, tokens, -1).astype(np.int32)
        self.sampled = tokens
        return StepResult(
            plan.step,
            tokens,
            None,
            0.0,
            log_probs=np.full(n, np.nan, np.float32),
            top_n_ids=np.zeros((n, 0), np.int32),
            top_n_log_probs=np.zeros((n, 0), np.float32),
        )


@contextlib.asynccontextmanager
async def windowed_rank(config: InferenceConfig, record_dir):
    ctx = zmq.asyncio.Context()
    back, alloc, gpu = (f"inproc://window-{kind}" for kind in ("back", "alloc", "gpu"))
    engine_log, alloc_log = Recorder(record_dir, "engine-0"), Recorder(record_dir, "allocator")
    coord = make_socket(ctx, zmq.ROUTER, back, bind=True, name="engines")
    alloc_side = make_socket(ctx, zmq.PAIR, alloc, bind=True, name="engine", recorder=alloc_log)
    gpu_side = make_socket(ctx, zmq.PAIR, gpu, bind=True, name="engine")
    to_alloc = make_socket(ctx, zmq.PAIR, alloc, bind=False, name="allocator", recorder=engine_log)
    to_gpu = make_socket(ctx, zmq.PAIR, gpu, bind=False, name="gpu", recorder=engine_log)
    to_coord = make_socket(
        ctx, zmq.DEALER, back, bind=False, name="coordinator", identity=b"engine-0",
        recorder=engine_log,
    )  # fmt: skip
    load = LoadModel("fake", "float32", "cpu", BLOCK_SIZE, NUM_BLOCKS, 0.01, 16, 4, 256)
    engine = EngineActor(0, config, load, to_coord, to_alloc, to_gpu)
    actors = [AllocatorActor(alloc_side), ServiceActor("gpu", gpu_side, FakeGpu())]
    tasks = [asyncio.create_task(a.run()) for a in (engine, *actors)]
    try:
        yield coord
    finally:
        for a in (engine, *actors):
            a.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        for chan in (coord, alloc_side, gpu_side, to_alloc, to_gpu, to_coord):
            chan.close()
        ctx.term()
        engine_log.close()
        alloc_log.close()


async def recv(coord, kind: type):
    deadline = time.monotonic() + WAIT_S
    while True:
        env = await asyncio.wait_for(coord.recv(), max(deadline - time.monotonic(), 0.01))
        if isinstance(env.msg, kind):
            return env.msg


@pytest.mark.asyncio
@pytest.mark.parametrize("overlap", [False, True])
async def test_requests_longer_than_the_pool_complete_and_replay(tmp_path, overlap):
    config = InferenceConfig(
        block_size_tokens=BLOCK_SIZE,
        max_sequence_length=256,
        max_tokens=16,
        max_requests=4,
        enable_chunked_prefill=True,
        overlap_steps=overlap,
    )
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    # 20 + 40 tokens each (15 blocks) in a pool of 6: each needs 1 + ceil(6 / 4) = 3 at once.
    prompts = {rid: (np.arange(20) * 3 + rid).astype(np.int32) for rid in (1, 2)}
    async with windowed_rank(config, tmp_path) as coord:
        assert (await recv(coord, ModelLoaded)).sliding_window == WINDOW
        for rid, prompt in prompts.items():
            sampling = SamplingParams(max_tokens=40, seed=100 + rid, ignore_eos=True)
            msg = EngineSubmit(rid, prompt, sampling, False, time.time())
            await coord.send(msg, to=b"engine-0")
        done = {}
        while len(done) < len(prompts):
            for out in (await recv(coord, StepOutputs)).decoded():
                if out.finished:
                    done[out.request_id] = out
        for rid, out in done.items():
            assert out.error is None and out.finish_reason == "length", out.error
            want = [fake_token(100 + rid, 20 + j) for j in range(40)]
            assert out.new_token_ids.tolist() == want
        for _ in range(50):  # the last frees ride with a step of their own
            await coord.send(GetStats(), to=b"engine-0")
            rank = (await recv(coord, Stats)).ranks[0]
            if rank.blocks_free == NUM_BLOCKS:
                break
            await asyncio.sleep(0.02)
        assert rank.blocks_free == NUM_BLOCKS
    logs = {name: list(read_log(tmp_path / f"{name}.tplog")) for name in ("engine-0", "allocator")}
    paths = {name: tmp_path / f"{name}.tplog" for name in logs}
    sent = [decode(r.frames) for r in logs["engine-0"] if (r.direction, r.channel) == OPS]
    assert sum(len(m.release_ids) for m in sent if isinstance(m, BlockOps)) > 0
    assert replay.check(logs, paths) == 0


OPS = ("out", "allocator")
