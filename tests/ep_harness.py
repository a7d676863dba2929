"""An expert-parallel group of engine ranks in one process, for tests: real engine and allocator
actors, real consensus sockets (inproc), and fake gpu actors whose every forward (real or dummy)
meets the peers' at a shared `Lockstep`, as the MoE token exchange makes real gpu actors do. A
group that steps out of lockstep (one rank forwards while another does not) shows as a forward
left waiting: `Lockstep.stalls` records it, with the bound `LOCKSTEP_WAIT_S`.

Fake tokens: row b of a step samples `token_for(seq_lens[b])`, a function of its context length
only, so a request's tokens are known in advance whatever the batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time

import numpy as np
import zmq
import zmq.asyncio

from taipan.actors.allocator.actor import AllocatorActor
from taipan.actors.base import Actor
from taipan.actors.channel import Channel, Envelope, make_socket
from taipan.actors.config import InferenceConfig
from taipan.actors.engine.actor import EngineActor
from taipan.actors.engine.ep import EpConsensus, ep_identity
from taipan.messages.common import Hello
from taipan.messages.gpu import (
    GpuControl,
    GpuControlReply,
    LoadModel,
    ModelLoaded,
    StepPlan,
    StepResult,
)
from taipan.messages.requests import EngineSubmit, RequestOutput, SamplingParams, StepOutputs

WAIT_S = 20.0
LOCKSTEP_WAIT_S = 5.0
VOCAB = 256
_names = itertools.count()


def token_for(context_len: int) -> int:
    return 10 + (context_len * 31) % 200


class Lockstep:
    """The group's forwards, in order: forward i of every rank must meet forward i of the
    others (the collective). `log[i]` = {rank: "real" | "dummy"}."""

    def __init__(self, ranks: tuple[int, ...], delay: float = 0.0):
        self.ranks = ranks
        self.delay = delay  # seconds each forward takes
        self.count = dict.fromkeys(ranks, 0)
        self.log: list[dict[int, str]] = []
        self.met: list[asyncio.Event] = []
        self.stalls: list[str] = []

    async def meet(self, rank: int, kind: str) -> None:
        i = self.count[rank]
        self.count[rank] += 1
        while len(self.log) <= i:
            self.log.append({})
            self.met.append(asyncio.Event())
        self.log[i][rank] = kind
        if len(self.log[i]) == len(self.ranks):
            self.met[i].set()
        try:
            await asyncio.wait_for(self.met[i].wait(), LOCKSTEP_WAIT_S)
        except TimeoutError:
            self.stalls.append(f"forward {i}: only {sorted(self.log[i])} arrived")
            raise
        if self.delay:
            await asyncio.sleep(self.delay)

    def kinds(self, rank: int) -> list[str]:
        return [f[rank] for f in self.log if rank in f]


class FakeGpu(Actor):
    """A gpu actor without a model: answers every forward after meeting the peers."""

    def __init__(self, rank: int, channel: Channel, lockstep: Lockstep):
        super().__init__(f"gpu-{rank}")
        self.rank, self.lockstep = rank, lockstep
        self.controls: list[GpuControl] = []
        self.fail_control: str | None = None  # the next control's error (tests)
        self.fail_step: str | None = None  # the next real step's error (tests)
        self.weight_version = 0
        self.serve(channel)
        self.on(LoadModel, self.on_load)
        self.on(StepPlan, self.on_step)
        self.on(GpuControl, self.on_control)

    async def on_load(self, env: Envelope, msg: LoadModel) -> None:
        await env.reply(ModelLoaded(msg.model, 64, msg.block_size, VOCAB, 4096, "", (), 1024))

    async def on_step(self, env: Envelope, msg: StepPlan) -> None:
        kind = "dummy" if len(msg.seq_lens) == 0 else "real"
        try:
            await self.lockstep.meet(self.rank, kind)
        except TimeoutError:
            no = np.full(len(msg.sample), -1, np.int32)
            await env.reply(StepResult(msg.step, no, "lockstep broken", 0.0))
            return
        tokens = np.where(msg.sample != 0, [token_for(n) for n in msg.seq_lens], -1)
        error = None
        if kind == "real":
            error, self.fail_step = self.fail_step, None
        await env.reply(StepResult(msg.step, tokens.astype(np.int32), error, 0.0))

    async def on_control(self, env: Envelope, msg: GpuControl) -> None:
        self.controls.append(msg)
        error, self.fail_control = self.fail_control, None
        if error is None and msg.command in ("update_weights", "commit_weights"):
            self.weight_version += 1
        await env.reply(GpuControlReply(msg.command, error, True, self.weight_version))


@dataclasses.dataclass
class Group:
    coord: Channel  # the test's ROUTER, where every engine's DEALER connects
    engines: list[EngineActor]
    gpus: list[FakeGpu]
    lockstep: Lockstep
    tasks: list[asyncio.Task]
    inbox: asyncio.Queue  # (rank, message) from the engines, in arrival order

    async def recv(self, kind: type = object, rank: int | None = None, timeout: float = WAIT_S):
        """The next message of `kind` (from `rank`, if given); others stay queued."""
        deadline = time.monotonic() + timeout
        skipped = []
        try:
            while True:
                left = max(deadline - time.monotonic(), 0.01)
                r, msg = await asyncio.wait_for(self.inbox.get(), left)
                if isinstance(msg, kind) and rank in (None, r):
                    return r, msg
                skipped.append((r, msg))
        finally:
            for item in skipped:
                self.inbox.put_nowait(item)  # (order among the skipped is kept)

    async def idle(self, timeout: float = WAIT_S) -> None:
        """Until every engine has agreed that the group is idle (each waits for a reason)."""
        deadline = time.monotonic() + timeout
        while not all(e.ep_driver.schedule.idle for e in self.engines):
            assert time.monotonic() < deadline, "the group did not go idle"
            await asyncio.sleep(0.01)

    async def send(self, rank: int, msg) -> None:
        await self.coord.send(msg, to=f"engine-{rank}".encode())

    async def submit(self, rank: int, request_id: int, max_tokens: int, prompt_len: int = 6):
        prompt = np.arange(3, 3 + prompt_len, dtype=np.int32)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        await self.send(rank, EngineSubmit(request_id, prompt, sampling, False, time.time()))

    async def terminal(self, ids: set[int], timeout: float = WAIT_S) -> dict[int, RequestOutput]:
        done: dict[int, RequestOutput] = {}
        while set(done) != ids:
            _, batch = await self.recv(StepOutputs, timeout=timeout)
            for out in batch.decoded():
                if out.finished:
                    done[out.request_id] = out
        return done


def expected_tokens(prompt_len: int, max_tokens: int) -> list[int]:
    return [token_for(prompt_len + i) for i in range(max_tokens)]


@contextlib.asynccontextmanager
async def ep_group(
    config: InferenceConfig, size: int = 2, *, record: dict | None = None, step_delay: float = 0.0
):
    """`size` engine ranks forming one expert-parallel group. `record`: rank -> Recorder;
    `step_delay`: seconds each forward takes."""
    ctx = zmq.asyncio.Context()
    n = next(_names)
    ranks = tuple(range(size))
    back = f"inproc://ep-back-{n}"
    coord = make_socket(ctx, zmq.ROUTER, back, bind=True, name="engines")
    lockstep = Lockstep(ranks, step_delay)
    channels, engines, gpus, others = [coord], [], [], []
    inboxes = {
        r: make_socket(ctx, zmq.ROUTER, f"inproc://ep-{n}-{r}", bind=True, name="ep",
                       recorder=(record or {}).get(r))
        for r in ranks
    }  # fmt: skip
    channels += inboxes.values()
    for r in ranks:
        rec = (record or {}).get(r)
        alloc, gpu = f"inproc://ep-alloc-{n}-{r}", f"inproc://ep-gpu-{n}-{r}"
        alloc_side = make_socket(ctx, zmq.PAIR, alloc, bind=True, name="engine")
        gpu_side = make_socket(ctx, zmq.PAIR, gpu, bind=True, name="engine")
        to_alloc = make_socket(ctx, zmq.PAIR, alloc, bind=False, name="allocator", recorder=rec)
        to_gpu = make_socket(ctx, zmq.PAIR, gpu, bind=False, name="gpu", recorder=rec)
        to_coord = make_socket(
            ctx, zmq.DEALER, back, bind=False, name="coordinator",
            identity=f"engine-{r}".encode(), recorder=rec,
        )  # fmt: skip
        peers = {
            p: make_socket(ctx, zmq.DEALER, f"inproc://ep-{n}-{p}", bind=False, name=f"ep-{p}",
                           identity=ep_identity(r), recorder=rec)
            for p in ranks if p != r
        }  # fmt: skip
        channels += [alloc_side, gpu_side, to_alloc, to_gpu, to_coord, *peers.values()]
        group = EpConsensus(r, ranks, inboxes[r], peers)
        load = LoadModel("fake", "float32", "cpu", config.block_size_tokens, 64, 0.01, 256, 16, 256)
        engine = EngineActor(r, config, load, to_coord, to_alloc, to_gpu, ep=group)
        gpu_actor = FakeGpu(r, gpu_side, lockstep)
        engines.append(engine)
        gpus.append(gpu_actor)
        others += [AllocatorActor(alloc_side), gpu_actor]
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump():
        while True:
            env = await coord.recv()
            rank = int(env.sender.decode().split("-")[1])
            inbox.put_nowait((rank, env.msg))

    tasks = [asyncio.create_task(a.run()) for a in (*engines, *others)]
    tasks.append(asyncio.create_task(pump()))
    group = Group(coord, engines, gpus, lockstep, tasks, inbox)
    try:
        for r in ranks:
            await group.recv(Hello, rank=r)
            await group.recv(ModelLoaded, rank=r)
        yield group
    finally:
        for a in (*engines, *others):
            a.stop()
        tasks[-1].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for chan in channels:
            chan.close()
        ctx.term()
