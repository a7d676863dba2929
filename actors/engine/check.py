"""Replay check of the engine's scheduler core (`taipan replay --check`, DESIGN.md §10).

Re-drives a fresh Scheduler from an engine's recorded log and compares the two messages that
carry its decisions — `BlockOps` to the allocator and `StepPlan` to the gpu actor — byte for
byte with the recorded ones. Everything else the engine sends (outputs, acks, stats) follows
from those decisions and is not compared; its `StepOutputs` are checked against the contract
the coordinator relies on instead: every entry is the RequestOutput it is filed as, and no
request gets a second terminal output.

Why the log is enough: the engine sets its clock from every inbound message (`self.now`), plans
a step synchronously and sends its first message (BlockOps, or StepPlan when no block changes)
before yielding, and marks the step done right after applying its result. So, walking the log in
order, every inbound message recorded before a step's first outbound message was applied before
that step was planned, and an abort recorded between a step's first message and its result
arrived while the step was in flight. The config is not in the log: the launcher writes it to
`config.json` in the record directory.

Pure: decoded messages in, a divergence text out. No sockets, no torch.
"""

from __future__ import annotations

from taipan.actors.config import InferenceConfig
from taipan.actors.engine import plan as P
from taipan.actors.engine.scheduler import Scheduler, StepBatch
from taipan.messages.allocator import AllocatorReady, BlockOps, BlockOpsReply
from taipan.messages.codec import MessageError, encode
from taipan.messages.common import ErrorReply
from taipan.messages.gpu import GpuControlReply, ModelLoaded, StepPlan, StepResult
from taipan.messages.lifecycle import Stop
from taipan.messages.requests import AbortRequest, EngineSubmit, StepOutputs
from taipan.messages.summary import summarize


class EngineReplay:
    """Feed it an engine log's records in order (`inbound` / `outbound`); a non-None return
    is the first divergence."""

    def __init__(self, config: InferenceConfig):
        self.config = config
        self.sched: Scheduler | None = None
        self.loaded: ModelLoaded | None = None
        self.batch: StepBatch | None = None  # planned, its StepPlan not yet sent
        self.in_flight: StepBatch | None = None  # planned, its result not yet applied
        self.now = 0.0
        self.stopped = False
        self.steps_checked = 0
        self.finished: set[int] = set()  # requests whose terminal output the engine sent

    # --- inbound ------------------------------------------------------------------------------

    def inbound(self, channel: str, msg, time: float) -> str | None:
        """`msg` None: the frames did not decode (the engine's clock still moved)."""
        if self.stopped:
            return None
        self.now = time
        sched = self.sched
        if isinstance(msg, ModelLoaded):
            self.loaded = msg
        elif isinstance(msg, AllocatorReady) and self.loaded is not None:
            try:
                self.sched = P.new_scheduler(
                    self.config, P.runtime_plan(self.config, self.loaded, msg)
                )
            except P.BootError:
                self.sched = None
        elif isinstance(msg, EngineSubmit):
            vocab = self.loaded.vocab_size if self.loaded else 0
            req, _ = P.submission(sched, vocab, msg)
            if req is not None:
                sched.add(req, time)
        elif isinstance(msg, AbortRequest) and sched is not None:
            sched.abort(msg.request_id, self.in_flight is not None, time)
        elif isinstance(msg, Stop):
            self.stopped = True  # the engine fails everything and exits: nothing left to plan
        elif isinstance(msg, BlockOpsReply | StepResult | ErrorReply) and channel != "coordinator":
            return self._step_reply(channel, msg)
        elif isinstance(msg, GpuControlReply) and msg.error is None and sched is not None:
            if msg.command == "resume" and not msg.kv_valid:
                sched.invalidate_kv()
            elif msg.command == "update_weights":
                sched.increment_staleness()
        return None

    def _step_reply(self, channel: str, msg) -> str | None:
        batch, sched = self.in_flight, self.sched
        if batch is None:
            if isinstance(msg, ErrorReply):
                return None  # an error answering a control call, not a step
            return f"{type(msg).__name__} arrived with no step in flight"
        if isinstance(msg, BlockOpsReply):
            if not msg.ok:
                sched.num_free_blocks = msg.num_free
                return self._fail(f"allocator refused a planned step: {msg.error}")
            sched.assign_blocks(batch, msg.block_ids, msg.num_free)
            if not batch.chunks:  # a step that only freed blocks: no StepPlan follows
                self.in_flight = self.batch = None
            return None
        if isinstance(msg, ErrorReply):
            return self._fail(f"{channel}: {msg.text}")
        if msg.error is not None:
            return self._fail(f"forward failed: {msg.error}")
        sched.update(batch, msg, self.now)
        self.in_flight = None
        return None

    def _fail(self, error: str) -> None:
        """The step failed (as the live engine's EngineError path): its requests end."""
        self.sched.update(self.in_flight, None, self.now, error=error)
        self.in_flight = self.batch = None
        return None

    # --- outbound -----------------------------------------------------------------------------

    def outbound(self, msg, frames: tuple[bytes, ...]) -> str | None:
        if isinstance(msg, StepOutputs):
            return self._check_outputs(msg)
        if self.stopped or not isinstance(msg, BlockOps | StepPlan):
            return None
        if self.sched is None:
            return f"the engine sent {type(msg).__name__} before it could have a scheduler"
        if isinstance(msg, BlockOps) or self.batch is None:
            if self.in_flight is not None:
                step = self.in_flight.step
                return f"{type(msg).__name__} for step {msg.step} while step {step} is in flight"
            batch = self.sched.schedule(self.now)
            self.batch = self.in_flight = batch
            ops = P.block_ops(batch)
            if isinstance(msg, BlockOps):
                return self._compare("BlockOps", ops, frames)
            if ops is not None:
                return f"the engine skipped the allocator, replay plans {summarize(ops)}"
        plan = P.step_plan(self.sched, self.batch)
        self.batch = None
        self.steps_checked += 1
        return self._compare("StepPlan", plan, frames)

    def _check_outputs(self, msg: StepOutputs) -> str | None:
        problem = msg.problem()
        if problem is not None:
            return problem
        try:
            outputs = msg.decoded()
        except MessageError as e:
            return str(e)
        for i, out in enumerate(outputs):
            rid, finished = int(msg.request_ids[i]), bool(msg.finished[i])
            if (out.request_id, out.finished) != (rid, finished):
                return (
                    f"StepOutputs entry {i} is filed as request {rid} (finished {finished}) "
                    f"but holds request {out.request_id} (finished {out.finished})"
                )
            if finished and rid in self.finished:
                return f"request {rid} got a second terminal output"
            if finished:
                self.finished.add(rid)
        return None

    @staticmethod
    def _compare(kind: str, replayed, frames) -> str | None:
        if replayed is None:
            return f"the engine sent {kind}, replay plans no {kind}"
        if tuple(bytes(f) for f in encode(replayed)) == tuple(bytes(f) for f in frames):
            return None
        return f"{kind} differs: replay plans {summarize(replayed)}"
