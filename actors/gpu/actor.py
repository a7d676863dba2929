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

Tensor parallel (`tp` and `followers`; actors/gpu/peers.py): this actor is its rank's leader. It
joins the rank's group at load, publishes every LoadModel, StepPlan and GpuControl to its
followers before running it, and answers a load or control only once every follower has (a
failure anywhere is the rank's). A step that raises ends the process (FatalError), as does a
control the peers disagree on: they could no longer be known to run the same collectives. A
weight update is therefore run in two phases across the peers: staged everywhere (which changes
nothing), then committed only if every peer staged it, else discarded everywhere and answered
with the failing peer's error (a follower on another host without the checkpoint's path fails
the update, not the rank). A
follower whose connection closes ends it too (PeerGoneError), and one that stops cleanly first
says goodbye to its followers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import time

import numpy as np

from taipan.actors.all_or_none import Failures, two_phase
from taipan.actors.base import Actor, FatalError
from taipan.actors.channel import Channel, Envelope
from taipan.actors.gpu.peers import (
    LEADER,
    OWN_FAILURE_GRACE_S,
    Followers,
    PeerError,
    PeerGoneError,
    TPSetup,
    first_failure,
)
from taipan.messages.common import ErrorReply, PeerGone
from taipan.messages.errors import ErrorCode
from taipan.messages.gpu import (
    GpuCommand,
    GpuControl,
    GpuControlReply,
    LoadModel,
    PeerHello,
    PeerOutcome,
    StepPlan,
    StepResult,
)


