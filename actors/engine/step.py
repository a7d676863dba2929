"""One engine step, written once for both step loops (the engine's own in actors/engine/actor.py
and the expert-parallel one in actors/engine/ep.py): `StepRunner`, the I/O around the step's
rules (actors/engine/flow.py's StepFlow, which the replay checker drives too).

- `plan()`: the scheduler's next batch, or None when nothing runs a forward (the requests that
  ended while planning get their outputs; a `NoStep` is recorded for replay).
- `dispatch(batch)`: the step's BlockOps and MambaOps go out, both replies are read and handed
  to the flow, then the StepPlan goes to the gpu and the allocator's prefix events to the
  coordinator. True when a result will come.
- `dummy()`: an expert-parallel dummy step goes to the gpu instead.
- `collect(keep)`: the gpu's StepResults are read and applied, oldest first, until `keep` steps
  remain at the gpu; each step's outputs go to the coordinator in one StepOutputs.
- `emit(requests)` and `die(why)`: outputs between steps, and the end of a rank that cannot go on.

Ordering rules replay relies on (actors/engine/check.py reads them back from the log): from
planning to the step's first message nothing yields; BlockOps goes out before MambaOps and both
before either reply is read; the StepPlan goes out before the PrefixEvents; a step's outputs are
one message, sent after the step's replies were read.

Failures: a refused allocation, a failed forward or any exception inside a step fails that
step's requests (each gets its terminal output) and the rank goes on; under expert parallelism a
failed forward ends the rank (the group's collectives may be out of step). When even failing the
requests is impossible, `die` fails every request the rank holds and raises FatalError.

The runner owns the step counters the rank's stats report (`steps_total`, `dummy_steps`, ...);
the engine actor owns the channels, the clock (`now`, set by every message read), the scheduler
and the lifecycle.
"""

from __future__ import annotations

from taipan.actors.base import FatalError
from taipan.actors.channel import Channel
from taipan.actors.engine.flow import DummyStep, EngineError, StepFlow
from taipan.actors.engine.outputs import step_outputs
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.scheduler import StepBatch
from taipan.actors.engine.wire import dummy_plan, step_plan
from taipan.messages.allocator import BlockOpsReply
from taipan.messages.gpu import NoStep, StepResult
from taipan.messages.mamba_cache import MambaOpsReply
from taipan.messages.requests import FinishReason
from taipan.messages.stats import PrefixEvents


