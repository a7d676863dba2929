"""The gpu actor: serves LoadModel, StepPlan and GpuControl from its engine, computing in its
own thread.

The forward runs in a dedicated single-thread executor so the event loop (and the engine that
shares it) stays free while the device works. A step is launched (its device work queued) and
collected in a second thread (waiting for its tokens), so the next StepPlan, sent by an engine
that overlaps steps, is launched while this one still runs. A CUDA step without log-probs is
launched on the event loop's own thread instead: its host work is short and never waits for the
device, while a thread of its own would have to win the GIL from the engine's Python (CPython
hands it over only every 5 ms), which made overlapped steps wait for the engine's planning.
At most MAX_LAUNCHED (actors/gpu/worker.py) steps are launched and not yet answered, and the
replies go out in the order the plans came. Load and controls wait until every launched step is
answered, and run in the forward's thread, so they never overlap a step. A failed load, step
or control becomes an error reply, a StepResult or a GpuControlReply with `error` set; the actor
keeps serving.
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
        from taipan.actors.gpu.worker import MAX_LAUNCHED, ModelWorker  # torch loads here

        self.worker = ModelWorker()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.name)
        self.collector = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="collect")
        self.launched: asyncio.Queue = asyncio.Queue()  # (envelope, handle), in plan order
        self.room = asyncio.Semaphore(MAX_LAUNCHED)
        self.serve(channel)
        self.on(LoadModel, self.on_load)
        self.on(StepPlan, self.on_step)
        self.on(GpuControl, self.on_control)

    async def started(self) -> None:
        self.spawn(self._answer_steps())

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def on_load(self, env: Envelope, msg: LoadModel) -> None:
        await self.launched.join()
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
        """Launch the step and queue it for `_answer_steps`; returns without waiting for the
        device (unless MAX_LAUNCHED steps are already launched)."""
        await self.room.acquire()
        no_tokens = np.full(len(msg.sample), -1, dtype=np.int32)
        if self.worker.model is None:
            handle = StepResult(msg.step, no_tokens, "no model is loaded", 0.0)
        else:
            try:
                if self.worker.launches_inline(msg):
                    handle = self.worker.launch(msg)
                else:
                    handle = await self._in_thread(self.worker.launch, msg)
            except Exception as e:
                self.log.exception("step failed", step=msg.step)
                handle = StepResult(msg.step, no_tokens, f"{type(e).__name__}: {e}", 0.0)
        self.launched.put_nowait((env, msg, handle))

    async def _answer_steps(self) -> None:
        """Collect the launched steps in order and answer each."""
        loop = asyncio.get_running_loop()
        while True:
            env, plan, handle = await self.launched.get()
            try:
                reply = await loop.run_in_executor(self.collector, self.worker.collect, handle)
            except Exception as e:
                self.log.exception("step failed", step=plan.step)
                no_tokens = np.full(len(plan.sample), -1, dtype=np.int32)
                reply = StepResult(plan.step, no_tokens, f"{type(e).__name__}: {e}", 0.0)
            finally:
                self.room.release()
            try:
                await env.reply(reply)
            except Exception:  # the engine shares this process: only a broken socket gets here
                self.log.exception("could not answer a step", step=plan.step)
            finally:
                self.launched.task_done()

    async def on_control(self, env: Envelope, msg: GpuControl) -> None:
        await self.launched.join()  # every launched step is answered first
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
        self.collector.shutdown(wait=False, cancel_futures=True)
