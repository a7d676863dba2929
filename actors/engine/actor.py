"""The engine actor: one rank's step loop, a thin shell around the Scheduler.

Channels: `coord` (DEALER to the coordinator; served: EngineSubmit, AbortRequest, GetStats and
the lifecycle controls), `alloc` and `gpu` (PAIR over inproc; one message each way per step,
and the gpu control calls between steps). The engine never touches tensors or the block pool
itself: it plans, the allocator hands out blocks, the gpu actor computes.

Lifecycle (the coordinator's FSM decides what is legal; the engine re-checks its own state):
PAUSE waits for the step in flight and stops stepping (requests keep their KV, submissions
queue); SUSPEND / RESUME / UPDATE_WEIGHTS go to the gpu actor (a "recompute" resume makes every
request recompute its KV); UNPAUSE starts stepping again. Each is answered with a ControlAck.
Time: every decision uses the time of the inbound message that caused it (`self.now`), so a
replay of the same messages makes the same decisions.
"""

from __future__ import annotations

import asyncio

import numpy as np

from taipan.actors.base import Actor
from taipan.actors.channel import Channel, Envelope
from taipan.actors.config import InferenceConfig
from taipan.actors.engine.plan import (
    BootError,
    block_ops,
    new_scheduler,
    runtime_plan,
    step_plan,
    submission,
)
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.scheduler import Scheduler, StepBatch
from taipan.messages.allocator import AllocatorInit, AllocatorReady, BlockOpsReply
from taipan.messages.common import ErrorReply, Hello
from taipan.messages.gpu import GpuControl, GpuControlReply, LoadModel, ModelLoaded, StepResult
from taipan.messages.lifecycle import (
    ControlAck,
    Pause,
    Resume,
    Stop,
    StopAck,
    Suspend,
    Unpause,
    UpdateWeights,
)
from taipan.messages.requests import AbortRequest, EngineSubmit, RequestOutput
from taipan.messages.stats import GetStats, RankStats, Stats

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
        self.now = 0.0  # time of the last inbound message (see module docstring)
        self.state = "RUNNING"
        self.weight_version = 0
        self.in_flight = False
        self.device_lock = asyncio.Lock()  # one user of the alloc/gpu channels at a time
        self.tokens_last_step = 0
        self.serve(coord)
        for msg_type, handler in [
            (EngineSubmit, self.on_submit),
            (AbortRequest, self.on_abort),
            (Stop, self.on_stop),
            (GetStats, self.on_get_stats),
            (Pause, self.on_pause),
            (Unpause, self.on_unpause),
            (Suspend, self.on_suspend),
            (Resume, self.on_resume),
            (UpdateWeights, self.on_update_weights),
        ]:
            self.on(msg_type, handler)

    async def dispatch(self, env: Envelope) -> None:
        self.now = env.time  # every inbound message sets the clock (see actors/engine/check.py)
        await super().dispatch(env)

    async def started(self) -> None:
        await self.coord.send(Hello("engine", self.rank))
        self.spawn(self._boot_then_loop())

    # --- boot ---------------------------------------------------------------------------------

    async def _call(self, channel: Channel, msg, expect: type):
        await channel.send(msg)
        env = await channel.recv()
        self.now = env.time
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
        try:
            plan = runtime_plan(self.config, loaded, ready)
        except BootError as e:
            await self.coord.send(ErrorReply("load_failed", str(e), None))
            return
        self.vocab_size = loaded.vocab_size
        self.scheduler = new_scheduler(self.config, plan)
        self.log.info("engine ready", num_blocks=plan.num_blocks, max_tokens=plan.max_tokens)
        await self.coord.send(loaded)
        await self._step_loop()

    # --- requests -----------------------------------------------------------------------------

    async def on_submit(self, env: Envelope, msg: EngineSubmit) -> None:
        req, problem = submission(self.scheduler, self.vocab_size, msg)
        if req is None:
            n = len(msg.prompt_token_ids)
            await self.coord.send(
                RequestOutput(msg.request_id, NO_TOKENS, True, "error", problem, n, 0)
            )
            return
        self.scheduler.add(req, env.time)
        self.work.set()

    async def on_abort(self, env: Envelope, msg: AbortRequest) -> None:
        if self.scheduler is None:
            return
        ended = self.scheduler.abort(msg.request_id, self.in_flight, env.time)
        if ended is not None:
            await self._emit([ended])
        self.work.set()

    async def on_stop(self, env: Envelope, msg: Stop) -> None:
        async with self.device_lock:  # let the step in flight finish and report
            if self.scheduler is not None:
                await self._emit(self.scheduler.fail_all("abort", env.time))
            await self.coord.send(StopAck(self.name))
            self.stop()

    async def on_get_stats(self, env: Envelope, msg: GetStats) -> None:
        await env.reply(self._stats())

    def _stats(self) -> Stats:
        s = self.scheduler.stats() if self.scheduler is not None else None
        if s is None:
            return Stats(self.state, ())
        rank = RankStats(
            self.rank,
            self.state,
            s["step"],
            s["running"],
            s["waiting"],
            s["paused"],
            self.scheduler.plan.num_blocks,
            s["blocks_free"],
            s["blocks_used"],
            s["paused_total"],
            s["evicted_total"],
            self.tokens_last_step,
            self.weight_version,
        )
        return Stats(self.state, (rank,))

    # --- lifecycle ----------------------------------------------------------------------------

    async def _refuse(self, env: Envelope, command: str, legal_in: str) -> bool:
        if self.state == legal_in and self.scheduler is not None:
            return False
        text = f"{self.name}: {command} is illegal while {self.state}"
        if self.scheduler is None:
            text = f"{self.name}: {command} before the model is loaded"
        await env.reply(ErrorReply("illegal_transition", text, None))
        return True

    async def _ack(self, env: Envelope, command: str) -> None:
        await env.reply(ControlAck(command, self.state, self.weight_version))

    async def on_pause(self, env: Envelope, msg: Pause) -> None:
        if await self._refuse(env, "pause", "RUNNING"):
            return
        self.state = "PAUSED"
        async with self.device_lock:  # the step in flight ends before the ack
            await self._ack(env, "pause")

    async def on_unpause(self, env: Envelope, msg: Unpause) -> None:
        if await self._refuse(env, "unpause", "PAUSED"):
            return
        self.state = "RUNNING"
        self.work.set()
        await self._ack(env, "unpause")

    async def _gpu_control(self, env: Envelope, command: str, msg: GpuControl):
        """Run one gpu control call between steps; an error goes back to the coordinator."""
        async with self.device_lock:
            try:
                reply = await self._call(self.gpu, msg, GpuControlReply)
            except EngineError as e:
                reply = GpuControlReply(command, str(e), True, self.weight_version)
        if reply.error is not None:
            await env.reply(ErrorReply("control_failed", f"{command}: {reply.error}", None))
            return None
        return reply

    async def on_suspend(self, env: Envelope, msg: Suspend) -> None:
        if await self._refuse(env, "suspend", "PAUSED"):
            return
        mode = msg.mode or self.config.kv_cache_management_mode or "persist"
        if await self._gpu_control(env, "suspend", GpuControl("suspend", str(mode), None, None)):
            self.state = "SUSPENDED"
            await self._ack(env, "suspend")

    async def on_resume(self, env: Envelope, msg: Resume) -> None:
        if await self._refuse(env, "resume", "SUSPENDED"):
            return
        reply = await self._gpu_control(env, "resume", GpuControl("resume", None, None, None))
        if reply is not None:
            if not reply.kv_valid:
                self.scheduler.invalidate_kv()
            self.state = "PAUSED"
            await self._ack(env, "resume")

    async def on_update_weights(self, env: Envelope, msg: UpdateWeights) -> None:
        if await self._refuse(env, "update_weights", "SUSPENDED"):
            return
        control = GpuControl("update_weights", None, msg.path, msg.state)
        reply = await self._gpu_control(env, "update_weights", control)
        if reply is not None:
            self.weight_version = reply.weight_version
            self.scheduler.increment_staleness()
            await self._ack(env, "update_weights")

    # --- the step loop ------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        sched = self.scheduler
        assert sched is not None
        interval = self.config.logging_step_interval
        while True:
            await self.work.wait()
            if self.state != "RUNNING" or not sched.has_work():
                self.work.clear()
                continue
            async with self.device_lock:
                if self.state != "RUNNING":  # paused while we waited for the lock
                    continue
                # From planning to the step's first message nothing may yield: replay relies on
                # it (actors/engine/check.py).
                batch = sched.schedule(self.now)
                if not batch.chunks and not batch.free_ids:
                    # Work exists but nothing fits this step; an abort or a finish changes that.
                    await self._emit(batch.ended)
                    self.work.clear()
                    continue
                self.in_flight = True
                await self._run_step(batch)
            self.tokens_last_step = batch.num_tokens
            if interval and sched.step % interval == 0:
                stats = self._stats()
                self.log.info("stats", **sched.stats(), tokens=batch.num_tokens)
                await self.coord.send(stats)

    async def _run_step(self, batch: StepBatch) -> None:
        """Run one planned step; `in_flight` drops as soon as its result is applied."""
        sched = self.scheduler
        try:
            ops = block_ops(batch)
            if ops is not None:  # no block changes: no allocator hop this step
                reply = await self._call(self.alloc, ops, BlockOpsReply)
                if not reply.ok:
                    sched.num_free_blocks = reply.num_free
                    raise EngineError(f"allocator refused a planned step: {reply.error}")
                sched.assign_blocks(batch, reply.block_ids, reply.num_free)
            outputs = []
            if batch.chunks:
                result = await self._call(self.gpu, step_plan(sched, batch), StepResult)
                if result.error is not None:
                    raise EngineError(f"forward failed: {result.error}")
                outputs = sched.update(batch, result, self.now)
        except EngineError as e:
            # The step's requests fail (each gets its terminal output); the engine keeps serving.
            self.log.error("step failed", step=batch.step, error=str(e))
            outputs = sched.update(batch, None, self.now, error=str(e))
        finally:
            self.in_flight = False
        await self._emit(batch.ended + outputs)

    async def _emit(self, requests: list[EngineRequest]) -> None:
        for r in requests:
            await self.coord.send(output_of(r))


