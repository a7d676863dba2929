"""The gpu actor: serves LoadModel, StepPlan and GpuControl from its engine, computing in its
own thread.

The forward runs in a dedicated single-thread executor so the event loop (and the engine that
shares it) stays free while the device works; controls run in the same thread, so they never
overlap a step. A failed load, step or control becomes an error reply, a StepResult or a
GpuControlReply with `error` set; the actor keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np

from taipan.actors.base import Actor
from taipan.actors.channel import Channel, Envelope
from taipan.messages.common import ErrorReply
from taipan.messages.gpu import GpuControl, GpuControlReply, LoadModel, StepPlan, StepResult


class GpuActor(Actor):
    def __init__(self, rank: int, channel: Channel):
        super().__init__(f"gpu-{rank}")
        from taipan.actors.gpu.worker import ModelWorker  # torch loads here, not at import

        self.worker = ModelWorker()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.name)
        self.serve(channel)
        self.on(LoadModel, self.on_load)
        self.on(StepPlan, self.on_step)
        self.on(GpuControl, self.on_control)

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def on_load(self, env: Envelope, msg: LoadModel) -> None:
        try:
            reply = await self._in_thread(self.worker.load, msg)
        except Exception as e:
            self.log.error("load failed", model=msg.model, error=str(e))
            reply = ErrorReply("load_failed", f"cannot load {msg.model}: {e}", None)
        else:
            self.log.info(
                "kv cache",
                blocks=reply.num_blocks,
                tokens=reply.num_blocks * reply.block_size,
                bytes=reply.num_blocks * reply.block_bytes,
                sized_by=self.worker.kv_budget_source,
            )
            graphs = self.worker.graphs
            if graphs is not None:
                self.log.info(
                    "cuda graphs",
                    decode=[b.tokens for b in graphs.decode],
                    mixed=[b.tokens for b in graphs.mixed],
                    capture_seconds=round(self.worker.graph_capture_seconds, 2),
                )
        await env.reply(reply)

    async def on_step(self, env: Envelope, msg: StepPlan) -> None:
        no_tokens = np.full(len(msg.sample), -1, dtype=np.int32)
        if self.worker.model is None:
            await env.reply(StepResult(msg.step, no_tokens, "no model is loaded", 0.0))
            return
        try:
            reply = await self._in_thread(self.worker.step, msg)
        except Exception as e:
            self.log.exception("step failed", step=msg.step)
            reply = StepResult(msg.step, no_tokens, f"{type(e).__name__}: {e}", 0.0)
        await env.reply(reply)

    async def on_control(self, env: Envelope, msg: GpuControl) -> None:
        try:
            reply = await self._in_thread(self.worker.control, msg)
        except Exception as e:  # the worker answers expected failures itself; this is the rest
            self.log.exception("control failed", command=msg.command)
            error = f"{type(e).__name__}: {e}"
            reply = GpuControlReply(
                msg.command, error, self.worker.kv_valid, self.worker.weight_version
            )
        await env.reply(reply)

    async def stopping(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