class StepRunner:
    """The step protocol of one engine actor (`engine`: its channels, scheduler, clock, log).
    `flow` is set once the scheduler exists (`start`)."""

    def __init__(self, engine):
        self.engine = engine
        self.flow: StepFlow | None = None
        self.tokens_last_step = 0
        self.device_seconds_total = 0.0  # the gpu actor's device time of every step so far
        self.steps_total = 0
        self.steps_graphed = 0
        self.dummy_steps = 0  # dummy forwards run, and their device time (RankStats)
        self.dummy_device_seconds = 0.0
        self.verify_steps = 0  # forwards that verified drafts, and their device time
        self.verify_device_seconds = 0.0

    def start(self) -> None:
        """The engine's scheduler exists: steps may run."""
        self.flow = StepFlow(self.engine.scheduler)

    @property
    def in_flight(self) -> int:
        """Steps at the gpu whose result is not applied yet."""
        return len(self.flow.at_gpu)

    async def plan(self) -> StepBatch | None:
        """The next batch to dispatch, or None when it would run no forward."""
        e = self.engine
        sched = e.scheduler
        try:
            # From planning to the step's first message nothing may yield (see above).
            planned = sched.schedule(e.now)
        except Exception as err:
            await self.die(f"planning step {sched.step + 1} failed", err)
        if planned.is_step:
            return planned
        e.gpu.record_only(NoStep(planned.step))  # for replay (check.py)
        await self.emit(planned.ended)
        return None

    async def dispatch(self, batch: StepBatch) -> bool:
        """Get the step's blocks and send its StepPlan to the gpu, without waiting for the
        result. True when a result will come (`collect` it); False for a step that only freed
        blocks, or one that failed here (its requests got their terminal outputs)."""
        e, flow = self.engine, self.flow
        published = False
        try:
            ops, mops = flow.begin(batch)
            # Both requests go out before either reply is read: the two actors work at once.
            if ops is not None:  # no block changes: no allocator hop this step
                await e.alloc.send(ops)
            if mops is not None:
                await e.mamba.send(mops)
            # Both replies are read before the flow applies either: the requests then hold
            # every block and slot handed out, and their ends free them.
            if ops is not None:
                flow.reply_in("allocator", await self._reply(e.alloc, BlockOpsReply))
            if mops is not None:
                flow.reply_in("mamba_cache", await self._reply(e.mamba, MambaOpsReply))
            failure = flow.settle()
            if failure is not None:
                raise failure
            if batch.chunks:
                await e.gpu.send(step_plan(e.scheduler, batch))
                flow.sent(batch)
            published = True  # after the plan: the gpu starts first
            await self._publish(flow.block_reply)
        except Exception as err:
            if not published:  # the table must see every event
                await self._publish(flow.block_reply)
            await self._emit_or_die(batch, batch.ended + await self._failed(batch, err))
            return False
        await self._emit_or_die(batch, batch.ended)
        return bool(batch.chunks)

    async def _reply(self, channel: Channel, expect: type):
        """The step's reply on `channel`, or the error that came instead of it."""
        try:
            return await self.engine.reply_on(channel, expect)
        except Exception as err:
            return err

    async def _publish(self, reply: BlockOpsReply | None) -> None:
        """Relay the step's hash events to the coordinator's routing table (DESIGN.md §5)."""
        if reply is not None and (len(reply.added_hashes) or len(reply.evicted_hashes)):
            await self.engine.coord.send(PrefixEvents(reply.added_hashes, reply.evicted_hashes))

    async def dummy(self) -> None:
        """A dummy step (expert parallelism: the group steps and this rank has nothing to run):
        the gpu worker runs padding rows through every MoE exchange."""
        step = self.engine.scheduler.step
        await self.engine.gpu.send(dummy_plan(step))
        self.flow.sent_dummy(step)

    async def collect(self, keep: int = 0) -> None:
        """Apply the gpu's results, oldest step first, until `keep` steps remain at the gpu."""
        while len(self.flow.at_gpu) > keep:
            await self._collect_one()

    async def _collect_one(self) -> None:
        """Wait for the oldest step's result, apply it and report: a failed step fails its
        requests (each gets its terminal output) and the engine goes on."""
        e, step = self.engine, self.flow.at_gpu[0]
        try:
            result = await e.reply_on(e.gpu, StepResult)
            outputs = self.flow.on_result(result, e.now)
        except Exception as err:
            if e.ep is not None:  # the group's collectives may be out of step now
                what = "dummy step after" if isinstance(step, DummyStep) else "step"
                await self.die(await e.ep.why_failed(f"{what} {step.step} failed: {err}"))
            outputs = await self._failed(step, err)
        else:
            self._count(step, result)
        if isinstance(step, DummyStep):
            return
        await self._emit_or_die(step, outputs)
        self.tokens_last_step = step.num_tokens
        interval = e.config.logging_step_interval
        if interval and step.step % interval == 0:
            e.log.info("stats", **e.scheduler.stats(), tokens=step.num_tokens)
            await e.coord.send(e.stats())

    def _count(self, step: StepBatch | DummyStep, result: StepResult) -> None:
        if isinstance(step, DummyStep):
            self.dummy_steps += 1
            self.dummy_device_seconds += result.device_seconds
            return
        self.device_seconds_total += result.device_seconds
        self.steps_total += 1
        self.steps_graphed += int(result.graphed)
        verify = verify_forwards(step, result)
        if verify:
            self.verify_steps += verify
            self.verify_device_seconds += result.device_seconds

    async def _failed(self, batch: StepBatch, err: Exception) -> list[EngineRequest]:
        """The step's requests, ended with the error `err` (an EngineError is an expected
        failure, logged in a line; anything else is a bug, logged once with its traceback)."""
        log = self.engine.log
        if isinstance(err, EngineError):
            log.error("step failed", step=batch.step, error=str(err))
            error = str(err)
        else:
            log.error("step failed", step=batch.step, exc_info=err)
            error = f"internal error: {type(err).__name__}: {err}"
        outputs = self._fail_step(batch, error)
        if outputs is None:
            await self.die(f"step {batch.step} failed and its requests could not be failed")
        return outputs

    async def _emit_or_die(self, batch: StepBatch, requests: list[EngineRequest]) -> None:
        try:
            await self.emit(requests)
        except Exception as err:
            await self.die(f"step {batch.step}: its outputs could not be sent", err)

    def _fail_step(self, batch: StepBatch, error: str) -> list[EngineRequest] | None:
        """End the step's requests with `error` (each gets its terminal output); None when the
        scheduler cannot even do that."""
        e = self.engine
        try:
            return self.flow.fail(batch, error, e.now)
        except Exception:
            e.log.exception("failing the step's requests failed", step=batch.step)
            return None

    async def die(self, why: str, cause: Exception | None = None) -> None:
        """The rank cannot go on: fail every request it holds (if it still can), then end the
        process loudly. Never returns."""
        e = self.engine
        if cause is not None:
            e.log.error(why, exc_info=cause)
        try:
            await self.emit(e.scheduler.fail_all(FinishReason.ERROR, e.now, error=why))
        except Exception:
            e.log.exception("could not fail the remaining requests; the coordinator will")
        raise FatalError(f"{e.name}: {why}")

    async def emit(self, requests: list[EngineRequest]) -> None:
        """Report `requests` (their next outputs) to the coordinator in one message."""
        if requests:
            await self.engine.coord.send(step_outputs(requests))


def verify_forwards(step: StepBatch, result: StepResult) -> int:
    """How many forwards of `step` verified drafts: a chain's inner steps (StepResult.spec_chain
    rows that ran), else 1 when a row verified drafts, else 0."""
    if len(result.spec_chain):
        return int((result.spec_chain[:, :, 0] >= 0).any(axis=0).sum())
    return int(any(c.drafts is not None and len(c.drafts) for c in step.chunks))
