"""The engine actor: one rank's step loop, a thin shell around the Scheduler.

Channels: `coord` (DEALER to the coordinator; served: EngineSubmit, AbortRequest, GetStats and
the lifecycle controls), `alloc`, `mamba` and `gpu` (in-process pairs, actors/local.py, or any
PAIR socket; at most one message each way per step, and the gpu control calls between steps;
`mamba`, the mamba_cache actor, only for hybrid models: its MambaOps goes out right after the
step's BlockOps, before either reply is awaited, so the two hops overlap). The engine never
touches tensors or the block pool itself: it plans, the allocator hands out blocks, the gpu
actor computes. Outputs go to the
coordinator in one `StepOutputs` per step (and one per abort, refused submission or shutdown
that ends requests between steps), never one message per request.

Lifecycle (actors/engine/controls.py, a base of this actor): PAUSE stops planning, waits for the
steps in flight and then acks (requests keep their KV or are aborted, submissions queue; mode
wait first stops admitting and lets the requests that started finish); SUSPEND / RESUME /
weight updates go to the gpu actor; FLUSH_CACHE drops the cached prefix; UNPAUSE starts stepping
again (or withdraws a pause still pending). A control runs as a task of
its own (in arrival order), so the receive loop keeps taking submissions, aborts and stats while
a step finishes or weights load.
Time: every decision uses the time of the inbound message that caused it (`self.now`), so a
replay of the same messages makes the same decisions.

Steps overlap (`overlap_steps`; by default on CUDA): step N+1 is planned and sent while the gpu
runs step N (`_run_steps`; the scheduler's docstring has the contract). A control that needs the
channels makes the loop stop planning and finish what is in flight before it runs.

Failures: a step that fails (a refused allocation, a failed forward, or any exception in the
step) fails the requests of that step, each with its terminal output, and the engine keeps
serving; the exception is logged once with its traceback. If even that is impossible (the
scheduler itself broke), the engine fails every request it holds and ends its process with a
`FatalError` (runtime/procs.py exits non-zero): the coordinator sees the rank die.
Expert parallelism (`ep`, an EpConsensus of more than one rank): the engines of the group must step
together (their gpu actors exchange tokens inside every MoE layer), so the step loop is
actors/engine/ep.py's EpDriver, which agrees with the peers over ZMQ before stepping (idle ranks
run dummy steps), and PAUSE completes only once the whole group stopped in the same step and met
at a barrier. A peer that dies, breaks the protocol or stays silent past a bound ends this rank
too (its requests fail naming the peer), and a step whose forward fails ends it (the group's
collectives can no longer be trusted); STOP tells the peers first (EpBye).
Heartbeats go to the coordinator every HEARTBEAT_S seconds; an engine started on its own (`taipan
serve --role engine`) watches the answers: a coordinator silent for `coordinator_timeout` s, or
one that refuses the rank (`rank_refused`), ends the process with a FatalError naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from taipan.actors.base import Actor, FatalError
from taipan.actors.channel import Channel, Envelope
from taipan.actors.config import InferenceConfig
from taipan.actors.engine.controls import EngineControls
from taipan.actors.engine.ep import EpConsensus, EpDriver, GroupError
from taipan.actors.engine.flow import EngineError
from taipan.actors.engine.gc_time import GcTime
from taipan.actors.engine.scheduler import Scheduler
from taipan.actors.engine.step import StepRunner
from taipan.actors.engine.wire import (
    BootError,
    mamba_init,
    new_scheduler,
    prefix_policy,
    runtime_plan,
    submission,
)
from taipan.messages.allocator import AllocatorInit, AllocatorReady
from taipan.messages.common import ErrorReply, Heartbeat, Hello, PeerGone
from taipan.messages.consensus import EpBarrier, EpBye, EpHello, EpOutcome, EpVote
from taipan.messages.errors import ErrorCode
from taipan.messages.gpu import (
    LoadModel,
    ModelLoaded,
)
from taipan.messages.lifecycle import (
    KVCacheManagementMode,
    LifecycleState,
    PauseMode,
    Stop,
    StopAck,
)
from taipan.messages.mamba_cache import MambaReady
from taipan.messages.requests import (
    AbortRequest,
    EngineSubmit,
    FinishReason,
    RequestOutput,
    StepOutputs,
)
from taipan.messages.stats import GetStats, RankStats, Stats

NO_TOKENS = np.zeros(0, dtype=np.int32)
HEARTBEAT_S = 1.0  # the coordinator declares an engine dead after ENGINE_TIMEOUT_S of silence


class EngineActor(EngineControls, Actor):
    def __init__(
        self,
        rank: int,
        config: InferenceConfig,
        load: LoadModel,
        coord: Channel,
        alloc: Channel,
        gpu: Channel,
        mamba: Channel | None = None,
        *,
        coordinator_timeout: float | None = None,
        ep: EpConsensus | None = None,
    ):
        super().__init__(f"engine-{rank}")
        self.coordinator_timeout = coordinator_timeout  # None: the coordinator is not watched
        self.coord_heard = time.monotonic()
        self.rank = rank
        self.config = config
        self.load = load
        self.coord, self.alloc, self.gpu, self.mamba = coord, alloc, gpu, mamba
        self.scheduler: Scheduler | None = None
        self.vocab_size = 0
        self.tp_size = 1  # the rank's gpu processes (ModelLoaded says)
        self.work = asyncio.Event()
        self.now = 0.0  # time of the last inbound message (see module docstring)
        self.state = LifecycleState.RUNNING
        self.weight_version = 0
        self.weights_incomplete = False  # a weight transfer failed part way (controls.py)
        self.device_lock = asyncio.Lock()  # one user of the alloc/gpu channels at a time
        self.waiting_for_device = 0  # controls waiting for the step loop to hand over
        self.control_lock = asyncio.Lock()  # controls run one at a time, in arrival order
        self.steps = StepRunner(self)  # the step protocol, and its counters
        self.gc_time = GcTime()  # the process's time in the garbage collector
        overlap = config.overlap_steps
        if overlap is None:  # synchronous rounds need steps that do not overlap (ep.py)
            overlap = load.device.startswith("cuda") and not config.use_synchronous_zmq_collectives
        self.overlap = overlap
        self.pause_mode = PauseMode.KEEP  # of the last pause, and its clear_cache (controls.py)
        self.pause_clear = False
        self.pause_waiters: list[Envelope] = []  # pauses not answered yet (controls.py)
        self.drain_progress = asyncio.Event()  # set after steps and aborts (a pause in mode wait)
        self.suspended_mode: KVCacheManagementMode | None = None  # of the last suspend
        self.ep, self.ep_driver = ep, None
        if ep is not None:
            interval, disabled = config.ep_consensus_interval, config.disable_ep_consensus
            self.ep_driver = EpDriver(self, ep, interval, disabled)
            ep.synchronous = config.use_synchronous_zmq_collectives
            ep.take_now = self._take_ep_now
            self.serve(ep.inbox)
            for msg_type in (EpHello, EpVote, EpBarrier, EpOutcome, EpBye, PeerGone):
                self.on(msg_type, self.on_ep_message)
        self.serve(coord)
        for msg_type, handler in [
            (EngineSubmit, self.on_submit),
            (AbortRequest, self.on_abort),
            (Stop, self.on_stop),
            (GetStats, self.on_get_stats),
            (Heartbeat, self.on_heartbeat),
            (ErrorReply, self.on_error_reply),
            *((t, getattr(self, name)) for t, name in self.HANDLERS.items()),
        ]:
            self.on(msg_type, handler)

    async def dispatch(self, env: Envelope) -> None:
        self.now = env.time  # every inbound message sets the clock (see actors/engine/check.py)
        if env.channel is self.coord:
            self.coord_heard = time.monotonic()
        await super().dispatch(env)

    async def on_ep_message(self, env: Envelope, msg) -> None:
        """A peer's round message, its EpBye, or its closed connection (PeerGone)."""
        try:
            if isinstance(msg, PeerGone):
                self.ep.peer_gone(env.sender, msg.reason)
            else:
                self.ep.deliver(msg)
        except GroupError as e:
            self.spawn(self.steps.die(str(e)))

    def _take_ep_now(self, env: Envelope) -> None:
        """A synchronous round read `env` off the consensus inbox itself (actors/engine/ep.py);
        as `dispatch` then `on_ep_message` would, without yielding. GroupError propagates."""
        self.now = env.time
        if env.error is not None:
            self.ep.deliver_bad(str(env.error))
        elif isinstance(env.msg, PeerGone):
            self.ep.peer_gone(env.sender, env.msg.reason)
        elif isinstance(env.msg, EpHello | EpVote | EpBarrier | EpOutcome | EpBye):
            self.ep.deliver(env.msg)
        else:
            self.log.warning("unexpected message on the consensus inbox", msg=type(env.msg))

    async def on_heartbeat(self, env: Envelope, msg: Heartbeat) -> None:
        pass  # the coordinator's answer: dispatch noted that it is alive

    async def on_error_reply(self, env: Envelope, msg: ErrorReply) -> None:
        if msg.code is ErrorCode.RANK_REFUSED:
            self.spawn(self._exit(f"the coordinator refused this rank: {msg.text}"))
        else:
            self.log.warning("error reply", code=msg.code, text=msg.text)

    async def _exit(self, why: str) -> None:
        raise FatalError(f"{self.name}: {why}")

    async def started(self) -> None:
        await self.coord.send(Hello("engine", self.rank))
        self.spawn(self._heartbeat())
        self.spawn(self._boot_then_loop())

    async def stopping(self) -> None:
        self.gc_time.close()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self.coord.send(Heartbeat(time.time()))
            silent = time.monotonic() - self.coord_heard
            if self.coordinator_timeout is not None and silent > self.coordinator_timeout:
                # Its requests have no one to report to: end the process (and free the device).
                raise FatalError(f"{self.name}: the coordinator sent nothing for {silent:.0f} s")

    # --- boot ---------------------------------------------------------------------------------

    async def _call(self, channel: Channel, msg, expect: type):
        await channel.send(msg)
        return await self.reply_on(channel, expect)

    async def reply_on(self, channel: Channel, expect: type):
        """The next message on `channel`, which must be an `expect` (EngineError otherwise)."""
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
            policy = prefix_policy(self.config) or ""  # "": off, as AllocatorInit carries it
            init = AllocatorInit(loaded.num_blocks, loaded.block_size, policy)
            ready = await self._call(self.alloc, init, AllocatorReady)
            minit = mamba_init(loaded)
            if minit is not None:
                if self.mamba is None:
                    raise EngineError("a hybrid model needs the mamba_cache actor")
                await self._call(self.mamba, minit, MambaReady)
        except EngineError as e:
            self.log.error("model load failed", error=str(e))
            await self.coord.send(ErrorReply(ErrorCode.LOAD_FAILED, str(e), None))
            return
        try:
            plan = runtime_plan(self.config, loaded, ready)
        except BootError as e:
            await self.coord.send(ErrorReply(ErrorCode.LOAD_FAILED, str(e), None))
            return
        self.vocab_size = loaded.vocab_size
        self.tp_size = loaded.tensor_parallel_size
        self.scheduler = new_scheduler(self.config, plan)
        self.steps.start()
        self.log.info("engine ready", num_blocks=plan.num_blocks, max_tokens=plan.max_tokens)
        await self.coord.send(loaded)
        if self.ep_driver is None:
            await self._step_loop()
            return
        try:
            await self.ep_driver.run()
        except GroupError as e:
            await self.steps.die(str(e))

    # --- requests -----------------------------------------------------------------------------

    async def on_submit(self, env: Envelope, msg: EngineSubmit) -> None:
        req, problem = submission(self.scheduler, self.vocab_size, msg)
        if req is None:
            n = len(msg.prompt_token_ids)
            out = RequestOutput(msg.request_id, NO_TOKENS, True, FinishReason.ERROR, problem, n, 0)
            await self.coord.send(StepOutputs.of([out]))
            return
        self.scheduler.add(req, env.time)
        self.work.set()

    async def on_abort(self, env: Envelope, msg: AbortRequest) -> None:
        if self.scheduler is None:
            return
        ended = self.scheduler.abort(msg.request_id, env.time)
        if ended is not None:
            await self.steps.emit([ended])
        self.work.set()
        self.drain_progress.set()

    async def on_stop(self, env: Envelope, msg: Stop) -> None:
        self.spawn(self._stop_after_step())

    async def _stop_after_step(self) -> None:
        async with self.control_lock, self._between_steps():  # steps in flight end and report
            if self.scheduler is not None:
                await self.steps.emit(self.scheduler.fail_all(FinishReason.ABORT, self.now))
            if self.ep is not None:
                await self.ep.bye("stopped")  # its closed connection is no crash to the peers
            await self.coord.send(StopAck(self.name))
            self.stop()

    async def on_get_stats(self, env: Envelope, msg: GetStats) -> None:
        await env.reply(self.stats())

    def stats(self) -> Stats:
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
            self.steps.tokens_last_step,
            self.weight_version,
            self.steps.device_seconds_total,
            self.steps.steps_total,
            self.steps.steps_graphed,
            s.get("prefix_prompt_tokens", 0),
            s.get("prefix_cached_tokens", 0),
            s.get("prefill_tokens_computed", 0),
            s.get("blocks_hashed", 0),
            s.get("blocks_evictable", 0),
            s.get("mamba_live_free", 0),
            s.get("mamba_snapshots", 0),
            s.get("mamba_restored", 0),
            s.get("mamba_snapshots_taken", 0),
            self.steps.dummy_steps,
            self.steps.dummy_device_seconds,
            self.gc_time.seconds,
            self.gc_time.collections,
            spec_draft_tokens=s.get("spec_draft_tokens", 0),
            spec_accepted_tokens=s.get("spec_accepted_tokens", 0),
            spec_verify_rows=s.get("spec_verify_rows", 0),
            spec_accepted_per_position=s.get("spec_accepted_per_position", ()),
            spec_backoffs=s.get("spec_backoffs", 0),
            spec_draft_disabled=s.get("spec_draft_disabled", 0),
            spec_chains=s.get("spec_chains", 0),
            spec_batch_off_steps=s.get("spec_batch_off_steps", 0),
            grammar_void_rows=s.get("grammar_void_rows", 0),
            spec_verify_steps=self.steps.verify_steps,
            spec_verify_device_seconds=self.steps.verify_device_seconds,
            num_local_blocks=self.scheduler.plan.num_local_blocks,
            local_blocks_used=s.get("local_blocks_used", 0),
            local_blocks_cached=s.get("local_blocks_cached", 0),
            local_blocks_copied=s.get("local_blocks_copied", 0),
        )
        return Stats(self.state, (rank,))

    # --- the step loop ------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            await self.work.wait()
            if self._may_plan():
                async with self.device_lock:
                    await self._run_steps()
            else:
                self.work.clear()
            self.drain_progress.set()  # (a pause in mode wait looks whether it is done)

    def _may_plan(self) -> bool:
        return (
            self.state == LifecycleState.RUNNING
            and not self.waiting_for_device
            and self.scheduler.has_work()
            and not self.draining_done()
        )

    @contextlib.asynccontextmanager
    async def _between_steps(self):
        """Hold the alloc/gpu channels with no step in flight: the step loop stops planning,
        finishes the steps it has in flight, and hands over."""
        self.waiting_for_device += 1
        try:
            await self.device_lock.acquire()
        finally:
            self.waiting_for_device -= 1
        try:
            yield
        finally:
            self.device_lock.release()
            # The loop stopped for us with its `work` cleared: a control legal while RUNNING
            # (an in-flight weight update, joining a weight-transfer group) must wake it, or
            # the running requests would wait for the next submission.
            self.work.set()

    async def _run_steps(self) -> None:
        """Steps back to back while there is work and no control waits: plan, run, apply.
        With overlap, step N+1 is planned, given its blocks and sent to the gpu while step N
        runs, and N's result is applied after that: the gpu starts N+1 as soon as N ends, and
        the engine's host work for N+1 hides behind N (scheduler.py explains the contract).
        Returns with no step in flight."""
        steps = self.steps
        while True:
            batch = await steps.plan() if self._may_plan() else None
            if batch is None and not steps.in_flight:
                # Nothing fits, or nothing may run now: a submission, an abort, a finish or an
                # unpause sets `work` again.
                self.work.clear()
                return
            sent = batch is not None and await steps.dispatch(batch)
            await steps.collect(keep=int(self.overlap and sent))