class GpuActor(Actor):
    def __init__(
        self,
        rank: int,
        channel: Channel,
        *,
        tp: TPSetup | None = None,
        followers: Followers | None = None,
        name: str | None = None,
    ):
        super().__init__(name or f"gpu-{rank}")
        from taipan.actors.gpu.worker import MAX_LAUNCHED, ModelWorker  # torch loads here

        self.worker = ModelWorker()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.name)
        self.collector = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="collect")
        # (envelope, plan, handle, raised), in plan order; raised: the launch threw
        self.launched: asyncio.Queue = asyncio.Queue()
        self.room = asyncio.Semaphore(MAX_LAUNCHED)
        self.tp_setup = tp  # None: no tensor parallelism
        self.tp_size = tp.size if tp is not None else 1
        self.tp_group = None  # joined at the first load
        self.followers = followers
        self.serve(channel)
        self.on(LoadModel, self.on_load)
        self.on(StepPlan, self.on_step)
        self.on(GpuControl, self.on_control)
        if followers is not None:
            self.serve(followers.reports)
            self.on(PeerHello, followers.on_hello)
            self.on(PeerOutcome, followers.on_outcome)
            self.on(PeerGone, self.on_follower_gone)

    async def started(self) -> None:
        self.spawn(self._answer_steps())

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _answer(self, env: Envelope, reply) -> None:
        """Send a reply to the engine (a follower sends its outcomes to its leader instead)."""
        await env.reply(reply)

    def _fatal(self, why: str, error: type[FatalError] = FatalError) -> None:
        """End this actor, and with it the process (runtime/procs.py exits non-zero)."""

        async def fail():
            raise error(f"{self.name}: {why}")

        self.spawn(fail())

    async def on_follower_gone(self, env: Envelope, msg: PeerGone) -> None:
        why = self.followers.gone(env, msg)
        if why is not None:
            self._fatal(f"{why}: this engine rank ends", PeerGoneError)

    async def _peer_lost(self) -> str | None:
        """After a failed step under tensor parallelism: why, if a peer is gone."""
        return None if self.followers is None else await self.followers.why_step_failed()

    # --- load ---------------------------------------------------------------------------------

    def _load(self, msg: LoadModel):
        """In the forward's thread: join the rank's group (the first time), then load."""
        from taipan.actors.gpu.worker import check_device
        from taipan.ops.parallel import SINGLE

        tp = SINGLE
        if self.tp_setup is not None:
            if self.tp_group is None:
                import torch

                check_device(torch.device(msg.device))  # before NCCL picks the device
                if msg.expert_parallel_size > 1:  # one world: the group's ranks' peers
                    self.tp_group, self.worker.ep = self._join_with_experts(msg)
                else:
                    self.tp_group = self.tp_setup.join(msg.device)
            tp = self.tp_group
        return self.worker.load(msg, tp=tp)

    def _join_with_experts(self, msg: LoadModel):
        """Tensor and expert parallel together: every process of the expert-parallel group's
        ranks meets at the group's rendezvous (ops/expert_parallel.py `init_tp_ep`)."""
        from taipan.ops.expert_parallel import init_tp_ep

        setup = self.tp_setup
        return init_tp_ep(
            msg.expert_parallel_rank, msg.expert_parallel_size, setup.tp_rank, setup.size,
            msg.expert_parallel_init, msg.device, setup.timeout_s,
        )  # fmt: skip

    async def _load_everywhere(self, msg: LoadModel):
        """Load here and on every follower; raises what failed (a follower's as soon as it
        does: this peer may then wait in a collective for it)."""
        if self.followers is None:
            return await self._in_thread(self._load, msg)
        answers = await self.followers.publish_expecting(msg, "load", early=True)
        own = asyncio.get_running_loop().run_in_executor(self.executor, self._load, msg)
        # Marked retrieved: its outcome may no longer matter (a peer failed, or we stop).
        own.add_done_callback(lambda f: f.cancelled() or f.exception())
        await asyncio.wait({own, answers}, return_when=asyncio.FIRST_COMPLETED)
        if answers.done() and (failure := first_failure(answers.result())):
            # A failure every peer meets (a model that does not split) is best told as ours;
            # a peer's own (its device) as its. Ours may instead be blocked in a collective.
            await asyncio.wait({own}, timeout=OWN_FAILURE_GRACE_S)
            if own.done() and own.exception() is not None:
                raise own.exception()
            raise PeerError(failure)
        loaded = await own
        failure = first_failure(await self.followers.gather(answers, "load"))
        if failure:
            raise PeerError(failure)
        return loaded

    async def on_load(self, env: Envelope, msg: LoadModel) -> None:
        await self.launched.join()
        try:
            reply = await self._load_everywhere(msg)
        except Exception as e:
            self.log.error("load failed", model=msg.model, error=str(e))
            reply = ErrorReply(ErrorCode.LOAD_FAILED, f"cannot load {msg.model}: {e}", None)
        else:
            await self._bind_threads()
            self.log.info(
                "kv cache",
                blocks=reply.num_blocks,
                tokens=reply.num_blocks * reply.block_size,
                bytes=reply.num_blocks * reply.block_bytes,
                sized_by=self.worker.kv_budget_source,
                tp_size=self.tp_size,
            )
            if self.tp_size > 1:
                self.log.info("tensor-parallel sums", path=self.worker.all_reduce_path)
            graphs = self.worker.graphs
            if graphs is not None:
                self.log.info(
                    "cuda graphs",
                    decode=[b.tokens for b in graphs.decode],
                    mixed=[b.tokens for b in graphs.mixed],
                    capture_seconds=round(self.worker.graph_capture_seconds, 2),
                )
        await self._answer(env, reply)

    async def _bind_threads(self) -> None:
        """Make the loaded device current in the threads that launch (this one, for inline
        launches) and collect; the forward's thread made it current at load."""
        from taipan.actors.gpu.worker import use_device

        device = self.worker.device
        use_device(device)
        await asyncio.get_running_loop().run_in_executor(self.collector, use_device, device)

    # --- steps --------------------------------------------------------------------------------

    async def on_step(self, env: Envelope, msg: StepPlan) -> None:
        """Launch the step and queue it for `_answer_steps`; returns without waiting for the
        device (unless MAX_LAUNCHED steps are already launched, or the launch waits for it
        anyway: then the step is collected in the same thread hop)."""
        await self.room.acquire()
        if self.followers is not None:
            await self.followers.publish(msg)
        no_tokens = np.full(len(msg.sample), -1, dtype=np.int32)
        raised = False
        if self.worker.model is None:
            handle = StepResult(msg.step, no_tokens, "no model is loaded", 0.0)
        else:
            try:
                if self.worker.launches_inline(msg):
                    handle = self.worker.launch(msg)
                elif self.worker.launch_waits(msg):  # (collected in the same hop: a StepResult)
                    handle = await self._in_thread(self.worker.step, msg)
                else:
                    handle = await self._in_thread(self.worker.launch, msg)
            except Exception as e:
                self.log.exception("step failed", step=msg.step)
                handle = StepResult(msg.step, no_tokens, f"{type(e).__name__}: {e}", 0.0)
                raised = True
        self.launched.put_nowait((env, msg, handle, raised))

    async def _answer_steps(self) -> None:
        """Collect the launched steps in order and answer each."""
        loop = asyncio.get_running_loop()
        while True:
            env, plan, handle, raised = await self.launched.get()
            try:
                if isinstance(handle, StepResult):  # (refused, failed, or already collected)
                    reply = handle
                else:
                    collect = functools.partial(self.worker.collect, deferred_check=True)
                    reply = await loop.run_in_executor(self.collector, collect, handle)
                    reply = self.worker.finish_check(handle, reply)  # (its grammar check)
            except Exception as e:
                self.log.exception("step failed", step=plan.step)
                no_tokens = np.full(len(plan.sample), -1, dtype=np.int32)
                reply = StepResult(plan.step, no_tokens, f"{type(e).__name__}: {e}", 0.0)
                raised = True
            finally:
                self.room.release()
            if raised and self.tp_size > 1:
                # Unanswered: the rank ends, and the coordinator fails its requests as a dead
                # rank's (a peer that died mid-collective also lands here, or its watcher ends
                # the process first: either way the requests see the same error).
                lost = await self._peer_lost()
                if lost is not None:
                    raise PeerGoneError(f"{self.name}: step {plan.step} failed: {lost}")
                raise FatalError(
                    f"{self.name}: step {plan.step} failed under tensor parallelism "
                    f"({reply.error}); the rank's peers can no longer be known to run the same "
                    "collectives"
                )
            try:
                await self._answer(env, reply)
            except Exception:  # the engine shares this process: only a broken socket gets here
                self.log.exception("could not answer a step", step=plan.step)
            finally:
                self.launched.task_done()

    # --- controls -----------------------------------------------------------------------------

    def _control(self, msg: GpuControl) -> GpuControlReply:
        """In the forward's thread: apply the control; any failure is the reply's `error`."""
        try:
            start = time.perf_counter()
            reply = self.worker.control(msg)
            marks = {}
            if msg.buckets is not None:  # (wall-clock seconds, to set beside the trainer's)
                marks = {k: round(v, 5) for k, v in self.worker.transfer_marks.items()}
            self.log.info(
                "control", command=str(msg.command), error=reply.error,
                seconds=round(time.perf_counter() - start, 4), **marks,
            )  # fmt: skip
            return reply
        except Exception as e:  # the worker answers expected failures itself; this is the rest
            self.log.exception("control failed", command=msg.command)
            error = f"{type(e).__name__}: {e}"
            w = self.worker
            return GpuControlReply(
                msg.command, error, w.kv_valid, w.weight_version, w.weights_incomplete
            )

    async def _control_everywhere(self, msg: GpuControl) -> GpuControlReply:
        if self.followers is None:
            return await self._in_thread(self._control, msg)
        if msg.command == GpuCommand.UPDATE_WEIGHTS and msg.buckets is not None:
            # Each peer copies its shard in as the trainer's buckets arrive (staging them would
            # hold every bucket whole): names and shapes are checked alike everywhere first.
            return await self._agreed_control(msg)
        if msg.command in (GpuCommand.UPDATE_WEIGHTS, GpuCommand.STAGE_WEIGHTS):
            return await self._stage_everywhere(msg)
        return await self._agreed_control(msg)

    async def _everywhere(self, msg: GpuControl) -> tuple[GpuControlReply, dict | None]:
        """Run `msg` here and on every follower: (our reply, the followers' errors). A follower
        that does not answer ends the rank: then (our reply carrying why, None)."""
        command = str(msg.command)
        answers = await self.followers.publish_expecting(msg, command, early=False)
        reply = await self._in_thread(self._control, msg)
        try:
            return reply, await self.followers.gather(answers, command)
        except PeerError as e:
            self._fatal(f"{command}: {e}")
            return dataclasses.replace(reply, error=str(e)), None

    async def _stage_everywhere(self, msg: GpuControl) -> GpuControlReply:
        """A weight update over the peers, all or none (actors/all_or_none.py): stage it on
        every peer; where one failed, discard it on every peer (nothing was applied) and answer
        its error; else commit it (UPDATE_WEIGHTS) or leave it staged for the engine's commit
        (STAGE_WEIGHTS)."""
        answer: GpuControlReply | None = None

        async def stage() -> Failures | None:
            nonlocal answer
            staging = dataclasses.replace(msg, command=GpuCommand.STAGE_WEIGHTS)
            reply, errors = await self._everywhere(staging)
            answer = dataclasses.replace(reply, command=msg.command)
            if errors is None:  # a follower did not answer: the rank ends (`answer` says why)
                return None
            return Failures.of({LEADER: reply.error} | errors)

        async def keep() -> None:
            nonlocal answer
            if msg.command == GpuCommand.UPDATE_WEIGHTS:
                commit = GpuControl(GpuCommand.COMMIT_WEIGHTS, None, None, None)
                answer = dataclasses.replace(
                    await self._agreed_control(commit), command=msg.command
                )

        async def undo(failed: Failures) -> None:
            nonlocal answer
            discarded = await self._agreed_control(
                GpuControl(GpuCommand.DISCARD_WEIGHTS, None, None, None)
            )
            if discarded.error is not None:
                answer = discarded  # (peers that disagreed on it have ended the rank)
            else:
                answer = dataclasses.replace(answer, error=first_failure(failed.why))

        await two_phase(stage, keep, undo)
        return answer

    async def _agreed_control(self, msg: GpuControl) -> GpuControlReply:
        """A control every peer must apply alike (the rank ends where they do not)."""
        reply, errors = await self._everywhere(msg)
        if errors is None:
            return reply
        failure = first_failure(errors)
        if (reply.error is None) != (failure is None):
            # One peer applied it and another did not: their next steps would differ.
            why = f"leader: {reply.error or 'ok'}; {failure or 'followers: ok'}"
            self._fatal(f"the tensor-parallel peers disagree on {msg.command} ({why})")
            return dataclasses.replace(reply, error=f"peers disagree: {why}")
        return reply

    async def on_control(self, env: Envelope, msg: GpuControl) -> None:
        await self.launched.join()  # every launched step is answered first
        await self._answer(env, await self._control_everywhere(msg))

    async def stopping(self) -> None:
        if self.followers is not None:
            await self.followers.bye("the engine rank stops")
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.collector.shutdown(wait=False, cancel_futures=True)