def output_of(r: EngineRequest) -> RequestOutput:
    """The next RequestOutput of `r`: its streamable tokens (all, once it has ended), their
    log-probs, and on the terminal output the prompt log-probs, events and timings."""
    start = r.num_streamed
    stop = start + r.ready_to_stream() if r.stream else len(r.generated)
    if r.finish_reason is not None:
        stop = len(r.generated)
    r.num_streamed = stop
    finished = r.finish_reason is not None
    kw = {}
    if r.sampling.return_log_probs:
        kw["log_probs"] = np.asarray(r.log_probs[start:stop], dtype=np.float32)
    if r.sampling.top_n_logprobs:
        kw["top_n_ids"], kw["top_n_log_probs"] = _stack(r.top_n[start:stop], r.sampling)
    if finished:
        if r.wants_prompt_log_probs:
            kw["prompt_log_probs"] = np.asarray(r.prompt_log_probs, dtype=np.float32)
        if r.prompt_top_n:
            kw["prompt_top_n_ids"], kw["prompt_top_n_log_probs"] = _stack(
                r.prompt_top_n, r.sampling
            )
        policy, kv = r.record.staleness(r.num_tokens)
        kw.update(
            events=tuple(r.events),
            ttft=r.ttft,
            tpot=r.tpot,
            policy_staleness=policy,
            kv_cache_staleness=kv,
        )
    return RequestOutput(
        r.request_id,
        np.asarray(r.generated[start:stop], dtype=np.int32),
        finished,
        r.finish_reason,
        r.error,
        len(r.prompt),
        len(r.generated),
        **kw,
    )


def _stack(pairs, sampling) -> tuple[np.ndarray, np.ndarray]:
    n = sampling.top_n_logprobs
    if not pairs:
        return np.zeros((0, n), np.int32), np.zeros((0, n), np.float32)
    ids = np.stack([p[0] for p in pairs]).astype(np.int32)
    lps = np.stack([p[1] for p in pairs]).astype(np.float32)
    return ids, lps
