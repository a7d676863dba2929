"""The engine actor: one rank's step loop, a thin shell around the Scheduler.

Channels: `coord` (DEALER to the coordinator; served: EngineSubmit, AbortRequest, Stop),
`alloc` and `gpu` (PAIR over inproc; called by the step loop only, one message each way per
step). The engine never touches tensors or the block pool itself: it plans, the allocator hands
out blocks, the gpu actor computes.
"""

from __future__ import annotations

import asyncio

import numpy as np

from actors.engine.request import EngineRequest
from actors.engine.scheduler import Scheduler, StepBatch, derive_seed
from messages.allocator import AllocatorInit, AllocatorReady, BlockOps, BlockOpsReply
from messages.common import ErrorReply, Hello
from messages.gpu import LoadModel, ModelLoaded, StepPlan, StepResult
from messages.lifecycle import Stop, StopAck
from messages.requests import AbortRequest, EngineSubmit, RequestOutput
from runtime.actor import Actor
from runtime.channel import Channel, Envelope
from runtime.config import InferenceConfig, RuntimePlan, plan_limits

NO_TOKENS = np.zeros(0, dtype=np.int32)


class EngineError(RuntimeError):
    pass


class EngineActor(Actor):
    def __init__(
        self,
        rank: int,
        config: InferenceConfig,
        load: LoadModel,
        coord: Channel,
        alloc: Channel,
        gpu: Channel,
    ):
        super().__init__(f"engine-{rank}")
        self.rank = rank
        self.config = config
        self.load = load
        self.coord, self.alloc, self.gpu = coord, alloc, gpu
        self.scheduler: Scheduler | None = None
        self.vocab_size = 0
        self.work = asyncio.Event()
        self.serve(coord)
        self.on(EngineSubmit, self.on_submit)
        self.on(AbortRequest, self.on_abort)
        self.on(Stop, self.on_stop)

    async def started(self) -> None:
        await self.coord.send(Hello("engine", self.rank))
        self.spawn(self._boot_then_loop())

    # --- boot ---------------------------------------------------------------------------------

    async def _call(self, channel: Channel, msg, expect: type):
        await channel.send(msg)
        env = await channel.recv()
        if isinstance(env.msg, expect):
            return env.msg
        if isinstance(env.msg, ErrorReply):
            raise EngineError(f"{channel.name}: {env.msg.text}")
        raise EngineError(f"{channel.name}: expected {expect.__name__}, got {env.msg or env.error}")

    async def _boot_then_loop(self) -> None:
        try:
            loaded = await self._call(self.gpu, self.load, ModelLoaded)
            ready = await self._call(
                self.alloc, AllocatorInit(loaded.num_blocks, loaded.block_size), AllocatorReady
            )
        except EngineError as e:
            self.log.error("model load failed", error=str(e))
            await self.coord.send(ErrorReply("load_failed", str(e), None))
            return
        max_requests, max_tokens = plan_limits(self.config)
        if self.config.max_sequence_length > loaded.max_position_embeddings:
            text = (
                f"max_sequence_length ({self.config.max_sequence_length}) exceeds the model's "
                f"max_position_embeddings ({loaded.max_position_embeddings})"
            )
            await self.coord.send(ErrorReply("load_failed", text, None))
            return
        plan = RuntimePlan(
            num_blocks=ready.num_blocks,
            block_size=loaded.block_size,
            max_requests=max_requests,
            max_tokens=max_tokens,
            max_sequence_length=self.config.max_sequence_length,
            eos_token_ids=tuple(loaded.eos_token_ids),
        )
        self.vocab_size = loaded.vocab_size
        self.scheduler = Scheduler(plan, self.config.enable_chunked_prefill)
        self.log.info("engine ready", num_blocks=plan.num_blocks, max_tokens=plan.max_tokens)
        await self.coord.send(loaded)
        await self._step_loop()

    # --- handlers -----------------------------------------------------------------------------

    async def on_submit(self, env: Envelope, msg: EngineSubmit) -> None:
        prompt = msg.prompt_token_ids
        problem = None
        if self.scheduler is None:
            problem = "the engine has no model loaded"
        elif prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            problem = "prompt_token_ids must be a 1-D integer array"
        elif prompt.size and (prompt.min() < 0 or prompt.max() >= self.vocab_size):
            problem = f"prompt token ids must be in [0, {self.vocab_size})"
        else:
            problem = self.scheduler.check(len(prompt), msg.sampling)
        if problem is not None:
            await self.coord.send(
                RequestOutput(msg.request_id, NO_TOKENS, True, "error", problem, len(prompt), 0)
            )
            return
        seed = msg.sampling.seed
        if seed is None:
            seed = derive_seed(msg.request_id, msg.arrival_time)
        req = EngineRequest(
            msg.request_id,
            prompt.astype(np.int32),
            msg.sampling,
            msg.stream,
            msg.arrival_time,
            seed,
        )
        self.scheduler.add(req)
        self.work.set()

    async def on_abort(self, env: Envelope, msg: AbortRequest) -> None:
        if self.scheduler is None:
            return
        ended = self.scheduler.abort(msg.request_id)
        if ended is not None:
            await self._emit([ended])
        self.work.set()

    async def on_stop(self, env: Envelope, msg: Stop) -> None:
        if self.scheduler is not None:
            await self._emit(self.scheduler.fail_all("abort"))
        await self.coord.send(StopAck(self.name))
        self.stop()

    # --- the step loop ------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        sched = self.scheduler
        assert sched is not None
        interval = self.config.logging_step_interval
        while True:
            await self.work.wait()
            if not sched.has_work():
                self.work.clear()
                continue
            batch = sched.schedule()
            await self._emit(batch.ended)
            if not batch.chunks and not batch.free_ids:
                # Work exists but nothing fits this step (cannot happen with reservations);
                # wait for an abort or a finish to change that rather than spinning.
                self.work.clear()
                continue
            await self._run_step(batch)
            if interval and sched.step % interval == 0:
                self.log.info(
                    "stats",
                    step=sched.step,
                    running=len(sched.running),
                    waiting=len(sched.waiting),
                    blocks_free=sched.num_free_blocks,
                    tokens=batch.num_tokens,
                )

    async def _run_step(self, batch: StepBatch) -> None:
        sched = self.scheduler
        counts = np.asarray([c.new_blocks for c in batch.chunks if c.new_blocks], np.int32)
        ids = np.asarray([c.request.request_id for c in batch.chunks if c.new_blocks], np.int64)
        ops = BlockOps(batch.step, np.asarray(batch.free_ids, np.int64), ids, counts)
        try:
            if len(ids) or batch.free_ids:  # no block changes: no allocator hop this step
                reply = await self._call(self.alloc, ops, BlockOpsReply)
                if not reply.ok:
                    sched.num_free_blocks = reply.num_free
                    raise EngineError(f"allocator refused a planned step: {reply.error}")
                sched.assign_blocks(batch, reply.block_ids, reply.num_free)
            if not batch.chunks:
                return
            plan = StepPlan(step=batch.step, **sched.plan_arrays(batch))
            result = await self._call(self.gpu, plan, StepResult)
            if result.error is not None:
                raise EngineError(f"forward failed: {result.error}")
        except EngineError as e:
            # The step's requests fail (each gets its terminal output); the engine keeps serving.
            self.log.error("step failed", step=batch.step, error=str(e))
            await self._emit(sched.update(batch, None, error=str(e)))
            return
        await self._emit(sched.update(batch, result.token_ids))

    async def _emit(self, requests: list[EngineRequest]) -> None:
        for r in requests:
            new = np.asarray(r.generated[r.num_streamed :], dtype=np.int32)
            r.num_streamed = len(r.generated)
            finished = r.finish_reason is not None
            await self.coord.send(
                RequestOutput(
                    r.request_id,
                    new,
                    finished,
                    r.finish_reason,
                    r.error,
                    len(r.prompt),
                    len(r.generated),
                )
            )
